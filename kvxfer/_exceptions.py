"""Every error kvxfer raises on purpose, in one tree.

    KvxferError
    ├── InvalidInputError (also ValueError)   bad value from a user, a config or the wire;
    │   │                                     `.field` names the offending field path
    │   ├── LayoutError                       a layout, group, region or span is malformed
    │   ├── PlanError                         a request cannot be planned (N, C, spans, ids)
    │   └── ProfileError                      a model config cannot be read
    │       └── UnsupportedModelError         a readable config of an architecture not handled yet
    ├── LimitExceededError                    a configured limit was hit (message names the limit)
    │   └── BusyError                         a peer runs as many of this client's calls as it
    │                                         allows: the same call may succeed a moment later
    ├── NegotiationError                      two layouts do not agree; `.mismatches` lists why
    ├── NotFoundError                         unknown request, engine or peer
    ├── LeaseError                            a lease expired or was released under a request
    ├── PeerUnavailableError                  a peer sidecar cannot be reached over gRPC
    ├── ShuttingDownError                     the sidecar is draining and takes no new work
    └── DataPlaneError                        NIXL side of things
        ├── BackendCreationError              NIXL refused a backend the agent's options name;
        │                                     `.option` names the option to fix
        ├── RegistrationError                 memory could not be opened or registered
        ├── PeerDisconnectedError             the remote agent went away
        └── TransferError                     a transfer could not be posted or failed

Errors from lower libraries (nixl, grpc, OS) are translated at the module that
calls them and re-raised `from exc`, so callers only ever catch these. A message
that quotes a value from outside quotes it with `shown`, so it stays short however
long the value was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SHOWN_CHARS = 64  # of a quoted value: enough to recognise it, short enough to log and send


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`value` quoted for an error message: its repr, or for a string or bytes longer
    than `limit` the repr of its start and how long it was. An error about a
    9000-character id must not carry the id: a message travels in gRPC trailers,
    which have a size limit, and ends up in logs."""
    if not isinstance(value, str | bytes) or len(value) <= limit:
        return repr(value)
    unit = "characters" if isinstance(value, str) else "bytes"
    return f"{value[:limit]!r}... ({len(value)} {unit})"


class KvxferError(Exception):
    """Base of every error raised on purpose by kvxfer."""


class InvalidInputError(KvxferError, ValueError):
    """A value from a user, a config file or the wire is not acceptable."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class LayoutError(InvalidInputError):
    """A layout, KV group, region or block span is malformed."""


class PlanError(InvalidInputError):
    """A request cannot be planned as given."""


class ProfileError(InvalidInputError):
    """A model config cannot be turned into a layout."""


class UnsupportedModelError(ProfileError):
    """The config is readable but describes an architecture kvxfer does not handle yet."""


class LimitExceededError(KvxferError):
    """A configured limit (message size, blocks per request, in-flight pulls) was exceeded."""


class BusyError(LimitExceededError):
    """The peer already runs `limits.max_calls_per_peer` calls of this client: the call
    never started there, and the same call may succeed once one of them ends. Every
    other LimitExceededError is about the call itself and fails again as it is."""


class NotFoundError(KvxferError):
    """An unknown request, engine or peer was named."""


class LeaseError(KvxferError):
    """A lease expired or was released while a request still needed it."""


class PermissionDeniedError(KvxferError):
    """The caller may not do this: another reader's lease, or a peer not allowed."""


class NegotiationError(KvxferError):
    """Two layouts do not agree; `mismatches` says where and what to do."""

    def __init__(self, mismatches: Sequence[Any]) -> None:
        lines = "; ".join(str(m) for m in mismatches)
        super().__init__(f"layouts do not agree: {lines}")
        self.mismatches = tuple(mismatches)


class PeerUnavailableError(KvxferError):
    """A peer sidecar (or this engine's sidecar) could not be reached over gRPC."""


class LaneUnreachableError(PeerUnavailableError):
    """A peer lane could not be connected to: nothing of the call was sent."""


class ShuttingDownError(KvxferError):
    """The sidecar is shutting down and accepts no new work."""


class DataPlaneError(KvxferError):
    """Something went wrong on the NIXL side."""


class BackendCreationError(DataPlaneError):
    """NIXL could not create a backend an agent's options name, for a reason the options
    are: `option` is "backends" (NIXL has no such backend) or "backend_params" (NIXL
    refused it with the parameters given)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


class RegistrationError(DataPlaneError):
    """Engine memory could not be opened or registered with NIXL."""


class PeerDisconnectedError(DataPlaneError):
    """The remote agent went away; its metadata must be loaded again."""


class TransferError(DataPlaneError):
    """A transfer could not be posted, or it failed."""
