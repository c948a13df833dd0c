"""`kvxfer-cli bench --tp` and `--modes pull push` (TP pairings beside equal TP, push
rows beside pull ones, issue 15 item 5) and `--multihost`
(the same bench between two network namespaces over UCX TCP, issue 13): the options'
validation, the pure parts, and both modes run end to end with well-formed JSON.
Nothing here asserts a speed."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from kvxfer._exceptions import InvalidInputError
from kvxfer.cli import bench_multihost, hosts
from kvxfer.cli.bench_table import report_text
from kvxfer.cli.bench_tp import Pairing, min_bytes, pairings, refusal
from kvxfer.cli.fleet import BIN
from kvxfer.cli.main import UsageError, build_parser
from kvxfer.core.planner import plan_blocks
from kvxfer.core.profiles import layout_for_model

CLI = str(BIN / "kvxfer-cli")


def test_tp_and_modes_are_validated_naming_the_option() -> None:
    args = build_parser().parse_args(["bench", "--tp", "1:2", "2:1"])
    assert args.tp == [(1, 2), (2, 1)] and args.modes == ["pull"]
    for bad in ("2", "0:1", "1:x", "1:2:3"):
        with pytest.raises(UsageError, match="--tp"):
            build_parser().parse_args(["bench", "--tp", bad])
    args = build_parser().parse_args(["bench", "--tp", "1:2", "--modes", "pull", "push"])
    assert args.modes == ["pull", "push"]
    with pytest.raises(UsageError, match="--modes"):
        build_parser().parse_args(["bench", "--modes", "write"])


def test_equal_tp_comes_first_once_and_every_mode_is_a_case() -> None:
    assert pairings([(1, 2), (2, 1), (1, 2)], ["pull"]) == [
        Pairing(1, 1), Pairing(1, 2), Pairing(2, 1)
    ]  # fmt: skip
    assert pairings([(1, 1)], ["pull", "pull"]) == [Pairing(1, 1, "pull")]
    assert pairings([], ["pull", "push"]) == [Pairing(1, 1, "pull"), Pairing(1, 1, "push")]
    assert [p.label for p in pairings([(2, 1)], ["push", "pull"])] == [
        "TP 1->1 push", "TP 1->1 pull", "TP 2->1 push", "TP 2->1 pull"
    ]  # fmt: skip


def test_block_orders_are_cases_beside_token_major_blocks() -> None:
    args = build_parser().parse_args(["bench", "--orders", "token-major:hnd", "hnd:hnd"])
    assert args.orders == [("token-major", "hnd"), ("hnd", "hnd")]
    for bad in ("hnd", "hnd:nhd", "token:hnd", ":hnd"):
        with pytest.raises(UsageError, match="--orders"):
            build_parser().parse_args(["bench", "--orders", bad])
    wanted = pairings([(1, 2)], ["pull"], [("token-major", "hnd")])
    assert [p.label for p in wanted] == [
        "TP 1->1 pull", "TP 1->1 token-major->hnd pull",
        "TP 1->2 pull", "TP 1->2 token-major->hnd pull",
    ]  # fmt: skip
    assert refusal("llama-3.1-8b", Pairing(1, 2, orders=("token-major", "hnd")), 16) is None
    reason = refusal("llama-3.1-8b", Pairing(1, 1, orders=("head-major", "hnd")), 16)
    assert reason and "in the engine's own order" in reason, reason


def test_a_pairing_negotiation_refuses_is_skipped_with_its_reason() -> None:
    assert refusal("gpt-oss-20b", Pairing(1, 2), 16) is None
    assert refusal("gemma-3-4b-it", Pairing(2, 1), 16) is None
    assert refusal("qwen3-next-80b-a3b", Pairing(1, 2), 16) is None  # state ranges split
    reason = refusal("falcon-h1-7b", Pairing(1, 16), 16)  # 24 Mamba heads over 16 ranks
    assert reason and "mamba_n_heads" in reason, reason


@pytest.mark.parametrize("model", ["gpt-oss-20b", "gemma-3-4b-it", "llama-3.1-8b"])
@pytest.mark.parametrize("tokens", [1, 1000, 16384])
def test_the_exact_minimum_splits_over_decode_ranks(model: str, tokens: int) -> None:
    """Two decode ranks need together what one does; with whole blocks (TP 1) that is at
    most one block per group more than the token-exact minimum."""
    one = layout_for_model(model, block_size=16)
    two = [layout_for_model(model, block_size=16, tp_size=2, tp_rank=r) for r in range(2)]
    assert sum(min_bytes(layout, tokens) for layout in two) == min_bytes(one, tokens)
    blocks = sum(p.nbytes for p in plan_blocks(one, tokens, 0))
    assert min_bytes(one, tokens) <= blocks
    assert blocks - min_bytes(one, tokens) < sum(g.bytes_per_block for g in one.groups)


def _pairing_row(p: int, d: int) -> dict[str, Any]:
    return {
        "model": "m", "tokens": 1024, "mode": "pull", "prefill_tp": p, "decode_tp": d,
        "pulls": max(p, d), "descriptors": 48, "bytes": 2**20, "bytes_moved": 2**20,
        "min_bytes": 2**20, "bytes_vs_min": 1.0, "valid_tokens": 1024, "raw_nixl_gbps": 1.0,
        "kvxfer_gbps": 0.5, "kvxfer_vs_raw": 0.5,
        "kvxfer_vs_raw_rounds": {"min": 0.4, "median": 0.5, "max": 0.6},
        "raw_ms_p50": 1.0, "raw_ms_p99": 2.0, "kvxfer_ms_p50": 2.0, "kvxfer_ms_p99": 3.0,
        "overhead_ms_p50": 1.0,
    }  # fmt: skip


def test_the_text_report_shows_pairings_side_by_side_and_their_skips() -> None:
    report = {
        "memcpy_gbps": 5.0, "cases": [], "handshakes": [],
        "pairings": [_pairing_row(1, 1), _pairing_row(1, 2), _pairing_row(2, 1),
                     {**_pairing_row(2, 1), "mode": "push"}],
        "skipped": [{"model": "q", "pairing": "TP 1->2 pull", "reason": "a state group"}],
        "multihost": {"transport": "UCX_TLS=tcp,self over a veth pair"},
    }  # fmt: skip
    text = report_text(report)
    for label in ("1->1", "1->2", "2->1"):
        assert f" {label} " in text
    assert any(" 2->1 " in line and " push " in line for line in text.splitlines())
    assert "skipped q TP 1->2 pull: a state group" in text
    assert "between hosts: UCX_TLS=tcp,self" in text


def _bench(*args: str, model: str = "gemma-3-4b-it") -> dict[str, Any]:
    result = subprocess.run(
        [CLI, "bench", "--models", model, "--sizes", "1k", "--repeat", "1", "--json", *args],
        capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def _check_pairings(report: dict[str, Any], wanted: list[tuple[int, int, str]]) -> None:
    """Every pairing row, in order; each transfer ended OK (the bench fails otherwise)
    with every token valid and the same bytes as TP 1 -> 1."""
    rows = report["pairings"]
    assert [(r["prefill_tp"], r["decode_tp"], r["mode"]) for r in rows] == wanted
    (case,) = report["cases"]  # the equal-TP case keeps its schema
    assert case["tokens"] == 1024 and case["kvxfer_gbps"] > 0
    for row in rows:
        assert row["model"] == case["model"] and row["tokens"] == 1024
        assert row["valid_tokens"] == 1024
        assert row["pulls"] == max(row["prefill_tp"], row["decode_tp"])
        assert row["bytes_moved"] == row["bytes"] == rows[0]["bytes"]  # same request
        assert row["bytes_moved"] >= row["min_bytes"] > 0
        assert row["raw_nixl_gbps"] > 0 and row["kvxfer_gbps"] > 0
        assert row["raw_ms_p50"] <= row["raw_ms_p99"]


@pytest.mark.e2e
@pytest.mark.nixl
@pytest.mark.timeout(300)
def test_bench_reports_push_beside_pull_in_every_tp_pairing() -> None:
    """llama-3.1-8b at 1k is whole blocks of full attention: every pairing, pushed or
    pulled, moves exactly what the decode ranks need."""
    report = _bench("--tp", "1:2", "2:1", "--modes", "pull", "push", model="llama-3.1-8b")
    pairs = [(1, 1), (1, 2), (2, 1)]
    _check_pairings(report, [(p, d, mode) for p, d in pairs for mode in ("pull", "push")])
    for row in report["pairings"]:
        assert row["bytes_moved"] == row["min_bytes"] and row["bytes_vs_min"] == 1.0
    assert "multihost" not in report


@pytest.mark.e2e
@pytest.mark.nixl
@pytest.mark.timeout(300)
@pytest.mark.skipif(hosts.unavailable() is not None, reason=f"{hosts.unavailable()}")
def test_multihost_bench_moves_its_bytes_over_the_veth() -> None:
    report = _bench(
        "--multihost", "--tp", "2:1", "--concurrency", "1,2", "--concurrency-sizes", "1k"
    )
    _check_pairings(report, [(1, 1, "pull"), (2, 1, "pull")])
    assert [level["concurrency"] for level in report["concurrency"]] == [1, 2]
    assert all(level["errors"] == 0 for level in report["concurrency"])
    link = report["multihost"]
    assert "UCX_TLS=tcp" in link["transport"]
    # Every read crossed the link: at least the bytes of all the measured reads (each
    # method's warm-up round and the concurrency bursts come on top).
    (case,) = report["cases"]
    assert link["prefill_link_tx_bytes"] > 3 * case["bytes"] + 2 * sum(
        r["bytes"] for r in report["pairings"]
    )


def test_multihost_without_namespaces_is_refused_naming_the_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench_multihost, "unavailable", lambda: "creating namespaces needs root")
    with pytest.raises(InvalidInputError, match=r"--multihost.*needs root"):
        bench_multihost.run_in_hosts(["bench", "--multihost"])


@pytest.mark.e2e
@pytest.mark.nixl
@pytest.mark.timeout(300)
def test_bench_moves_the_same_bytes_between_block_orders() -> None:
    """gemma-3-4b-it at 1k, equal TP: token-major -> HND is every (token, head) its own
    descriptor, HND -> HND whole blocks; each moves the request's exact bytes."""
    report = _bench("--orders", "token-major:hnd", "hnd:hnd")
    rows = report["pairings"]
    assert [r["orders"] for r in rows] == ["token-major->token-major", "token-major->hnd",
                                           "hnd->hnd"]  # fmt: skip
    layout = layout_for_model("gemma-3-4b-it")
    cells = sum((g.num_kv_heads or 0) * len(g.tensors) for g in layout.groups)
    assert [r["descriptors"] for r in rows] == [rows[0]["descriptors"], 1024 * cells,
                                                rows[0]["descriptors"]]  # fmt: skip
    for row in rows:
        assert row["bytes_moved"] == row["bytes"] == rows[0]["bytes"]
        assert row["valid_tokens"] == 1024 and row["kvxfer_gbps"] > 0
    assert " t->hnd " in report_text(report)
