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
it. A request whose publication is gone is no longer held (its pull will fail
and be recomputed, as before).

The first round starts as soon as the first request is added, the next ones an
interval apart, however long the last one took (the sidecar answers each Hold
within about a second and leaves a silent publisher to the next round). The
ranks are asked at once, from a small pool: each rank's Hold can take that
second, and one after another a round of TP 8 outlasted a 5 s TTL. A batch the
sidecar refuses (a publication naming the decode sidecar itself, say) is sent
again without the request of the publication the refusal names, which is
dropped, so one bad request never leaves the others of its batch unheld; a
refused call answers at once, so this costs one call per refused request, not
one per publication (each of which would wait the second for a silent
publisher). Plain threads and a client per decode TP rank (a rank's
publications are held through its own engine, as it will pull them); nothing
here imports vLLM.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Protocol

from kvxfer._exceptions import InvalidInputError, KvxferError, LimitExceededError
from kvxfer.core.requests import Held, HoldState, Publication
from kvxfer.core.throttle import LogThrottle

log = logging.getLogger(__name__)

FIRST_INTERVAL_S = 1.0  # until a sidecar has said how often (a third of the lease TTL)
MIN_INTERVAL_S = 0.1  # whatever a sidecar says
BATCH = 1024  # publications per Hold call, halved while the sidecar's limit is lower
WARN_EVERY_S = 60.0  # a rank whose holds fail is logged at most this often
MAX_RANKS_AT_ONCE = 8  # ranks whose Holds run at once, a pool thread each


_REFUSED = re.compile(r"publications\[(\d+)\]")


def refused_index(exc: InvalidInputError, count: int) -> int | None:
    """The position of the publication a refused Hold names (the sidecar's field is
    `publications[i]...`), None where its field names none of the `count` sent."""
    match = _REFUSED.match(exc.field)
    if match is None or int(match[1]) >= count:
        return None
    return int(match[1])


class HoldClient(Protocol):
    def hold(self, publications: Sequence[Publication]) -> Held: ...


class Holder:
    """Requests to hold: request id -> {decode TP rank: the publications that rank will
    pull}. `client(rank)` is that rank's sidecar client, None while its registration
    has not reached the scheduler (then nothing is held through it yet)."""

    def __init__(
        self,
        client: Callable[[int], HoldClient | None],
        first_interval_s: float = FIRST_INTERVAL_S,
    ) -> None:
        self._client = client
        self._interval_s = first_interval_s
        self._batch = BATCH
        self._lock = threading.Lock()
        self._waiting: dict[str, dict[int, list[Publication]]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by a new request and by close
        self._fresh: set[str] = set()  # requests added since the last round began
        self._thread: threading.Thread | None = None
        self._logs = LogThrottle(WARN_EVERY_S)  # by rank
        self._pool: ThreadPoolExecutor | None = None  # made for the first round of 2+ ranks
        self._closed = False
        self.rounds = 0  # rounds held, for tests and logs

    def add(self, request_id: str, by_rank: Mapping[int, Sequence[Publication]]) -> None:
        with self._lock:
            if request_id not in self._waiting:
                self._fresh.add(request_id)
                self._wake.set()
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

    def close(self, wait_s: float = 10.0) -> None:
        """Stop holding, waiting up to `wait_s` for the thread to leave its round (its
        calls end by the client's deadline; one cut short by the client's close is not
        logged), and end the ranks' pool threads."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(wait_s)
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        """Rounds from the first request on, the first at once (the request may have
        waited for vLLM to hand it over already), then each an interval after the last
        one started. A request added between rounds is held at once, alone with the
        others added meanwhile: its publisher's TTL may be shorter than any asked so
        far (a round that reached no publisher answers the decode's own, 10 s), and the
        next full round could come after its lease lapsed."""
        due = time.monotonic()
        while not self._stop.is_set():
            self._wake.clear()
            started = time.monotonic()
            full = started >= due
            try:
                self.hold_once(None if full else self._take_fresh())
            except Exception:  # a bug must not end the holds of every later request
                if not self._stop.is_set():
                    log.exception("kvxfer: holding waiting requests failed")
            # A fresh request's shorter interval brings the next full round forward.
            due = started + self._interval_s if full else min(due, started + self._interval_s)
            self._wake.wait(max(0.0, due - time.monotonic()))

    def _take_fresh(self) -> set[str]:
        with self._lock:
            fresh, self._fresh = self._fresh, set()
        return fresh

    def hold_once(self, only: set[str] | None = None) -> None:
        """One round: every waiting request's publications (or those of `only`), per
        rank, in batches, the ranks at once; the next full round starts after the
        shortest interval a sidecar answered (for `only`: if shorter than the last)."""
        with self._lock:
            if only is None:
                self._fresh.clear()
            snapshot = {
                rid: dict(ranks)
                for rid, ranks in self._waiting.items()
                if only is None or rid in only
            }
        if not snapshot:
            return
        by_rank: dict[int, list[tuple[str, Publication]]] = {}
        for request_id, ranks in snapshot.items():
            for rank, publications in ranks.items():
                by_rank.setdefault(rank, []).extend((request_id, p) for p in publications)
        work = []
        for rank, items in sorted(by_rank.items()):
            client = self._client(rank)
            if client is not None:
                work.append((rank, client, items))
        answers, failure = self._hold_ranks(work)
        intervals = [interval for rank_intervals, _ in answers for interval in rank_intervals]
        self.rounds += 1
        if intervals:
            shortest = max(min(intervals), MIN_INTERVAL_S)
            self._interval_s = shortest if only is None else min(self._interval_s, shortest)
        ended = {request_id for _, rank_ended in answers for request_id in rank_ended}
        for request_id in ended:  # nothing left to keep: its pull fails and is recomputed
            log.info("kvxfer: %s is no longer held by its prefill: not held any more", request_id)
            self.remove(request_id)
        if failure is not None:
            raise failure

    def _hold_ranks(
        self, work: list[tuple[int, HoldClient, list[tuple[str, Publication]]]]
    ) -> tuple[list[tuple[list[float], set[str]]], BaseException | None]:
        """Each rank's answers (its intervals, its ended requests), held at once: a rank's
        Hold takes up to the sidecar's second when a publisher is silent, so one after
        another a round of TP 8 took 8 s and leases of a 5 s TTL lapsed while held. What
        the ranks that answered found is kept when another failed (its error second)."""
        if len(work) <= 1:  # no thread needed
            return [self._hold_rank(*w) for w in work], None
        futures = [self._executor().submit(self._hold_rank, *w) for w in work]
        wait(futures)
        failures = [exc for f in futures if (exc := f.exception()) is not None]
        return [f.result() for f in futures if f.exception() is None], next(iter(failures), None)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("the holder is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(MAX_RANKS_AT_ONCE, "kvxfer-hold-rank")
            return self._pool

    def _hold_rank(
        self, rank: int, client: HoldClient, items: list[tuple[str, Publication]]
    ) -> tuple[list[float], set[str]]:
        """One rank's publications in batches (in a pool thread): the intervals its
        sidecar answered and the requests no longer held."""
        intervals: list[float] = []
        ended: set[str] = set()
        size = self._batch
        start = 0
        while start < len(items):
            batch = items[start : start + size]
            try:
                self._hold_batch(client, batch, intervals, ended)
            except LimitExceededError:
                if size == 1:
                    raise
                size = max(1, size // 2)  # the sidecar takes fewer at once
                with self._lock:  # other ranks' threads may have halved it too
                    self._batch = min(self._batch, size)
                continue
            except KvxferError as exc:
                self._warn(rank, f"holding {len(batch)} publications failed: {exc}")
            start += len(batch)
        return intervals, ended

    def _hold_batch(
        self,
        client: HoldClient,
        batch: list[tuple[str, Publication]],
        intervals: list[float],
        ended: set[str],
    ) -> None:
        """Hold `batch` in one call. A refused call names the publication it refused
        (`publications[i]`): that request is dropped (its pull would be refused as well)
        and the rest sent again as one batch, until one is accepted. Each Hold of a
        batch with a silent publisher in it takes the sidecar's second, so this costs
        one such call however many are refused; a refusal naming no publication splits
        the batch in halves, each held the same way."""
        while batch:
            try:
                held = client.hold([p for _, p in batch])
            except InvalidInputError as exc:
                index = refused_index(exc, len(batch))
                if index is None and len(batch) > 1:
                    half = len(batch) // 2
                    self._hold_batch(client, batch[:half], intervals, ended)
                    self._hold_batch(client, batch[half:], intervals, ended)
                    return
                refused = batch[index or 0][0]
                log.error("kvxfer: %s cannot be held: %s", refused, exc)
                ended.add(refused)
                batch = [item for item in batch if item[0] != refused]
                continue
            intervals.append(held.interval_s)
            for (request_id, _), state in zip(batch, held.states, strict=True):
                if state in (HoldState.GONE, HoldState.ABORTED):
                    ended.add(request_id)
            return

    def _warn(self, rank: int, message: str) -> None:
        if self._logs.due(rank) is not None:
            log.warning("kvxfer: rank %d: %s (logged at most every %g s)", rank, message,
                        WARN_EVERY_S)  # fmt: skip
