"""kvxfer.client: engine-side helpers and the client of a kvxfer sidecar.

    from kvxfer.client import EngineClient, SyncEngineClient

The client classes load on first use, so that `kvxfer.client.shm` and the other
helpers stay importable without grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvxfer.client.engine import EngineClient, Registration, SyncEngineClient

__all__ = ["EngineClient", "Registration", "SyncEngineClient"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvxfer.client import engine  # noqa: PLC0415 (lazy: see the docstring)

        return getattr(engine, name)
    raise AttributeError(f"module 'kvxfer.client' has no attribute {name!r}")
