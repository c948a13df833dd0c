"""Different tensor-parallel sizes, end to end through `kvxfer-cli demo --prefill-tp
--decode-tp`: engine-sim ranks, real sidecar processes, real NIXL, chunk failures
injected through the decode sidecar's fault seam.

The demo checks every decode byte itself (head by head over the decode blocks, every
other byte untouched). This test checks, from the oracle alone (tests/oracle.py, which
knows nothing of tp_map or the planner), each pull's bytes (which heads the source
serves, which tokens move, minus failed blocks) and where each decode rank resumes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from oracle import (
    oracle_head_server,
    oracle_moved_tokens,
    oracle_rank_heads,
    oracle_valid_tokens_moved,
)
from test_demo import CLI, Demos, demos  # noqa: F401 (the fixture)
from test_tp_state_oracle import oracle_state_bytes

from kvxfer.cli.fleet import Fleet
from kvxfer.core.layout import EngineLayout, GroupKind
from kvxfer.core.profiles import layout_for_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _oracle_pull_bytes(
    layout: EngineLayout, src_tp: int, src_block: int, pull: dict[str, Any], row: dict[str, Any]
) -> int:
    """Bytes one pull lands: the source's heads of every moved token outside failed blocks,
    and its byte ranges of a state block that moved and did not fail."""
    total, size = 0, layout.block_size
    failed = {int(g): set(b) for g, b in pull["failed_blocks"].items()}
    for group in layout.groups:
        if group.kind is GroupKind.MAMBA:
            if row["computed_tokens"] < row["tokens"] and not failed.get(group.group_id):
                total += oracle_state_bytes(
                    layout.model, group, src_tp, layout, pull["prefill_rank"]
                )
            continue
        moved = oracle_moved_tokens(group, row["tokens"], row["computed_tokens"], src_block, size)
        landed = [t for t in moved if t // size not in failed.get(group.group_id, set())]
        if group.kind is GroupKind.MLA:  # an mla-only model: rank d mod Tp, whole tokens
            if pull["prefill_rank"] == layout.tp_rank % src_tp:
                total += len(landed) * group.bytes_per_block // size
            continue
        heads = group.num_kv_heads
        assert heads is not None
        mine = oracle_rank_heads(heads, layout.tp_size, layout.tp_rank)
        served = [
            h
            for h in mine
            if oracle_head_server(heads, src_tp, h, layout.tp_rank) == pull["prefill_rank"]
        ]
        per_head = sum(t.bytes_per_block for t in group.tensors) // size // len(mine)
        total += len(landed) * len(served) * per_head
    return total


SEED_2 = ("0.25", "2")  # (fail rate, seed)
TOKEN_MAJOR = ("token-major", "token-major")


@pytest.mark.parametrize(
    ("model", "prefill_tp", "decode_tp", "blocks", "faults", "orders"),
    [
        ("llama-3.1-8b", 1, 2, (16, 16), SEED_2, TOKEN_MAJOR),
        # vLLM's CPU pages: heads of whole blocks, equal block sizes.
        ("gpt-oss-20b", 2, 1, (16, 16), SEED_2, ("head-major", "head-major")),
        ("gpt-oss-20b", 1, 2, (32, 16), SEED_2, TOKEN_MAJOR),  # block sizes differ as well
        # Gated DeltaNet state beside attention, both ways (seed 4 fails state blocks), and
        # Mamba-2 state whose one B/C group is replicated on every rank.
        ("qwen3-next-80b-a3b", 1, 2, (16, 16), SEED_2, TOKEN_MAJOR),
        ("qwen3-next-80b-a3b", 2, 1, (16, 16), ("0.4", "4"), TOKEN_MAJOR),
        ("falcon-h1-7b", 2, 4, (16, 16), SEED_2, TOKEN_MAJOR),
        ("deepseek-v2-lite", 1, 2, (16, 16), SEED_2, TOKEN_MAJOR),  # the latent, whole
        # Blocks ordered differently: a head at a time, at equal TP sizes too.
        ("gemma-3-4b-it", 1, 2, (32, 16), SEED_2, ("token-major", "hnd")),
        ("qwen3-next-80b-a3b", 1, 1, (16, 32), SEED_2, ("hnd", "token-major")),
        ("llama-3.1-8b", 2, 1, (16, 48), SEED_2, ("hnd", "hnd")),
    ],
)
def test_different_tp_sizes_pull_head_by_head_with_failures(
    demos: Demos,  # noqa: F811 (the fixture)
    model: str,
    prefill_tp: int,
    decode_tp: int,
    blocks: tuple[int, int],
    faults: tuple[str, str],
    orders: tuple[str, str],
) -> None:
    result = demos.run(
        "--model", model, "--requests", "4", "--tokens-range", "100:1200",
        "--prefix-hit-rate", "0.5", "--fail-rate", faults[0], "--seed", faults[1],
        "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
        "--prefill-block-size", str(blocks[0]), "--decode-block-size", str(blocks[1]),
        "--prefill-order", orders[0], "--decode-order", orders[1],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["orders"] == {"prefill": orders[0], "decode": orders[1]}
    check_tp_report(report, model, prefill_tp, decode_tp, blocks)
    if faults[1] == "4":  # a failed state block fails that pull's state: it resumes at C
        state = [
            g.group_id
            for g in layout_for_model(model, block_size=blocks[1]).groups
            if g.kind is GroupKind.MAMBA
        ]
        lost = [
            (row, pull)
            for row in report["per_request"]
            for pull in row["pulls"]
            if pull["failed_blocks"].get(str(state[0]))
        ]
        assert lost, "seed 4 fails at least one state block"
        for row, pull in lost:
            assert pull["valid_tokens"] == row["valid_tokens"] == row["computed_tokens"]


def check_tp_report(
    report: dict[str, Any], model: str, prefill_tp: int, decode_tp: int, blocks: tuple[int, int]
) -> None:
    """Each transfer's bytes and valid_tokens of a TP `demo --json` report, from the
    oracle alone, and one valid_tokens per request."""
    assert report["tp"] == {"prefill": prefill_tp, "decode": decode_tp}
    assert report["verified_requests"] == 4 and report["untouched_bytes_verified"] is True
    assert report["failed_blocks"] > 0, "the seed injects at least one failure"
    assert report["head_bytes_verified"] == report["bytes_moved"]
    layouts = [
        layout_for_model(model, block_size=blocks[1], tp_size=decode_tp, tp_rank=r)
        for r in range(decode_tp)
    ]
    for row in report["per_request"]:
        assert row["problems"] == []
        assert len(row["pulls"]) == max(prefill_tp, decode_tp)  # one per (source, reader)
        resume = []
        for pull in row["pulls"]:
            layout = layouts[pull["decode_rank"]]
            assert pull["bytes_moved"] == _oracle_pull_bytes(
                layout, prefill_tp, blocks[0], pull, row
            )
            failed = {int(g): b for g, b in pull["failed_blocks"].items()}
            groups = list(layout.groups)
            moved = {
                g.group_id: oracle_moved_tokens(
                    g, row["tokens"], row["computed_tokens"], blocks[0], blocks[1]
                )
                for g in groups
                if g.kind is not GroupKind.MAMBA  # a state's validity is its failure alone
            }
            want = oracle_valid_tokens_moved(
                groups, row["tokens"], row["computed_tokens"], blocks[1], failed, moved
            )
            assert pull["valid_tokens"] == want
            resume.append(want)
        assert row["valid_tokens"] == min(resume)  # one answer for the whole request


@pytest.mark.parametrize(
    ("model", "decode_tp", "refusal"),
    [
        # vLLM splits Mamba-2 heads over TP ranks and 24 heads do not split over 16.
        ("falcon-h1-7b", 16, ("mamba_n_heads", "24 does not divide by tp_size 16")),
        ("llama-3.1-8b", 3, ("num_key_value_heads", "8 heads cannot be placed on tp_size 3")),
    ],
)
def test_pairings_negotiation_refuses_stop_the_demo_before_it_starts(
    model: str, decode_tp: int, refusal: tuple[str, str]
) -> None:
    """No process is started: the refusal comes from the layouts alone."""
    result = subprocess.run(
        [CLI, "demo", "--model", model, "--prefill-tp", "1", "--decode-tp", str(decode_tp),
         "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    error = json.loads(result.stdout)
    assert error["field"] == refusal[0] and refusal[1] in error["error"], error


def test_handshake_shows_which_prefill_rank_serves_which_state_bytes(tmp_path: Path) -> None:
    """`kvxfer-cli handshake --peer-rank` against prefill rank 1 of 2 (Qwen3-Next) from a
    decode rank of TP 1: the agreement lists the state byte ranges it reads from each
    prefill rank, rank 1's among them."""
    fleet = Fleet(tmp_path)
    try:
        sidecar = fleet.sidecar("p")
        tp = ("--tp-size", "2", "--tp-rank", "1", "--num-blocks", "16", "--state-blocks", "1")
        fleet.engine(sidecar, "qwen3-next-80b-a3b", "prefill", *tp)
        peer = sidecar.ready["peer_address"]
        argv = [CLI, "handshake", "--peer", peer, "--layout", "qwen3-next-80b-a3b"]
        text = subprocess.run(
            [*argv, "--peer-rank", "1"], capture_output=True, text=True, timeout=60, check=False
        )
        assert text.returncode == 0, text.stderr
        assert "TP 2 -> 1 (rank 0 <- prefill ranks 0, 1; this peer is rank 1)" in text.stdout
        assert "state block by byte ranges, each from the prefill rank holding it" in text.stdout
        # Rank 1's half of the first conv row's q channels lands after rank 0's.
        assert "conv bytes 2048..4095 <- prefill rank 1 bytes 0..2047" in text.stdout
        assert "ssm bytes 524288..1048575 <- prefill rank 1 bytes 0..524287" in text.stdout
        report = json.loads(
            subprocess.run(
                [*argv, "--peer-rank", "1", "--json"],
                capture_output=True, text=True, timeout=60, check=True,
            ).stdout
        )  # fmt: skip
        state = next(g for g in report["agreement"]["groups"] if g["kind"] == "mamba")
        assert {r["src_rank"] for r in state["state_reads"]} == {0, 1}
    finally:
        fleet.close()


@pytest.mark.parametrize(
    ("argv", "field", "reason"),
    [
        # Head-major blocks in an engine's own order name no token of a head.
        (("--prefill-order", "head-major", "--decode-order", "hnd"), "--decode-order",
         "in the engine's own order"),
        (("--prefill-order", "head-major", "--decode-order", "head-major",
          "--prefill-block-size", "32"), "--decode-order",
         "head-major blocks of 32 (prefill) and 16 (decode)"),
        # Flags one engine does not read are refused, never ignored.
        (("--engine", "vllm", "--mode", "push"), "--mode", "not read by --engine vllm"),
        (("--engine", "vllm", "--decode-order=hnd"), "--decode-order", "not read by --engine"),
        (("--max-tokens", "4",), "--max-tokens", "not read by --engine sim"),
        (("--engine", "vllm", "--decode-ord", "hnd"), None, "unrecognized arguments"),
    ],
)  # fmt: skip
def test_a_demo_that_cannot_run_as_asked_stops_before_it_starts(
    argv: tuple[str, ...], field: str | None, reason: str
) -> None:
    """No process is started: the refusal comes from the flags and layouts alone."""
    result = subprocess.run(
        [CLI, "demo", "--model", "gpt-oss-20b", *argv, "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    error = json.loads(result.stdout)
    assert error["field"] == field and reason in error["error"], error
