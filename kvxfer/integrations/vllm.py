"""kvxfer as a vLLM v1 KV connector (KVConnectorBase_V1 + SupportsHMA).

Load it with

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
        "kv_connector_module_path": "kvxfer.integrations.vllm",
        "kv_role": "kv_producer" | "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"sidecar": "unix:/run/kvxfer/engine.sock"}}'

Prefill (producer): the router sends `kv_transfer_params={"do_remote_decode": true}`.
When the request finishes, the scheduler publishes its blocks to the local
sidecar and returns the transfer params (under "kvxfer") in the request
output; the blocks stay allocated until the sidecar reports them Released.
Decode (consumer): the router passes those params with
`"do_remote_prefill": true`. The scheduler reports the remote tokens as an
asynchronous external hit; once vLLM allocated blocks, the worker asks its
sidecar to pull and the request waits until PullDone. A partly failed pull
makes vLLM recompute: from `valid_tokens` for a one-group model, from the
start for hybrid models (vLLM 0.32 takes only request-level failures when
there are several KV cache groups).

The worker remaps vLLM's KV allocation onto shared memory in place and
registers it with its sidecar (`shm_remap`); the scheduler learns the
registration through vLLM's handshake-metadata channel, or, as a MultiConnector
child whose sibling owns that channel, from the worker's handshake file
(`vllm_params.handshake_path`; docs/vllm.md, "Composition"). Models with Mamba/GDN
state prefill N-1 tokens and the decode side computes the last one (the state
at N cannot be recomputed from a state already at N).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tp_group
from vllm.v1.request import RequestStatus

from kvxfer._exceptions import (
    InvalidInputError,
    KvxferError,
    LaneUnreachableError,
    NotFoundError,
    PeerUnavailableError,
)
from kvxfer.client.engine import SyncEngineClient
from kvxfer.core.layout import BlockSpan, EngineLayout, GroupKind, StateShard
from kvxfer.core.planner import needed_blocks
from kvxfer.core.requests import (
    AbortState,
    EngineEvent,
    LeaseExpired,
    Publication,
    PullAccepted,
    PullDone,
    PullStatus,
    Released,
)
from kvxfer.integrations.cpu_amx import allow_amx
from kvxfer.integrations.shm_remap import SharedRemap
from kvxfer.integrations.vllm_hold import Holder
from kvxfer.integrations.vllm_kernel import (
    KernelFacts,
    cpu_kernel_isa,
    cpu_kernel_write,
    kernel_facts,
)
from kvxfer.integrations.vllm_layout import (
    Staging,
    attention_layers,
    group_kinds,
    group_shape,
    is_state_spec,
    layout_from_vllm,
    pages_are_head_major,
    spans_from_block_ids,
)
from kvxfer.integrations.vllm_params import (
    KEY,
    connector_event_loop,
    decode_tp_size,
    handshake_path,
    load_errors,
    params_to_dict,
    publication_id,
    pulled_tokens,
    rank_params,
    read_handshake,
    reader_params,
    reader_sources,
    remove_handshake,
    write_handshake,
)
from kvxfer.integrations.vllm_reblock import (
    FIELD as REBLOCK_FIELD,
)
from kvxfer.integrations.vllm_reblock import (
    STAGING_FIELD,
    GroupRepack,
    StagingPool,
    block_size_hint,
    kernel_rows,
    reblock_ratio,
    received_blocks,
    repack_steps,
    resumable,
    staged_spans,
    staged_units,
    staging_pages,
    sub_spans,
    unstage_steps,
)
from kvxfer.integrations.vllm_release import Releases
from kvxfer.integrations.vllm_state import StateTensor, cuts_from_config, state_groups

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvxfer.vllm")


@dataclass
class KvxferHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler: who this worker is at its sidecar."""

    engine_id: str
    epoch: int
    peer_address: str


@dataclass(frozen=True)
class PullOrder:
    """Scheduler -> worker: pull one request into these local blocks."""

    request_id: str  # this engine's id for the request
    params: dict[str, Any]
    block_ids: tuple[list[int], ...]
    computed_tokens: int
    awaiting: bool = True  # False: nothing to load, only tell the prefill to release


@dataclass
class KvxferMetadata(KVConnectorMetadata):
    pulls: list[PullOrder] = field(default_factory=list)
    # Scheduler -> prefill workers: request id -> TP rank -> the publications its blocks
    # are held for (one per decode rank reading from that rank; at TP 1 the request's
    # own id); a request is sent once every one of them was released (vllm_release).
    published: dict[str, dict[int, list[str]]] = field(default_factory=dict)


class _Lost:
    """The event `_watch` queues once the sidecar is gone."""


SIDECAR_LOST = _Lost()


@dataclass(frozen=True)
class _Answered:
    """The event a Pull call's answer queues (`_Worker._pull`): the step that started the
    pull did not wait for it."""

    receiving: _Receiving  # the request whose pull it is
    pull_id: str
    answer: concurrent.futures.Future[PullAccepted]


_WATCH_PAUSE_S = 0.2
# Bytes of pages laid out again per engine step (vllm_reblock): ~10 ms on one core here.
_LAY_OUT_BUDGET = 32 << 20
# How soon a worker asks its sidecar again to abort a pull whose Pull call got no answer,
# after an Abort that got none either: doubling up to the most (each unanswered call holds
# vLLM's step for the client's deadline; see `_Worker._settle_unsure`).
_UNSURE_RETRY_S = 1.0
_UNSURE_RETRY_MAX_S = 30.0
# After a Publish call went unanswered, how long the prefill scheduler publishes nothing:
# each call blocks vLLM's scheduler up to its deadline, and a sidecar that did not answer
# one would hold every finished request that long, one after another. The pause doubles
# while the sidecar stays silent (a dead one would otherwise cost a connect timeout every
# pause), back to the first once one is answered.
_PUBLISH_PAUSE_S = 5.0
_PUBLISH_PAUSE_MAX_S = 300.0
# The scheduler's calls go to a sidecar its worker already registered with: one that does
# not take the connection within this is gone, not starting.
_SCHEDULER_CONNECT_S = 1.0


@dataclass
class _Receiving:
    """One request's pulls on a decode worker: one per prefill rank it reads from."""

    order: PullOrder
    pending: int = 0
    failed: bool = False
    errors: set[int] = field(default_factory=set)
    valid_tokens: int = 1 << 62  # the least any of its pulls reported
    # Staging pages it holds (vllm_reblock): group id -> (first prefill block, page ids).
    staged: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        sidecar = extra.get("sidecar")
        if not isinstance(sidecar, str) or not sidecar:
            raise KvxferError('kv_connector_extra_config.sidecar: required, e.g. "unix:/path"')
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._kinds = group_kinds(kv_cache_config)
        self._has_state = GroupKind.MAMBA in self._kinds
        self._states = state_tensors(vllm_config, kv_cache_config, self._tp_size)
        self._state_cuts = state_cuts(self._states)
        self._loop_choice = connector_event_loop(extra)
        # A decode with another block size than its prefill's (vllm_reblock): larger blocks
        # are read as sub-pages, smaller ones through staging pages of the prefill's size.
        self._ratio = reblock_ratio(
            extra,
            self._kv_transfer_config.kv_role,
            kv_cache_config,
            bool(vllm_config.cache_config.enable_prefix_caching),
        )
        self._reblock = self._ratio.grow
        attention_groups = sum(kind is not GroupKind.MAMBA for kind in self._kinds)
        self._staging_pages = (
            staging_pages(
                extra,
                vllm_config.model_config.max_model_len,
                self._ratio.source,
                attention_groups,
            )
            if self._ratio.staged
            else 0
        )
        self._scheduler = _Scheduler(self, sidecar) if role is KVConnectorRole.SCHEDULER else None
        stats = extra.get("stats_path")
        worker = role is KVConnectorRole.WORKER
        if worker:
            allow_amx()  # a decode's first step would SIGILL on AMX CPUs (cpu_amx.py)
        self._worker = _Worker(self, sidecar, stats) if worker else None

    # ---- scheduler side -------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        params = _params(request)
        if self._has_state and params and params.get("do_remote_decode"):
            _trim_last_prompt_token(request)
        if self._scheduler is not None and _pulled_tokens(request) is not None:
            self._scheduler.hold(request)  # until its blocks are allocated, or it finishes

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        remote = _pulled_tokens(request)
        if remote is None:
            return 0, False
        count = min(remote, request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.holder.remove(request.request_id)  # its pull renews the lease now
        remote = _pulled_tokens(request)
        if remote is None:
            return
        params = request.kv_transfer_params
        params["do_remote_prefill"] = False  # one pull per request
        block_ids = tuple(list(g) for g in blocks.get_block_ids())
        # A full local hit still "pulls" with C == N: nothing moves, the prefill releases.
        computed = remote - max(num_external_tokens, 0)
        self._scheduler.pending.append(
            PullOrder(request.request_id, params[KEY], block_ids, computed, num_external_tokens > 0)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = KvxferMetadata(self._scheduler.pending, self._scheduler.published)
        self._scheduler.pending, self._scheduler.published = [], {}
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        self._scheduler.holder.remove(request.request_id)
        remote = _pulled_tokens(request)
        params = _params(request)
        if not params:
            return False, None
        if remote is not None:
            # Finished (aborted) before blocks were allocated: let the prefill release.
            params["do_remote_prefill"] = False
            empty: tuple[list[int], ...] = tuple([] for _ in block_ids)
            self._scheduler.pending.append(
                PullOrder(request.request_id, params[KEY], empty, remote, awaiting=False)
            )
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if self._ratio.differs:  # its pages are no pages a reader could take
            log.error(
                "kvxfer: %s not published: this decode reads another block size (%s), so "
                "its pages are no pages a reader could take",
                request.request_id,
                REBLOCK_FIELD,
            )
            return False, None
        return self._scheduler.publish(request, block_ids)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        if self._scheduler is None:
            return
        # Under a MultiConnector the channel carries the first child's metadata only: a
        # sibling's (NixlConnector's...) is not ours, and the scheduler falls back to the
        # worker's handshake file (vllm_params.handshake_path).
        for rank, handshake in metadata.items():
            if isinstance(handshake, KvxferHandshake):
                self._scheduler.handshakes[rank] = handshake
            elif handshake is not None:
                log.info(
                    "kvxfer: the handshake channel carries %s (a MultiConnector sibling's); "
                    "reading the worker's registration from its file",
                    type(handshake).__name__,
                )

    # ---- worker side ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake if self._worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferMetadata)
        self._worker.expect_released(meta.published)
        for order in meta.pulls:
            self._worker.pull(order)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        errors, self._worker.load_errors = self._worker.load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()


def state_tensors(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, tp_size: int
) -> dict[int, tuple[StateTensor, ...]] | str:
    """Each state group's packed tensors with their cuts over TP ranks (vllm_state), or
    why they are not known: the pages then stay opaque, and a decode engine of another
    TP size is refused."""
    if not any(is_state_spec(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups):
        return {}
    from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: PLC0415
        get_conv_state_layout,  # state models only: what vLLM stores conv states as
    )

    try:
        config = vllm_config.model_config.hf_config.to_dict()
        cuts = cuts_from_config(config, tp_size=tp_size, conv_layout=get_conv_state_layout())
        return state_groups(kv_cache_config, cuts, tp_size=tp_size)
    except (KvxferError, AttributeError, KeyError, TypeError, ValueError) as exc:
        # A config kvxfer cannot read costs the pairing across TP sizes, not the engine.
        reason = str(exc) if isinstance(exc, KvxferError) else f"{type(exc).__name__}: {exc}"
        log.warning(
            "kvxfer: state pages are moved whole, not cut over TP ranks (%s): a decode "
            "engine of another TP size is refused",
            reason,
        )
        return reason


def state_cuts(states: dict[int, tuple[StateTensor, ...]] | str) -> tuple[StateShard, ...] | str:
    """The distinct cuts of every state tensor (for the TP ranks a decode rank reads), or
    why they are not known."""
    if isinstance(states, str):
        return states
    return tuple(dict.fromkeys(t.shard for tensors in states.values() for t in tensors))


def _params(request: Request) -> dict[str, Any] | None:
    """The request's kv_transfer_params when they are an object (`_pulled_tokens` has
    dropped any other kind, with an error naming it)."""
    params = request.kv_transfer_params
    return params if isinstance(params, dict) else None


def _pulled_tokens(request: Request) -> int | None:
    """`pulled_tokens` of the request's params, on vLLM's scheduler path: malformed params
    (from the router, over the wire) are logged with the field they break and the request
    is prefilled here, where an exception would end the engine with every request on it.
    (Its prefill's blocks are held until their lease lapses.)"""
    try:
        return pulled_tokens(request.kv_transfer_params)
    except InvalidInputError as exc:
        log.error("kvxfer: %s is prefilled here, nothing pulled: %s", request.request_id, exc)
        params = request.kv_transfer_params
        if isinstance(params, dict):
            params["do_remote_prefill"] = False
        else:
            request.kv_transfer_params = None
        return None


def _trim_last_prompt_token(request: Request) -> None:
    """Prefill of a state model computes N-1 tokens: the decode side then computes
    token N itself from the state at N-1 (what NixlConnector does too)."""
    params = request.kv_transfer_params
    if params.get("_kvxfer_trimmed") or request.num_prompt_tokens < 2:
        return
    if request.prompt_token_ids is None:
        return
    del request.prompt_token_ids[-1]
    del request._all_token_ids[-1]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    params["_kvxfer_trimmed"] = True


class _Scheduler:
    """Publishes finished prefill requests to the sidecar; queues decode pulls, and holds
    their publications while they wait for blocks (vllm_hold)."""

    def __init__(self, owner: KvxferConnector, sidecar: str) -> None:
        self._owner = owner
        self._sidecar = sidecar
        self._clients: dict[int, SyncEngineClient] = {}  # per TP rank's engine
        self._clients_lock = threading.Lock()  # the holder's thread makes them too
        self.holder = Holder(self._hold_client)
        self.handshakes: dict[int, KvxferHandshake] = {}  # TP rank -> its registration
        self.pending: list[PullOrder] = []
        self.published: dict[str, dict[int, list[str]]] = {}  # for the next metadata
        self._paused_until = 0.0  # publishing nothing until then (_PUBLISH_PAUSE_S)
        self._pause_s = _PUBLISH_PAUSE_S  # the next pause

    def publish(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted: nothing to hand off
        if time.monotonic() < self._paused_until:
            return False, None  # not handed off: its decode prefills it (logged at the pause)
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        tp_size = self._owner._tp_size
        try:
            heads = self._owner._vllm_config.model_config.get_total_num_kv_heads()
            cuts = self._owner._state_cuts
            readers = decode_tp_size(request.kv_transfer_params, tp_size, heads, cuts)
            spans = spans_from_block_ids(self._owner._kinds, block_ids)
            if tp_size == 1 and readers == 1:
                params = self._client(0).publish(request.request_id, num_tokens, spans)
                self.published[request.request_id] = {0: [request.request_id]}
                self._pause_s = _PUBLISH_PAUSE_S
                return True, {"do_remote_prefill": True, KEY: params_to_dict(params)}
            published = self._publish_per_reader(
                request.request_id, num_tokens, spans, readers, heads, cuts
            )
        except PeerUnavailableError as exc:
            self._paused_until = time.monotonic() + self._pause_s
            log.error(
                "kvxfer: publish of %s got no answer (%s): publishing nothing for %.0f s, so "
                "vLLM's scheduler does not wait on the sidecar for every finished request",
                request.request_id, exc, self._pause_s,
            )  # fmt: skip
            self._pause_s = min(2 * self._pause_s, _PUBLISH_PAUSE_MAX_S)
            return False, None
        except KvxferError as exc:
            log.error("kvxfer: publish of %s failed: %s", request.request_id, exc)
            return False, None
        self._pause_s = _PUBLISH_PAUSE_S
        return True, {"do_remote_prefill": True, KEY: published}

    def _publish_per_reader(
        self,
        request_id: str,
        num_tokens: int,
        spans: tuple[BlockSpan, ...],
        readers: int,
        heads: int,
        cuts: tuple[StateShard, ...] | str,
    ) -> dict[str, Any]:
        """Different TP sizes (or TP > 1): one publication per (prefill rank, decode rank
        reading heads or state from it); the params of every decode rank's sources. A failure
        withdraws what was published, so no lease outlives the blocks vLLM frees."""
        tp_size = self._owner._tp_size
        made: list[tuple[int, str]] = []
        by_reader: list[list[dict[str, Any]]] = []
        try:
            states = () if isinstance(cuts, str) else cuts  # str: readers == tp_size
            for reader in range(readers):
                mine = []
                for source in reader_sources(heads, tp_size, readers, reader, states):
                    publication = publication_id(request_id, source, reader, readers)
                    params = self._client(source).publish(publication, num_tokens, spans)
                    made.append((source, publication))
                    mine.append(params_to_dict(params))
                by_reader.append(mine)
        except BaseException:
            # No worker hears of these publications, so their Released never frees blocks
            # vLLM already freed.
            for source, publication in made:
                with contextlib.suppress(KvxferError):
                    self._client(source).abort(publication)
            raise
        held: dict[int, list[str]] = {rank: [] for rank in range(tp_size)}
        for source, publication in made:
            held[source].append(publication)
        self.published[request_id] = held
        return {"num_tokens": num_tokens, "prefill_tp_size": tp_size, "readers": by_reader}

    def hold(self, request: Request) -> None:
        """Hold the publications a decode request will pull while vLLM's queue holds it
        back: each decode rank's, through that rank's engine. Params the pull would
        refuse are not held (the pull names what is wrong)."""
        value = request.kv_transfer_params[KEY]
        tp_size = self._owner._tp_size
        try:
            by_rank = {
                rank: [Publication.of(p) for p in reader_params(value, tp_size, rank)]
                for rank in range(tp_size)
            }
        except KvxferError as exc:
            log.debug("kvxfer: %s not held: %s", request.request_id, exc)
            return
        except Exception:  # vLLM calls this inside add_request: a bug must not end the engine
            log.exception("kvxfer: %s not held: its params could not be read", request.request_id)
            return
        self.holder.add(request.request_id, by_rank)

    def _hold_client(self, rank: int) -> SyncEngineClient | None:
        try:
            return self._client(rank)
        except KvxferError:  # its worker's registration has not reached here yet
            return None

    def _client(self, rank: int) -> SyncEngineClient:
        """The sidecar client of TP rank `rank`'s engine."""
        with self._clients_lock:
            return self._client_locked(rank)

    def _client_locked(self, rank: int) -> SyncEngineClient:
        client = self._clients.get(rank)
        if client is None:
            handshake = self.handshakes.get(rank) or self._handshake_from_file(rank)
            if handshake is None:
                raise KvxferError(f"no registration of TP rank {rank}'s worker reached here")
            self.handshakes[rank] = handshake
            client = SyncEngineClient(
                self._sidecar,
                engine_id=handshake.engine_id,
                connect_timeout_s=_SCHEDULER_CONNECT_S,
                **self._owner._loop_choice,
            )
            self._clients[rank] = client
        return client

    def _handshake_from_file(self, rank: int) -> KvxferHandshake | None:
        path = handshake_path(str(self._owner._kv_transfer_config.engine_id), rank)
        try:
            record = read_handshake(path)
        except KvxferError as exc:
            log.error("kvxfer: worker registration file refused: %s", exc)
            return None
        if record is None:
            return None
        return KvxferHandshake(record["engine_id"], record["epoch"], record["peer_address"])

    def close(self) -> None:
        self.holder.close()
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


def group_kernels(
    kv_cache_config: Any,
    kv_caches: dict[str, torch.Tensor],
    cache_dtype: str,
    source_block: int | None = None,
) -> list[KernelFacts | None]:
    """Each group's attention kernel, asked once per group (None: a state group, or one
    without a tensor here); with `source_block`, the kernel of pages of that block size
    (a decode registering pages of its prefill's size, vllm_reblock)."""
    out: list[KernelFacts | None] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        layers = [kv_caches[n] for n in group.layer_names if n in kv_caches]
        if is_state_spec(spec) or not layers:
            out.append(None)
        else:
            out.append(kernel_facts(spec, layers[0], cache_dtype, source_block))
    return out


def group_repacks(
    kv_cache_config: Any,
    kv_caches: dict[str, torch.Tensor],
    cache_dtype: str,
    source_block: int,
    stages: dict[str, torch.Tensor] | None = None,
) -> dict[int, GroupRepack]:
    """Per attention group, how its received sub-pages are laid out again (vllm_reblock):
    how each page is gathered from the prefill pages received into it, learnt from the
    prefill's kernel at the sub-page size and the decode's at its own. Raises where
    vLLM's kernel cannot be asked: such a decode cannot read another block size, and
    says so when it starts."""
    repacks: dict[int, GroupRepack] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if is_state_spec(spec):
            continue
        caches = tuple(kv_caches[n] for n in group.layer_names)
        if not all(c.is_contiguous() for c in caches):
            raise KvxferError(f"{REBLOCK_FIELD}: the pages of group {gid} are not dense")
        block, dtype = int(spec.block_size), caches[0].dtype
        sub, heads, size = source_block, int(spec.num_kv_heads), int(spec.head_size)
        expected = (int(kv_cache_config.num_blocks), heads, block, 2 * size)
        if any(tuple(c.shape) != expected for c in caches):
            raise KvxferError(
                f"{REBLOCK_FIELD}: group {gid}'s pages are not {list(expected)} "
                "(num_blocks, heads, block_size, 2 * head_size)"
            )
        writes = [cpu_kernel_isa(spec, dtype, cache_dtype, b) for b in (sub, block)]
        kernels = [None if isa is None else cpu_kernel_write(isa) for isa in writes]
        if None in kernels:
            raise KvxferError(
                f"{REBLOCK_FIELD}: vLLM's attention kernel cannot be asked here, so pages "
                "of another block size cannot be laid out again"
            )
        theirs, own = kernels
        assert theirs is not None and own is not None
        rows, run = kernel_rows(
            theirs, own, heads=heads, source_block=sub, target_block=block, size=size, dtype=dtype
        )
        shape = group_shape(spec, f"kv_cache_groups[{gid}].kv_cache_spec")
        staged = tuple((stages or {})[n] for n in group.layer_names) if stages else ()
        repacks[gid] = GroupRepack(shape.kind, shape.window, shape.chunk, caches, rows, run, staged)
        log.info("kvxfer: group %d reads %d-token prefill pages, laid out again in runs of %d",
                 gid, sub, run)  # fmt: skip
    return repacks


class _Worker:
    """Registers the KV cache, issues pulls, turns sidecar events into vLLM results."""

    def __init__(self, owner: KvxferConnector, sidecar: str, stats_path: str | None) -> None:
        self._owner = owner
        self._client = SyncEngineClient(sidecar, **owner._loop_choice)
        self._stats_path = stats_path
        self._remap: SharedRemap | None = None
        self.layout: EngineLayout | None = None
        self.handshake: KvxferHandshake | None = None
        self._events: queue.Queue[EngineEvent | _Lost | _Answered] = queue.Queue()
        self._closing = threading.Event()
        self._pulls: dict[str, _Receiving] = {}  # prefill request (publication) id -> pulls
        self._releases = Releases(0)  # when a published request's blocks are free
        self._tp_rank = 0
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self.load_errors: set[int] = set()
        self._handshake_file: str | None = None
        self._repacks: dict[int, GroupRepack] = {}  # gid -> re-layout (vllm_reblock)
        # With smaller blocks than the prefill's: staging pages, and pulls waiting for them.
        self._staging_store: torch.Tensor | None = None
        self._staging_remap: SharedRemap | None = None
        self._pool = StagingPool(0)
        self._waiting: collections.deque[PullOrder] = collections.deque()
        self._staged: dict[str, dict[int, tuple[int, list[int]]]] = {}
        # Pulls whose Pull call got no answer (the sidecar may have taken them): pull id ->
        # when to ask the sidecar to abort it again; and the pause after an unanswered one.
        self._unsure: dict[str, float] = {}
        self._unsure_pause = _UNSURE_RETRY_S
        # The sidecar is gone (`_watch`): every later pull fails at once, where each would
        # block vLLM's step until its connect timeout and then never hear back.
        self._gone = False
        self._local_block = 0
        # Requests whose pages are being laid out again, a budget of bytes per engine step.
        self._laying: collections.deque[tuple[_Receiving, Iterator[int]]] = collections.deque()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        storages = {t.untyped_storage().data_ptr() for t in kv_caches.values()}
        if len(storages) != 1:
            raise KvxferError(f"expected one KV allocation, found {len(storages)}")
        storage = next(iter(kv_caches.values())).untyped_storage()
        self._remap = SharedRemap(storage.data_ptr(), storage.nbytes())
        remapped = self._remap.range
        config = self._owner._vllm_config
        self._tp_rank = get_tp_group().rank_in_group if self._owner._tp_size > 1 else 0
        self._releases = Releases(self._tp_rank)
        kv_config = self._owner._kv_cache_config
        states = {} if isinstance(self._owner._states, str) else self._owner._states
        cache_dtype, reblock = str(config.cache_config.cache_dtype), self._owner._reblock
        ratio = self._owner._ratio
        source = ratio.source if ratio.source != ratio.own else None
        kernels = group_kernels(kv_config, kv_caches, cache_dtype, source)
        buffers = [remapped.handle()]
        staging, stages = self._staging(kv_config, kv_caches)
        if staging is not None:
            assert self._staging_remap is not None
            buffers.append(self._staging_remap.range.handle())
        if source is not None:
            self._repacks = group_repacks(kv_config, kv_caches, cache_dtype, source, stages)
        apart = {
            id(group.kv_cache_spec): facts.heads_apart
            for group, facts in zip(kv_config.kv_cache_groups, kernels, strict=True)
            if facts is not None
        }
        self.layout = layout_from_vllm(
            kv_config,
            buffer=remapped.name,
            base_offset=remapped.offset_of(storage.data_ptr()),
            model=str(config.model_config.model).rstrip("/").rsplit("/", 1)[-1],
            tp_size=self._owner._tp_size,
            tp_rank=self._tp_rank,
            num_kv_heads=config.model_config.get_total_num_kv_heads(),
            head_major=pages_are_head_major(
                kv_config, kv_caches, lambda spec, _: apart.get(id(spec), False)
            ),
            kernels=[k.name if k else None for k in kernels],
            states=states or None,
            reblock=reblock,
            staging=staging,
        )
        # The engine's own attention block size, which the registered one may not be.
        self._local_block = ratio.own if ratio.staged else self.layout.block_size * reblock
        role = self._owner._kv_transfer_config.kv_role
        registration = self._client.register(self.layout, buffers, name=f"vllm-{role}")
        self.handshake = KvxferHandshake(
            registration.engine_id, registration.epoch, registration.peer_address
        )
        self._handshake_file = handshake_path(
            str(self._owner._kv_transfer_config.engine_id), self._tp_rank
        )
        write_handshake(self._handshake_file, vars(self.handshake))
        log.info(
            "kvxfer: registered %d bytes as %s (remap %.3f s)",
            remapped.size,
            registration.engine_id,
            remapped.seconds,
        )
        self._record(
            layout={
                "block_size": self.layout.block_size,
                "sub_pages": reblock,  # prefill pages per page (vllm_reblock)
                # Prefill pages and decode blocks laid out together from staging pages.
                "staged": list(ratio.unit) if ratio.staged else None,
                "tp_size": self.layout.tp_size,
                "head_major": self.layout.head_major,
                # Each state group's tensors when cut over TP ranks (vllm_state), else [].
                "state_tensors": [
                    [t.suffix for t in states.get(g.group_id, ())]
                    for g in self.layout.groups
                    if g.kind is GroupKind.MAMBA
                ],
                "groups": [
                    [
                        g.kind.value,
                        g.sliding_window,
                        self.layout.block_size_of(g),
                        g.bytes_per_block,
                    ]
                    for g in self.layout.groups
                ],
            },
            registered_bytes=remapped.size,
            remap_s=remapped.seconds,
        )
        threading.Thread(target=self._watch, name="kvxfer-events", daemon=True).start()

    def _staging(
        self, kv_config: Any, kv_caches: dict[str, torch.Tensor]
    ) -> tuple[Staging | None, dict[str, torch.Tensor]]:
        """A decode that stages its prefill's pages (smaller blocks, or sizes that do not
        nest): staging pages of the prefill's size for every attention layer, in shared
        memory the sidecar can write (vllm_reblock); their registration and each layer's
        view of them."""
        pages, source = self._owner._staging_pages, self._owner._ratio.source
        if not pages:
            return None, {}
        layers = attention_layers(kv_config)
        first = kv_caches[layers[0]]
        page_shape = (first.shape[1], source, first.shape[3])
        page_bytes = first.shape[1] * source * first.shape[3] * first.element_size()
        if any(tuple(kv_caches[n].shape[1:]) != tuple(first.shape[1:]) for n in layers):
            raise KvxferError(f"{REBLOCK_FIELD}: staging needs one page shape in every layer")
        store = torch.zeros(len(layers) * pages * page_bytes // first.element_size(),
                            dtype=first.dtype)  # fmt: skip
        self._staging_store = store
        self._staging_remap = SharedRemap(store.data_ptr(), store.numel() * store.element_size())
        remapped = self._staging_remap.range
        views = store.view(len(layers), pages, *page_shape)
        self._pool = StagingPool(pages)
        staging = Staging(
            remapped.name, remapped.offset_of(store.data_ptr()), pages, source, page_bytes, layers
        )
        log.info("kvxfer: %d staging pages of %d bytes per layer (%s)", pages, page_bytes,
                 STAGING_FIELD)  # fmt: skip
        return staging, {layer: views[k] for k, layer in enumerate(layers)}

    def _record(self, **fields: object) -> None:
        """One JSON line of facts for benchmarks and the demo (extra config stats_path)."""
        if self._stats_path:
            with open(self._stats_path, "a") as out:
                out.write(json.dumps({**fields, "tp_rank": self._tp_rank}) + "\n")

    def _watch(self) -> None:
        """The sidecar's events, watched again when the stream ends, until the sidecar is
        gone: it no longer knows this engine (it restarted) or nothing listens on its
        socket (it died). Its agents and leases died with it, so nothing of what it held
        can move any more: the worker then fails every pull still waiting (vLLM
        recomputes) and releases every publication (vLLM frees the blocks), where vLLM
        would otherwise wait for ever."""
        pause = _WATCH_PAUSE_S
        while not self._closing.is_set():
            try:
                for event in self._client.events():
                    self._events.put(event)
                    pause = _WATCH_PAUSE_S
            except (NotFoundError, PeerUnavailableError) as exc:
                if not self._closing.is_set():
                    log.error("kvxfer: the sidecar is gone (%s): pulls fail, blocks go", exc)
                    self._events.put(SIDECAR_LOST)
                return
            except KvxferError as exc:
                log.warning("kvxfer: event stream ended: %s; watching again", exc)
            self._closing.wait(pause)
            pause = min(2 * pause, 5.0)

    def pull(self, order: PullOrder) -> None:
        """Pull one request: with different TP sizes, one pull per prefill rank this rank
        reads heads from; the request is received once all of them ended. With staging
        pages (vllm_reblock) it waits, in order, until enough are free."""
        if order.awaiting:  # a pull with nothing to load never waits
            staged = False if self._waiting else self._stage_into(order)
            if staged is False:
                self._waiting.append(order)
            if not staged:
                return
        self._pull(order)

    def _stage_into(self, order: PullOrder) -> bool | None:
        """Take the staging pages `order` needs, if any: True when it can be pulled, False
        while too few are free. None: an order that could never have them (or whose params
        are bad), failed at once (vLLM recomputes), never left waiting."""
        ratio = self._owner._ratio
        if not ratio.staged or not order.awaiting:
            return True
        try:
            num_tokens = int(order.params["num_tokens"])
            computed = order.computed_tokens // ratio.source * ratio.source
            needed = {
                gid: needed_blocks(
                    g.kind, g.window, num_tokens, computed, ratio.source, chunk_size=g.chunk
                )
                for gid, g in self._repacks.items()
            }
            count = sum(len(r) for r in needed.values())
            if count > self._pool.pages:
                raise KvxferError(
                    f"needs {count} staging pages, {STAGING_FIELD} gives {self._pool.pages}"
                )
        except (KvxferError, KeyError, TypeError, ValueError) as exc:
            log.error("kvxfer: pull of %s refused: %s", order.request_id, exc)
            self._received(_Receiving(order, failed=True))
            return None
        pages = self._pool.take(count)
        if pages is None:
            return False
        staged: dict[int, tuple[int, list[int]]] = {}
        for gid, blocks in needed.items():
            staged[gid] = (blocks.start if blocks else 0, pages[: len(blocks)])
            pages = pages[len(blocks) :]
        self._staged[order.request_id] = staged
        return True

    def _pull(self, order: PullOrder) -> None:
        receiving = _Receiving(order, staged=self._staged.pop(order.request_id, {}))
        computed = order.computed_tokens
        if receiving.staged:  # staging pages hold whole prefill blocks
            computed = computed // self._owner._ratio.source * self._owner._ratio.source
        try:
            if self._gone:
                raise KvxferError("the sidecar is gone: vLLM computes it here")
            layout = self.layout
            if layout is None:
                raise KvxferError("the KV cache is not registered with the sidecar")
            heads = next((g.num_kv_heads for g in layout.groups if g.num_kv_heads), None)
            cuts = self._owner._state_cuts
            states = () if isinstance(cuts, str) else cuts  # str: the pages are opaque
            every = rank_params(order.params, layout.tp_size, self._tp_rank, heads, states)
            kinds = self._owner._kinds
            spans = sub_spans(
                spans_from_block_ids(kinds, order.block_ids), kinds, self._owner._reblock
            )
            spans = staged_spans(spans, receiving.staged)
        except KvxferError as exc:
            log.error("kvxfer: pull of %s refused: %s", order.request_id, exc)
            every, receiving.failed = [], True
        for params in every:
            pull_id = params.request_id
            other = self._pulls.get(pull_id)
            if other is not None:
                # A second request pulling one publication (a retried or hedged decode, a
                # router bug): the sidecar would refuse it, but its PullDone and abort are
                # keyed by the publication, so it must never stand in for the first.
                log.error("kvxfer: pull of %s refused: %s is already pulled for %s",
                          order.request_id, pull_id, other.order.request_id)  # fmt: skip
                receiving.failed = True
                continue
            # Not waited for here, at the start of vLLM's step: the answer comes with the
            # events (`_answered`), and may come after the pull's PullDone.
            self._pulls[pull_id] = receiving
            receiving.pending += 1
            try:
                answer = self._client.pull_soon(params, spans, computed)
            except RuntimeError as exc:  # the client's loop is closed: nothing was sent
                answer = concurrent.futures.Future()
                answer.set_exception(KvxferError(f"not sent: {exc}"))
            answer.add_done_callback(self._on_answer(receiving, pull_id))
        if not receiving.pending:
            self._received(receiving)

    def _on_answer(
        self, receiving: _Receiving, pull_id: str
    ) -> Callable[[concurrent.futures.Future[PullAccepted]], None]:
        """Queues a Pull call's answer with the events (it runs on the client's thread)."""
        return lambda answer: self._events.put(_Answered(receiving, pull_id, answer))

    def _answered(self, event: _Answered) -> None:
        """A Pull call's answer: accepted (its PullDone ends it), refused (nothing was
        taken: it ended), or none (the sidecar may have taken it: `_settle_unsure`)."""
        pull_id = event.pull_id
        receiving: _Receiving | None = event.receiving
        if self._pulls.get(pull_id) is not receiving:
            receiving = None  # its PullDone came, or the sidecar is gone: it ended
        try:
            accepted = event.answer.result()
        except Exception as exc:  # concurrent.futures.CancelledError too (closing)
            unsure = isinstance(exc, PeerUnavailableError) or not isinstance(exc, KvxferError)
            if isinstance(exc, LaneUnreachableError):
                unsure = False  # turned away before any call ran: nothing was taken
            if receiving is None:  # it ended meanwhile: nothing to settle
                log.info("kvxfer: pull of %s ended before its call's answer (%r)", pull_id, exc)
                return
            if unsure:
                # A deadline, a lost connection (or a bug in the call): the sidecar may
                # have taken it, and its reads may still land in these blocks. The request
                # stays receiving (vLLM keeps its blocks) until the sidecar says: a
                # PullDone, an abort answered, or the sidecar gone with its agents.
                log.error("kvxfer: pull of %s got no answer (%r): aborting it", pull_id, exc)
            else:
                log.error("kvxfer: pull of %s refused: %s%s", pull_id, exc,
                          block_size_hint(exc, self._owner._ratio.differs))  # fmt: skip
            receiving.failed = True
            if unsure:
                self._unsure[pull_id] = 0.0
                return
            del self._pulls[pull_id]
            receiving.pending -= 1
            if not receiving.pending:
                self._received(receiving)
            return
        self._record(
            request_id=event.receiving.order.request_id,
            pull_id=pull_id,
            bytes_planned=accepted.bytes_planned,
            full_attention_bytes=accepted.full_attention_bytes,
        )

    def _drop_finished(self, finished_req_ids: set[str]) -> None:
        """Pulls waiting for staging pages whose request vLLM finished meanwhile (aborted):
        nothing is to load any more. The prefill is told to release (a pull with nothing
        to load), and vLLM hears the request received, which frees the blocks it kept
        for it; the pulls behind it no longer wait for it."""
        waiting, self._waiting = self._waiting, collections.deque()
        for order in waiting:
            if order.request_id not in finished_req_ids:
                self._waiting.append(order)
                continue
            log.info("kvxfer: %s finished while its pull waited for staging pages: not "
                     "pulled", order.request_id)  # fmt: skip
            self._done_recving.add(order.request_id)
            # Every token "computed": a pull that plans nothing, as the scheduler's own.
            remote = int(order.params.get("num_tokens", 0))
            self._pull(replace(order, block_ids=tuple([] for _ in order.block_ids),
                               computed_tokens=remote, awaiting=False))  # fmt: skip

    def expect_released(self, published: dict[str, dict[int, list[str]]]) -> None:
        """The publications holding each request's blocks, per rank (vllm_release)."""
        self._releases.announce(published)

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            self._on_event(event)
        self._lay_out(_LAY_OUT_BUDGET)
        if self._waiting and finished_req_ids:
            self._drop_finished(finished_req_ids)
        if self._unsure:
            self._settle_unsure(time.monotonic())
        while self._waiting:
            staged = self._stage_into(self._waiting[0])
            if staged is False:
                break
            order = self._waiting.popleft()
            if staged:
                self._pull(order)
        sending = self._releases.sending_done(finished_req_ids, time.monotonic())
        if sending:
            self._record(finished_sending=sorted(sending))
        recving, failed = self._done_recving, self._failed_recving
        self._done_recving, self._failed_recving = set(), set()
        return KVConnectorTransferResults(sending, recving, failed)

    def _on_event(self, event: EngineEvent | _Lost | _Answered) -> None:
        if isinstance(event, _Lost):
            self._sidecar_lost()
            return
        if isinstance(event, _Answered):
            self._answered(event)
            return
        if isinstance(event, Released | LeaseExpired):
            self._releases.released(event.request_id, time.monotonic())
            return
        assert isinstance(event, PullDone)
        receiving = self._pulls.pop(event.request_id, None)
        if receiving is None:
            return
        order = receiving.order
        receiving.pending -= 1
        if not order.awaiting:  # nothing was to load: it only let the prefill release
            if not receiving.pending:
                self._received(receiving)
            return
        self._record(
            request_id=order.request_id,
            pull_id=event.request_id,
            num_tokens=int(order.params["num_tokens"]),
            computed_tokens=order.computed_tokens,
            status=event.status.value,
            bytes_moved=event.bytes_moved,
            duration_s=event.duration_s,
            failed_blocks={str(g): list(b) for g, b in event.failed_blocks.items()},
            valid_tokens=event.valid_tokens,
            reason=event.reason,
        )
        if event.status is not PullStatus.OK:
            log.warning(
                "kvxfer: pull of %s %s (%s): failed blocks %s, resume at %d",
                event.request_id,
                event.status.value,
                event.reason or "no reason given",
                dict(event.failed_blocks),
                event.valid_tokens,
            )
            errors = (
                load_errors(
                    event,
                    order.block_ids,
                    self.layout.block_size,
                    self._local_block,
                    order.computed_tokens,
                )
                if self.layout is not None
                and resumable(self._owner._kinds, not self._owner._ratio.differs)
                else None
            )
            if errors is None:
                receiving.failed = True
            else:
                receiving.errors |= errors
        receiving.valid_tokens = min(receiving.valid_tokens, event.valid_tokens)
        if not receiving.pending:
            self._received(receiving)

    def _settle_unsure(self, now: float) -> None:
        """Ask the sidecar to abort each pull whose Pull call got no answer, until it says
        whether it took it: it did (its PullDone comes once every read it posted ended),
        or it knows no such pull (nothing can land: the request is received, failed). A
        sidecar that does not answer is asked again a second after its call gave up, then
        two, up to 30; one that is gone fails them all (`_sidecar_lost`). The calls block
        vLLM's step: only after a Pull call already went unanswered, and at most one
        unanswered call per step."""
        for pull_id, when in list(self._unsure.items()):
            receiving = self._pulls.get(pull_id)
            if receiving is None:  # its PullDone came, or the sidecar is gone
                del self._unsure[pull_id]
                continue
            if when > now:
                continue
            try:
                state = self._client.abort(pull_id)
            except NotFoundError:
                state = None
            except KvxferError as exc:  # no answer again: the others would wait as long
                log.warning("kvxfer: abort of unanswered pull %s: %s; asking again in %.0f s",
                            pull_id, exc, self._unsure_pause)  # fmt: skip
                # From now (the call may have waited its whole deadline), and less often
                # while the sidecar stays silent.
                self._unsure[pull_id] = time.monotonic() + self._unsure_pause
                self._unsure_pause = min(2 * self._unsure_pause, _UNSURE_RETRY_MAX_S)
                return
            self._unsure_pause = _UNSURE_RETRY_S
            del self._unsure[pull_id]
            if state is AbortState.PULLING:
                continue  # taken, and now cancelled: its PullDone ends it
            del self._pulls[pull_id]
            receiving.pending -= 1
            if not receiving.pending:
                self._received(receiving)

    def _sidecar_lost(self) -> None:
        """Every pull still waiting failed; every publication released; every later pull
        fails at once (see `_watch`)."""
        self._gone = True
        waiting = {id(r): r for r in self._pulls.values()}
        self._pulls.clear()
        self._unsure.clear()
        for receiving in waiting.values():
            receiving.pending, receiving.failed = 0, True
            self._received(receiving)
        self._releases.release_all()

    def _received(self, receiving: _Receiving) -> None:
        """Every pull of a request ended: vLLM hears it received (or what to recompute),
        after its pages were laid out again where they arrived as sub-pages (`_lay_out`).
        No byte can land in them any more (PullDone comes once every read the sidecar
        posted ended), and vLLM does not touch them before it hears the request received."""
        if not receiving.order.awaiting:
            return
        if not receiving.failed and self._repacks:
            self._laying.append((receiving, self._repack(receiving)))
            return
        self._finish(receiving)

    def _lay_out(self, budget: int) -> None:
        """Lay out pages of the requests waiting for it, up to about `budget` bytes: this
        runs on vLLM's step (its own threads, no second OpenMP team beside them), so a
        long request's pages take several steps rather than stalling one."""
        while self._laying and budget > 0:
            receiving, steps = self._laying[0]
            try:
                budget -= next(steps)
                continue
            except StopIteration:
                pass
            except Exception as exc:  # whatever failed, vLLM must recompute
                log.error("kvxfer: laying out %s's pages again failed: %r",
                          receiving.order.request_id, exc)  # fmt: skip
                receiving.failed = True
            self._laying.popleft()
            self._finish(receiving)

    def _finish(self, receiving: _Receiving) -> None:
        order = receiving.order
        # Every read into them ended: PullDone, or the sidecar knew no such pull, or it
        # is gone with its agents.
        for _, pages in receiving.staged.values():
            self._pool.give(pages)
        receiving.staged = {}
        self._done_recving.add(order.request_id)
        if receiving.failed:
            self._failed_recving.add(order.request_id)
        else:
            self.load_errors |= receiving.errors

    def _repack(self, receiving: _Receiving) -> Iterator[int]:
        """The steps laying out again the pages this request received as sub-pages or into
        staging pages (vllm_reblock), with what they took recorded at the end."""
        order, spent, count = receiving.order, 0.0, 0
        ratio = self._owner._ratio
        num_tokens = int(order.params["num_tokens"])
        for gid, group in self._repacks.items():
            ids = order.block_ids[gid]
            if gid in receiving.staged:
                first, staged = receiving.staged[gid]
                sources, targets = staged_units(
                    ids, staged, first, ratio.source, ratio.own, num_tokens,
                    order.computed_tokens, receiving.valid_tokens,
                )  # fmt: skip
                steps = unstage_steps(group, sources, targets)
                count += int((targets >= 0).sum())
            else:
                blocks, moved = received_blocks(
                    group, ids, ratio.grow, num_tokens, order.computed_tokens,
                    receiving.valid_tokens,
                )  # fmt: skip
                steps = repack_steps(group, blocks, moved)
                count += len(blocks)
            started = time.perf_counter()
            for done in steps:
                spent += time.perf_counter() - started
                yield done
                started = time.perf_counter()
        self._record(request_id=order.request_id, repacked_blocks=count, repack_s=spent)

    def close(self) -> None:
        self._closing.set()
        if self._handshake_file is not None:
            remove_handshake(self._handshake_file)
        try:
            self._client.unregister()
        except KvxferError as exc:
            log.warning("kvxfer: unregister failed: %s", exc)
        self._client.close()
        if self._remap is not None:
            self._remap.close()
        if self._staging_remap is not None:
            self._staging_remap.close()
