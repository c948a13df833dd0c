"""kvxfer's vLLM connector when its sidecar or its router misbehave (the scenarios run
under .venv-vllm in tests/vllm_connector_faults.py, which imports vLLM's connector API).

- A Pull call with no answer (a deadline, a lost connection) may have been taken by the
  sidecar, whose reads could still land in the request's blocks: the request stays
  receiving (vLLM keeps its blocks) until the sidecar says. It is asked to abort the
  pull; it took it (its PullDone ends the request, failed), or it knows no such pull
  (received, failed, at once), or it does not answer (asked again). A refused Pull
  took nothing: failed at once, nothing asked. The step that starts a pull does not
  wait for the answer, which may come after the pull's PullDone.
- A sidecar that does not answer a Publish would hold vLLM's scheduler for the call's
  deadline on every finished request: after one, nothing is published for a while
  (those requests are not handed off; their decode prefills them), twice as long after
  each that goes unanswered.
- A sidecar that is gone (the worker's event watch saw it) fails the pulls waiting on
  it, and every later pull at once, without a call.
- Malformed kv_transfer_params from the router reach vLLM's scheduler, where anything
  raised would end the engine with every request on it: the request is prefilled
  locally instead, its params marked as pulling nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_harness import run_script

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
NOTHING: dict[str, list[str]] = {"recving": [], "failed": []}
FAILED = {"recving": ["decode-7"], "failed": ["decode-7"]}


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    got: dict[str, Any] = run_script(HERE / "vllm_connector_faults.py", None, timeout_s=300)
    return got


def test_an_unanswered_pull_the_sidecar_took_ends_with_its_pulldone(
    report: dict[str, Any],
) -> None:
    taken = report["taken"]
    assert taken["aborted"] == ["req-7"]  # asked once, and it said it was pulling
    assert taken["steps"][:3] == [NOTHING] * 3  # vLLM keeps the blocks meanwhile
    assert taken["steps"][3] == FAILED


def test_an_unanswered_pull_the_sidecar_never_took_fails_once_it_says_so(
    report: dict[str, Any],
) -> None:
    assert report["not_taken"] == {"steps": [FAILED, NOTHING, NOTHING], "aborted": ["req-7"]}
    silent = report["silent_then_not_taken"]
    assert silent["aborted"] == ["req-7", "req-7"]
    assert silent["steps"] == [NOTHING, FAILED, NOTHING]


def test_a_refused_pull_fails_at_once_and_asks_nothing(report: dict[str, Any]) -> None:
    assert report["refused"] == {"steps": [FAILED], "aborted": []}


def test_a_pull_is_not_waited_for_and_its_answer_may_come_after_its_pulldone(
    report: dict[str, Any],
) -> None:
    late = report["late"]
    received = {"recving": ["decode-7"], "failed": []}
    # vLLM's step returns before the sidecar answers; the request is decided by what comes.
    done_first = late["accepted_after_done"]
    assert done_first["steps"] == [NOTHING, NOTHING, received, NOTHING, NOTHING]
    assert done_first["waiting"] == [] and done_first["aborted"] == []
    # Refused after the step: it took nothing, so the request fails at the next step.
    assert late["refused"]["steps"] == [NOTHING, NOTHING, FAILED, NOTHING]
    assert late["refused"]["waiting"] == [] and late["refused"]["aborted"] == []
    # Accepted with no PullDone yet: still receiving, its PullDone will end it.
    assert late["accepted"]["steps"] == [NOTHING] * 4
    assert late["accepted"]["waiting"] == ["req-7"] and late["accepted"]["aborted"] == []


def test_a_second_request_pulling_the_same_publication_fails_alone(
    report: dict[str, Any],
) -> None:
    twice = report["same_publication_twice"]
    second = {"recving": ["decode-8"], "failed": ["decode-8"]}
    first = {"recving": ["decode-7"], "failed": []}
    assert twice["steps"] == [second, first, NOTHING]
    assert twice["pulled"] == ["req-7"]  # the second never reached the sidecar
    assert twice["waiting"] == []


def test_malformed_params_are_prefilled_locally_not_raised(report: dict[str, Any]) -> None:
    schedule = report["schedule"]
    good = schedule["good"]
    assert good["matched"] == [32, True] and good["pending"] == 1  # released when aborted
    # held from the moment vLLM hands it over until it finishes (vllm_hold)
    assert good["held"] == good["unheld"] == ["r-1"]
    for case in ("empty_part", "list_part", "text_tokens"):
        bad = schedule[case]
        assert bad["matched"] == [0, False] and bad["pending"] == 0, (case, bad)
        assert bad["held"] == [], (case, bad)  # nothing to keep for a request prefilled here
        assert bad["finished"] == [False, None], (case, bad)
        assert bad["params_after"]["do_remote_prefill"] is False, (case, bad)
    other = schedule["not_an_object"]
    assert other["matched"] == [0, False] and other["params_after"] is None
    # A peer_address that is no string passes the token count: holding it must not raise
    # out of add_request (it ended the engine); it is not held, and its pull names it.
    assert report["held_bad_address"] == [{"raised": None, "waiting": []}] * 3


def test_after_an_unanswered_publish_the_scheduler_does_not_wait_on_each_request(
    report: dict[str, Any],
) -> None:
    silent = report["silent_publisher"]
    # none handed off but p-5, answered; p-2 came during the first pause: not called
    assert silent["answers"] == [[False]] * 4 + [[True], [False]]
    assert silent["called"] == ["p-1", "p-3", "p-4", "p-5", "p-6"]
    # a pause twice as long each time the sidecar is still silent, back to 5 s once answered
    assert silent["pauses"] == [5, 5, 10, 20, 0, 5]


def test_once_the_sidecar_is_gone_pulls_fail_at_once_and_call_nothing(
    report: dict[str, Any],
) -> None:
    gone = report["gone_sidecar"]
    # The unsure pull fails with the loss; the later one at its own step, not parked.
    assert gone["steps"] == [FAILED, FAILED, NOTHING]
    assert gone["pulled"] == ["req-7"]  # only the pull from before the loss was called
    assert gone["aborted"] == []  # and the sidecar is not asked again about it
