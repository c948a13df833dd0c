"""`end_patiently`, which ends a read or a write at the peer: it retries while the peer
cannot be reached or refuses for too many calls at once, and stops at a definite
answer or when its patience runs out (the peer's lease then ends on its own)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvxfer._exceptions import (
    KvxferError,
    LimitExceededError,
    NotFoundError,
    PeerUnavailableError,
)
from kvxfer.server import pulls
from kvxfer.server.pulls import end_patiently


@pytest.fixture(autouse=True)
def no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    async def sleep(_: float) -> None:
        return None

    monkeypatch.setattr(pulls.asyncio, "sleep", sleep)


def answers(*outcomes: KvxferError | str) -> tuple[Callable[[], object], list[int]]:
    calls = [0]

    async def call() -> str:
        outcome = outcomes[calls[0]]
        calls[0] += 1
        if isinstance(outcome, KvxferError):
            raise outcome
        return outcome

    return call, calls


@pytest.mark.parametrize(
    "transient",
    [PeerUnavailableError("peer gone"), LimitExceededError("limits.max_calls_per_peer: 2")],
)
async def test_transient_refusals_are_retried_until_an_answer(transient: KvxferError) -> None:
    call, calls = answers(transient, transient, "ended")
    assert await end_patiently(call, "ending", 60) == "ended"  # type: ignore[arg-type]
    assert calls == [3]


async def test_a_definite_answer_ends_it_and_patience_bounds_it() -> None:
    call, calls = answers(NotFoundError("no such lease"), "never")
    assert await end_patiently(call, "ending", 60) is None  # type: ignore[arg-type]
    assert calls == [1]
    call, calls = answers(*[LimitExceededError("busy")] * 10)
    assert await end_patiently(call, "ending", 0.1) is None  # type: ignore[arg-type]
    assert calls == [1]  # the first pause (0.25 s) would already be past 0.1 s
