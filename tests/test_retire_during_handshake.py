"""An engine that retires while its transfer waits on a new peer gets no transfer.

The retirement waits for the engine's pulls, then unmaps its buffers. A Pull that
passed its engine check and then awaited the handshake with a new peer used to be
recorded after the retirement had looked: its read then registered the unmapped
buffers with NIXL (the CI of 2026-11-27: "malloc(): corrupted top size" in the decode
sidecar, after its engine died during the first pull). Here the prefill sidecar is
frozen so the handshake waits; the decode engine unregisters meanwhile (its memory
is unmapped when that returns); after the thaw the Pull must be refused, no reader
may open into that engine, and the decode sidecar must keep serving. A Push waits the
same way on the decode sidecar (its handshake, then BeginWrite) while its prefill
engine retires: it must be refused too, with no writer opened from that engine's
memory, and the decode engine must hear that nothing was written. Each test checks
that its transfer did wait in the handshake (the handshake is counted, so the refusal
came after it, not from an engine already retiring when the call arrived).

A second Pull of the same request during that handshake was recorded too (only a pull
already recorded was refused): two reads into the same blocks, two PullDones, and the
retirement saw only one of them. It must be refused.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sidecars import engine_link, freeze, pd_sidecars, spans, start_engine, thaw, unregister

from kvxfer._exceptions import InvalidInputError, NotFoundError
from kvxfer.cli.fleet import Proc, metric, scrape
from kvxfer.core.requests import PullDone, PullStatus, Received

pytestmark = [pytest.mark.e2e, pytest.mark.nixl, pytest.mark.timeout(120)]

MODEL = "gpt-oss-20b"
TOKENS = 64  # 4 blocks of 16
BLOCKS = spans({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]})
WAIT_S = 2.0  # for the calls to reach the sidecar and wait in the handshake
PATIENT = ("--transfer.rpc-timeout-s", "60")  # the dialing side waits out the freeze


def handshakes(sidecar: Proc) -> float:
    """The handshakes `sidecar` made (it dials its peers)."""
    samples = scrape(sidecar.ready["metrics_address"])
    return metric(samples, "kvxfer_handshakes_total", result="ok")


async def test_a_pull_waiting_on_a_handshake_is_refused_once_its_engine_retired(
    tmp_path: Path,
) -> None:
    with pd_sidecars(tmp_path, MODEL, d_args=PATIENT) as pair:
        p, d, pe, de = pair.p, pair.d, pair.pe, pair.de
        async with engine_link(p, pe) as (p_client, _):
            async with engine_link(d, de) as (d_client, _):
                params = await p_client.publish("r", TOKENS, BLOCKS)
                freeze(p)
                try:
                    pulling = asyncio.create_task(d_client.pull(params, BLOCKS, 0))
                    await asyncio.sleep(WAIT_S)  # the Pull waits in its handshake with the peer
                    assert not pulling.done(), pulling
                    await unregister(d, de)
                finally:
                    thaw(p)
                with pytest.raises(NotFoundError, match="going away"):
                    await pulling
                assert handshakes(d) == 1
            d.check_alive()
            assert f"into engine {de.engine_id}" not in d.log_text(), d.log_text()[-3000:]
            # The sidecar still serves: a new engine registers and pulls.
            again = start_engine(tmp_path, d, MODEL, "decode")
            pair.procs.insert(0, again)
            async with engine_link(d, again) as (client, events):
                await client.pull(await p_client.publish("again", TOKENS, BLOCKS), BLOCKS, 0)
                done = await events.next(timeout_s=60)
            assert isinstance(done, PullDone) and done.status is PullStatus.OK, done


async def test_a_push_waiting_on_its_peer_is_refused_once_its_engine_retired(
    tmp_path: Path,
) -> None:
    with pd_sidecars(tmp_path, MODEL, p_args=PATIENT) as pair:
        p, d, pe, de = pair.p, pair.d, pair.pe, pair.de
        async with engine_link(d, de) as (d_client, d_events):
            async with engine_link(p, pe) as (p_client, _):
                params = await d_client.expect("r", TOKENS, BLOCKS)
                freeze(d)
                try:
                    pushing = asyncio.create_task(p_client.push(params, BLOCKS, TOKENS))
                    await asyncio.sleep(WAIT_S)  # the Push waits on the frozen decode sidecar
                    assert not pushing.done(), pushing
                    await unregister(p, pe)
                finally:
                    thaw(d)
                with pytest.raises(NotFoundError, match="going away"):
                    await pushing
                assert handshakes(p) == 1
            received = await d_events.next(timeout_s=60)
            assert isinstance(received, Received), received
            assert received.status is PullStatus.ABORTED and received.bytes_moved == 0, received
            assert "going away" in received.reason, received
            assert received.failed_blocks == {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}, received
        p.check_alive()
        assert f"into engine {pe.engine_id}" not in p.log_text(), p.log_text()[-3000:]


async def test_two_pulls_of_a_request_during_a_handshake_make_one_pull(tmp_path: Path) -> None:
    with pd_sidecars(tmp_path, MODEL, d_args=PATIENT) as pair:
        p, d = pair.p, pair.d
        async with (
            engine_link(p, pair.pe) as (p_client, _),
            engine_link(d, pair.de) as (d_client, d_events),
        ):
            params = await p_client.publish("r", TOKENS, BLOCKS)
            freeze(p)
            try:
                pulls = [asyncio.create_task(d_client.pull(params, BLOCKS, 0)) for _ in "ab"]
                await asyncio.sleep(WAIT_S)  # both wait in the one handshake
                assert not any(pull.done() for pull in pulls), pulls
            finally:
                thaw(p)
            results = await asyncio.gather(*pulls, return_exceptions=True)
            refused = [r for r in results if isinstance(r, InvalidInputError)]
            assert len(refused) == 1, results
            assert "'r' is already being pulled" in str(refused[0]), refused
            assert handshakes(d) == 1
            done = await d_events.next(timeout_s=60)
            assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
            with pytest.raises(TimeoutError):  # one pull, one PullDone
                print("a second event:", await d_events.next(timeout_s=3))
        d.check_alive()
