"""Data-plane logic that needs no second process: descriptor binding, handles, shm."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import layouts, requests
from test_transfer_plan import bind, spans_for

from kvxfer._exceptions import (
    BackendCreationError,
    DataPlaneError,
    LayoutError,
    PlanError,
    RegistrationError,
)
from kvxfer.client.cuda_ipc import buffer_from_ipc
from kvxfer.client.shm import ShmKVCache
from kvxfer.core.buffers import BufferHandle, MemoryKind
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupId
from kvxfer.core.planner import Chunk, kept_pairs, plan_transfer
from kvxfer.core.profiles import layout_for_model
from kvxfer.dataplane import adapter, descriptors
from kvxfer.dataplane.adapter import AgentOptions, NixlAgent
from kvxfer.dataplane.descriptors import BoundBuffer, chunk_arrays
from kvxfer.dataplane.executor import handle_ranges
from kvxfer.dataplane.memory import open_buffer
from kvxfer.dataplane.readers import Readers


@given(st.data())
def test_arrays_equal_the_planners_descriptors(data: st.DataObject) -> None:
    base = data.draw(layouts())
    num_tokens, computed = data.draw(requests(base.block_size, max_tokens=3000))
    num_blocks = -(-num_tokens // base.block_size) + 2
    src = bind(base, num_blocks, "p", strided=data.draw(st.booleans()))
    dst = bind(base, num_blocks, "d")
    rng = random.Random(data.draw(st.integers(0, 1000)))
    src_spans = spans_for(src, num_tokens, num_blocks, rng, 0.3)
    dst_spans = spans_for(dst, num_tokens, num_blocks, rng, 0.1)
    plan = plan_transfer(src, dst, src_spans, dst_spans, num_tokens, computed, 64)
    size = 1 << 44
    src_bases = {r.buffer: BoundBuffer(1 << 40, size, 0, MemoryKind.DRAM) for r in src.regions}
    dst_bases = {r.buffer: BoundBuffer(1 << 41, size, 3, MemoryKind.DRAM) for r in dst.regions}
    for chunk in plan.chunks:
        s, d = chunk_arrays(chunk, src_bases, dst_bases)
        want = list(chunk.descriptors())
        assert s.shape == d.shape == (len(want), 3)
        assert [int(x) for x in s[:, 0]] == [(1 << 40) + w.src_offset for w in want]
        assert [int(x) for x in d[:, 0]] == [(1 << 41) + w.dst_offset for w in want]
        assert [int(x) for x in s[:, 1]] == [w.length for w in want] == list(d[:, 1])
        assert set(d[:, 2].tolist()) == {3}


def test_region_past_the_buffer_is_refused() -> None:
    base = layout_for_model("llama-3.1-8b")
    src, dst = bind(base, 4, "p"), bind(base, 4, "d")
    span = spans_for(src, 64, 4, random.Random(0), 0)
    plan = plan_transfer(src, dst, span, span, 64, 0)
    tiny = {"p0": BoundBuffer(4096, 100, 0, MemoryKind.DRAM)}
    with pytest.raises(PlanError, match=r"region 'layer.0.k': ends at byte 131072, past buffer"):
        chunk_arrays(plan.chunks[0], tiny, tiny)


def test_binding_reads_the_buffers_every_time_and_keeps_only_the_layouts_geometry() -> None:
    base = layout_for_model("gpt-oss-20b", block_size=16)
    src, dst = bind(base, 80, "p"), bind(base, 80, "d")
    spans = spans_for(src, 1024, 80, random.Random(1), 0.2)
    plan = plan_transfer(src, dst, spans, spans, 1024, 0)
    size = 1 << 30
    # The same chunks bound to buffers at other addresses (the peer registered again,
    # say): each binding reads where every buffer is now, buffer by buffer.
    for at in (1 << 40, 1 << 44):
        peer = {f"p{g}": BoundBuffer(at + (g << 34), size, 0, MemoryKind.DRAM) for g in (0, 1)}
        mine = {f"d{g}": BoundBuffer(at + (g << 35), size, 2, MemoryKind.DRAM) for g in (0, 1)}
        for chunk in plan.chunks:
            s, d = chunk_arrays(chunk, peer, mine)
            want = list(chunk.descriptors())
            assert [int(x) for x in s[:, 0]] == [
                peer[w.src_buffer].address + w.src_offset for w in want
            ]
            assert [int(x) for x in d[:, 0]] == [
                mine[w.dst_buffer].address + w.dst_offset for w in want
            ]
            assert [int(x) for x in d[:, 1]] == [w.length for w in want]
            assert set(d[:, 2].tolist()) == {2} and set(s[:, 2].tolist()) == {0}
    # A buffer that shrank, or is gone, is refused naming a region, geometry known or not.
    small = {f"d{g}": BoundBuffer(1 << 40, 4096, 0, MemoryKind.DRAM) for g in (0, 1)}
    with pytest.raises(PlanError, match=r"region '.*': ends at byte \d+, past buffer 'd0'"):
        chunk_arrays(plan.chunks[0], peer, small)
    with pytest.raises(PlanError, match=r"buffer 'd1' is not bound"):
        chunk_arrays(plan.chunks[1], peer, {"d0": mine["d0"]})


def test_pairs_built_for_one_plan_are_bound_without_being_kept() -> None:
    """Pairs cut by tokens (block sizes differ) are new in every plan: keeping their
    arrays would only grow the memo and push out the links' own."""
    src = bind(layout_for_model("llama-3.1-8b", block_size=16), 64, "p")
    dst = bind(layout_for_model("llama-3.1-8b", block_size=32), 32, "d")
    src_spans = [BlockSpan(GroupId(0), 0, tuple(BlockId(b) for b in range(64)))]
    dst_spans = [BlockSpan(GroupId(0), 0, tuple(BlockId(b) for b in range(32)))]
    size = 1 << 30
    peer = {"p0": BoundBuffer(1 << 40, size, 0, MemoryKind.DRAM)}
    mine = {"d0": BoundBuffer(1 << 41, size, 0, MemoryKind.DRAM)}
    kept, bases = len(descriptors._GEOMETRY), len(descriptors._BASES)
    for _ in range(3):
        plan = plan_transfer(src, dst, src_spans, dst_spans, 1000, 0)
        assert not kept_pairs(plan.chunks[0].regions)
        for chunk in plan.chunks:
            s, d = chunk_arrays(chunk, peer, mine)
            want = list(chunk.descriptors())
            assert [int(x) for x in d[:, 0]] == [(1 << 41) + w.dst_offset for w in want]
            assert [int(x) for x in s[:, 0]] == [(1 << 40) + w.src_offset for w in want]
    assert len(descriptors._GEOMETRY) == kept and len(descriptors._BASES) == bases


def test_kept_bases_follow_the_buffers_bound_now() -> None:
    """A layout pair's region bases are kept by the identity of the buffers they were
    bound to: buffers registered again (new addresses) bind at their new addresses."""
    base = layout_for_model("gpt-oss-20b")
    src, dst = bind(base, 64, "p"), bind(base, 64, "d")
    span = spans_for(src, 1024, 64, random.Random(0), 0)
    plan = plan_transfer(src, dst, span, span, 1024, 0, 1024)
    size = 1 << 34

    def buffers(side: EngineLayout, at: int) -> dict[str, BoundBuffer]:
        names = {r.buffer for r in side.regions}
        return {n: BoundBuffer(at + (i << 36), size, 0, MemoryKind.DRAM)
                for i, n in enumerate(sorted(names))}  # fmt: skip

    for at in (1 << 40, 1 << 41, 1 << 40):
        peer, mine = buffers(src, at), buffers(dst, at + (1 << 39))
        for chunk in plan.chunks:
            s, d = chunk_arrays(chunk, peer, mine)
            want = list(chunk.descriptors())
            got_s, got_d = [int(x) for x in s[:, 0]], [int(x) for x in d[:, 0]]
            assert got_s == [peer[w.src_buffer].address + w.src_offset for w in want]
            assert got_d == [mine[w.dst_buffer].address + w.dst_offset for w in want]


@pytest.mark.parametrize(("tokens", "handles"), [(1024, [2]), (16384, [1, 1])])
def test_a_small_pulls_chunks_share_one_handle_and_a_full_chunk_keeps_its_own(
    tokens: int, handles: list[int]
) -> None:
    """gpt-oss-20b, 1024-block chunks: at 1k its two groups' chunks (the window's few
    blocks, the full group's 64) fit one handle together; at 16k the full group's chunk
    is 1024 blocks alone and the window's chunk keeps a handle of its own."""
    base = layout_for_model("gpt-oss-20b")
    num_blocks = tokens // base.block_size
    src, dst = bind(base, num_blocks, "p"), bind(base, num_blocks, "d")
    span = spans_for(src, tokens, num_blocks, random.Random(0), 0)
    plan = plan_transfer(src, dst, span, span, tokens, 0, 1024)
    ranges = handle_ranges(plan.chunks, 1024)
    assert [len(r) for r in ranges] == handles
    assert [i for r in ranges for i in r] == list(range(len(plan.chunks)))  # in order, once
    # Memory of another kind starts a handle of its own; a chunk past the limit is alone.
    assert handle_ranges(plan.chunks, 1024, kinds=["dram", "vram"][: len(plan.chunks)]) == [
        range(i, i + 1) for i in range(len(plan.chunks))
    ]
    assert handle_ranges(plan.chunks, 1) == [range(i, i + 1) for i in range(len(plan.chunks))]
    assert handle_ranges((), 1024) == []


@given(
    st.lists(st.tuples(st.integers(1, 40), st.sampled_from("ab")), max_size=30),
    st.integers(1, 64),
)
def test_handles_are_maximal_runs_of_chunks_that_fit(
    chunks: list[tuple[int, str]], limit: int
) -> None:
    """Checked against the rule, not the code: the runs cover every chunk once in
    order; a run of several fits in `limit` and has one kind; and no run could have
    taken the next chunk too (greedy, so no more handles than needed)."""
    fake = [
        Chunk(GroupId(0), range(0, size), (), ()) for size, _ in chunks
    ]  # only the blocks count
    kinds = [kind for _, kind in chunks]
    runs = handle_ranges(fake, limit, kinds)
    assert [i for run in runs for i in run] == list(range(len(chunks)))
    for run in runs:
        blocks = sum(chunks[i][0] for i in run)
        assert len(run) == 1 or (blocks <= limit and len({kinds[i] for i in run}) == 1)
        if run.stop < len(chunks):
            nxt = run.stop
            assert blocks + chunks[nxt][0] > limit or kinds[nxt] != kinds[run.start]


def test_buffer_handle_validation() -> None:
    with pytest.raises(LayoutError, match=r"buffer 'b'.shm_name: must be 1-200 characters"):
        BufferHandle("b", MemoryKind.DRAM, 10, shm_name="../etc/passwd")
    with pytest.raises(LayoutError, match=r"ipc_handle: must be 64 bytes, got 3"):
        buffer_from_ipc("v", 0, b"abc", 0, 10)
    handle = buffer_from_ipc("v", 1, bytes(64), 512, 4096)
    assert (handle.kind, handle.device_id, handle.offset_bytes) == (MemoryKind.VRAM, 1, 512)


def test_opening_missing_or_short_shm_is_a_clear_error() -> None:
    with pytest.raises(RegistrationError, match="cannot open shared memory 'kvxfer-nope'"):
        open_buffer(BufferHandle("x", MemoryKind.DRAM, 10, shm_name="kvxfer-nope"))
    cache = ShmKVCache(layout_for_model("llama-3.1-8b"), 2, "short")
    try:
        real = cache.buffers[0]
        lying = BufferHandle("x", MemoryKind.DRAM, real.size_bytes * 2, shm_name=real.shm_name)
        with pytest.raises(RegistrationError, match=r"holds .* bytes, the engine declared"):
            open_buffer(lying)
    finally:
        cache.close()


def test_shm_cache_layout_permissions_and_cleanup() -> None:
    layout = layout_for_model("jamba-mini-1.5", block_size=16)
    cache = ShmKVCache(layout, 10, "unit", num_state_blocks=2)
    names = [b.shm_name for b in cache.buffers]
    assert len(names) == 2
    for name in names:
        assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600
    mamba = cache.layout.region_map["layer.0.conv"]
    assert mamba.num_blocks == 2
    cache.block("layer.4.k", 9)[:] = 7
    mapped = open_buffer(cache.buffers[1])
    view = np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint8 * 16).from_address(
            mapped.address + cache.layout.region_map["layer.4.k"].block_offset(9)
        )
    )
    assert view.tolist() == [7] * 16  # the sidecar's mapping sees the engine's bytes
    del view
    mapped.close()
    cache.close()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)


def test_vram_needs_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    from kvxfer.client.cuda_ipc import export_cuda_tensor  # noqa: PLC0415

    tensor = torch.arange(1024, dtype=torch.uint8, device="cuda")
    handle = export_cuda_tensor("kv", tensor)
    assert handle.kind is MemoryKind.VRAM and handle.size_bytes == 1024


class _Agent:
    """The part of a TransferBackend `Readers` drives; the first one made is stuck in a
    NIXL call (closed, its thread still alive), as a hung UCX call leaves one."""

    made = 0

    def __init__(self, prefix: str) -> None:
        _Agent.made += 1
        self.name = f"{prefix}-{_Agent.made}"
        self.stuck = _Agent.made == 1
        self.closed = False

    @property
    def alive(self) -> bool:
        return self.stuck or not self.closed

    async def register(self, buffers: object) -> None:
        pass

    async def add_peer(self, metadata: bytes) -> str:
        return "peer"

    async def close(self) -> None:
        self.closed = True


async def test_a_replaced_reader_that_did_not_stop_keeps_its_engine_mapped() -> None:
    """New peer metadata replaces a reader; one whose thread did not stop may still touch
    the engine's buffers, so retiring that engine must not be told they can be unmapped
    (it was: the replaced reader was forgotten)."""
    _Agent.made = 0
    readers = Readers(_Agent, per_pair=1)  # type: ignore[arg-type]
    await readers.get("peer", "engine", b"v1", [])
    await readers.get("peer", "engine", b"v2", [])  # the first reader is replaced
    assert await readers.get("peer", "other", b"v1", []) is not None
    assert await readers.close_engine("other") is True  # nothing stuck touches it
    assert await readers.close_engine("engine") is False
    assert await readers.close() is False


def _refusing_nixl(error: str, listed: bool = False, defaults_fail: bool = False) -> object:
    """nixl's API as `adapter._nixl` returns it, whose agent refuses to create a backend
    with an exception of class `error` (nixl's own are named so): whenever a parameter
    is given beyond the plugin's defaults, and also with the defaults alone when
    `defaults_fail`. `listed`: the plugin is in NIXL's list (it exists but does not
    load)."""
    refusal = type(error, (Exception,), {})

    class Agent:
        def __init__(self, name: str, config: object) -> None:
            pass

        def get_plugin_list(self) -> list[str]:
            return ["UCX"] if listed else []

        def get_plugin_params(self, backend: str) -> dict[str, str]:
            return {"default": "1"}

        def create_backend(self, backend: str, params: dict[str, str]) -> None:
            if defaults_fail or set(params) != {"default"}:
                raise refusal("NIXL_ERR_SOMETHING")

    return lambda: (Agent, lambda **config: config)


@pytest.mark.parametrize(
    ("error", "params", "listed", "defaults_fail", "option", "says"),
    [
        ("nixlNotFoundError", (), False, True, "backends", "no plugin of that name"),
        ("nixlNotFoundError", (("num_workers", "2"),), False, True, "backends", "no plugin"),
        ("nixlNotFoundError", (), True, True, "backends", "does not load here"),
        ("nixlBackendError", (("num_workers", "abc"),), False, False, "backend_params", "can"),
        # NIXL fails with its own defaults too: neither the parameters nor any option is
        # shown at fault (the host, its drivers, UCX_TLS in the environment)
        ("nixlBackendError", (("num_workers", "2"),), False, True, None, ""),
        ("nixlBackendError", (), False, True, None, ""),
    ],
)
def test_a_refused_backend_blames_an_option_only_where_nixl_says_it_is_at_fault(
    monkeypatch: pytest.MonkeyPatch,
    error: str,
    params: tuple[tuple[str, str], ...],
    listed: bool,
    defaults_fail: bool,
    option: str | None,
    says: str,
) -> None:
    monkeypatch.setattr(adapter, "_nixl", _refusing_nixl(error, listed, defaults_fail))
    with pytest.raises(DataPlaneError) as err:
        NixlAgent("refused", AgentOptions(backends=("UCX",), backend_params=params))
    if option is None:
        assert type(err.value) is DataPlaneError
        assert str(err.value) == "cannot create NIXL agent: NIXL_ERR_SOMETHING"
    else:
        assert isinstance(err.value, BackendCreationError) and err.value.option == option
        assert "'UCX'" in str(err.value) and says in str(err.value)
