"""Pulls of the MLA and chunked_local group kinds, end to end: real kvxfer-server and
engine-sim processes, gRPC on loopback, real NIXL.

For each model, one prefill sidecar P serves an engine; D pulls from it plainly and
DF through the fault seam (chunks fail at random). Every pull is checked byte for
byte against the token-level oracle's blocks, every reported `valid_tokens` against
the oracle's simulation of which tokens hold valid KV, and at the end every byte of
both decode engines against its pattern or the blocks pulled into it.

Models: DeepSeek-V2-Lite (27 MLA layers, one latent tensor each) and a Llama 4
text config with 256-token chunks (six chunked_local layers, two full layers).
"""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from oracle import oracle_blocks, oracle_valid_tokens
from sidecars import DecodeImage, EngineSim, Proc, engine_link, spans, start_engine, start_sidecar

from kvxfer.cli.fleet import BIN
from kvxfer.core.layout import BlockSpan, GroupKind
from kvxfer.core.requests import PullDone, PullStatus, Released

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

B = 16
NUM_BLOCKS = 200
CHUNKED = str(Path(__file__).parent / "data" / "llama4-text-chunk-256.json")
MODELS = {"mla": "deepseek-v2-lite", "chunked": CHUNKED}
# (tokens, computed): prompts ending inside, at and just after a 256-token chunk,
# with and without a prefix hit (the hit sometimes inside the last chunk).
REQUESTS = [(600, 0), (512, 0), (513, 0), (1000, 256), (1100, 1024), (300, 288)]


@dataclass
class Decode:
    """One decode sidecar, its engine, what its memory must hold, its next free block."""

    sidecar: Proc
    engine: EngineSim
    image: DecodeImage
    next_block: int = 0


@dataclass
class KindFleet:
    model: str
    p: Proc
    pe: EngineSim
    sides: dict[str, Decode]
    ids: Iterator[int] = field(default_factory=itertools.count)
    p_next: Iterator[int] = field(default_factory=lambda: itertools.cycle(range(NUM_BLOCKS)))

    def spans_for(self, side: str, tokens: int, computed: int) -> tuple[list, list]:
        """Source ids rotate through the prefill pool; destination ids are fresh on the
        decode side (never reused, so the final image check sees every pull), written in
        a scattered order so runs break."""
        src: dict[int, list[int]] = {}
        dst: dict[int, list[int]] = {}
        firsts: dict[int, int] = {}
        for group in self.pe.layout.groups:
            needed = sorted(oracle_blocks(group, tokens, computed, B))
            if not needed:
                continue
            firsts[group.group_id] = needed[0]
            decode = self.sides[side]
            start = decode.next_block
            assert start + len(needed) <= NUM_BLOCKS, "the test fleet ran out of decode blocks"
            decode.next_block += len(needed)
            fresh = list(range(start, start + len(needed)))
            dst[group.group_id] = fresh[1::2] + fresh[0::2]
            src[group.group_id] = [next(self.p_next) for _ in needed]
        return _spans(src, firsts), _spans(dst, firsts)


def _spans(ids: dict[int, list[int]], firsts: dict[int, int]) -> list[BlockSpan]:
    return [span for g, blocks in ids.items() for span in spans({g: blocks}, firsts[g])]


@pytest.fixture(scope="module", params=sorted(MODELS))
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KindFleet]:
    model = MODELS[request.param]
    tmp = tmp_path_factory.mktemp(f"kinds-{request.param}")
    procs: list[Proc | EngineSim] = []
    try:
        p = start_sidecar(tmp, "p")
        d = start_sidecar(tmp, "d")
        df = start_sidecar(
            tmp, "df", "--faults.fail-rate", "0.4", "--faults.seed", "5",
            "--transfer.chunk-blocks", "2",
        )  # fmt: skip
        procs += [p, d, df]
        pe = start_engine(tmp, p, model, "prefill", num_blocks=NUM_BLOCKS)
        de = start_engine(tmp, d, model, "decode", num_blocks=NUM_BLOCKS)
        dfe = start_engine(tmp, df, model, "decode", "--seed", "2", num_blocks=NUM_BLOCKS)
        procs += [pe, de, dfe]
        sides = {"d": Decode(d, de, DecodeImage(de)), "df": Decode(df, dfe, DecodeImage(dfe))}
        yield KindFleet(model, p, pe, sides)
    finally:
        for proc in reversed(procs):
            proc.stop()


async def _pull(fleet: KindFleet, side: str, tokens: int, computed: int) -> tuple[PullDone, int]:
    """One publish -> pull -> PullDone -> Released; returns PullDone and verified bytes."""
    decode = fleet.sides[side]
    src, dst = fleet.spans_for(side, tokens, computed)
    async with (
        engine_link(fleet.p, fleet.pe) as (p, p_events),
        engine_link(decode.sidecar, decode.engine) as (
            d,
            d_events,
        ),
    ):
        params = await p.publish(f"{side}-{next(fleet.ids)}", tokens, src)
        accepted = await d.pull(params, dst, computed)
        done = await d_events.next()
        released = await p_events.next()
    assert isinstance(done, PullDone) and isinstance(released, Released)
    groups = fleet.pe.layout.groups
    exact = sum(len(oracle_blocks(g, tokens, computed, B)) * g.bytes_per_block for g in groups)
    assert accepted.bytes_planned == exact
    moved = decode.image.expect_pull(fleet.pe, src, dst, tokens, computed, done.failed_blocks)
    assert done.bytes_moved == moved == released.bytes_read
    return done, exact


async def test_pulls_move_exactly_the_oracle_blocks(fleet: KindFleet) -> None:
    kinds = {g.kind for g in fleet.pe.layout.groups}
    assert kinds & {GroupKind.MLA, GroupKind.CHUNKED_LOCAL}
    for tokens, computed in REQUESTS:
        done, exact = await _pull(fleet, "d", tokens, computed)
        assert done.status is PullStatus.OK and not done.failed_blocks
        assert done.valid_tokens == tokens and done.bytes_moved == exact


async def test_injected_failures_report_what_the_oracle_predicts(fleet: KindFleet) -> None:
    groups = fleet.pe.layout.groups
    failures = 0
    for tokens, computed in REQUESTS:
        done, _ = await _pull(fleet, "df", tokens, computed)
        want = oracle_valid_tokens(groups, tokens, computed, B, done.failed_blocks)
        assert done.valid_tokens == want, (tokens, computed, done.failed_blocks)
        for group_id, blocks in done.failed_blocks.items():
            assert set(blocks) <= oracle_blocks(groups[group_id], tokens, computed, B)
        failures += sum(len(b) for b in done.failed_blocks.values())
    assert failures, "seed 5 at a 40% fail rate fails some chunks"


def test_every_decode_byte_is_its_pattern_or_a_pulled_block(fleet: KindFleet) -> None:
    for decode in fleet.sides.values():
        decode.image.check_all()


def test_cli_handshake_names_the_kind_and_the_replicated_latent(fleet: KindFleet) -> None:
    peer = fleet.p.ready["peer_address"]
    report = json.loads(_cli("handshake", "--peer", peer, "--layout", fleet.model, "--json"))
    assert report["compatible"] is True
    groups = report["agreement"]["groups"]
    text = _cli("handshake", "--peer", peer, "--layout", fleet.model)
    if fleet.model == MODELS["mla"]:
        assert [(g["kind"], g["replicated"]) for g in groups] == [("mla", True)]
        assert "latent replicated on every TP rank" in text
    else:
        assert [(g["kind"], g["chunk_size"]) for g in groups] == [
            ("chunked_local", 256),
            ("full_attention", None),
        ]
        assert "chunked_local S=256" in text


def _cli(*args: str) -> str:
    result = subprocess.run(
        [str(BIN / "kvxfer-cli"), *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout
