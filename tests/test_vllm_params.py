"""What the vLLM connector sends through kv_transfer_params, and how a pull's outcome
becomes the block ids vLLM recomputes from."""

from __future__ import annotations

import json

import pytest

from kvxfer._exceptions import InvalidInputError, KvxferError
from kvxfer.core.layout import BlockId, BlockSpan, GroupId
from kvxfer.core.requests import PullDone, PullStatus, TransferParams
from kvxfer.integrations.vllm_params import load_errors, params_from_dict, params_to_dict


def _params() -> TransferParams:
    spans = (
        BlockSpan(GroupId(0), 1, (BlockId(2), BlockId(3))),
        BlockSpan(GroupId(1), 0, (BlockId(4),)),
    )
    return TransferParams("127.0.0.1:5000", "engine-1", 3, 0, "req-7", 299, spans)


def test_params_survive_a_json_round_trip() -> None:
    params = _params()
    assert params_from_dict(json.loads(json.dumps(params_to_dict(params)))) == params


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_tokens": 0}, "params.num_tokens"),
        ({"spans": [[0, 1]]}, "kv_transfer_params.kvxfer.spans"),
        ({"engine_id": "has space"}, "params.engine_id"),
    ],
)
def test_bad_params_name_the_field(change: dict[str, object], field: str) -> None:
    bad = {**params_to_dict(_params()), **change}
    with pytest.raises(KvxferError) as caught:
        params_from_dict(bad)
    assert field in str(caught.value)


def test_missing_key_is_named() -> None:
    bad = params_to_dict(_params())
    del bad["epoch"]
    with pytest.raises(InvalidInputError, match=r"kvxfer\.epoch"):
        params_from_dict(bad)


def _done(status: PullStatus, failed: dict[int, tuple[int, ...]], valid: int) -> PullDone:
    return PullDone("req-7", status, failed, valid, 0, 0.0)


def test_load_errors_start_at_valid_tokens_and_cover_failed_blocks() -> None:
    local = [[10, 11, 12, 13, 14]]
    # Blocks 2 and 4 failed (B = 128): vLLM must resume at token 256, block 2.
    done = _done(PullStatus.PARTIAL, {0: (2, 4)}, 256)
    assert load_errors(done, local, 128) == {12, 14}
    assert load_errors(_done(PullStatus.FAILED, {0: (0, 1)}, 0), local, 128) == {10, 11}
    assert load_errors(_done(PullStatus.OK, {}, 600), local, 128) == set()


def test_hybrid_caches_get_no_block_level_errors() -> None:
    # vLLM 0.32 refuses block ids with several groups; the connector fails the request.
    done = _done(PullStatus.PARTIAL, {0: (2,)}, 256)
    assert load_errors(done, [[1, 2, 3], [4, 5, 6]], 128) == set()
