"""Push (WRITE) end to end: the decode engine announces its blocks (Expect), the
prefill sidecar writes them as tokens become ready (Push), real sidecar processes,
real NIXL over shared memory, chunk failures injected at the prefill sidecar's
fault seam (where push posts its chunks).

`kvxfer-cli demo --mode push` checks every byte itself (each decode block against
the prefill block it must hold, every other decode byte untouched); this test checks
each request's bytes and valid_tokens against the token-level oracle, as for pull.
"""

from __future__ import annotations

import json

import pytest
from test_demo import Demos, demos  # noqa: F401 (the fixture)
from test_reblock_e2e import check_demo_report
from test_tp_e2e import check_tp_report

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.mark.parametrize(
    ("model", "prefill_block", "decode_block", "steps"),
    [
        ("gpt-oss-20b", 16, 16, 3),  # sliding window + full attention, progressive
        ("gemma-3-4b-it", 32, 16, 4),  # decode blocks smaller
        ("qwen3-next-80b-a3b", 16, 48, 2),  # a state group: it goes only at final
        ("llama-3.1-8b", 48, 32, 1),  # one final call; neither block size divides the other
    ],
)
def test_push_byte_for_byte_with_failures(
    demos: Demos,  # noqa: F811 (the fixture)
    model: str,
    prefill_block: int,
    decode_block: int,
    steps: int,
) -> None:
    result = demos.run(
        "--mode", "push", "--push-steps", str(steps),
        "--model", model, "--requests", "5", "--tokens-range", "100:1500",
        "--prefix-hit-rate", "0.5", "--fail-rate", "0.25", "--seed", "2",
        "--prefill-block-size", str(prefill_block), "--decode-block-size", str(decode_block),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["mode"] == "push"
    check_demo_report(report, model, prefill_block, decode_block)


@pytest.mark.parametrize(
    ("model", "prefill_tp", "decode_tp", "blocks"),
    [
        ("llama-3.1-8b", 1, 2, (16, 16)),  # one announcement per (decode rank, source)
        ("gpt-oss-20b", 2, 1, (16, 32)),  # two sources write heads into one decode rank
    ],
)
def test_push_between_tp_sizes_head_by_head_with_failures(
    demos: Demos,  # noqa: F811 (the fixture)
    model: str,
    prefill_tp: int,
    decode_tp: int,
    blocks: tuple[int, int],
) -> None:
    result = demos.run(
        "--mode", "push", "--model", model, "--requests", "4", "--tokens-range", "100:1200",
        "--prefix-hit-rate", "0.5", "--fail-rate", "0.25", "--seed", "2",
        "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
        "--prefill-block-size", str(blocks[0]), "--decode-block-size", str(blocks[1]),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["mode"] == "push"
    check_tp_report(report, model, prefill_tp, decode_tp, blocks)
