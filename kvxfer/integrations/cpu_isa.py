"""CPU instruction-set state a vLLM-CPU process needs before its first kernel."""

from __future__ import annotations

ALLOW_AMX_ENV = "KVXFER_HARNESS_ALLOW_AMX"
"""Set to 1 by kvxfer's vLLM harness for engines whose connector is not kvxfer's."""


def allow_amx() -> None:
    """Ask Linux for AMX tile state in this process, where the CPU has AMX.

    vLLM-CPU's attention kernel uses AMX on such CPUs (bf16, block size a multiple of
    32) but never asks for the permission Linux requires (arch_prctl
    ARCH_REQ_XCOMP_PERM). A process only has it once oneDNN asked first, which oneDNN
    does for large enough matmuls. A P/D decode's first step (one new token over KV that
    arrived by transfer) runs the AMX attention with no large matmul before it and dies
    with SIGILL, whatever the connector. Seen with vllm-cpu 0.32 on a Sapphire Rapids
    class CPU (amx_tile, amx_bf16). Harmless where the permission is already held."""
    try:
        import torch  # noqa: PLC0415 (only where vLLM runs)
    except ImportError:
        return
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
