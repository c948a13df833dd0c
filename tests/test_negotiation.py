"""Negotiation: real profiles agree with themselves; every kind of difference is named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from strategies import PROFILES

from kvxfer._exceptions import LayoutError, NegotiationError
from kvxfer.core import negotiation
from kvxfer.core.layout import EngineLayout, GroupKind, KVGroup, TensorSpec
from kvxfer.core.negotiation import find_mismatches, negotiate
from kvxfer.core.profiles import layout_for_model


@pytest.mark.parametrize("model", PROFILES)
def test_a_profile_agrees_with_itself(model: str) -> None:
    layout = layout_for_model(model)
    agreement = negotiate(layout, layout_for_model(model))
    assert [g.kind for g in agreement.groups] == [g.kind.value for g in layout.groups]
    assert [(g.local_group, g.peer_group) for g in agreement.groups] == [
        (g.group_id, g.group_id) for g in layout.groups
    ]
    assert agreement.peer_block_size == layout.block_size and agreement.tp_rank == layout.tp_rank


def _fields(local: object, peer: object, **kw: int) -> dict[str, object]:
    return {m.field: m for m in find_mismatches(local, peer, **kw)}  # type: ignore[arg-type]


def test_dtype_block_size_and_tp_are_named() -> None:
    base = layout_for_model("gpt-oss-20b")
    assert "layout.kv_dtype" in _fields(base, layout_for_model("gpt-oss-20b", kv_dtype="float16"))
    assert not _fields(base, layout_for_model("gpt-oss-20b", tp_size=2))  # split by heads
    rank = _fields(
        layout_for_model("gpt-oss-20b", tp_size=2, tp_rank=0),
        layout_for_model("gpt-oss-20b", tp_size=2, tp_rank=1),
    )
    assert set(rank) == {"layout.tp_rank"}


def _tp(model: str, tp: int, rank: int = 0, block_size: int = 16) -> EngineLayout:
    return layout_for_model(model, block_size=block_size, tp_size=tp, tp_rank=rank)


@pytest.mark.parametrize(
    ("decode", "prefill", "sources", "reads"),
    [
        ((2, 1), (1, 0), (0,), {(0, (4, 8), (0, 4))}),  # TP 1 -> 2, decode rank 1
        ((1, 0), (2, 1), (0, 1), {(0, (0, 4), (0, 4)), (1, (0, 4), (4, 8))}),  # 2 -> 1
        ((16, 5), (8, 2), (2,), {(2, (0, 1), (0, 1))}),  # replicated on the decode side
        ((4, 3), (16, 13), (13, 15), {(13, (0, 1), (0, 1)), (15, (0, 1), (1, 2))}),
    ],
)
def test_different_tp_sizes_agree_on_which_heads_come_from_where(
    decode: tuple[int, int],
    prefill: tuple[int, int],
    sources: tuple[int, ...],
    reads: set[tuple[int, tuple[int, int], tuple[int, int]]],
) -> None:
    """Llama-3.1-8B has 8 KV heads; the agreement lists every source of the decode rank
    and the head runs, block sizes may differ as well."""
    for model in ("llama-3.1-8b", "gpt-oss-20b"):
        agreement = negotiate(_tp(model, *decode, block_size=32), _tp(model, *prefill))
        assert agreement.source_ranks == sources
        assert (agreement.peer_tp_size, agreement.peer_tp_rank) == prefill
        for group in agreement.groups:
            assert (group.block_mapping, group.slice_tokens) == ("heads", 1)
            assert {(r.src_rank, r.src_heads, r.dst_heads) for r in group.head_reads} == reads


def test_different_tp_sizes_are_refused_where_heads_cannot_be_split() -> None:
    """Each refusal names the field and says why."""
    wrong_rank = _fields(_tp("llama-3.1-8b", 4, 0), _tp("llama-3.1-8b", 8, 2))
    assert "reads prefill rank(s) [0, 1] of 8" in wrong_rank["layout.tp_rank"].hint  # type: ignore[attr-defined]
    base = _tp("llama-3.1-8b", 2)
    unknown = dataclasses.replace(
        base, groups=tuple(dataclasses.replace(g, num_kv_heads=None) for g in base.groups)
    )
    assert set(_fields(unknown, _tp("llama-3.1-8b", 1))) == {"layout.groups[0].num_kv_heads"}
    fused = _fields(dataclasses.replace(base, token_major=False), _tp("llama-3.1-8b", 1))
    assert "local side's blocks cannot be cut" in fused["layout.groups[0].tensors"].hint  # type: ignore[attr-defined]
    qwen = _tp("qwen3-next-80b-a3b", 2)
    uncut = dataclasses.replace(
        qwen,
        groups=tuple(
            dataclasses.replace(
                g, tensors=tuple(dataclasses.replace(t, shard=None) for t in g.tensors)
            )
            for g in qwen.groups
        ),
    )
    state = _fields(uncut, _tp("qwen3-next-80b-a3b", 1))
    assert list(state) == ["layout.groups[0].tensors"], state
    hint = state["layout.groups[0].tensors"].hint  # type: ignore[attr-defined]
    assert "local side's layout cannot say which: tensor 'layer.0.conv'" in hint
    ds = _fields(qwen, layout_for_model("qwen3-next-80b-a3b", conv_state_layout="DS"))
    assert list(ds) == ["layout.groups[0].tensors['layer.0.conv'].shard"], ds
    agreed = negotiate(qwen, _tp("qwen3-next-80b-a3b", 1))
    reads = {(r.tensor, r.src_rank) for g in agreed.groups for r in g.state_reads}
    assert reads == {("conv", 0), ("ssm", 0)} and agreed.source_ranks == (0,)
    latent = negotiate(_tp("deepseek-v2-lite", 2, 1), _tp("deepseek-v2-lite", 1))
    assert latent.source_ranks == (0,) and all(g.replicated for g in latent.groups)


def test_different_block_sizes_map_by_tokens_or_are_refused_with_the_reason() -> None:
    small, large = layout_for_model("gpt-oss-20b"), layout_for_model("gpt-oss-20b", block_size=32)
    agreement = negotiate(large, small)
    assert (agreement.block_size, agreement.peer_block_size) == (32, 16)
    assert {(g.block_mapping, g.local_block_size, g.peer_block_size, g.slice_tokens)
            for g in agreement.groups} == {("tokens", 32, 16, 16)}  # fmt: skip
    fused = dataclasses.replace(small, token_major=False)
    refused = _fields(dataclasses.replace(large, token_major=False), fused)
    assert set(refused) == {"layout.groups[0].block_size", "layout.groups[1].block_size"}
    assert "not token-major" in refused["layout.groups[0].block_size"].hint  # type: ignore[attr-defined]
    assert negotiate(fused, fused).groups[0].block_mapping == "same"
    # An engine's own order against token-major blocks: no whole block, of any size, is
    # the other's bytes, and the engine's blocks cannot be cut into heads.
    for other in (small, large):
        refused = _fields(other, fused)
        assert set(refused) == {"layout.groups[0].tensors", "layout.groups[1].tensors"}
        hint = refused["layout.groups[0].tensors"].hint  # type: ignore[attr-defined]
        assert "blocks ordered differently" in hint and "in the engine's own order" in hint
    odd = layout_for_model("gpt-oss-20b", block_size=24)
    assert {g.slice_tokens for g in negotiate(odd, large).groups} == {8}


def test_window_and_kind_differences_are_never_downgraded() -> None:
    base = layout_for_model("gpt-oss-20b")
    sliding = base.groups[0]
    assert sliding.kind is GroupKind.SLIDING_WINDOW
    wider = dataclasses.replace(
        base, groups=(dataclasses.replace(sliding, sliding_window=256), base.groups[1])
    )
    m = _fields(base, wider)
    assert set(m) == {"layout.groups[0].sliding_window"}
    as_full = dataclasses.replace(
        base,
        groups=(
            dataclasses.replace(sliding, kind=GroupKind.FULL_ATTENTION, sliding_window=None),
            base.groups[1],
        ),
    )
    m = _fields(base, as_full)
    assert "layout.groups[0].kind" in m
    assert "never treats" in m["layout.groups[0].kind"].hint  # type: ignore[attr-defined]
    with pytest.raises(NegotiationError, match=r"layout.groups\[0\].kind"):
        negotiate(base, as_full)


def test_a_missing_group_is_a_mismatch_not_a_drop() -> None:
    base = layout_for_model("jamba-mini-1.5")
    fewer = dataclasses.replace(base, groups=base.groups[:-1])
    m = _fields(base, fewer)
    last = f"layout.groups[{len(base.groups) - 1}]"
    assert m[last].peer == "absent"  # type: ignore[attr-defined]
    assert _fields(fewer, base)[last].local == "absent"  # type: ignore[attr-defined]


def test_tensor_differences_are_named_or_summarised() -> None:
    base = layout_for_model("llama-3.1-8b")
    group = base.groups[0]
    one = dataclasses.replace(
        group,
        tensors=(TensorSpec(group.tensors[0].name, 0, 1), *group.tensors[1:]),
    )
    m = _fields(base, dataclasses.replace(base, groups=(one,)))
    assert set(m) == {"layout.groups[0].tensors['layer.0.k'].bytes_per_block"}
    many = _fields(base, layout_for_model("mistral-7b-v0.1"))
    assert "layout.fingerprint" in many
    assert len(many) < 8, "a different model must not list every layer"


def test_protocol_versions_must_match() -> None:
    base = layout_for_model("gemma-3-4b-it")
    m = _fields(base, base, local_protocol=1, peer_protocol=2)
    assert set(m) == {"protocol_version"}
    # Protocol 1 did not carry token_rows: it would take HND blocks for blocks in an
    # engine's own order, so it never pairs with this one.
    assert set(_fields(base, base, local_protocol=2, peer_protocol=1)) == {"protocol_version"}


def test_group_ids_must_match_structure() -> None:
    base = layout_for_model("gemma-3-4b-it")
    extra = KVGroup(
        group_id=len(base.groups),  # type: ignore[arg-type]
        kind=GroupKind.MAMBA,
        sliding_window=None,
        layers=(0,),
        tensors=(TensorSpec("extra.state", 0, 64),),
    )
    m = _fields(base, dataclasses.replace(base, groups=(*base.groups, extra)))
    assert m[f"layout.groups[{len(base.groups)}]"].local == "absent"  # type: ignore[attr-defined]


LLAMA4 = str(Path(__file__).parent / "data/configs/llama4-text-formomouse.json")


def _chunked(chunk_size: int) -> EngineLayout:
    layout = layout_for_model(LLAMA4)
    group = dataclasses.replace(layout.groups[0], chunk_size=chunk_size)
    return dataclasses.replace(layout, groups=(group,))


def test_chunk_size_difference_is_named() -> None:
    m = _fields(_chunked(8192), _chunked(4096))
    assert m["layout.groups[0].chunk_size"].local == "8192"  # type: ignore[attr-defined]
    assert m["layout.groups[0].chunk_size"].peer == "4096"  # type: ignore[attr-defined]


def test_chunked_groups_agree_and_a_listed_kind_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """chunked_local pulls are byte-checked end to end now (tests/test_sidecar_kinds.py),
    so identical Llama 4 layouts agree. A kind still listed in NOT_YET_TRANSFERABLE is
    refused by name, even between identical layouts."""
    layout = layout_for_model(LLAMA4)
    (group,) = negotiate(layout, layout_for_model(LLAMA4)).groups
    assert (group.kind, group.chunk_size) == ("chunked_local", 8192)
    assert not negotiation.NOT_YET_TRANSFERABLE
    monkeypatch.setitem(negotiation.NOT_YET_TRANSFERABLE, GroupKind.CHUNKED_LOCAL, "not yet")
    with pytest.raises(NegotiationError) as info:
        negotiate(layout, layout_for_model(LLAMA4))
    (mismatch,) = info.value.mismatches
    assert mismatch.field == "layout.groups[0].kind"
    assert (mismatch.local, mismatch.peer, mismatch.hint) == (
        "chunked_local",
        "chunked_local",
        "not yet",
    )
    # Against a layout without the group, both the difference and the refusal are named.
    full = layout_for_model("llama-3.1-8b")
    assert _fields(full, layout)["layout.groups[0].kind"].hint == "not yet"  # type: ignore[attr-defined]


def _deepseek(**changes: object) -> EngineLayout:
    from kvxfer.core.profiles import layout_from_config, load_config  # noqa: PLC0415

    _, config = load_config("deepseek-v2-lite")
    return layout_from_config(config | changes, name="deepseek-v2-lite")


def test_mla_agreement_says_the_latent_is_replicated() -> None:
    (group,) = negotiate(_deepseek(), _deepseek()).groups
    assert (group.kind, group.replicated, group.num_layers) == ("mla", True, 27)
    (full,) = negotiate(layout_for_model("llama-3.1-8b"), layout_for_model("llama-3.1-8b")).groups[
        :1
    ]
    assert not full.replicated


def test_mla_geometry_mismatch_names_the_latent() -> None:
    """A different kv_lora_rank changes every layer's latent: one summary naming what to
    compare; MLA against full attention is a kind mismatch, never a downgrade."""
    m = _fields(_deepseek(), dataclasses.replace(_deepseek(kv_lora_rank=256), fingerprint="x"))
    summary = m["layout.groups[0].tensors"]
    assert "kv_lora_rank + qk_rope_head_dim" in summary.hint  # type: ignore[attr-defined]
    assert "not split by TP" in summary.hint  # type: ignore[attr-defined]
    one = _deepseek()
    group = one.groups[0]
    smaller = dataclasses.replace(
        group,
        tensors=(dataclasses.replace(group.tensors[0], bytes_per_block=64), *group.tensors[1:]),
    )
    field = "layout.groups[0].tensors['layer.0.latent'].bytes_per_block"
    hint = _fields(one, dataclasses.replace(one, groups=(smaller,)))[field].hint  # type: ignore[attr-defined]
    assert hint.startswith("per-block sizes differ: check kv_lora_rank")
    llama = layout_for_model("llama-3.1-8b")
    kind = _fields(one, llama)["layout.groups[0].kind"]
    assert (kind.local, kind.peer) == ("mla", "full_attention")  # type: ignore[attr-defined]


def _head_major(layout: EngineLayout) -> EngineLayout:
    return dataclasses.replace(layout, token_major=False, head_major=True)


def test_head_major_sides_split_by_block_and_mixed_orders_are_named() -> None:
    """vLLM's CPU pages are head-major: between different TP sizes both sides must be,
    at equal block sizes; the handshake text says a head run is a byte range of every
    block there, of every token otherwise."""
    from kvxfer.cli.admin import _block_mapping  # noqa: PLC0415

    decode = _head_major(layout_for_model("gpt-oss-20b", tp_size=2, tp_rank=1))
    prefill = _head_major(layout_for_model("gpt-oss-20b"))
    agreement = negotiate(decode, prefill)
    assert {g.block_mapping for g in agreement.groups} == {"heads"}
    assert {g.slice_tokens for g in agreement.groups} == {decode.block_size}
    text = _block_mapping(dataclasses.asdict(agreement.groups[0]))
    assert text.endswith("(a run of heads is a byte range of every block)"), text
    token_major = negotiate(
        layout_for_model("gpt-oss-20b", tp_size=2), layout_for_model("gpt-oss-20b")
    )
    assert _block_mapping(dataclasses.asdict(token_major.groups[0])).endswith("every token)")
    hnd = dataclasses.replace(decode, token_rows=True)
    wide = _head_major(layout_for_model("gpt-oss-20b", block_size=32))
    rows = negotiate(hnd, dataclasses.replace(wide, token_rows=True))
    assert {(g.head_cut, g.slice_tokens) for g in rows.groups} == {("rows", 16)}
    text = _block_mapping(dataclasses.asdict(rows.groups[0]))
    assert text.endswith("(a head at a time, 16 of its token rows per byte range)"), text
    mixed = _fields(decode, layout_for_model("gpt-oss-20b"))
    assert set(mixed) == {"layout.groups[0].block_size", "layout.groups[1].block_size"}
    assert "the decode side's blocks are head-major" in mixed["layout.groups[0].block_size"].hint  # type: ignore[attr-defined]
    sizes = _fields(decode, _head_major(layout_for_model("gpt-oss-20b", block_size=32)))
    assert (
        "head-major blocks of 32 (prefill) and 16 (decode) tokens"
        in sizes["layout.groups[0].block_size"].hint
    )  # type: ignore[attr-defined]
    with pytest.raises(LayoutError, match="head_major"):
        dataclasses.replace(prefill, token_major=True)
