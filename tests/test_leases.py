"""The lease table on a fake clock: hold, read, renew, abort, expire."""

from __future__ import annotations

import pytest

from kvxfer._exceptions import InvalidInputError, LeaseError, LimitExceededError, NotFoundError
from kvxfer.core.layout import BlockId, BlockSpan, GroupId
from kvxfer.server.leases import LeaseState, LeaseTable

SPANS = (BlockSpan(GroupId(0), 0, (BlockId(1), BlockId(2))),)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> LeaseTable:
    return LeaseTable(ttl_s=10.0, max_leases=3, clock=clock)


def test_publish_read_end(table: LeaseTable) -> None:
    table.add("e", "r", 32, SPANS)
    assert table.held_blocks == 2
    with pytest.raises(InvalidInputError, match="already published"):
        table.add("e", "r", 32, SPANS)
    assert table.begin_read("e", "r").state is LeaseState.READING
    with pytest.raises(LeaseError, match="already being read"):
        table.begin_read("e", "r")
    assert table.end_read("e", "r").request_id == "r"
    assert len(table) == 0
    with pytest.raises(NotFoundError, match="not held"):
        table.end_read("e", "r")


def test_expiry_and_renewal(table: LeaseTable, clock: Clock) -> None:
    table.add("e", "a", 1, SPANS)
    table.add("e", "b", 1, SPANS)
    clock.now += 6
    assert table.renew("e", ["a", "gone"]) == [LeaseState.HELD, None]
    clock.now += 5  # b is 11 s old, a was renewed 5 s ago
    assert [lease.request_id for lease in table.expire()] == ["b"]
    clock.now += 5
    assert [lease.request_id for lease in table.expire()] == ["a"]


def test_abort_waits_for_a_read_in_flight(table: LeaseTable) -> None:
    table.add("e", "idle", 1, SPANS)
    before, released = table.abort("e", "idle")
    assert before is LeaseState.HELD and released is not None
    table.add("e", "busy", 1, SPANS)
    table.begin_read("e", "busy")
    before, released = table.abort("e", "busy")
    assert before is LeaseState.READING and released is None
    assert table.renew("e", ["busy"]) == [LeaseState.ABORTED]
    with pytest.raises(LeaseError, match="aborted"):
        table.begin_read("e", "busy")
    assert table.end_read("e", "busy").state is LeaseState.ABORTED


def test_limits_and_engines(table: LeaseTable) -> None:
    for i in range(3):
        table.add("e" if i else "f", f"r{i}", 1, SPANS)
    with pytest.raises(LimitExceededError, match=r"limits\.max_leases"):
        table.add("e", "r9", 1, SPANS)
    assert sorted(lease.request_id for lease in table.drop_engine("e")) == ["r1", "r2"]
    assert len(table) == 1


def test_held_blocks_follows_every_way_out(table: LeaseTable, clock: Clock) -> None:
    table.add("e", "a", 1, SPANS)
    table.add("e", "b", 1, SPANS)
    table.add("f", "c", 1, SPANS)
    assert table.held_blocks == 6
    table.abort("e", "a")
    table.begin_read("e", "b")
    table.end_read("e", "b")
    assert table.held_blocks == 2
    clock.now += 11
    table.expire()
    assert table.held_blocks == 0
    table.add("f", "d", 1, SPANS)
    table.drop_engine("f")
    assert table.held_blocks == 0 and len(table) == 0
