"""`kvxfer-cli layout` / `plan` as a user runs them: the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CLI = shutil.which("kvxfer-cli") or str(Path(sys.executable).parent / "kvxfer-cli")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=30, check=False)


def test_plan_json_gemma_32k() -> None:
    result = run("plan", "--model", "gemma-3-4b-it", "--tokens", "32768", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {
        "model",
        "tokens",
        "block_size",
        "computed_tokens",
        "kv_dtype",
        "groups",
        "total_bytes",
        "full_attention_bytes",
    }
    assert report["model"] == "gemma-3-4b-it" and report["tokens"] == 32768
    sliding, full = report["groups"]
    assert set(sliding) == {
        "kind",
        "sliding_window",
        "chunk_size",
        "num_layers",
        "first_block",
        "last_block",
        "num_blocks",
        "bytes",
    }
    assert (sliding["kind"], sliding["sliding_window"], sliding["num_layers"]) == (
        "sliding_window",
        1024,
        29,
    )
    assert (sliding["first_block"], sliding["last_block"], sliding["num_blocks"]) == (
        1984,
        2047,
        64,
    )
    assert (full["first_block"], full["last_block"], full["num_blocks"]) == (0, 2047, 2048)
    assert report["total_bytes"] == sliding["bytes"] + full["bytes"]
    assert report["total_bytes"] * 5 < report["full_attention_bytes"]


def test_plan_full_hit_has_null_blocks() -> None:
    report = json.loads(
        run(
            "plan", "--model", "jamba-mini-1.5", "--tokens", "100", "--computed", "100", "--json"
        ).stdout
    )
    assert all(g["first_block"] is None and g["num_blocks"] == 0 for g in report["groups"])
    assert report["total_bytes"] == 0


def test_plan_table_is_readable() -> None:
    result = run("plan", "--model", "gpt-oss-20b", "--tokens", "1000", "--computed", "512")
    assert result.returncode == 0
    assert "sliding_window(W=128)" in result.stdout and "saved" in result.stdout


def test_layout_json_and_table() -> None:
    report = json.loads(run("layout", "--model", "qwen3-next-80b-a3b", "--json").stdout)
    assert [g["kind"] for g in report["groups"]] == ["mamba", "full_attention"]
    assert report["groups"][0]["bytes_per_token"] is None
    assert report["groups"][1]["bytes_per_token"] == 12 * 2 * 2 * 256 * 2
    assert "bytes/block" in run("layout", "--model", "llama-3.1-8b", "--tp-size", "2").stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["plan", "--model", "llama-3.1-8b", "--tokens", "100", "--computed", "200"],
            "computed_tokens: must be in [0, num_tokens=100]",
        ),
        (
            ["plan", "--model", "llama-3.1-8b", "--tokens", "100", "--computed", "7"],
            "computed_tokens: must be a multiple of block_size 16",
        ),
        (["plan", "--model", "llama-3.1-8b", "--tokens", "0"], "--tokens: must be at least 1"),
        # an OverflowError traceback, then accepted up to any length: the sidecar's 2^40
        (["plan", "--model", "llama-3.1-8b", "--tokens", str(10**21)], "--tokens: must be at most"),
        (["plan", "--model", "llama-3.1-8b", "--tokens", str(2**40 + 1)], "--tokens: must be at"),
        (["plan", "--model", "nope", "--tokens", "10"], "'nope' is neither a built-in profile"),
        (["layout", "--model", "deepseek-v2-lite", "--block-size", "0"], "--block-size"),
        (["plan", "--model", "llama-3.1-8b", "--tokens", "ten"], "not an integer: 'ten'"),
        (["layout", "--model", "llama-3.1-8b", "--kv-dtype", "int2"], "unknown dtype 'int2'"),
        (["layout", "--model", "llama-3.1-8b", "--tp-size", "3"], "cannot be placed on tp_size 3"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args: list[str], needle: str) -> None:
    result = run(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("tokens", [str(2**40 + 1), str(10**21)])
def test_tokens_beyond_the_sidecars_limit_are_a_usage_error(tokens: str) -> None:
    refused = run("plan", "--model", "llama-3.1-8b", "--tokens", tokens)
    assert refused.returncode == 2 and "argument --tokens" in refused.stderr, refused.stderr
    assert run("plan", "--model", "llama-3.1-8b", "--tokens", str(2**40)).returncode == 0


def test_state_dtype_flag_sizes_the_state_a_config_leaves_open() -> None:
    config = str(Path(__file__).parent / "data/configs/qwen3-next-tiny-test.json")
    refused = run("layout", "--model", config, "--json")
    assert refused.returncode != 0 and "state_dtype" in json.loads(refused.stdout)["error"]
    sizes = {}
    for dtype in ("bfloat16", "float32"):
        report = json.loads(
            run("layout", "--model", config, "--state-dtype", dtype, "--json").stdout
        )
        sizes[dtype] = [g["bytes_per_block"] for g in report["groups"] if g["kind"] == "mamba"]
    assert sizes["float32"] == [2 * b for b in sizes["bfloat16"]] and sizes["bfloat16"]


@pytest.mark.parametrize("model", ["gpt-oss-20b", "data/configs/qwen3-next-tiny-test.json"])
def test_an_unknown_state_dtype_is_refused_with_or_without_state_layers(model: str) -> None:
    """gpt-oss has no state layers: the name was never looked at, and it exited 0."""
    if model.endswith(".json"):
        model = str(Path(__file__).parent / model)
    refused = run("layout", "--model", model, "--state-dtype", "wat")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("kvxfer-cli: error: state_dtype: unknown dtype 'wat'")
    assert len(refused.stderr.splitlines()) == 1


def test_malformed_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    result = run("plan", "--model", str(bad), "--tokens", "10")
    assert result.returncode == 2 and "is not valid JSON" in result.stderr


def test_planning_commands_import_neither_torch_nor_nixl() -> None:
    code = (
        "import sys; from kvxfer.cli.main import main; "
        "rc = main(['plan', '--model', 'gpt-oss-20b', '--tokens', '999', '--json']); "
        "heavy = [m for m in ('torch', 'nixl_cu12', 'nixl', 'grpc', 'numpy') if m in sys.modules]; "
        "print(heavy, file=sys.stderr); sys.exit(rc or bool(heavy))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_llama4_layout_and_plan_show_the_chunk() -> None:
    config = str(Path(__file__).parent / "data/configs/llama4-text-formomouse.json")
    report = json.loads(run("layout", "--model", config, "--json").stdout)
    (group,) = report["groups"]
    assert (group["kind"], group["chunk_size"], group["num_layers"]) == ("chunked_local", 8192, 28)
    assert "chunked_local(S=8192)" in run("layout", "--model", config).stdout
    plan = json.loads(run("plan", "--model", config, "--tokens", "130000", "--json").stdout)
    (moved,) = plan["groups"]
    assert (moved["first_block"], moved["last_block"], moved["chunk_size"]) == (7680, 8124, 8192)
    assert plan["total_bytes"] == 445 * 28 * 2 * 32 * 8 * 128
    assert plan["full_attention_bytes"] == 8125 * 28 * 2 * 32 * 8 * 128


def test_mla_layout_and_plan_show_the_latent() -> None:
    """DeepSeek-V2-Lite: 27 MLA layers of 576 bf16 elements per token (1152 bytes), the
    same at TP 4; 1000 tokens move blocks 0..62 of every layer."""
    report = json.loads(run("layout", "--model", "deepseek-v2-lite", "--json").stdout)
    (group,) = report["groups"]
    assert (group["kind"], group["num_layers"], group["num_tensors"]) == ("mla", 27, 27)
    assert (group["bytes_per_token"], group["replicated_across_tp"]) == (27 * 1152, True)
    text = run("layout", "--model", "deepseek-v2-lite", "--tp-size", "4").stdout
    assert "mla(latent)" in text and "the same on every TP rank" in text
    plan = json.loads(
        run("plan", "--model", "deepseek-v2-lite", "--tokens", "1000", "--json").stdout
    )
    (moved,) = plan["groups"]
    assert (moved["first_block"], moved["last_block"]) == (0, 62)
    assert plan["total_bytes"] == plan["full_attention_bytes"] == 63 * 27 * 16 * 1152
