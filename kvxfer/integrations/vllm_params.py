"""What the vLLM connector puts in `kv_transfer_params`, and how a pull's outcome
becomes vLLM's recompute instructions. Pure: no vLLM, no gRPC.

`kv_transfer_params` travel as JSON through the router (prefill's request
output -> decode's request), so transfer params become a plain dict under the
key "kvxfer" and are validated again by the domain constructors when read
back; a bad dict is an InvalidInputError/LayoutError naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from kvxfer._exceptions import InvalidInputError
from kvxfer.core.layout import BlockId, BlockSpan, GroupId
from kvxfer.core.requests import PullDone, PullStatus, TransferParams

KEY = "kvxfer"


def params_to_dict(params: TransferParams) -> dict[str, Any]:
    return {
        "peer_address": params.peer_address,
        "engine_id": params.engine_id,
        "epoch": params.epoch,
        "tp_rank": params.tp_rank,
        "request_id": params.request_id,
        "num_tokens": params.num_tokens,
        "spans": [[s.group_id, s.first_block, list(s.block_ids)] for s in params.spans],
    }


def params_from_dict(value: object, field: str = f"kv_transfer_params.{KEY}") -> TransferParams:
    if not isinstance(value, Mapping):
        raise InvalidInputError(field, f"must be an object, got {type(value).__name__}")
    try:
        spans = tuple(
            BlockSpan(GroupId(int(g)), int(first), tuple(BlockId(int(b)) for b in ids))
            for g, first, ids in value["spans"]
        )
        return TransferParams(
            peer_address=value["peer_address"],
            engine_id=value["engine_id"],
            epoch=value["epoch"],
            tp_rank=value["tp_rank"],
            request_id=value["request_id"],
            num_tokens=value["num_tokens"],
            spans=spans,
        )
    except KeyError as exc:
        raise InvalidInputError(f"{field}.{exc.args[0]}", "missing") from exc
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{field}.spans", f"must be [group, first, [ids]]: {exc}") from exc


def load_errors(
    done: PullDone, local_block_ids: Sequence[Sequence[int]], block_size: int
) -> set[int]:
    """Local block ids to report from `get_block_ids_with_load_errors` for a one-group
    cache: vLLM resumes at the first reported block, so the block holding token
    `valid_tokens` goes first; every failed block follows (all must be recomputed)."""
    if done.status is PullStatus.OK or len(local_block_ids) != 1:
        return set()
    ids = local_block_ids[0]
    logical = {done.valid_tokens // block_size, *done.failed_blocks.get(0, ())}
    return {int(ids[b]) for b in logical if b < len(ids)}


# ---- the worker's registration, for a scheduler the handshake channel did not reach ----
#
# vLLM passes one handshake object from the workers to the scheduler. Under a
# MultiConnector that object is the *first* child's that returns one, so beside a
# sibling that also uses the channel (NixlConnector, Mooncake, ...) kvxfer's
# registration may never arrive. The worker therefore also leaves it in a file
# only this user can write, named after vLLM's engine id (the same in the
# scheduler and worker processes of one engine), and the scheduler reads it when
# the channel brought nothing of kvxfer's.

HANDSHAKE_FIELDS = ("engine_id", "epoch", "peer_address")


def handshake_path(vllm_engine_id: str, tp_rank: int = 0, directory: str | None = None) -> str:
    """Where the worker of `vllm_engine_id` (vLLM's kv_transfer_config.engine_id) leaves
    its registration; the id is hashed, so any string makes a safe file name."""
    if not vllm_engine_id:
        raise InvalidInputError("kv_transfer_config.engine_id", "empty")
    digest = hashlib.sha256(vllm_engine_id.encode()).hexdigest()[:20]
    return os.path.join(
        directory or tempfile.gettempdir(), f"kvxfer-vllm-{digest}-tp{tp_rank}.json"
    )


def write_handshake(path: str, fields: Mapping[str, Any]) -> None:
    """Atomically replace `path` with `fields` (0600: the scheduler trusts its contents)."""
    record = {key: fields[key] for key in HANDSHAKE_FIELDS}
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(record, out)
    os.replace(temporary, path)


def read_handshake(path: str) -> dict[str, Any] | None:
    """The registration at `path`, None if there is none yet; a file another user owns or
    others may write, or one missing a field, is refused naming what is wrong."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as source:
        info = os.fstat(source.fileno())
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise InvalidInputError(path, "not owned by this user or writable by others")
        try:
            record = json.load(source)
        except ValueError as exc:
            raise InvalidInputError(path, f"not JSON: {exc}") from exc
    if not isinstance(record, dict):
        raise InvalidInputError(path, "must hold an object")
    for key, kind in zip(HANDSHAKE_FIELDS, (str, int, str), strict=True):
        if not isinstance(record.get(key), kind):
            raise InvalidInputError(f"{path}.{key}", f"missing or not {kind.__name__}")
    return record
