"""Hold: a decode engine keeps the publications it will pull alive while its queue holds
the requests back, on real sidecars (a prefill and a decode, real gRPC and peer lane,
real NIXL for the pull that follows).

The prefill's lease TTL is 1 s and its holds end 3 s after a publish. What must hold:
- a publication held past its TTL is still there, and its pull then moves every
  needed byte (checked against the source);
- one published beside it and not held expires at its TTL;
- holds never keep a publication past lease.max_hold_s: it expires there, and the
  next hold answers GONE;
- bad input (another sidecar's engine, too many, this sidecar's own) is refused naming
  the field; a publisher that does not answer within a second is UNASKED, not an error,
  and does not hold up the answer for the others;
- the vLLM decode scheduler's holder thread does the same with a real client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Iterator

import pytest
from sidecars import DecodeImage, PdSidecars, engine_link, free_port, pd_sidecars, spans

from kvxfer._exceptions import InvalidInputError, LimitExceededError, NotFoundError
from kvxfer.client.engine import EngineClient, SyncEngineClient
from kvxfer.core.requests import (
    HoldState,
    LeaseExpired,
    PullDone,
    PullStatus,
    Released,
    TransferParams,
)
from kvxfer.integrations.vllm_hold import Holder
from kvxfer.server.holds import HOLD_ASK_S

pytestmark = [pytest.mark.e2e, pytest.mark.nixl, pytest.mark.timeout(120)]

MODEL = "gpt-oss-20b"
TTL_S, MAX_HOLD_S = 1.0, 3.0
PREFILL = (
    "--lease.ttl-s", str(TTL_S), "--lease.max-hold-s", str(MAX_HOLD_S),
    "--transfer.stall-deadline-s", "0.5",
)  # fmt: skip
TOKENS = 100  # 7 blocks of 16


def blocks(first: int) -> list:
    """Spans of a request's 7 blocks in both groups, from block `first` on."""
    ids = range(first, first + -(-TOKENS // 16))
    return spans({0: ids, 1: ids})


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdSidecars]:
    with pd_sidecars(tmp_path_factory.mktemp("hold"), MODEL, p_args=PREFILL) as pair:
        yield pair


async def _hold_until(
    client: EngineClient, params: list[TransferParams], seconds: float
) -> list[tuple[HoldState, ...]]:
    """Hold `params` at the interval the sidecar says, for `seconds`: every answer."""
    answers = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        held = await client.hold(params)
        answers.append(held.states)
        assert 0 < held.interval_s <= TTL_S / 3 + 1e-6
        await asyncio.sleep(held.interval_s)
    return answers


async def test_a_held_publication_outlives_its_ttl_and_is_then_pulled_whole(
    pd: PdSidecars,
) -> None:
    src, dst = blocks(0), blocks(0)
    async with (
        engine_link(pd.p, pd.pe) as (p, p_events),
        engine_link(pd.d, pd.de) as (d, d_events),
    ):
        held = await p.publish("held", TOKENS, src)
        other = await p.publish("not-held", TOKENS, blocks(10))
        answers = await _hold_until(d, [held], 2 * TTL_S)  # past its TTL, within the cap
        assert answers and all(a == (HoldState.HELD,) for a in answers)
        expired = await p_events.next(timeout_s=5)
        assert isinstance(expired, LeaseExpired) and expired.request_id == other.request_id
        accepted = await d.pull(held, dst, 0)
        done = await d_events.next(timeout_s=20)
        assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
        assert done.bytes_moved == accepted.bytes_planned > 0
        released = await p_events.next(timeout_s=10)
        assert isinstance(released, Released) and released.request_id == held.request_id
    image = DecodeImage(pd.de)
    image.expect_pull(pd.pe, src, dst, TOKENS, 0, {})
    image.check_all()


async def test_holds_end_at_max_hold_and_then_say_it_is_gone(pd: PdSidecars) -> None:
    async with (
        engine_link(pd.p, pd.pe) as (p, p_events),
        engine_link(pd.d, pd.de) as (d, _),
    ):
        params = await p.publish("capped", TOKENS, blocks(20))
        published = time.monotonic()
        answers = await _hold_until(d, [params], MAX_HOLD_S + 2 * TTL_S)
        expired = await p_events.next(timeout_s=1)
    assert isinstance(expired, LeaseExpired) and expired.request_id == params.request_id
    # Kept by the holds past its TTL, up to the cap, and not for ever.
    assert MAX_HOLD_S - 0.1 <= expired.held_s <= time.monotonic() - published
    assert answers[0] == (HoldState.HELD,) and answers[-1] == (HoldState.GONE,)


async def test_bad_holds_are_refused_naming_the_field_and_a_silent_publisher_is_unasked(
    pd: PdSidecars,
) -> None:
    """A publisher that takes connections and never answers (a hung or partitioned
    sidecar) costs the others at most HOLD_ASK_S, not the peer deadline (5 s): their
    leases would lapse while held."""
    async with (
        engine_link(pd.p, pd.pe) as (p, _),
        engine_link(pd.d, pd.de) as (d, _),
    ):
        params = await p.publish("checked", TOKENS, blocks(30))
        with pytest.raises(LimitExceededError, match="max_heartbeat_ids"):
            await d.hold([params] * 5000)
        with pytest.raises(InvalidInputError, match=r"publications\[0\]\.peer_address"):
            await p.hold([params])  # its own publisher's sidecar: not a peer
        with socket.create_server(("127.0.0.1", 0)) as hung:  # accepts, never answers
            silent = dataclasses.replace(params, peer_address=f"127.0.0.1:{hung.getsockname()[1]}")
            refused = dataclasses.replace(params, peer_address=f"127.0.0.1:{free_port()}")
            started = time.monotonic()
            held = await d.hold([silent, refused, params])
            took = time.monotonic() - started
        assert held.states == (HoldState.UNASKED, HoldState.UNASKED, HoldState.HELD)
        assert took < HOLD_ASK_S + 2.0, took
        never = dataclasses.replace(params, request_id="never-published")
        assert (await d.hold([never])).states == (HoldState.GONE,)
        await p.abort(params.request_id)  # aborted unread: released, gone
        assert (await d.hold([params])).states == (HoldState.GONE,)
    async with EngineClient(pd.d.ready["engine_address"], engine_id="nobody") as stranger:
        with pytest.raises(NotFoundError, match="nobody"):
            await stranger.hold([params])


async def test_the_vllm_holder_keeps_a_waiting_request_through_a_real_sidecar(
    pd: PdSidecars,
) -> None:
    """The decode scheduler's holder thread (vllm_hold) with a real client: the request
    it holds outlives the TTL at its own pace, the interval the sidecar answered."""
    decode = SyncEngineClient(pd.d.ready["engine_address"], engine_id=pd.de.engine_id)
    holder = Holder(lambda rank: decode if rank == 0 else None)
    try:
        async with (
            engine_link(pd.p, pd.pe) as (p, p_events),
            engine_link(pd.d, pd.de) as (d, d_events),
        ):
            params = await p.publish("queued", TOKENS, blocks(40))
            holder.add("decode-queued", {0: [params]})
            await asyncio.sleep(2 * TTL_S)  # waiting in vLLM's queue, past the TTL
            holder.remove("decode-queued")  # its blocks came: the pull takes over
            assert holder.rounds >= 2 and holder._interval_s == pytest.approx(TTL_S / 3, abs=1e-3)
            await d.pull(params, blocks(40), 0)
            done = await d_events.next(timeout_s=20)
            assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
            assert isinstance(await p_events.next(timeout_s=10), Released)
    finally:
        holder.close()
        decode.close()
