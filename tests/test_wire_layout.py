"""Layouts on the wire: lossless round trip, field-named errors, and committed gencode."""

from __future__ import annotations

import filecmp
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from strategies import PROFILES

from kvxfer._exceptions import InvalidInputError, LayoutError
from kvxfer.core.layout import BlockId, BlockSpan, GroupId, Region
from kvxfer.core.profiles import layout_for_model
from kvxfer.v1 import layout_pb2 as pb
from kvxfer.v1 import sidecar_pb2
from kvxfer.wire.layout import layout_from_proto, layout_to_proto, span_to_proto, spans_from_proto
from kvxfer.wire.sidecar import bound_from_proto, params_from_proto

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model", PROFILES)
def test_round_trip(model: str) -> None:
    layout = layout_for_model(model, block_size=32, tp_size=1)
    regions = [
        Region(t.name, "buf", i * 10**6, 7, t.bytes_per_block, t.bytes_per_block)
        for i, t in enumerate(t for g in layout.groups for t in g.tensors)
    ]
    bound = layout.with_regions(regions)
    wire = layout_to_proto(bound).SerializeToString()
    assert layout_from_proto(pb.EngineLayout.FromString(wire)) == bound


def test_bad_message_names_the_field() -> None:
    message = layout_to_proto(layout_for_model("gpt-oss-20b"))
    message.groups[0].ClearField("sliding_window")
    with pytest.raises(LayoutError, match=r"^layout.groups\[0\].sliding_window: required"):
        layout_from_proto(message)
    message = layout_to_proto(layout_for_model("gpt-oss-20b"))
    message.groups[1].kind = pb.GROUP_KIND_UNSPECIFIED
    with pytest.raises(LayoutError, match=r"^layout.groups\[1\].kind: unknown group kind 0"):
        layout_from_proto(message)
    message = layout_to_proto(layout_for_model("gpt-oss-20b"))
    message.groups[1].kind = pb.GROUP_KIND_MLA  # K and V per layer: not one latent each
    with pytest.raises(LayoutError, match=r"^layout.groups\[1\].tensors: an mla group holds"):
        layout_from_proto(message)
    message = layout_to_proto(layout_for_model("gpt-oss-20b"))
    message.block_size = 0
    with pytest.raises(LayoutError, match=r"^layout.block_size: must be in"):
        layout_from_proto(message)


@pytest.mark.parametrize(("model", "heads"), [("llama-3.1-8b", 8), ("gpt-oss-20b", 8)])
def test_attention_groups_carry_the_models_kv_heads(model: str, heads: int) -> None:
    """What a split by head needs travels on the wire; head bytes follow from the rank's
    share of the heads (8 heads of 64 or 128 dims, bf16)."""
    for tp in (1, 2, 8):
        layout = layout_for_model(model, block_size=16, tp_size=tp)
        back = layout_from_proto(
            pb.EngineLayout.FromString(layout_to_proto(layout).SerializeToString())
        )
        for group in back.groups:
            assert group.num_kv_heads == heads
            assert layout.rank_heads(group) == heads // tp
        tensor = back.groups[0].tensors[0]
        dim = 128 if model == "llama-3.1-8b" else 64
        assert back.head_bytes(back.groups[0], tensor) == dim * 2


def test_kv_heads_are_optional_and_validated_by_name() -> None:
    message = layout_to_proto(layout_for_model("llama-3.1-8b", tp_size=2))
    message.groups[0].ClearField("num_kv_heads")
    assert layout_from_proto(message).groups[0].num_kv_heads is None
    message.groups[0].num_kv_heads = 3  # does not place on 2 ranks
    with pytest.raises(LayoutError, match=r"^layout.groups\[0\].num_kv_heads: 3 KV heads cannot"):
        layout_from_proto(message)
    message.groups[0].num_kv_heads = 6  # places, but 4 heads' bytes per token are not 3 heads
    odd = layout_from_proto(message)
    assert odd.head_bytes(odd.groups[0], odd.groups[0].tensors[0]) is None
    message = layout_to_proto(layout_for_model("qwen3-next-80b-a3b"))
    state = next(i for i, g in enumerate(message.groups) if g.kind == pb.GROUP_KIND_MAMBA)
    message.groups[state].num_kv_heads = 2
    with pytest.raises(
        LayoutError, match=rf"^layout.groups\[{state}\].num_kv_heads: must be unset"
    ):
        layout_from_proto(message)


def test_spans_round_trip() -> None:
    span = BlockSpan(GroupId(2), 5, (BlockId(9), BlockId(3)))
    assert spans_from_proto([span_to_proto(span)], "spans") == (span,)


@pytest.mark.parametrize(
    ("span", "part"),
    [
        (pb.BlockSpan(group_id=70000), "group_id"),
        (pb.BlockSpan(first_block=2**64 - 1), "first_block"),
        (pb.BlockSpan(block_ids=[2**64 - 1]), "block_ids[0]"),
        (pb.BlockSpan(block_ids=[1, 2, 2**33]), "block_ids[2]"),
    ],
)
def test_a_bad_span_names_its_position_and_the_part_that_is_wrong(
    span: pb.BlockSpan, part: str
) -> None:
    """Each of these was named only `spans[1]`."""
    good = span_to_proto(BlockSpan(GroupId(0), 0, (BlockId(1),)))
    with pytest.raises(LayoutError, match=rf"^spans\[1\]\.{re.escape(part)}: must be in"):
        spans_from_proto([good, span], "spans")
    params = sidecar_pb2.TransferParams(spans=[good, span])
    with pytest.raises(LayoutError) as err:
        params_from_proto(params)
    assert err.value.field == f"params.spans[1].{part}"


def test_generated_code_is_current(tmp_path: Path) -> None:
    """Regenerating from proto/ with the pinned generators changes nothing."""
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
    )
    fresh = sorted(p.name for p in (tmp_path / "kvxfer" / "v1").iterdir())
    committed_dir = REPO / "kvxfer" / "v1"
    assert fresh, "the generator produced nothing"
    for name in fresh:
        assert filecmp.cmp(
            tmp_path / "kvxfer" / "v1" / name, committed_dir / name, shallow=False
        ), f"kvxfer/v1/{name} is stale: run scripts/gen_proto.sh"


def test_chunked_local_round_trips_and_needs_its_chunk_size() -> None:
    config = REPO / "tests/data/configs/llama4-text-formomouse.json"
    layout = layout_for_model(str(config), block_size=32)
    message = layout_to_proto(layout)
    assert message.groups[0].kind == pb.GROUP_KIND_CHUNKED_LOCAL
    assert message.groups[0].chunk_size == 8192
    assert layout_from_proto(pb.EngineLayout.FromString(message.SerializeToString())) == layout
    message.groups[0].ClearField("chunk_size")
    with pytest.raises(LayoutError, match=r"^layout.groups\[0\].chunk_size: required"):
        layout_from_proto(message)
    message = layout_to_proto(layout_for_model("gpt-oss-20b"))
    message.groups[1].chunk_size = 64  # a full-attention group with a chunk size
    with pytest.raises(LayoutError, match=r"^layout.groups\[1\].chunk_size: must be unset"):
        layout_from_proto(message)


def test_state_cuts_round_trip_are_optional_and_validated_by_name() -> None:
    """A state tensor's cut over TP ranks crosses the wire; unset stays unset; a bad one
    is refused naming the field."""
    layout = layout_for_model("falcon-h1-7b", tp_size=4, tp_rank=1)
    back = layout_from_proto(layout_to_proto(layout))
    assert back == layout and back.groups[1].tensors[0].shard is not None
    message = layout_to_proto(layout)
    message.groups[1].tensors[0].ClearField("shard")
    assert layout_from_proto(message).groups[1].tensors[0].shard is None
    message = layout_to_proto(layout)
    message.groups[1].tensors[0].shard.rows = 0
    with pytest.raises(LayoutError, match=r"layout.groups\[1\].tensors\[0\].shard.rows"):
        layout_from_proto(message)
    message = layout_to_proto(layout)
    message.groups[1].tensors[0].shard.rows = 2  # 2 rows no longer add up to the bytes
    with pytest.raises(LayoutError, match=r"tensors\['layer.0.conv'\].shard: 2 rows"):
        layout_from_proto(message)
    message = layout_to_proto(layout)
    message.groups[1].tensors[0].shard.segments.extend(
        [pb.ShardSegment(heads=1, head_bytes=1)] * 70
    )
    with pytest.raises(LayoutError, match=r"shard.segments: 73 segments, at most 64"):
        layout_from_proto(message)
    message = layout_to_proto(layout)
    message.groups[0].tensors[0].shard.rows = 1  # an attention tensor has no cut
    message.groups[0].tensors[0].shard.segments.add(heads=2, head_bytes=1)
    with pytest.raises(
        LayoutError, match=r"groups\[0\].tensors\['layer.0.k'\].shard: must be unset"
    ):
        layout_from_proto(message)


def test_a_peer_buffer_must_fit_in_the_address_space() -> None:
    """Descriptors are uint64 sums of a buffer's address and offsets inside it: a buffer
    running past 2**64 would wrap them to low addresses, so the handshake refuses it."""

    def buffer(address: int, size: int) -> sidecar_pb2.RegisteredBuffer:
        return sidecar_pb2.RegisteredBuffer(
            name="g0", kind=sidecar_pb2.MEMORY_KIND_DRAM, address=address, size_bytes=size
        )

    top = (1 << 64) - 4096
    assert bound_from_proto([buffer(top, 4096)])["g0"].address == top  # ends exactly at 2**64
    with pytest.raises(InvalidInputError, match=r"^buffers\[0\]: address \+ size_bytes runs past"):
        bound_from_proto([buffer(top, 4097)])
