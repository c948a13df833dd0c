"""The vLLM decode scheduler's holder (kvxfer/integrations/vllm_hold.py) against a fake
client at the seam every Hold goes through (`hold(params) -> Held`): what it asks, of
which rank's engine, in what batches, and what it stops holding. The same holder
against real sidecars is in tests/test_hold.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from kvxfer._exceptions import PeerUnavailableError
from kvxfer.core.layout import BlockId, BlockSpan, GroupId
from kvxfer.core.requests import Held, HoldState, TransferParams
from kvxfer.integrations import vllm_hold
from kvxfer.integrations.vllm_hold import Holder

BASE = TransferParams(
    "127.0.0.1:5000", "prefill", 3, 0, "r", 32, (BlockSpan(GroupId(0), 0, (BlockId(1),)),)
)


def params(request_id: str, rank: int = 0) -> TransferParams:
    return dataclasses.replace(BASE, request_id=request_id, tp_rank=rank)


class FakeClient:
    """Answers each Hold with the states it is told per request id (HELD otherwise), or
    raises `error`; records what it was asked."""

    def __init__(self, states: dict[str, HoldState] | None = None, interval_s: float = 2.0):
        self.states = states or {}
        self.interval_s = interval_s
        self.asked: list[list[str]] = []
        self.error: Exception | None = None

    def hold(self, held: Sequence[TransferParams]) -> Held:
        self.asked.append([p.request_id for p in held])
        if self.error is not None:
            raise self.error
        states = tuple(self.states.get(p.request_id, HoldState.HELD) for p in held)
        return Held(states, self.interval_s)


def test_each_rank_holds_its_own_publications_through_its_own_client() -> None:
    clients = {0: FakeClient(), 1: FakeClient(interval_s=0.5)}
    holder = Holder(clients.get)
    holder._stop.set()  # no thread: rounds are run here
    holder.add("a", {0: [params("a-p0")], 1: [params("a-p1", 1)]})
    holder.add("b", {0: [params("b-p0")], 1: []})
    holder.hold_once()
    assert clients[0].asked == [["a-p0", "b-p0"]] and clients[1].asked == [["a-p1"]]
    assert holder._interval_s == 0.5  # the shortest any sidecar asked for
    holder.remove("a")
    holder.hold_once()
    assert clients[0].asked[-1] == ["b-p0"] and len(clients[1].asked) == 1


def test_a_request_whose_publication_is_gone_or_aborted_is_no_longer_held() -> None:
    client = FakeClient({"b-p0": HoldState.GONE, "c-p0": HoldState.ABORTED})
    holder = Holder(lambda rank: client)
    holder._stop.set()
    for name in ("a", "b", "c"):
        holder.add(name, {0: [params(f"{name}-p0")]})
    client.states["a-p0"] = HoldState.UNASKED  # its publisher did not answer: kept
    holder.hold_once()
    assert holder.waiting() == ["a"]


def test_a_rank_not_registered_yet_or_a_failed_call_keeps_holding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = FakeClient()
    clients: dict[int, FakeClient] = {}
    holder = Holder(clients.get)
    holder._stop.set()
    holder.add("a", {0: [params("a-p0")]})
    holder.hold_once()  # no client for rank 0 yet: nothing asked, nothing dropped
    assert holder.waiting() == ["a"] and holder.rounds == 1
    clients[0] = client
    client.error = PeerUnavailableError("hold: no answer")
    holder.hold_once()
    assert holder.waiting() == ["a"] and client.asked == [["a-p0"]]
    monkeypatch.setattr(vllm_hold, "BATCH", 2)
    client.error = None
    holder.add("b", {0: [params("b-p0"), params("b-p1", 1)]})
    holder.hold_once()
    assert client.asked[1:] == [["a-p0", "b-p0"], ["b-p1"]]  # at most BATCH per call


def test_the_thread_holds_at_the_interval_and_stops_on_close() -> None:
    client = FakeClient(interval_s=0.02)
    holder = Holder(lambda rank: client, first_interval_s=0.01)
    holder.add("a", {0: [params("a-p0")]})
    deadline = 200
    while holder.rounds < 3 and deadline:
        holder._stop.wait(0.02)
        deadline -= 1
    holder.close()
    assert holder.rounds >= 3 and client.asked[0] == ["a-p0"]
    rounds = holder.rounds
    holder._stop.wait(0.1)
    assert holder.rounds == rounds  # closed: no more rounds
