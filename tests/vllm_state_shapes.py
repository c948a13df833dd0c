"""Run under .venv-vllm: vLLM's own state sizes for the configs on stdin.

Input: JSON {case: {"config": {...}, "tp": int, "dtype": str}}. Output: JSON
{case: {"bytes": [bytes of each state tensor of one layer], "shapes": [its per-rank shape
in vLLM's default (SD) conv layout]}}, from each model class's
`get_mamba_state_shape_from_config` / `get_mamba_state_dtype_from_config` (MiniMax, whose
model vLLM 0.23 removed, from `linear_attention_state_shape` / `_dtype` as its lightning
layer calls them; Qwen3.5, whose module needs torchvision, from
`gated_delta_net_state_shape` / `_dtype` as Qwen3_5ForCausalLMBase calls them), with
vLLM's config-update hooks applied (Nemotron-H's float32 ssm default, Qwen3.5's
mamba_ssm_dtype). Written for tests/test_state_families_vllm.py.
"""

from __future__ import annotations

import importlib
import json
import sys
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.models import config as model_configs

# model_type -> (module under vllm.model_executor.models, class)
MODELS = {
    "mamba": ("mamba", "MambaForCausalLM"),
    "falcon_mamba": ("mamba", "MambaForCausalLM"),
    "mamba2": ("mamba2", "Mamba2ForCausalLM"),
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM"),
    "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "zamba2": ("zamba2", "Zamba2ForCausalLM"),
    "lfm2": ("lfm2", "Lfm2ForCausalLM"),
}
METADATA = ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version")


def _hf_config(config: dict[str, Any]) -> Any:
    text = dict(config.get("text_config", config))
    for key in METADATA:
        text.pop(key, None)
    return AutoConfig.for_model(text.pop("model_type"), **text)


def _state(config: dict[str, Any], tp: int, dtype: str) -> dict[str, list[Any]]:
    hf = _hf_config(config)
    model_type = config.get("model_type")
    cache = SimpleNamespace(
        mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto", use_replayssm=False
    )
    model = SimpleNamespace(hf_config=hf, hf_text_config=hf, dtype=getattr(torch, dtype))
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=model,
        cache_config=cache,
        num_speculative_tokens=0,
        speculative_config=None,
    )
    if model_type == "nemotron_h":
        model_configs.NemotronHForCausalLMConfig.verify_and_update_config(vllm_config)
    if model_type == "qwen3_5":
        model_configs.Qwen3_5ForConditionalGenerationConfig.verify_and_update_config(vllm_config)
    if model_type in ("minimax", "minimax_m1", "minimax_text_01"):
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        shapes = MambaStateShapeCalculator.linear_attention_state_shape(
            num_heads=hf.num_attention_heads, tp_size=tp, head_dim=head_dim
        )
        dtypes = MambaStateDtypeCalculator.linear_attention_state_dtype(model.dtype, "auto")
    elif model_type == "qwen3_5":
        shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp,
            hf.linear_num_key_heads,
            hf.linear_num_value_heads,
            hf.linear_key_head_dim,
            hf.linear_value_head_dim,
            hf.linear_conv_kernel_dim,
            0,
        )
        dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            model.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
        )
    else:
        module, name = MODELS[str(model_type)]
        cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
        shapes = cls.get_mamba_state_shape_from_config(vllm_config)
        dtypes = cls.get_mamba_state_dtype_from_config(vllm_config)
    sizes = [
        int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        for shape, dt in zip(shapes, dtypes, strict=True)
    ]
    return {"bytes": sizes, "shapes": [list(shape) for shape in shapes]}


def main() -> None:
    cases = json.load(sys.stdin)
    out = {name: _state(c["config"], c["tp"], c["dtype"]) for name, c in cases.items()}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
