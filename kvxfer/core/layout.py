"""The layout vocabulary: engine layouts, KV groups, regions and block spans.

Everything here is a frozen dataclass that validates itself in
`__post_init__`, naming the offending field. Nothing here does I/O.

A *group* is a set of layers that share one list of block ids per request.
A *region* is one registered buffer range holding one layer's sub-tensor
(K, V, conv state, ssm state) for every block of its group. Two groups may
point tensors at the same region (a hybrid KV cache manager shares pools), so
a block id only means something together with its group.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NewType

from kvxfer._exceptions import LayoutError, shown

GroupId = NewType("GroupId", int)
BlockId = NewType("BlockId", int)

# Largest block count / byte value accepted anywhere; keeps arithmetic sane
# against hostile input from the wire.
MAX_BLOCKS = 1 << 32
MAX_BLOCK_SIZE = 1 << 20  # tokens per block
MAX_BYTES = 1 << 50
MAX_TOKENS = 1 << 40  # of one request
MAX_TP_SIZE = 1 << 12  # ranks of one engine
MAX_LAYERS = 1 << 12  # of one model, and of one group (many times the largest real ones)


class GroupKind(enum.StrEnum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"
    CHUNKED_LOCAL = "chunked_local"
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): one latent tensor per layer
    # instead of K and V, the same on every TP rank; read like full attention.
    MLA = "mla"


KV_DTYPE_BYTES: Mapping[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_bytes(kv_dtype: str, field_name: str = "kv_dtype") -> int:
    try:
        return KV_DTYPE_BYTES[kv_dtype]
    except KeyError:
        known = ", ".join(KV_DTYPE_BYTES)
        raise LayoutError(field_name, f"unknown dtype {shown(kv_dtype)} (known: {known})") from None


def check_int(name: str, value: int, lo: int, hi: int = MAX_BYTES) -> None:
    """Raise LayoutError unless lo <= value <= hi (and value is a real int)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(name, f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise LayoutError(name, f"must be in [{lo}, {hi}], got {value}")


@dataclass(frozen=True)
class ShardSegment:
    """One stretch of a state tensor's row, split over TP ranks like KV heads: `heads`
    units for the whole model (heads, channels or B/C groups), `head_bytes` bytes of one
    unit in one row. Rank r of T holds units as `tp_map.rank_heads(heads, T, r)` says:
    a contiguous 1/T of them when T divides `heads`, else (T a multiple of `heads`) one
    unit replicated on T/heads consecutive ranks (Mamba-2's single B/C group)."""

    heads: int
    head_bytes: int


@dataclass(frozen=True)
class StateShard:
    """How one state tensor is cut over TP ranks: on every rank its block is `rows` equal
    rows, each row this rank's part of every segment in order. A conv state stored
    (kernel - 1, channels) has kernel - 1 rows of [x | B | C] (Mamba-2) or [q | k | v]
    (Gated DeltaNet) channels; stored (channels, kernel - 1), or a recurrent state
    (heads, ...), it is one row. vLLM's MambaStateShapeCalculator gives the per-rank
    shapes; docs/planning.md, State under different TP sizes."""

    rows: int
    segments: tuple[ShardSegment, ...]

    def check(self, where: str) -> None:
        check_int(f"{where}.rows", self.rows, 1, 1 << 16)
        if not self.segments:
            raise LayoutError(f"{where}.segments", "a shard needs at least one segment")
        for i, segment in enumerate(self.segments):
            check_int(f"{where}.segments[{i}].heads", segment.heads, 1, 1 << 24)
            check_int(f"{where}.segments[{i}].head_bytes", segment.head_bytes, 1, 1 << 32)

    def rank_units(self, tp_size: int) -> tuple[int, ...]:
        """Units of each segment one rank of `tp_size` holds."""
        return tuple(max(1, s.heads // tp_size) for s in self.segments)

    def row_bytes(self, tp_size: int) -> int:
        """Bytes of one row on one rank of `tp_size`."""
        units = self.rank_units(tp_size)
        return sum(n * s.head_bytes for n, s in zip(units, self.segments, strict=True))

    def placement_problem(self, tp_size: int) -> str | None:
        """Why some segment cannot be placed on `tp_size` ranks, or None."""
        for i, s in enumerate(self.segments):
            if s.heads % tp_size and tp_size % s.heads:
                return f"segments[{i}]: {s.heads} units cannot be placed on tp_size {tp_size}"
        return None


@dataclass(frozen=True)
class TensorSpec:
    """One per-layer sub-tensor of a group; `name` is the region that holds it. `shard`
    says how a state tensor is cut over TP ranks (None: not known, and different TP
    sizes are refused naming it)."""

    name: str
    layer: int
    bytes_per_block: int
    shard: StateShard | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise LayoutError("tensor.name", "must not be empty")
        check_int(f"tensor '{self.name}'.layer", self.layer, 0, 1 << 16)
        check_int(f"tensor '{self.name}'.bytes_per_block", self.bytes_per_block, 1)
        if self.shard is not None:
            self.shard.check(f"tensor '{self.name}'.shard")


@dataclass(frozen=True)
class KVGroup:
    """`sliding_window` is set only for a sliding_window group, `chunk_size` (tokens per
    attention chunk, Llama 4) only for a chunked_local group. An mla group holds one
    latent tensor per layer (`kv_lora_rank + qk_rope_head_dim` elements per token).

    `block_size` is this group's own block size in tokens when it differs from the
    layout's (an engine such as vLLM's hybrid manager sizes groups separately, e.g.
    a state group of 1024 tokens beside 160-token attention blocks); None means the
    layout's `block_size`. Always read it through `EngineLayout.block_size_of`.

    `num_kv_heads` is the model's KV head count of an attention group (all ranks
    together), what a pairing of different TP sizes needs to split a token into
    heads; a head's bytes in a tensor are the token's bytes over the heads this rank
    holds (`EngineLayout.head_bytes`), so K and V may differ in head dim. None: not
    known, and different TP sizes are refused naming this field."""

    group_id: GroupId
    kind: GroupKind
    sliding_window: int | None
    layers: tuple[int, ...]
    tensors: tuple[TensorSpec, ...]
    block_size: int | None = None
    chunk_size: int | None = None
    num_kv_heads: int | None = None

    def __post_init__(self) -> None:
        where = f"groups[{self.group_id}]"
        check_int(f"{where}.group_id", self.group_id, 0, 1 << 16)
        if self.block_size is not None:
            check_int(f"{where}.block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        if not isinstance(self.kind, GroupKind):
            raise LayoutError(f"{where}.kind", f"unknown group kind {self.kind!r}")
        if self.kind is GroupKind.SLIDING_WINDOW:
            if self.sliding_window is None:
                raise LayoutError(f"{where}.sliding_window", "required for a sliding_window group")
            check_int(f"{where}.sliding_window", self.sliding_window, 1, 1 << 30)
        elif self.sliding_window is not None:
            raise LayoutError(
                f"{where}.sliding_window", f"must be unset for a {self.kind.value} group"
            )
        if self.kind is GroupKind.CHUNKED_LOCAL:
            if self.chunk_size is None:
                raise LayoutError(f"{where}.chunk_size", "required for a chunked_local group")
            check_int(f"{where}.chunk_size", self.chunk_size, 1, 1 << 30)
        elif self.chunk_size is not None:
            raise LayoutError(f"{where}.chunk_size", f"must be unset for a {self.kind.value} group")
        if not self.layers:
            raise LayoutError(f"{where}.layers", "a group needs at least one layer")
        if not self.tensors:
            raise LayoutError(f"{where}.tensors", "a group needs at least one tensor")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise LayoutError(f"{where}.tensors", "tensor names repeat within the group")
        if self.kind is GroupKind.MLA:
            self._check_one_latent_per_layer(where)
        if self.kind is not GroupKind.MAMBA:
            for tensor in self.tensors:
                if tensor.shard is not None:
                    raise LayoutError(
                        f"{where}.tensors['{tensor.name}'].shard",
                        f"must be unset for a {self.kind.value} group (only state is sharded)",
                    )
        if self.num_kv_heads is not None:
            check_int(f"{where}.num_kv_heads", self.num_kv_heads, 1, 1 << 16)
            if self.kind in (GroupKind.MAMBA, GroupKind.MLA):
                raise LayoutError(
                    f"{where}.num_kv_heads", f"must be unset for a {self.kind.value} group"
                )

    def _check_one_latent_per_layer(self, where: str) -> None:
        """An MLA layer caches one latent tensor (no K/V split): exactly one per layer."""
        owners = sorted(t.layer for t in self.tensors)
        if owners != sorted(self.layers):
            raise LayoutError(
                f"{where}.tensors",
                f"an mla group holds exactly one latent tensor per layer: layers "
                f"{sorted(self.layers)[:8]}, tensors of layers {owners[:8]}",
            )

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one logical block across every tensor of the group."""
        return sum(t.bytes_per_block for t in self.tensors)


def group_block_size(group: KVGroup, default: int) -> int:
    """Tokens per block of `group`, falling back to the layout's `default`."""
    return default if group.block_size is None else group.block_size


@dataclass(frozen=True)
class Region:
    """A registered buffer range: block b of it starts at offset_bytes + b * stride_bytes."""

    name: str
    buffer: str
    offset_bytes: int
    num_blocks: int
    stride_bytes: int
    block_bytes: int

    def __post_init__(self) -> None:
        where = f"region '{self.name}'"
        if not self.name:
            raise LayoutError("region.name", "must not be empty")
        if not self.buffer:
            raise LayoutError(f"{where}.buffer", "must not be empty")
        check_int(f"{where}.offset_bytes", self.offset_bytes, 0)
        check_int(f"{where}.num_blocks", self.num_blocks, 1, MAX_BLOCKS)
        check_int(f"{where}.block_bytes", self.block_bytes, 1)
        check_int(f"{where}.stride_bytes", self.stride_bytes, self.block_bytes)

    @property
    def end_bytes(self) -> int:
        """One past the last byte of the region inside its buffer."""
        return self.offset_bytes + (self.num_blocks - 1) * self.stride_bytes + self.block_bytes

    @property
    def contiguous(self) -> bool:
        return self.stride_bytes == self.block_bytes

    def block_offset(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise LayoutError(
                "block_ids",
                f"block {block_id} out of range for region '{self.name}' "
                f"({self.num_blocks} blocks)",
            )
        return self.offset_bytes + block_id * self.stride_bytes


def span_where(group_id: int) -> str:
    """How a BlockSpan names itself in its errors: by its group, as it has no position."""
    return f"spans[group {group_id}]"


@dataclass(frozen=True)
class BlockSpan:
    """Block ids of one group for logical blocks first_block, first_block + 1, ..."""

    group_id: GroupId
    first_block: int
    block_ids: tuple[BlockId, ...]

    def __post_init__(self) -> None:
        where = span_where(self.group_id)
        check_int(f"{where}.group_id", self.group_id, 0, 1 << 16)
        check_int(f"{where}.first_block", self.first_block, 0, MAX_BLOCKS)
        ids = self.block_ids
        # All at once (a 16k-token pull has thousands of ids); one by one only to name
        # the first bad id.
        if not all(type(b) is int for b in ids) or (
            ids and (min(ids) < 0 or max(ids) > MAX_BLOCKS)
        ):
            for i, block_id in enumerate(ids):
                check_int(f"{where}.block_ids[{i}]", block_id, 0, MAX_BLOCKS)

    @property
    def end_block(self) -> int:
        """One past the last logical block this span covers."""
        return self.first_block + len(self.block_ids)

    def block_id(self, logical: int) -> BlockId:
        return self.block_ids[logical - self.first_block]


@dataclass(frozen=True)
class EngineLayout:
    """What one engine rank holds: model, dtype, block size, TP placement, groups, regions.

    `regions` is empty for a layout that only describes a model (as the
    `plan` command uses it); a layout registered by an engine binds every
    tensor of every group to a region.
    """

    model: str
    fingerprint: str
    kv_dtype: str
    block_size: int
    tp_size: int
    tp_rank: int
    groups: tuple[KVGroup, ...]
    regions: tuple[Region, ...] = field(default=())
    # Every attention/latent block is [block_size tokens][bytes of one token] (K and V
    # in regions of their own, as kvxfer's own shared-memory layout has them), so a token
    # range of a block is one byte range: what a pairing of different block sizes needs.
    # vLLM fuses K and V in one page: not token-major.
    token_major: bool = True
    # Every attention block is [the heads this rank holds][one head's bytes for every
    # token of the block, in an order of the engine's own] (vLLM's CPU pages: per head,
    # the block's K half then its V half, K transposed by its vec kernels), so a run of
    # heads is one byte range of a block: what a pairing of different TP sizes with
    # equal block sizes needs; a token range is not. Never with token_major.
    head_major: bool = False
    # Head-major blocks whose every head is the block's tokens in order, one row of that
    # head's bytes each: [heads][block_size][head bytes], the HND layout (vLLM's
    # VLLM_KV_CACHE_LAYOUT=HND, FlashInfer's). A token range of a head is then one byte
    # range, so such blocks pair with token-major ones and with other block sizes, a head
    # at a time. Only with head_major.
    token_rows: bool = False

    def __post_init__(self) -> None:
        dtype_bytes(self.kv_dtype)
        if self.token_major and self.head_major:
            raise LayoutError(
                "head_major", "a layout's blocks are token-major or head-major, not both"
            )
        if self.token_rows and not self.head_major:
            raise LayoutError(
                "token_rows",
                "token rows inside a head (HND) describe head-major blocks; set head_major",
            )
        check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        check_int("tp_size", self.tp_size, 1, MAX_TP_SIZE)
        check_int("tp_rank", self.tp_rank, 0, self.tp_size - 1)
        if not self.groups:
            raise LayoutError("groups", "a layout needs at least one KV group")
        for index, group in enumerate(self.groups):
            if group.group_id != index:
                raise LayoutError(f"groups[{index}].group_id", f"must equal its position {index}")
        for group in self.groups:
            self._check_heads(group)
        if self.regions:
            self._check_regions()

    def _check_heads(self, group: KVGroup) -> None:
        """A group's head count must place on this TP size (whether its tokens split into
        heads is asked by negotiation, `head_bytes`, where TP sizes differ), and a state
        tensor's shard must place and add up to its bytes on this rank."""
        heads = group.num_kv_heads
        if heads is not None and heads % self.tp_size and self.tp_size % heads:
            raise LayoutError(
                f"groups[{group.group_id}].num_kv_heads",
                f"{heads} KV heads cannot be placed on tp_size {self.tp_size}",
            )
        for tensor in group.tensors:
            shard = tensor.shard
            if shard is None:
                continue
            where = f"groups[{group.group_id}].tensors['{tensor.name}'].shard"
            problem = shard.placement_problem(self.tp_size)
            if problem is not None:
                raise LayoutError(where, problem)
            if shard.rows * shard.row_bytes(self.tp_size) != tensor.bytes_per_block:
                raise LayoutError(
                    where,
                    f"{shard.rows} rows of {shard.row_bytes(self.tp_size)} bytes on tp_size "
                    f"{self.tp_size}, but the tensor holds {tensor.bytes_per_block} bytes/block",
                )

    def rank_heads(self, group: KVGroup) -> int:
        """KV heads of `group` this rank holds (1 where heads are replicated)."""
        assert group.num_kv_heads is not None
        return max(1, group.num_kv_heads // self.tp_size)

    def head_bytes(self, group: KVGroup, tensor: TensorSpec) -> int | None:
        """Bytes of one head of one token of `tensor`, or None when the layout cannot
        say (no head count, neither token-major nor token rows, or bytes that do not
        split)."""
        if self.token_rows:  # a row of a head's block
            block, size = self.head_block_bytes(group, tensor), self.block_size_of(group)
            return None if block is None or block % size else block // size
        token = self.token_bytes(group, tensor)
        if token is None or group.num_kv_heads is None or token % self.rank_heads(group):
            return None
        return token // self.rank_heads(group)

    def head_block_bytes(self, group: KVGroup, tensor: TensorSpec) -> int | None:
        """Bytes of one head of `tensor` over a whole block in a head-major layout, or
        None when the layout cannot say (not head-major, a state or latent group, no
        head count, or bytes that do not split)."""
        if (
            not self.head_major
            or group.kind in (GroupKind.MAMBA, GroupKind.MLA)
            or group.num_kv_heads is None
            or tensor.bytes_per_block % self.rank_heads(group)
        ):
            return None
        return tensor.bytes_per_block // self.rank_heads(group)

    def _check_regions(self) -> None:
        by_name = self.region_map
        if len(by_name) != len(self.regions):
            raise LayoutError("regions", "region names repeat")
        for group in self.groups:
            for tensor in group.tensors:
                region = by_name.get(tensor.name)
                where = f"groups[{group.group_id}].tensors['{tensor.name}']"
                if region is None:
                    raise LayoutError(where, "no region registered for this tensor")
                if region.block_bytes != tensor.bytes_per_block:
                    raise LayoutError(
                        f"region '{region.name}'.block_bytes",
                        f"expected {tensor.bytes_per_block} (from the layout), "
                        f"got {region.block_bytes}",
                    )

    @property
    def region_map(self) -> dict[str, Region]:
        return {r.name: r for r in self.regions}

    def token_bytes(self, group: KVGroup, tensor: TensorSpec) -> int | None:
        """Bytes of one token of `tensor` inside a block, or None when a block of it
        cannot be sliced by tokens (a state group, a layout that is not token-major,
        or a block size that does not divide its bytes)."""
        size = self.block_size_of(group)
        # An mla latent is one head: in HND blocks its rows are the block's tokens.
        by_token = self.token_major or (self.token_rows and group.kind is GroupKind.MLA)
        if group.kind is GroupKind.MAMBA or not by_token or tensor.bytes_per_block % size:
            return None
        return tensor.bytes_per_block // size

    def block_size_of(self, group: KVGroup) -> int:
        """Tokens per block of `group`: its own size, else the layout's."""
        return group_block_size(group, self.block_size)

    def group(self, group_id: int) -> KVGroup:
        if not 0 <= group_id < len(self.groups):
            raise LayoutError("group_id", f"unknown group {group_id} ({len(self.groups)} groups)")
        return self.groups[group_id]

    def with_regions(self, regions: Iterable[Region]) -> EngineLayout:
        return EngineLayout(
            model=self.model,
            fingerprint=self.fingerprint,
            kv_dtype=self.kv_dtype,
            block_size=self.block_size,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            groups=self.groups,
            regions=tuple(regions),
            token_major=self.token_major,
            head_major=self.head_major,
            token_rows=self.token_rows,
        )
