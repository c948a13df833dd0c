"""The lease table on a fake clock: hold, read, renew, abort, expire."""

from __future__ import annotations

import pytest

from kvxfer._exceptions import (
    InvalidInputError,
    LeaseError,
    LimitExceededError,
    NotFoundError,
    PermissionDeniedError,
)
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
    lease = table.begin_read("e", "r", "d")
    assert lease.state is LeaseState.READING
    with pytest.raises(LeaseError, match="already being read"):
        table.begin_read("e", "r", "d")
    assert table.end_read("e", "r", "d", lease.read_token).request_id == "r"
    assert len(table) == 0
    with pytest.raises(NotFoundError, match="not held"):
        table.end_read("e", "r", "d", lease.read_token)


def test_expiry_and_renewal(table: LeaseTable, clock: Clock) -> None:
    table.add("e", "a", 1, SPANS)
    table.add("e", "b", 1, SPANS)
    token = table.begin_read("e", "a", "d").read_token
    clock.now += 6
    assert table.renew("e", ["a", "gone"], "d", [token, ""]) == [LeaseState.READING, None]
    clock.now += 5  # b is 11 s old, a was renewed 5 s ago
    assert [lease.request_id for lease in table.expire()] == ["b"]
    clock.now += 5
    assert [lease.request_id for lease in table.expire()] == ["a"]


def test_abort_waits_for_a_read_in_flight(table: LeaseTable) -> None:
    table.add("e", "idle", 1, SPANS)
    before, released = table.abort("e", "idle")
    assert before is LeaseState.HELD and released is not None
    table.add("e", "busy", 1, SPANS)
    token = table.begin_read("e", "busy", "d").read_token
    before, released = table.abort("e", "busy")
    assert before is LeaseState.READING and released is None
    assert table.renew("e", ["busy"], "d", [token]) == [LeaseState.ABORTED]
    with pytest.raises(LeaseError, match="aborted"):
        table.begin_read("e", "busy", "d")
    assert table.end_read("e", "busy", "d", token).state is LeaseState.ABORTED


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
    table.end_read("e", "b", "d", table.begin_read("e", "b", "d").read_token)
    assert table.held_blocks == 2
    clock.now += 11
    table.expire()
    assert table.held_blocks == 0
    table.add("f", "d", 1, SPANS)
    table.drop_engine("f")
    assert table.held_blocks == 0 and len(table) == 0


def test_reads_are_bound_to_their_reader(table: LeaseTable, clock: Clock) -> None:
    """Another identity, or the same anonymous identity without the read's token, can
    neither end (steal) nor renew (pin) a read; a lease nobody reads cannot be pinned."""
    table.add("e", "r", 1, SPANS)
    with pytest.raises(PermissionDeniedError, match="no read of yours"):
        table.renew("e", ["r"], "anonymous", [""])
    token = table.begin_read("e", "r", "anonymous").read_token
    for reader, wrong in (("anonymous", ""), ("anonymous", "0" * 32), ("mallory", token)):
        with pytest.raises(PermissionDeniedError, match="another reader"):
            table.renew("e", ["r"], reader, [wrong])
        with pytest.raises(PermissionDeniedError, match="another reader"):
            table.end_read("e", "r", reader, wrong)
    clock.now += 10  # nothing foreign renewed it: it lapses on time
    assert [lease.request_id for lease in table.expire()] == ["r"]


def test_a_hold_keeps_an_unread_publication_a_ttl_more_up_to_its_cap(
    table: LeaseTable, clock: Clock
) -> None:
    table.add("e", "r", 32, SPANS)  # published at 100, expires at 110
    table.add("e", "push", 32, SPANS, push=True)
    clock.now = 108.0
    states = table.hold("e", ["r", "push", "never"], max_hold_s=25.0)
    assert states == [LeaseState.HELD, None, None]  # a destination lease is no publication
    assert table.get("e", "r").expires == 118.0
    assert table.get("e", "push").expires == 110.0  # untouched
    clock.now = 120.0  # past the cap's last full TTL: held up to 125 (published + 25)
    table.hold("e", ["r"], max_hold_s=25.0)
    assert table.get("e", "r").expires == 125.0
    clock.now = 124.0
    table.hold("e", ["r"], max_hold_s=25.0)
    assert table.get("e", "r").expires == 125.0  # never past the cap
    clock.now = 125.0
    assert [lease.request_id for lease in table.expire()] == ["r", "push"]
    assert table.hold("e", ["r"], max_hold_s=25.0) == [None]


def test_a_hold_leaves_a_read_to_its_reader(table: LeaseTable, clock: Clock) -> None:
    table.add("e", "r", 32, SPANS)
    lease = table.begin_read("e", "r", "d")  # expires at 110
    clock.now = 105.0
    assert table.hold("e", ["r"], max_hold_s=100.0) == [LeaseState.READING]
    assert lease.expires == 110.0  # only its reader's heartbeat renews it
    table.abort("e", "r")
    assert table.hold("e", ["r"], max_hold_s=100.0) == [LeaseState.ABORTED]
    assert lease.expires == 110.0
