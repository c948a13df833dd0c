"""Keep the prefill's publications of decode requests alive while vLLM's queue holds them.

A decode request with remote KV waits in vLLM's queue until its blocks can be
allocated; only then does the worker pull. Under load that wait can pass the
prefill's lease TTL (30 s by default), and the pull then finds nothing held:
the whole prompt is recomputed at the decode, exactly when it is busiest. The
decode scheduler therefore holds every such request from the moment vLLM
hands it over (`on_new_request`) until its blocks are allocated or it
finishes: a thread of its own asks the decode sidecar to hold them (the Hold
call, which asks each publisher, up to the publisher's lease.max_hold_s after
it published) every third of the shortest TTL, so vLLM's step never waits on
it. A request whose publication is gone or aborted is no longer held (its pull
will fail and be recomputed, as before).

Plain threads and a client per decode TP rank (a rank's publications are held
through its own engine, as it will pull them); nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kvxfer._exceptions import KvxferError
from kvxfer.core.requests import Held, HoldState, TransferParams

log = logging.getLogger(__name__)

FIRST_INTERVAL_S = 1.0  # until a sidecar has said how often (a third of the lease TTL)
BATCH = 1024  # params per Hold call (the sidecar takes up to limits.max_heartbeat_ids)


class HoldClient(Protocol):
    def hold(self, params: Sequence[TransferParams]) -> Held: ...


class Holder:
    """Requests to hold: request id -> {decode TP rank: the params that rank will pull}.
    `client(rank)` is that rank's sidecar client, None while its registration has not
    reached the scheduler (then nothing is held through it yet)."""

    def __init__(
        self,
        client: Callable[[int], HoldClient | None],
        first_interval_s: float = FIRST_INTERVAL_S,
    ) -> None:
        self._client = client
        self._interval_s = first_interval_s
        self._lock = threading.Lock()
        self._waiting: dict[str, dict[int, list[TransferParams]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0  # holds sent, for tests and logs

    def add(self, request_id: str, by_rank: Mapping[int, Sequence[TransferParams]]) -> None:
        with self._lock:
            self._waiting[request_id] = {rank: list(p) for rank, p in by_rank.items() if p}
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="kvxfer-hold", daemon=True)
                self._thread.start()

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)

    def waiting(self) -> list[str]:
        with self._lock:
            return list(self._waiting)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.hold_once()
            except Exception:  # a bug must not end the holds of every later request
                log.exception("kvxfer: holding waiting requests failed")

    def hold_once(self) -> None:
        """One round: every waiting request's publications, per rank, in batches; the
        next round comes after the shortest interval a sidecar answered."""
        with self._lock:
            snapshot = {rid: dict(ranks) for rid, ranks in self._waiting.items()}
        if not snapshot:
            return
        by_rank: dict[int, list[tuple[str, TransferParams]]] = {}
        for request_id, ranks in snapshot.items():
            for rank, params in ranks.items():
                by_rank.setdefault(rank, []).extend((request_id, p) for p in params)
        intervals, ended = [], set()
        for rank, items in sorted(by_rank.items()):
            client = self._client(rank)
            if client is None:
                continue
            for start in range(0, len(items), BATCH):
                batch = items[start : start + BATCH]
                try:
                    held = client.hold([p for _, p in batch])
                except KvxferError as exc:
                    log.warning("kvxfer: holding %d publications failed: %s", len(batch), exc)
                    continue
                if held.interval_s > 0:
                    intervals.append(held.interval_s)
                for (request_id, _), state in zip(batch, held.states, strict=True):
                    if state in (HoldState.GONE, HoldState.ABORTED):
                        ended.add(request_id)
        self.rounds += 1
        if intervals:
            self._interval_s = min(intervals)
        for request_id in ended:  # nothing left to keep: its pull fails and is recomputed
            log.info("kvxfer: %s is no longer held by its prefill: not held any more", request_id)
            self.remove(request_id)
