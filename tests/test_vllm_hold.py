"""The vLLM decode scheduler's holder (kvxfer/integrations/vllm_hold.py) against a fake
client at the seam every Hold goes through (`hold(publications) -> Held`): what it
asks, of which rank's engine, in what batches, what it stops holding, and how it
paces its rounds. The same holder against real sidecars is in tests/test_hold.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from kvxfer._exceptions import InvalidInputError, LimitExceededError, PeerUnavailableError
from kvxfer.core.requests import Held, HoldState, Publication
from kvxfer.integrations import vllm_hold
from kvxfer.integrations.vllm_hold import Holder


def pub(request_id: str, rank: int = 0) -> Publication:
    return Publication("127.0.0.1:5000", "prefill", 3, rank, request_id)


class FakeClient:
    """Answers each Hold with the states it is told per request id (HELD otherwise);
    raises `error`, or refuses (InvalidInputError) a call naming one of `refused` (its
    field naming the first of them, `publications[i]`, as the sidecar's does, unless
    `unnamed`), or more than `limit` publications; records what it was asked."""

    def __init__(self, states: dict[str, HoldState] | None = None, interval_s: float = 2.0):
        self.states = states or {}
        self.interval_s = interval_s
        self.asked: list[list[str]] = []
        self.error: Exception | None = None
        self.refused: set[str] = set()
        self.unnamed = False
        self.limit = 1 << 20
        self.delay_s = 0.0

    def hold(self, held: Sequence[Publication]) -> Held:
        ids = [p.request_id for p in held]
        self.asked.append(ids)
        time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        if len(ids) > self.limit:
            raise LimitExceededError(f"publications: {len(ids)} exceed the limit")
        if self.refused & set(ids):
            first = min(i for i, request_id in enumerate(ids) if request_id in self.refused)
            field = "publications" if self.unnamed else f"publications[{first}].peer_address"
            raise InvalidInputError(field, "is this sidecar itself")
        states = tuple(self.states.get(i, HoldState.HELD) for i in ids)
        return Held(states, self.interval_s)


def still(holder: Holder) -> Holder:
    """A holder whose rounds the test runs (no thread)."""
    holder._stop.set()
    return holder


def test_each_rank_holds_its_own_publications_through_its_own_client() -> None:
    clients = {0: FakeClient(), 1: FakeClient(interval_s=0.5)}
    holder = still(Holder(clients.get))
    holder.add("a", {0: [pub("a-p0")], 1: [pub("a-p1", 1)]})
    holder.add("b", {0: [pub("b-p0")], 1: []})
    holder.hold_once()
    assert clients[0].asked == [["a-p0", "b-p0"]] and clients[1].asked == [["a-p1"]]
    assert holder._interval_s == 0.5  # the shortest any sidecar asked for
    holder.remove("a")
    holder.hold_once()
    assert clients[0].asked[-1] == ["b-p0"] and len(clients[1].asked) == 1
    clients[0].interval_s = clients[1].interval_s = 0.001
    holder.hold_once()
    assert holder._interval_s == vllm_hold.MIN_INTERVAL_S  # never sooner, whatever it says
    holder.close()


def test_the_ranks_are_asked_at_once_and_their_threads_end_on_close() -> None:
    """Each rank's Hold can take the sidecar's second (a silent publisher): one rank after
    another, a round of TP 8 took 8 s, past a 5 s TTL."""
    clients = {rank: FakeClient(interval_s=1.0 + rank) for rank in range(4)}
    for client in clients.values():
        client.delay_s = 0.3
    holder = still(Holder(clients.get))
    holder.add("a", {rank: [pub(f"a-p{rank}", rank)] for rank in range(4)})
    clients[2].states["a-p2"] = HoldState.GONE
    started = time.monotonic()
    holder.hold_once()
    took = time.monotonic() - started
    assert took < 0.9, took  # one rank's time, not four
    assert all(c.asked == [[f"a-p{r}"]] for r, c in clients.items())
    assert holder._interval_s == 1.0 and holder.waiting() == []  # every rank's answer
    holder.close()
    deadline = time.monotonic() + 5
    while any(t.name.startswith("kvxfer-hold") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a pool thread outlived close()"
        time.sleep(0.01)


def test_a_request_is_held_when_added_and_a_shorter_interval_brings_rounds_forward() -> None:
    """The first round starts when the first request is added; one added later is held
    at once, alone (its prefill's TTL may be shorter than any asked so far), and the
    interval its sidecar answers, if shorter, holds for the next full round."""
    client = FakeClient(interval_s=30.0)
    holder = Holder(lambda rank: client, first_interval_s=30.0)

    def asked(count: int) -> None:
        deadline = time.monotonic() + 5
        while len(client.asked) < count:
            assert time.monotonic() < deadline, f"{len(client.asked)} holds in 5 s"
            time.sleep(0.01)

    try:
        holder.add("a", {0: [pub("a-p0")]})
        asked(1)
        client.interval_s = 0.2
        holder.add("b", {0: [pub("b-p0")]})
        asked(3)  # b alone, then both 0.2 s later, not 30 s
        assert client.asked[:3] == [["a-p0"], ["b-p0"], ["a-p0", "b-p0"]]
    finally:
        holder.close()


def test_a_request_whose_publication_is_gone_or_aborted_is_no_longer_held() -> None:
    client = FakeClient({"b-p0": HoldState.GONE, "c-p0": HoldState.ABORTED})
    holder = still(Holder(lambda rank: client))
    for name in ("a", "b", "c"):
        holder.add(name, {0: [pub(f"{name}-p0")]})
    client.states["a-p0"] = HoldState.UNASKED  # its publisher did not answer: kept
    holder.hold_once()
    assert holder.waiting() == ["a"]


def test_a_refused_batch_is_sent_again_without_the_refused_request_only() -> None:
    """One call per refused request, not one per publication: a publication of a silent
    publisher costs each call it is in the sidecar's second, so 30 of them held one by
    one let every other lease lapse."""
    client = FakeClient()
    client.refused = {"bad-p0", "worse-p1"}
    holder = still(Holder(lambda rank: client))
    for name in ("a", "bad", "c", "worse", "e"):
        holder.add(name, {0: [pub(f"{name}-p0"), pub(f"{name}-p1")]})
    holder.hold_once()
    everything = [f"{n}-p{i}" for n in ("a", "bad", "c", "worse", "e") for i in (0, 1)]
    assert client.asked == [
        everything,
        [i for i in everything if not i.startswith("bad")],  # the request, all of it
        [i for i in everything if not i.startswith(("bad", "worse"))],
    ]
    assert holder.waiting() == ["a", "c", "e"]
    holder.hold_once()
    assert client.asked[-1] == ["a-p0", "a-p1", "c-p0", "c-p1", "e-p0", "e-p1"]


def test_a_refusal_naming_no_publication_splits_the_batch_in_halves() -> None:
    client = FakeClient()
    client.refused, client.unnamed = {"bad-p0"}, True
    holder = still(Holder(lambda rank: client))
    for name in ("a", "b", "bad", "d"):
        holder.add(name, {0: [pub(f"{name}-p0")]})
    holder.hold_once()
    assert client.asked == [["a-p0", "b-p0", "bad-p0", "d-p0"], ["a-p0", "b-p0"],
                            ["bad-p0", "d-p0"], ["bad-p0"], ["d-p0"]]  # fmt: skip
    assert holder.waiting() == ["a", "b", "d"]


def test_a_smaller_limit_at_the_sidecar_halves_the_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_hold, "BATCH", 8)
    client = FakeClient()
    client.limit = 3
    holder = still(Holder(lambda rank: client))
    holder.add("a", {0: [pub(f"a-p{i}", i) for i in range(5)]})
    holder.hold_once()
    assert [len(ids) for ids in client.asked] == [5, 4, 2, 2, 1]  # 8, 4, then 2 fit
    assert holder.waiting() == ["a"]


def test_a_rank_not_registered_yet_or_a_failed_call_keeps_holding() -> None:
    client = FakeClient()
    clients: dict[int, FakeClient] = {}
    holder = still(Holder(clients.get))
    holder.add("a", {0: [pub("a-p0")]})
    holder.hold_once()  # no client for rank 0 yet: nothing asked, nothing dropped
    assert holder.waiting() == ["a"] and holder.rounds == 1
    clients[0] = client
    client.error = PeerUnavailableError("hold: no answer")
    holder.hold_once()
    assert holder.waiting() == ["a"] and client.asked == [["a-p0"]]


def test_rounds_start_an_interval_apart_however_long_one_takes_and_stop_on_close() -> None:
    client = FakeClient(interval_s=0.3)
    client.delay_s = 0.3  # each round as long as the interval
    holder = Holder(lambda rank: client, first_interval_s=0.3)
    started = time.monotonic()
    holder.add("a", {0: [pub("a-p0")]})
    while holder.rounds < 4 and time.monotonic() - started < 20:
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    holder.close()
    assert holder.rounds >= 4
    # Four rounds start to start 0.3 s apart (about 1.5 s in all), where waiting the
    # interval after each round would take 0.6 s per round (2.7 s).
    assert elapsed < 2.4, elapsed
    rounds = holder.rounds
    time.sleep(0.8)
    assert holder.rounds == rounds  # closed: no more rounds
