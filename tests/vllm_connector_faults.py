"""kvxfer's vLLM connector under faults at its sidecar client, run under .venv-vllm
(tests/test_vllm_connector_faults.py runs it and checks what it prints).

The connector module imports vLLM, so this runs where vLLM is installed. Its sidecar
client is replaced by one that fails as a real one can (the seam every call of the
worker goes through: `pull` and `abort`, with the same signatures and errors); its
scheduler half is driven with request objects carrying what vLLM's `Request` gives the
connector (`request_id`, `kv_transfer_params`, `num_prompt_tokens`).

Reads nothing; prints one JSON object: what each scenario saw.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from kvxfer._exceptions import InvalidInputError, NotFoundError, PeerUnavailableError
from kvxfer.core.layout import BlockId, BlockSpan, GroupId, GroupKind
from kvxfer.core.requests import (
    AbortState,
    PullAccepted,
    PullDone,
    PullStatus,
    TransferParams,
)
from kvxfer.integrations import vllm as connector
from kvxfer.integrations.vllm_params import KEY, params_to_dict


class FaultyClient:
    """`SyncEngineClient`'s pull_soon, abort and publish, failing as told: `pull_error`
    answers every Pull (after the sidecar took it, or before), each of `aborts` answers
    one Abort in turn (an AbortState, or an error raised), and every Publish raises
    `publish_error`. With `pull_error` None, Pulls stay unanswered until the scenario
    answers them (`answers`)."""

    def __init__(
        self,
        pull_error: Exception | None,
        aborts: list[AbortState | Exception],
        publish_error: Exception | None = None,
    ) -> None:
        self.pull_error = pull_error
        self.answers: list[concurrent.futures.Future[PullAccepted]] = []
        self.aborts = aborts
        self.aborted: list[str] = []
        self.publish_error = publish_error
        self.published: list[str] = []
        self.pulled: list[str] = []

    def publish(self, request_id: str, num_tokens: int, spans: Any) -> TransferParams:
        self.published.append(request_id)
        if self.publish_error is None:  # answered
            return TransferParams("127.0.0.1:5000", "engine-1", 3, 0, request_id, num_tokens, spans)
        raise self.publish_error

    def pull_soon(
        self, params: TransferParams, local_spans: Any, computed_tokens: int
    ) -> concurrent.futures.Future[PullAccepted]:
        del local_spans, computed_tokens
        self.pulled.append(params.request_id)
        answer: concurrent.futures.Future[PullAccepted] = concurrent.futures.Future()
        if self.pull_error is not None:
            answer.set_exception(self.pull_error)
        self.answers.append(answer)
        return answer

    def abort(self, request_id: str) -> AbortState:
        self.aborted.append(request_id)
        answer = self.aborts.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


ACCEPTED = PullAccepted(bytes_planned=4096, full_attention_bytes=4096, chunks=1, descriptors=2)


def worker(client: FaultyClient) -> Any:
    owner = SimpleNamespace(
        _loop_choice={},
        _kinds=(GroupKind.FULL_ATTENTION,),
        _reblock=1,
        _state_cuts=(),
        _ratio=SimpleNamespace(source=16, differs=False, grow=1, staged=False),
    )
    made = connector._Worker(owner, "unix:/nonexistent/kvxfer.sock", None)  # never dialled
    made._client.close()
    made._client = client
    made.layout = SimpleNamespace(
        tp_size=1, block_size=16, groups=(SimpleNamespace(num_kv_heads=None),)
    )
    made._local_block = 16  # what `register` sets from the engine's block size
    return made


def order() -> connector.PullOrder:
    spans = (BlockSpan(GroupId(0), 0, (BlockId(1), BlockId(2))),)
    params = TransferParams("127.0.0.1:5000", "engine-1", 3, 0, "req-7", 32, spans)
    return connector.PullOrder("decode-7", params_to_dict(params), ([4, 5],), 0)


def steps(made: Any, count: int) -> list[dict[str, list[str]]]:
    """`count` engine steps of the worker: what each reported received and failed."""
    seen = []
    for _ in range(count):
        results = made.results(set())
        seen.append(
            {
                "recving": sorted(results.finished_recving or ()),
                "failed": sorted(results.failed_recving or ()),
            }
        )
    return seen


def unanswered_pull(aborts: list[AbortState | Exception], then_done: bool) -> dict[str, Any]:
    client = FaultyClient(PeerUnavailableError("Pull: no answer within 5s"), aborts)
    made = worker(client)
    made.pull(order())
    seen = steps(made, 3)
    if then_done:  # the sidecar had taken it: its PullDone comes once its reads ended
        failed = {0: (0, 1)}
        made._events.put(PullDone("req-7", PullStatus.ABORTED, failed, 0, 0, 0.1, "aborted"))
        seen += steps(made, 1)
    return {"steps": seen, "aborted": client.aborted}


def refused_pull() -> dict[str, Any]:
    client = FaultyClient(InvalidInputError("params.epoch", "stale"), [])
    made = worker(client)
    made.pull(order())
    return {"steps": steps(made, 1), "aborted": client.aborted}


def answered_late(answer: PullAccepted | Exception, done_first: bool) -> dict[str, Any]:
    """A Pull whose answer comes steps after the pull started (the step does not wait for
    it), and with `done_first` only after its PullDone."""
    client = FaultyClient(None, [])
    made = worker(client)
    made.pull(order())  # returns with the call unanswered
    seen = steps(made, 2)  # nothing is decided meanwhile: vLLM keeps the blocks
    if done_first:
        made._events.put(PullDone("req-7", PullStatus.OK, {}, 32, 4096, 0.1, ""))
        seen += steps(made, 1)
    if isinstance(answer, Exception):
        client.answers[0].set_exception(answer)
    else:
        client.answers[0].set_result(answer)
    seen += steps(made, 2)
    return {"steps": seen, "aborted": client.aborted, "waiting": sorted(made._pulls)}


def same_publication_twice() -> dict[str, Any]:
    """Two requests pulling one publication at once (a retried or hedged decode): the
    second fails at once, without a call, and the first's PullDone ends the first
    (PullDone and Abort are keyed by the publication, not by vLLM's request)."""
    client = FaultyClient(None, [])
    made = worker(client)
    made.pull(order())
    made.pull(replace(order(), request_id="decode-8", block_ids=([9, 10],)))
    seen = steps(made, 1)
    client.answers[0].set_result(ACCEPTED)
    made._events.put(PullDone("req-7", PullStatus.OK, {}, 32, 4096, 0.1, ""))
    seen += steps(made, 2)
    return {"steps": seen, "pulled": client.pulled, "waiting": sorted(made._pulls)}


def gone_sidecar() -> dict[str, Any]:
    """A worker whose event watch saw its sidecar go (SIDECAR_LOST) with a pull it is
    unsure of: that pull fails, and every later one fails at once, calling nothing (a
    call would block vLLM's step for the connect timeout and never be answered)."""
    client = FaultyClient(PeerUnavailableError("Pull: no answer within 5s"), [])
    made = worker(client)
    made.pull(order())  # no answer: unsure, vLLM keeps its blocks
    made._events.put(connector.SIDECAR_LOST)
    seen = steps(made, 1)
    made.pull(order())
    seen += steps(made, 2)
    return {"steps": seen, "pulled": client.pulled, "aborted": client.aborted}


def publish_request(made: Any, name: str) -> list[Any]:
    request = SimpleNamespace(
        request_id=name,
        status=connector.RequestStatus.FINISHED_LENGTH_CAPPED,
        num_computed_tokens=32,
        num_prompt_tokens=32,
        kv_transfer_params={"do_remote_decode": True},
    )
    return list(made.publish(request, ([1, 2],)))


def silent_publisher() -> dict[str, Any]:
    """A prefill scheduler whose sidecar does not answer Publish: the finished requests
    after the first are not handed off (and do not wait on it) until the pause ends. The
    pause doubles while the sidecar stays silent, and is back to the first once a
    Publish is answered."""
    client = FaultyClient(PeerUnavailableError("unused"), [], PeerUnavailableError("no answer"))
    owner = SimpleNamespace(
        _tp_size=1,
        _state_cuts=(),
        _kinds=(GroupKind.FULL_ATTENTION,),
        _vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 8)
        ),
    )
    made = connector._Scheduler(owner, "unix:/nonexistent/kvxfer.sock")
    made._clients[0] = client
    answers, pauses = [], []
    for name in ("p-1", "p-2", "p-3", "p-4", "p-5", "p-6"):
        if name in ("p-3", "p-4", "p-5", "p-6"):
            made._paused_until = 0.0  # the pause is over
        if name == "p-5":
            client.publish_error = None  # the sidecar answers again
        if name == "p-6":
            client.publish_error = PeerUnavailableError("no answer")
        answers.append(publish_request(made, name)[:1])
        pauses.append(round(max(made._paused_until - time.monotonic(), 0.0)))
    return {"answers": answers, "called": client.published, "pauses": pauses}


def scheduler(params: object) -> dict[str, Any]:
    """The scheduler's calls for one decode request, with `params` from the router."""
    made = object.__new__(connector.KvxferConnector)
    held: list[str] = []
    unheld: list[str] = []
    made._scheduler = SimpleNamespace(
        pending=[],
        hold=lambda request: held.append(request.request_id),
        holder=SimpleNamespace(remove=unheld.append),
    )
    made._has_state = False
    request = SimpleNamespace(request_id="r-1", kv_transfer_params=params, num_prompt_tokens=64)
    connector.KvxferConnector.on_new_request(made, request)
    matched = connector.KvxferConnector.get_num_new_matched_tokens(made, request, 0)
    finished = connector.KvxferConnector.request_finished_all_groups(made, request, ([],))
    return {
        "matched": list(matched),
        "finished": [finished[0], finished[1]],
        "pending": len(made._scheduler.pending),
        "params_after": request.kv_transfer_params,
        "held": held,
        "unheld": unheld,
    }


def held_by_the_real_scheduler(peer_address: object) -> dict[str, Any]:
    """on_new_request through the real `_Scheduler.hold` (its holder never gets to call
    anyone: the sidecar address leads nowhere), with router params whose peer_address is
    not a string, all else valid."""
    owner = SimpleNamespace(_tp_size=1, _state_cuts=(), _kinds=())
    made = object.__new__(connector.KvxferConnector)
    made._has_state = False
    made._scheduler = connector._Scheduler(owner, "unix:/nonexistent/kvxfer.sock")
    params = {**order().params, "peer_address": peer_address}
    request = SimpleNamespace(
        request_id="r-1",
        kv_transfer_params={"do_remote_prefill": True, KEY: params},
        num_prompt_tokens=64,
    )
    try:
        connector.KvxferConnector.on_new_request(made, request)
        raised = None
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    finally:
        waiting = made._scheduler.holder.waiting()
        made._scheduler.close()
    return {"raised": raised, "waiting": waiting}


def main() -> None:
    connector._UNSURE_RETRY_S = 0.0  # ask again at the next step
    good = order().params
    report = {
        "taken": unanswered_pull([AbortState.PULLING], then_done=True),
        "not_taken": unanswered_pull([NotFoundError("Abort: no request 'req-7'")], False),
        "silent_then_not_taken": unanswered_pull(
            [PeerUnavailableError("Abort: no answer"), NotFoundError("no 'req-7'")], False
        ),
        "refused": refused_pull(),
        "late": {
            "accepted_after_done": answered_late(ACCEPTED, done_first=True),
            "refused": answered_late(InvalidInputError("params.epoch", "stale"), False),
            "accepted": answered_late(ACCEPTED, done_first=False),
        },
        "silent_publisher": silent_publisher(),
        "gone_sidecar": gone_sidecar(),
        "same_publication_twice": same_publication_twice(),
        "schedule": {
            "good": scheduler({"do_remote_prefill": True, KEY: good}),
            "empty_part": scheduler({"do_remote_prefill": True, KEY: {}}),
            "list_part": scheduler({"do_remote_prefill": True, KEY: []}),
            "text_tokens": scheduler({"do_remote_prefill": True, KEY: {"num_tokens": "32"}}),
            "not_an_object": scheduler(["do_remote_prefill"]),
        },
        "held_bad_address": [held_by_the_real_scheduler(v) for v in (None, 5000, ["a:1"])],
    }
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
