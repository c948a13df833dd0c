"""Negotiation: do two engine layouts agree, and if not, exactly where and why?

A pure function of two layouts (docs/sidecar.md, Negotiation). The result is an
`Agreement` (which local group maps to which peer group, per-region block
sizes, block-size ratio, TP mapping) or a `NegotiationError` whose
`mismatches` each name the field path, the local value, the peer value and a
hint. Nothing is ever downgraded: a sliding-window or Mamba group is never
treated as full attention, and a group that exists on one side only is a
mismatch, not something to drop.

An mla group's latent is the same on every TP rank (`GroupMapping.replicated`):
with equal TP sizes rank r reads rank r; with different ones see below.

Different block sizes are agreed group by group (`GroupMapping.block_mapping`,
kvxfer/core/reblock.py): equal sizes map block to block; different sizes map by
token ranges when both sides' blocks can be cut into token slices (token-major,
contiguous regions, equal bytes per token), and are refused otherwise with the
reason; a state (mamba) group maps whole, its state bytes equal on both sides.
Different tensor-parallel sizes (kvxfer/core/tp_map.py) are agreed for attention
groups whose layouts carry `num_kv_heads` and are token-major and contiguous: the
decode rank reads its heads as byte ranges of every token from the prefill ranks
holding them (`Agreement.source_ranks`, `GroupMapping.head_reads`); an mla latent is
replicated, so decode rank d reads it whole from one prefill rank (tp_map.mla_server:
the lowest it reads for its other groups, else d mod T). A state group is agreed when
both layouts say how each state tensor is cut over TP ranks (`TensorSpec.shard`), the
same cut on both sides: the decode rank reads byte ranges of the state block from the
prefill ranks holding them (`GroupMapping.state_reads`, tp_map.state_pieces). Layouts
that cannot be cut into heads, and state without a cut, are refused with the reason.
`NOT_YET_TRANSFERABLE` names group kinds the planner sizes but no pull has moved end to
end; it is empty now that chunked_local and mla pulls are byte-checked between
simulated engines (the demo and tests/test_sidecar_kinds.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer._exceptions import NegotiationError
from kvxfer.core.layout import EngineLayout, GroupKind, KVGroup
from kvxfer.core.reblock import BlockMapping, mapping_of, slice_tokens, slicing_problem
from kvxfer.core.tp_map import (
    HeadCut,
    head_cut,
    pair_split_problem,
    pairing_sources,
    row_tokens,
    rows_problem,
    split_problem,
    state_problem,
)
from kvxfer.core.tp_reads import HeadRead, StateRead, head_reads, state_reads

# 2: layouts carry `token_rows` (HND). A sidecar of protocol 1 would drop it, take HND
# blocks for head-major ones in an engine's own order and, against token-major blocks of
# the same size and TP, agree to copy whole blocks; so 1 and 2 never pair.
PROTOCOL_VERSION = 2
SUPPORTED_PROTOCOLS = frozenset({2})

# Group kinds the planner handles but no pull has moved end to end yet, and why. A new
# kind is listed here until a byte-checked pull of it runs (kept as the seam for that).
NOT_YET_TRANSFERABLE: dict[GroupKind, str] = {}


@dataclass(frozen=True)
class Mismatch:
    field: str
    local: str
    peer: str
    hint: str

    def __str__(self) -> str:
        return f"{self.field}: local {self.local}, peer {self.peer} ({self.hint})"


@dataclass(frozen=True)
class GroupMapping:
    local_group: int
    peer_group: int
    kind: str
    sliding_window: int | None
    num_layers: int
    bytes_per_block: int
    chunk_size: int | None = None
    # The group's tensors are identical on every TP rank (an mla latent): any decode
    # rank may read any prefill rank's copy.
    replicated: bool = False
    # Tokens per block on each side and how blocks map (reblock.BlockMapping): "same"
    # (block i <- block i), "tokens" (token ranges in slices of `slice_tokens`),
    # "state" (the one state block, whole).
    local_block_size: int = 0
    peer_block_size: int = 0
    block_mapping: str = BlockMapping.SAME.value
    slice_tokens: int = 0
    # "heads" only: how heads are cut (tp_map.HeadCut): "block" (a run of heads per
    # block), "token" (per token), "rows" (a head at a time, slice_tokens of its rows).
    head_cut: str = ""
    # Different TP sizes ("heads"): every run of this decode rank's heads and the
    # prefill rank it comes from, all sources (the peer is one of them).
    head_reads: tuple[HeadRead, ...] = ()
    # Different TP sizes, a state group: the byte ranges of each distinct tensor (named by
    # its suffix: conv, ssm, ...) of the state block and the prefill rank each comes from.
    state_reads: tuple[StateRead, ...] = ()


@dataclass(frozen=True)
class RegionSizes:
    name: str
    local_block_bytes: int
    peer_block_bytes: int


@dataclass(frozen=True)
class Agreement:
    """What both sides agreed on; the planner can take any request from here."""

    model: str
    fingerprint: str
    kv_dtype: str
    block_size: int
    peer_block_size: int  # the peer's layout block size; groups say how blocks map
    tp_size: int
    tp_rank: int
    groups: tuple[GroupMapping, ...]
    regions: tuple[RegionSizes, ...]
    peer_tp_size: int = 0
    peer_tp_rank: int = 0
    # The prefill ranks this decode rank reads (only rank r with equal TP sizes).
    source_ranks: tuple[int, ...] = ()


def negotiate(
    local: EngineLayout,
    peer: EngineLayout,
    local_protocol: int = PROTOCOL_VERSION,
    peer_protocol: int = PROTOCOL_VERSION,
) -> Agreement:
    """The agreement between `local` (the pulling side) and `peer`, or NegotiationError."""
    mismatches = find_mismatches(local, peer, local_protocol, peer_protocol)
    if mismatches:
        raise NegotiationError(mismatches)
    return Agreement(
        model=local.model,
        fingerprint=local.fingerprint,
        kv_dtype=local.kv_dtype,
        block_size=local.block_size,
        peer_block_size=peer.block_size,
        tp_size=local.tp_size,
        tp_rank=local.tp_rank,
        groups=tuple(
            _mapping(local, a, peer, b) for a, b in zip(local.groups, peer.groups, strict=True)
        ),
        regions=_region_sizes(local, peer),
        peer_tp_size=peer.tp_size,
        peer_tp_rank=peer.tp_rank,
        source_ranks=_source_ranks(local, peer),
    )


def _source_ranks(local: EngineLayout, peer: EngineLayout) -> tuple[int, ...]:
    """The prefill ranks decode rank `local.tp_rank` reads, over all its groups."""
    return pairing_sources(peer.tp_size, local)


def find_mismatches(
    local: EngineLayout,
    peer: EngineLayout,
    local_protocol: int = PROTOCOL_VERSION,
    peer_protocol: int = PROTOCOL_VERSION,
) -> list[Mismatch]:
    """Every disagreement between the two layouts, in field order (empty when they agree)."""
    if peer_protocol not in SUPPORTED_PROTOCOLS or local_protocol != peer_protocol:
        return [
            Mismatch(
                "protocol_version",
                str(local_protocol),
                str(peer_protocol),
                "run the same kvxfer protocol version on both sidecars (upgrade the older one)",
            )
        ]
    found = _top_level(local, peer)
    found += _groups(local, peer)
    found += _group_block_sizes(local, peer)
    found += _not_transferable(local.groups, peer.groups)
    return found


def _not_transferable(local: tuple[KVGroup, ...], peer: tuple[KVGroup, ...]) -> list[Mismatch]:
    """Groups of a kind in NOT_YET_TRANSFERABLE, on either side, each named once."""
    found: list[Mismatch] = []
    for index in range(max(len(local), len(peer))):
        mine = local[index].kind if index < len(local) else None
        theirs = peer[index].kind if index < len(peer) else None
        kind = next((k for k in (mine, theirs) if k in NOT_YET_TRANSFERABLE), None)
        if kind is None:
            continue
        found.append(
            Mismatch(
                f"layout.groups[{index}].kind",
                mine.value if mine else "absent",
                theirs.value if theirs else "absent",
                NOT_YET_TRANSFERABLE[kind],
            )
        )
    return found


def _top_level(local: EngineLayout, peer: EngineLayout) -> list[Mismatch]:
    found: list[Mismatch] = []
    if local.fingerprint != peer.fingerprint:
        found.append(
            Mismatch(
                "layout.fingerprint",
                f"{local.fingerprint} ({local.model})",
                f"{peer.fingerprint} ({peer.model})",
                "prefill and decode must serve the same model config with the same cache "
                "(for vLLM on CPU, the same attention kernel too: its log names it); "
                "start both engines with the same model and settings",
            )
        )
    if local.kv_dtype != peer.kv_dtype:
        found.append(
            Mismatch(
                "layout.kv_dtype",
                local.kv_dtype,
                peer.kv_dtype,
                "KV bytes are copied as they are; set the same --kv-dtype on both engines",
            )
        )
    if local.tp_size != peer.tp_size:
        return found + _tp_split(local, peer)
    if local.tp_rank != peer.tp_rank:
        found.append(
            Mismatch(
                "layout.tp_rank",
                str(local.tp_rank),
                str(peer.tp_rank),
                "decode rank r pulls from prefill rank r; register every rank on both sides",
            )
        )
    for a, b in zip(local.groups, peer.groups, strict=False):
        if a.kind is b.kind and mapping_of(local, a, peer, b) is BlockMapping.HEADS:
            found += _head_problems(f"layout.groups[{a.group_id}]", local, a, peer, b)
    return found


def _tp_split(local: EngineLayout, peer: EngineLayout) -> list[Mismatch]:
    """Different TP sizes: every group must map by heads (or be a replicated latent),
    and the peer must be a rank this decode rank reads."""
    found: list[Mismatch] = []
    for a, b in zip(local.groups, peer.groups, strict=False):
        where = f"layout.groups[{a.group_id}]"
        if a.kind is not b.kind:
            continue  # named by _groups
        if a.kind is GroupKind.MAMBA:
            found += _state_problems(where, a, b)
        elif a.kind is GroupKind.MLA:
            continue  # replicated: read whole from one rank (tp_map.mla_server)
        else:
            found += _head_problems(where, local, a, peer, b)
    ranks = _source_ranks(local, peer)
    if not found and peer.tp_rank not in ranks:
        found.append(
            Mismatch(
                "layout.tp_rank",
                str(local.tp_rank),
                str(peer.tp_rank),
                f"decode rank {local.tp_rank} of {local.tp_size} reads prefill rank(s) "
                f"{list(ranks)} of {peer.tp_size}; pull from those",
            )
        )
    return found


def _state_problems(where: str, a: KVGroup, b: KVGroup) -> list[Mismatch]:
    """A state group under different TP sizes: both sides must say how every state
    tensor is cut over TP ranks, the same cut (the model's, not one rank's)."""
    for side, group in (("local", a), ("peer", b)):
        problem = state_problem(group)
        if problem is not None:
            return [
                Mismatch(
                    f"{where}.tensors",
                    "shard set" if side == "peer" else "shard unset",
                    "shard unset" if side == "peer" else "shard set",
                    f"different TP sizes read a state block as byte ranges of each rank's "
                    f"heads and channels, but the {side} side's layout cannot say which: "
                    f"{problem}; register the layout with state cuts (kvxfer's profiles "
                    "give them) or run equal TP",
                )
            ]
    theirs = {t.name: t.shard for t in b.tensors}
    for tensor in a.tensors:
        if tensor.name in theirs and theirs[tensor.name] != tensor.shard:
            return [
                Mismatch(
                    f"{where}.tensors['{tensor.name}'].shard",
                    str(tensor.shard),
                    str(theirs[tensor.name]),
                    "the two sides cut this state differently (head counts, head sizes or "
                    "conv state layout SD/DS differ); configure both engines the same way",
                )
            ]
    return []


def _head_problems(
    where: str, local: EngineLayout, a: KVGroup, peer: EngineLayout, b: KVGroup
) -> list[Mismatch]:
    """A group mapped by heads (different TP sizes, or blocks ordered differently):
    both sides carry the same head count and can be cut into heads that meet."""
    why = _why_heads(local, peer)
    if a.num_kv_heads is None or a.num_kv_heads != b.num_kv_heads:
        return [
            Mismatch(
                f"{where}.num_kv_heads",
                str(a.num_kv_heads),
                str(b.num_kv_heads),
                f"{why} cut each token into KV heads: both layouts must carry the model's "
                "num_kv_heads, the same on both sides",
            )
        ]
    found: list[Mismatch] = []
    for side, layout, group in (("local", local, a), ("peer", peer, b)):
        problem = split_problem(layout, group)
        if problem is not None:
            found.append(
                Mismatch(
                    f"{where}.tensors",
                    _cut(local, a, peer),
                    _cut(peer, b, local),
                    f"{why} read heads as byte ranges of each token (of each block where "
                    f"blocks are head-major), but the {side} side's blocks cannot be cut "
                    f"into heads: {problem}",
                )
            )
    # The two cuts must meet (orders, sizes), then each side's rows be one array.
    for field, check in (("block_size", pair_split_problem), ("tensors", rows_problem)):
        problem = None if found else check(peer, b, local, a)
        if problem is not None:
            found.append(
                Mismatch(
                    f"{where}.{field}",
                    _order(local, local.block_size_of(a)),
                    _order(peer, peer.block_size_of(b)),
                    f"{why}: {problem}",
                )
            )
    return found


def _cut(layout: EngineLayout, group: KVGroup, other: EngineLayout) -> str:
    """What a side's heads are cut by: its TP size, or its blocks' order."""
    if layout.tp_size != other.tp_size:
        return f"tp_size {layout.tp_size}"
    return _order(layout, layout.block_size_of(group))


def _why_heads(local: EngineLayout, peer: EngineLayout) -> str:
    if local.tp_size != peer.tp_size:
        return "different TP sizes"
    return "blocks ordered differently on the two sides"


def _order(layout: EngineLayout, block_size: int) -> str:
    if layout.token_rows:
        major = "head-major (HND)"
    elif layout.head_major:
        major = "head-major"
    else:
        major = "token-major" if layout.token_major else "engine-ordered"
    return f"{major} blocks of {block_size} tokens"


def _groups(local_layout: EngineLayout, peer_layout: EngineLayout) -> list[Mismatch]:
    local, peer = local_layout.groups, peer_layout.groups
    found: list[Mismatch] = []
    for index in range(max(len(local), len(peer))):
        where = f"layout.groups[{index}]"
        if index >= len(local):
            found.append(
                Mismatch(
                    where,
                    "absent",
                    _describe(peer[index]),
                    "the peer has a KV group this engine lacks; "
                    "kvxfer never drops a group, so the layouts must match",
                )
            )
        elif index >= len(peer):
            found.append(
                Mismatch(
                    where,
                    _describe(local[index]),
                    "absent",
                    "this engine has a KV group the peer lacks; "
                    "kvxfer never drops a group, so the layouts must match",
                )
            )
        else:
            found += _group(
                where,
                local[index],
                peer[index],
                _per_token(local_layout, local[index], peer_layout, peer[index]),
            )
    return found


def _group_block_sizes(local: EngineLayout, peer: EngineLayout) -> list[Mismatch]:
    """Groups whose block sizes differ map by token ranges; refused, with the reason,
    where either side's blocks cannot be cut into token slices."""
    found: list[Mismatch] = []
    for a, b in zip(local.groups, peer.groups, strict=False):
        if a.kind is not b.kind or mapping_of(local, a, peer, b) is not BlockMapping.TOKENS:
            continue
        for side, layout, group in (("local", local, a), ("peer", peer, b)):
            problem = slicing_problem(layout, group)
            if problem is None:
                continue
            found.append(
                Mismatch(
                    f"layout.groups[{a.group_id}].block_size",
                    str(local.block_size_of(a)),
                    str(peer.block_size_of(b)),
                    f"different block sizes map by token ranges, but the {side} side's "
                    f"blocks cannot be sliced: {problem}; give both engines the same "
                    "block size",
                )
            )
    return found


# (local divisor, peer divisor, unit) tensor sizes are compared in; None: per block.
Scale = tuple[int, int, str] | None


def _per_token(local: EngineLayout, a: KVGroup, peer: EngineLayout, b: KVGroup) -> Scale:
    """(local, peer) divisors when tensors compare per token (an attention group whose
    block sizes differ) or per head of a token (different TP sizes, heads known on
    both sides); None when they compare per block."""
    mapping = mapping_of(local, a, peer, b) if a.kind is b.kind else None
    if mapping is BlockMapping.HEADS:
        if split_problem(local, a) or split_problem(peer, b) or a.num_kv_heads != b.num_kv_heads:
            return (1, 1, "")  # not comparable; _tp_split names why
        return (
            local.block_size_of(a) * local.rank_heads(a),
            peer.block_size_of(b) * peer.rank_heads(b),
            "bytes/head/token",
        )
    if mapping is BlockMapping.STATE and local.tp_size != peer.tp_size:
        return (1, 1, "")  # sharded state: _tp_split refuses it
    if mapping is not BlockMapping.TOKENS:
        return None
    return local.block_size_of(a), peer.block_size_of(b), "bytes/token"


def _group(where: str, a: KVGroup, b: KVGroup, per_token: Scale) -> list[Mismatch]:
    found: list[Mismatch] = []
    if a.kind is not b.kind:
        found.append(
            Mismatch(
                f"{where}.kind",
                a.kind.value,
                b.kind.value,
                "kvxfer never treats sliding-window, chunked, Mamba or latent (MLA) layers "
                "as anything else; configure both engines' KV cache the same way",
            )
        )
    elif a.sliding_window != b.sliding_window:
        found.append(
            Mismatch(
                f"{where}.sliding_window",
                str(a.sliding_window),
                str(b.sliding_window),
                "the window decides which blocks move; both engines must use the same window",
            )
        )
    elif a.chunk_size != b.chunk_size:
        found.append(
            Mismatch(
                f"{where}.chunk_size",
                str(a.chunk_size),
                str(b.chunk_size),
                "the chunk size decides which blocks move; "
                "both engines must use the same attention_chunk_size",
            )
        )
    if a.layers != b.layers:
        found.append(
            Mismatch(
                f"{where}.layers",
                _layers(a),
                _layers(b),
                "the group must hold the same layers on both sides",
            )
        )
    found += _tensors(where, a, b, per_token)
    return found


def _tensors(where: str, a: KVGroup, b: KVGroup, per_token: Scale) -> list[Mismatch]:
    """One mismatch per differing tensor when few differ; one summary when many do
    (a different model would otherwise list every layer)."""
    found = _tensor_differences(where, a, b, per_token)
    if len(found) <= 2:
        return found
    examples = "; ".join(
        f"{m.field.removeprefix(where + '.')}: {m.local} vs {m.peer}" for m in found[:3]
    )
    return [
        Mismatch(
            f"{where}.tensors",
            f"{len(a.tensors)} tensors",
            f"{len(b.tensors)} tensors",
            f"{len(found)} tensors differ (e.g. {examples}); {_geometry_advice(a, placement=True)}",
        )
    ]


def _geometry_advice(group: KVGroup, placement: bool = False) -> str:
    """What to compare when a group's tensor sizes differ between the sides."""
    if group.kind is GroupKind.MLA:
        return (
            "check kv_lora_rank + qk_rope_head_dim (the latent per token) and the KV dtype "
            "on both sides; the latent is not split by TP"
        )
    where = ", layer placement" if placement else ""
    return f"check head counts, head size{where} and TP on both sides"


def _tensor_differences(where: str, a: KVGroup, b: KVGroup, per_token: Scale) -> list[Mismatch]:
    mine, theirs, unit = per_token or (1, 1, "bytes/block")
    if not unit:
        return []
    peer_tensors = {t.name: t for t in b.tensors}
    local_names = {t.name for t in a.tensors}
    found: list[Mismatch] = []
    for tensor in a.tensors:
        other = peer_tensors.get(tensor.name)
        if other is None:
            found.append(
                Mismatch(
                    f"{where}.tensors['{tensor.name}']",
                    f"{tensor.bytes_per_block} bytes/block",
                    "absent",
                    "both sides must hold the same per-layer tensors",
                )
            )
        elif other.bytes_per_block * mine != tensor.bytes_per_block * theirs:
            found.append(
                Mismatch(
                    f"{where}.tensors['{tensor.name}'].bytes_per_block",
                    f"{tensor.bytes_per_block / mine:g} {unit}",
                    f"{other.bytes_per_block / theirs:g} {unit}",
                    f"per-{unit.removeprefix('bytes/')} sizes differ: {_geometry_advice(a)}",
                )
            )
    for tensor in b.tensors:
        if tensor.name not in local_names:
            found.append(
                Mismatch(
                    f"{where}.tensors['{tensor.name}']",
                    "absent",
                    f"{tensor.bytes_per_block} bytes/block",
                    "both sides must hold the same per-layer tensors",
                )
            )
    return found


def _describe(group: KVGroup) -> str:
    window = f" W={group.sliding_window}" if group.sliding_window is not None else ""
    chunk = f" S={group.chunk_size}" if group.chunk_size is not None else ""
    return f"{group.kind.value}{window}{chunk}, {len(group.layers)} layers"


def _layers(group: KVGroup) -> str:
    layers = list(group.layers)
    shown = ",".join(str(x) for x in layers[:8])
    return f"[{shown}{',...' if len(layers) > 8 else ''}] ({len(layers)} layers)"


def _mapping(
    local: EngineLayout, group: KVGroup, peer: EngineLayout, other: KVGroup
) -> GroupMapping:
    mine, theirs = local.block_size_of(group), peer.block_size_of(other)
    mapping = mapping_of(local, group, peer, other)
    return GroupMapping(
        local_group=group.group_id,
        peer_group=group.group_id,
        kind=group.kind.value,
        sliding_window=group.sliding_window,
        num_layers=len(group.layers),
        bytes_per_block=group.bytes_per_block,
        chunk_size=group.chunk_size,
        replicated=group.kind is GroupKind.MLA,
        local_block_size=mine,
        peer_block_size=theirs,
        block_mapping=mapping.value,
        slice_tokens=_slice_tokens(mapping, local, group, peer, other),
        head_cut=head_cut(peer, other, local, group).value if mapping is BlockMapping.HEADS else "",
        head_reads=head_reads(local, group, peer) if mapping is BlockMapping.HEADS else (),
        state_reads=state_reads(local, group, peer) if group.kind is GroupKind.MAMBA else (),
    )


def _slice_tokens(
    mapping: BlockMapping, local: EngineLayout, group: KVGroup, peer: EngineLayout, other: KVGroup
) -> int:
    """Tokens each byte range covers: a block's, a slice's of token ranges, and by heads
    a block's (a run of heads per block), one (per token) or a head's row run."""
    mine, theirs = local.block_size_of(group), peer.block_size_of(other)
    if mapping is BlockMapping.HEADS:
        cut = head_cut(peer, other, local, group)
        if cut is HeadCut.ROWS:
            return row_tokens(peer, other, local, group)
        return mine if cut is HeadCut.BLOCK else 1
    return slice_tokens(mine, theirs) if mapping is BlockMapping.TOKENS else mine


def _region_sizes(local: EngineLayout, peer: EngineLayout) -> tuple[RegionSizes, ...]:
    peer_regions = peer.region_map
    return tuple(
        RegionSizes(r.name, r.block_bytes, peer_regions[r.name].block_bytes)
        for r in local.regions
        if r.name in peer_regions
    )
