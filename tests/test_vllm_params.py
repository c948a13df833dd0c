"""What the vLLM connector sends through kv_transfer_params, and how a pull's outcome
becomes the block ids vLLM recomputes from."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvxfer._exceptions import InvalidInputError, KvxferError
from kvxfer.core.layout import BlockId, BlockSpan, GroupId
from kvxfer.core.requests import PullDone, PullStatus, TransferParams
from kvxfer.integrations.vllm_params import (
    KEY,
    connector_event_loop,
    decode_tp_size,
    load_errors,
    params_from_dict,
    params_to_dict,
    publication_id,
    publication_of,
    published_request,
    pulled_tokens,
    rank_params,
    reader_sources,
    readers_of,
)


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
        ({"peer_address": None}, "params.peer_address"),
        ({"peer_address": 5000}, "params.peer_address"),
        ({"peer_address": ["127.0.0.1:5000"]}, "params.peer_address"),
    ],
)
def test_bad_params_name_the_field(change: dict[str, object], field: str) -> None:
    bad = {**params_to_dict(_params()), **change}
    with pytest.raises(KvxferError) as caught:
        params_from_dict(bad)
    assert field in str(caught.value)
    assert getattr(caught.value, "field", None) == field  # the field itself, not spans


def test_the_tokens_a_decode_pulls_are_read_from_its_params_or_none() -> None:
    published = params_to_dict(_params())
    assert pulled_tokens({"do_remote_prefill": True, KEY: published}) == 299
    # A TP publication carries the request's count beside its readers' params.
    assert pulled_tokens({"do_remote_prefill": True, KEY: {"num_tokens": 0, "readers": []}}) == 0
    assert pulled_tokens(None) is None
    assert pulled_tokens({}) is None
    assert pulled_tokens({"do_remote_prefill": False, KEY: published}) is None
    assert pulled_tokens({"do_remote_prefill": True}) is None  # another connector's


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (["do_remote_prefill"], "kv_transfer_params: must be an object, got list"),
        ({"do_remote_prefill": True, KEY: []}, f"kv_transfer_params.{KEY}: must be an object"),
        ({"do_remote_prefill": True, KEY: "x"}, f"kv_transfer_params.{KEY}: must be an object"),
        ({"do_remote_prefill": True, KEY: {}}, f"{KEY}.num_tokens: must be a non-negative"),
        ({"do_remote_prefill": True, KEY: {"num_tokens": None}}, f"{KEY}.num_tokens: "),
        ({"do_remote_prefill": True, KEY: {"num_tokens": "12"}}, f"{KEY}.num_tokens: "),
        ({"do_remote_prefill": True, KEY: {"num_tokens": -1}}, f"{KEY}.num_tokens: "),
        ({"do_remote_prefill": True, KEY: {"num_tokens": True}}, f"{KEY}.num_tokens: "),
        ({"do_remote_prefill": True, KEY: {"num_tokens": 2.5}}, f"{KEY}.num_tokens: "),
    ],
)
def test_malformed_params_on_the_schedulers_path_name_the_field(params: object, field: str) -> None:
    """What vLLM's scheduler reads of a decode request's params, where an exception would
    end the engine: the connector turns this error into a local prefill."""
    with pytest.raises(InvalidInputError) as caught:
        pulled_tokens(params)
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
    assert load_errors(done, local, 128, 128) == {12, 14}
    assert load_errors(_done(PullStatus.FAILED, {0: (0, 1)}, 0), local, 128, 128) == {10, 11}
    assert load_errors(_done(PullStatus.OK, {}, 600), local, 128, 128) == set()


def test_load_errors_never_name_the_null_block() -> None:
    # A window dropped logical blocks 0 and 1 (vLLM's null block 0 stands in for them).
    local = [[0, 0, 12, 13, 14]]
    # Resuming at block 3 is fine; failed block 1 is a null block and never reported.
    assert load_errors(_done(PullStatus.PARTIAL, {0: (1, 3)}, 384), local, 128, 128) == {13}
    # Resuming inside the dropped blocks cannot be done: the request is recomputed whole
    # (vLLM would take every request holding the null block as failed).
    assert load_errors(_done(PullStatus.FAILED, {0: (2,)}, 0), local, 128, 128) is None


def test_hybrid_caches_get_no_block_level_errors() -> None:
    # vLLM 0.32 refuses block ids with several groups; the connector fails the request.
    done = _done(PullStatus.PARTIAL, {0: (2,)}, 256)
    assert load_errors(done, [[1, 2, 3], [4, 5, 6]], 128, 128) == set()


# ---- different TP sizes ------------------------------------------------------------


def test_publication_ids_name_their_reader_and_plain_ids_do_not() -> None:
    pub = publication_id("cmpl-1~x", 3, 1, 2)
    assert pub == "cmpl-1~x~p3d1of2"
    assert publication_of(pub) == ("cmpl-1~x", 3, 1, 2)
    # A decode rank reading two prefill ranks pulls two distinct ids.
    assert publication_id("r", 0, 0, 1) != publication_id("r", 1, 0, 1)
    assert publication_of("cmpl-1") is None
    assert publication_of("cmpl~d1of2") is None


def test_the_request_behind_the_params_a_prefill_returned() -> None:
    """What the demo waits to see in the prefill's `finished_sending`."""
    assert published_request({KEY: {"request_id": "cmpl-7", "num_tokens": 3}}) == "cmpl-7"
    readers = [[{"request_id": publication_id("cmpl-7~x", 0, d, 2)}] for d in range(2)]
    assert published_request({KEY: {"num_tokens": 3, "readers": readers}}) == "cmpl-7~x"
    with pytest.raises(InvalidInputError, match=f"kv_transfer_params.{KEY}"):
        published_request({})
    with pytest.raises(InvalidInputError, match="readers"):
        published_request({KEY: {"readers": [[{"request_id": "plain"}]]}})


@pytest.mark.parametrize(
    ("heads", "prefill", "decode", "sources", "readers"),
    [
        (2, 1, 2, [[0], [0]], [[0, 1]]),  # 1 -> 2: both decode ranks read rank 0
        (2, 2, 1, [[0, 1]], [[0], [0]]),  # 2 -> 1: the decode rank reads both
        (8, 2, 2, [[0], [1]], [[0], [1]]),  # equal: rank r <- rank r
        (2, 4, 1, [[0, 2]], [[0], [], [0], []]),  # replicated heads: one replica each
    ],
)
def test_sources_and_readers_agree(
    heads: int, prefill: int, decode: int, sources: list[list[int]], readers: list[list[int]]
) -> None:
    assert [reader_sources(heads, prefill, decode, d) for d in range(decode)] == sources
    assert [readers_of(heads, prefill, decode, p) for p in range(prefill)] == readers


def test_a_decode_rank_takes_its_own_params_and_refuses_a_wrong_count() -> None:
    def pub(source: int, reader: int) -> dict[str, object]:
        params = dataclasses.replace(
            _params(), engine_id=f"engine-{source}", tp_rank=source,
            request_id=publication_id("req-7", source, reader, 2),
        )  # fmt: skip
        return params_to_dict(params)

    # Prefill TP 2 -> decode TP 2 with 2 heads: rank d reads rank d; with 1 head (both
    # replicated) each reads one replica.
    published = {
        "num_tokens": 299, "prefill_tp_size": 2, "readers": [[pub(0, 0)], [pub(1, 1)]]
    }  # fmt: skip
    assert [p.tp_rank for p in rank_params(published, 2, 1, 2)] == [1]
    field = "kv_transfer_params.kvxfer"
    cases: list[tuple[object, int, str, str]] = [
        (published, 4, f"{field}.readers", "published for 2 decode ranks"),
        ({**published, "readers": [[], [pub(1, 1)]]}, 2, f"{field}.readers[0]", "non-empty"),
        ({**published, "readers": [[pub(0, 0), pub(0, 0)], [pub(1, 1)]]}, 2,
         f"{field}.readers[0]", "twice"),
        ({**published, "readers": [[pub(0, 1)], [pub(1, 1)]]}, 2,
         f"{field}.readers[0][0].request_id", "for decode rank 0 of 2"),
        ({**published, "readers": [[pub(1, 0)], [pub(1, 1)]]}, 2, f"{field}.readers[0]",
         r"reads its heads from prefill ranks \[0\]"),
        ({**published, "num_tokens": 999}, 2, f"{field}.readers[0][0].num_tokens", "999"),
        ({**published, "prefill_tp_size": "2"}, 2, f"{field}.prefill_tp_size", "integer"),
    ]  # fmt: skip
    for value, tp_size, where, words in cases:
        with pytest.raises(InvalidInputError, match=words) as caught:
            rank_params(value, tp_size, 0, 2)
        assert caught.value.field == where
    plain = params_to_dict(_params())
    with pytest.raises(InvalidInputError, match="decode_tp_size=2") as single:
        rank_params(plain, 2, 1, 2)  # one publication, two decode ranks
    assert single.value.field == "kv_transfer_params.decode_tp_size"
    assert rank_params(plain, 1, 0, 2) == [_params()]


@pytest.mark.parametrize("value", [0, -1, "2", True, 5000, 1.5, 3, 4096])
def test_a_bad_decode_tp_size_is_named(value: object) -> None:
    with pytest.raises(InvalidInputError) as caught:
        decode_tp_size({"decode_tp_size": value}, 1, 8)  # 3: 8 heads do not place
    assert caught.value.field == "kv_transfer_params.decode_tp_size"
    assert decode_tp_size({}, 2, 8) == 2 and decode_tp_size({"decode_tp_size": 16}, 1, 8) == 16


def test_the_connector_event_loop_is_kvxfers_default_or_one_named() -> None:
    """What the connector hands its sidecar clients: nothing (kvxfer's default loop), or
    the loop named, which each client then runs (test_event_loops)."""
    assert connector_event_loop({"sidecar": "unix:/s"}) == {}
    assert connector_event_loop({"event_loop": "asyncio"}) == {"event_loop": "asyncio"}
    assert connector_event_loop({"event_loop": "uvloop"}) == {"event_loop": "uvloop"}
    for bad in ("trio", "", 1):
        with pytest.raises(InvalidInputError, match=r"kv_connector_extra_config\.event_loop"):
            connector_event_loop({"event_loop": bad})
