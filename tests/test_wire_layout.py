"""Layouts on the wire: lossless round trip, field-named errors, and committed gencode."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest
from strategies import PROFILES

from kvxfer._exceptions import LayoutError
from kvxfer.core.layout import BlockId, BlockSpan, GroupId, Region
from kvxfer.core.profiles import layout_for_model
from kvxfer.v1 import layout_pb2 as pb
from kvxfer.wire.layout import layout_from_proto, layout_to_proto, span_to_proto, spans_from_proto

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


def test_spans_round_trip_and_validate() -> None:
    span = BlockSpan(GroupId(2), 5, (BlockId(9), BlockId(3)))
    assert spans_from_proto([span_to_proto(span)], "spans") == (span,)
    with pytest.raises(LayoutError, match=r"spans\[0\]: must be in"):
        spans_from_proto([pb.BlockSpan(group_id=70000)], "spans")


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
