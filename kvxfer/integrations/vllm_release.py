"""When a prefill worker may tell vLLM a request's blocks are free (`finished_sending`).

vLLM keeps a finished request's blocks while the connector said it would send them,
until a worker reports the request in `finished_sending`. A request is published as
one or more leases (one per reader at TP > 1, `vllm_params.publication_id`; its own id
at TP 1), and the scheduler tells every worker, in the step's metadata, which of them
hold blocks on its rank. The worker reports the request once vLLM said it finished and
the sidecar released (or expired) every one of those leases.

Only what can still be reported is kept. vLLM hands every worker every finished
request id, published or not (a decode worker sees all of its own); an id is kept only
while it is announced or released and not yet reported, because vLLM announces a
request (its connector's `request_finished`, turned into metadata) in the same step
that lists it finished. A released lease nobody announces (one the scheduler withdrew
after a failed publication) is dropped after `unclaimed_s`: announcements reach the
workers within a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

UNCLAIMED_S = 600.0


class Releases:
    """One worker's bookkeeping (one TP rank); every method is called from the thread
    vLLM calls the connector's worker side on."""

    def __init__(self, tp_rank: int, unclaimed_s: float = UNCLAIMED_S) -> None:
        self._rank = tp_rank
        self._unclaimed_s = unclaimed_s
        self._held: dict[str, set[str]] = {}  # request -> its leases not yet released
        self._released_leases: dict[str, float] = {}  # lease -> when, not yet claimed
        self._released: set[str] = set()  # requests whose every lease was released
        self._finished: set[str] = set()  # of those announced or released, finished
        self._gone = False  # the sidecar holding the leases is gone (`release_all`)

    def announce(self, published: Mapping[str, Mapping[int, Sequence[str]]]) -> None:
        """The scheduler's word: request -> TP rank -> the leases holding its blocks
        there (a rank that holds none is listed with none, or not at all)."""
        for request_id, by_rank in published.items():
            if self._gone:  # no lease of it is held anywhere any more
                self._released.add(request_id)
            else:
                self._held[request_id] = set(by_rank.get(self._rank, ()))

    def released(self, lease_id: str, now: float) -> None:
        """The sidecar released, or expired, a lease of this rank's engine."""
        self._released_leases[lease_id] = now

    def release_all(self) -> None:
        """The sidecar is gone, and every lease with it: every announced request's blocks
        are free (it is reported once vLLM said it finished), and so are later ones'."""
        self._released.update(self._held)
        self._held.clear()
        self._released_leases.clear()
        self._gone = True

    def sending_done(self, finished_req_ids: Iterable[str], now: float) -> set[str]:
        """The requests to report in `finished_sending` now (each once)."""
        for request_id, held in list(self._held.items()):
            for lease in held & self._released_leases.keys():
                del self._released_leases[lease]
                held.discard(lease)
            if not held:
                del self._held[request_id]
                self._released.add(request_id)
        self._finished.update(r for r in finished_req_ids if r in self._held or r in self._released)
        for lease, when in list(self._released_leases.items()):
            if now - when > self._unclaimed_s:
                del self._released_leases[lease]
        sending = self._released & self._finished
        self._released -= sending
        self._finished -= sending
        return sending

    def __len__(self) -> int:
        """Ids kept, all kinds: bounded by the requests in flight."""
        held = sum(len(h) + 1 for h in self._held.values())
        return held + len(self._released_leases) + len(self._released) + len(self._finished)
