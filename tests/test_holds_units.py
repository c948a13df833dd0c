"""server/holds.py against a fake PeerLinks (the seam every Hold's publisher goes
through: `all`, `link` and `hold`), for what real sidecars make hard to stage: which
answers fill which slots, what a publisher with no such engine means, the interval, and
how long a Hold naming many silent publishers takes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvxfer._exceptions import NegotiationError, NotFoundError, PeerUnavailableError
from kvxfer.core.requests import Publication
from kvxfer.server import holds as holds_module
from kvxfer.server.holds import MIN_INTERVAL_S, Holds
from kvxfer.v1 import sidecar_pb2 as pb

ENGINE = SimpleNamespace(engine_id="decode-0", layout=None)


class Links:
    """Publishers by address: a TTL (answers HELD for every id), an error to raise from
    `link` (its handshake), or None (never answers). `linked`: the addresses with a link
    already (`all`)."""

    def __init__(self, publishers: dict[str, float | Exception | None]) -> None:
        self.publishers = publishers
        self.asked: list[tuple[str, list[str]]] = []
        self.linked: set[str] = set()
        self.claims: dict[str, int] = {}  # address -> claims held now (`use`)
        self.claimed: set[str] = set()  # every address ever claimed

    @contextlib.contextmanager
    def use(self, address: str) -> Iterator[None]:
        """Claimed while a Hold asks the publisher (PeerLinks.use: not forgotten meanwhile)."""
        self.claims[address] = self.claims.get(address, 0) + 1
        self.claimed.add(address)
        try:
            yield
        finally:
            self.claims[address] -= 1

    def all(self) -> list[Any]:
        hello = SimpleNamespace(engine_id="prefill")
        return [SimpleNamespace(address=a, epoch=3, hello=hello, tp_rank=0, stale=False)
                for a in sorted(self.linked)]  # fmt: skip

    async def link(self, address: str, *args: Any, quiet: bool = False) -> tuple[Any, None]:
        assert quiet  # Hold logs a refused negotiation itself, throttled
        assert self.claims.get(address), f"{address}'s link looked up unclaimed"
        answer = self.publishers[address]
        if answer is None:
            await asyncio.sleep(3600)
        if isinstance(answer, Exception):
            raise answer
        hello = SimpleNamespace(lease_ttl_s=answer)
        return SimpleNamespace(address=address, epoch=args[2], hello=hello), None

    async def hold(self, link: Any, ids: list[str]) -> list[int]:
        assert self.claims.get(link.address), f"{link.address} asked unclaimed"
        self.asked.append((link.address, ids))
        return [pb.LEASE_STATE_HELD] * len(ids)


def pub(address: str, request_id: str) -> Publication:
    return Publication(address, "prefill", 3, 0, request_id)


def test_each_slot_gets_its_publishers_answer_and_the_interval_its_shortest_ttl() -> None:
    links = Links({
        "10.0.0.1:1": 30.0,
        "10.0.0.2:1": 6.0,
        "10.0.0.3:1": NotFoundError("no engine of rank 0 is registered here"),
        "10.0.0.4:1": PeerUnavailableError("unreachable"),
    })  # fmt: skip
    holds = Holds(links, own_ttl_s=30.0)
    asked = [pub("10.0.0.1:1", "a"), pub("10.0.0.3:1", "b"), pub("10.0.0.2:1", "c"),
             pub("10.0.0.4:1", "d"), pub("10.0.0.1:1", "e")]  # fmt: skip
    states, interval = asyncio.run(holds.hold(ENGINE, asked))
    assert states == [
        pb.LEASE_STATE_HELD,
        pb.LEASE_STATE_UNKNOWN,  # nothing of an engine that is not there is held
        pb.LEASE_STATE_HELD,
        pb.LEASE_STATE_UNSPECIFIED,  # not asked: hold again next time
        pb.LEASE_STATE_HELD,
    ]
    assert sorted(links.asked) == [("10.0.0.1:1", ["a", "e"]), ("10.0.0.2:1", ["c"])]
    # Each publisher was claimed while asked (not forgotten under the Hold), then let go.
    assert links.claimed == {p.peer_address for p in asked}
    assert not any(links.claims.values())
    assert interval == holds_module.HOLD_ASK_S  # d unanswered: soon again, TTL unknown
    _, interval = asyncio.run(holds.hold(ENGINE, [p for p in asked if p.request_id != "d"]))
    assert interval == 2.0  # all answered: a third of the shortest TTL asked
    links.publishers["10.0.0.1:1"] = 0.003
    _, interval = asyncio.run(holds.hold(ENGINE, [pub("10.0.0.1:1", "a")]))
    assert interval == MIN_INTERVAL_S


def test_silent_publishers_cost_one_hold_ask_s_in_all_and_linked_ones_are_asked_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Twelve silent publishers, four asked at once: waiting for a slot counts against the
    one deadline, so the Hold takes HOLD_ASK_S, not three of them; a linked publisher
    named after them is asked first and held, an unlinked one is not reached and left
    UNSPECIFIED (hold again), not failed."""
    monkeypatch.setattr(holds_module, "HOLD_ASK_S", 0.3)
    monkeypatch.setattr(holds_module, "MAX_ASKING", 4)
    silent = {f"10.0.1.{i}:1": None for i in range(12)}
    links = Links({**silent, "10.0.0.1:1": 30.0, "10.0.0.2:1": 30.0})
    links.linked = {"10.0.0.2:1"}
    asked = [pub(a, f"dead{i}") for i, a in enumerate(silent)]
    asked += [pub("10.0.0.1:1", "unlinked"), pub("10.0.0.2:1", "linked")]
    started = time.monotonic()
    states, _ = asyncio.run(Holds(links, own_ttl_s=30.0).hold(ENGINE, asked))
    took = time.monotonic() - started
    assert 0.3 <= took < 0.6, took
    assert states[-1] == pb.LEASE_STATE_HELD
    assert states[:-1] == [pb.LEASE_STATE_UNSPECIFIED] * 13
    assert links.asked == [("10.0.0.2:1", ["linked"])]


def test_a_live_publisher_behind_silent_ones_is_reached_within_a_few_holds_and_soon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Twelve silent unlinked publishers named before a live one, four asked at once:
    the order of unlinked publishers turns at every Hold, so the live one is asked by
    the fourth (it was never asked when the order stayed put); and while anything is
    unanswered the engine holds again within HOLD_ASK_S, not a third of this sidecar's
    own TTL, which the live publisher's lease may not outlast."""
    monkeypatch.setattr(holds_module, "HOLD_ASK_S", 0.1)
    monkeypatch.setattr(holds_module, "MAX_ASKING", 4)
    silent = {f"10.0.1.{i}:1": None for i in range(12)}
    links = Links({**silent, "10.0.0.1:1": 30.0})
    asked = [pub(a, f"dead{i}") for i, a in enumerate(silent)] + [pub("10.0.0.1:1", "live")]
    holds = Holds(links, own_ttl_s=30.0)
    held_at = None
    for attempt in range(1, 5):
        states, interval = asyncio.run(holds.hold(ENGINE, asked))
        assert interval == 0.1  # unanswered ones remain: soon again
        if states[-1] == pb.LEASE_STATE_HELD:
            held_at = attempt
            break
    assert held_at == 4, held_at
    assert links.asked == [("10.0.0.1:1", ["live"])]


def test_a_publisher_whose_layout_disagrees_answers_gone_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its pull would be refused as well: UNKNOWN (GONE to the engine), which ends the
    engine's holds of it, instead of UNSPECIFIED, which had it handshaken again at every
    interval for ever, logging each time."""
    refused = NegotiationError(["layout.fingerprint: local a, peer b"])
    links = Links({"10.0.0.1:1": refused, "10.0.0.2:1": 30.0})
    holds = Holds(links, own_ttl_s=30.0)
    asked = [pub("10.0.0.1:1", "a"), pub("10.0.0.2:1", "b")]
    with caplog.at_level(logging.WARNING, logger="kvxfer.server.holds"):
        for _ in range(3):
            states, _ = asyncio.run(holds.hold(ENGINE, asked))
            assert states == [pb.LEASE_STATE_UNKNOWN, pb.LEASE_STATE_HELD]
    assert [r.getMessage().count("layouts do not agree") for r in caplog.records] == [1]
