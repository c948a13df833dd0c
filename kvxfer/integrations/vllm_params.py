"""What the vLLM connector puts in `kv_transfer_params`, and how a pull's outcome
becomes vLLM's recompute instructions. Pure: no vLLM, no gRPC.

`kv_transfer_params` travel as JSON through the router (prefill's request
output -> decode's request), so transfer params become a plain dict under the
key "kvxfer" and are validated again by the domain constructors when read
back; a bad dict is an InvalidInputError/LayoutError naming the field.
"""

from __future__ import annotations

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
