"""The state families against vLLM itself: for every case of test_state_families.py
(real files and hand-made configs, TP 1 and 2), the bytes of each state tensor kvxfer
plans equal what vLLM's model classes allocate (tests/vllm_state_shapes.py, run under
.venv-vllm), and each tensor's cut over TP ranks has vLLM's per-rank shape: a conv state
kernel - 1 rows of the rank's channels, any other state the rank's heads (or channels)
first. Bamba has no model class in vLLM 0.32 and is left out."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_state_families import CASES
from vllm_harness import run_script

from kvxfer.core.layout import GroupKind
from kvxfer.core.profiles import layout_from_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).parent / "vllm_state_shapes.py"


def _model_dtype(config: dict[str, object], state_dtype: str | None) -> str:
    text = config.get("text_config", config)
    assert isinstance(text, dict)
    return state_dtype or str(text.get("torch_dtype") or text.get("dtype"))


def test_state_bytes_equal_what_vllm_allocates() -> None:
    cases = {
        name: {"config": config, "tp": tp, "dtype": _model_dtype(config, state_dtype)}
        for name, (config, state_dtype, tp, _) in CASES.items()
        if config.get("model_type") != "bamba"
    }
    assert len(cases) == len(CASES) - 2  # all but bamba-9b and bamba-9b-tp2
    vllm = run_script(SCRIPT, cases, timeout_s=500)
    for name, case in cases.items():
        config, state_dtype, tp, _ = CASES[name]
        layout = layout_from_config(config, name=name, tp_size=tp, state_dtype=state_dtype)
        (state,) = [g for g in layout.groups if g.kind is GroupKind.MAMBA]
        tensors = [t for t in state.tensors if t.layer == state.layers[0]]
        assert [t.bytes_per_block for t in tensors] == vllm[name]["bytes"], (name, case["tp"])
        for tensor, shape in zip(tensors, vllm[name]["shapes"], strict=True):
            shard = tensor.shard
            assert shard is not None, (name, tensor.name)
            if tensor.name.endswith(".conv"):  # (kernel - 1, channels on this rank)
                assert shard.rows == shape[0], (name, tensor.name, shape)
            else:  # (heads or channels on this rank, ...)
                assert (shard.rows, sum(shard.rank_units(tp))) == (1, shape[0]), (name, shape)
