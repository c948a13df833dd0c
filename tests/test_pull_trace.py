"""benchmarks/trace_pull.py: a pull's steps lined up across processes, and the tracer
finding every step it wraps (a renamed step breaks this test, not the profile)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _trace_pull() -> ModuleType:
    if str(BENCHMARKS) not in sys.path:  # its sibling bench_child.py, as when run
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("trace_pull", BENCHMARKS / "trace_pull.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["trace_pull"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _write(path: Path, lines: list[tuple[int, str]]) -> None:
    path.write_text("".join(f"{ns} {point}\n" for ns, point in lines))


def test_the_timeline_lines_up_each_pull_from_its_call_to_its_pulldone(tmp_path: Path) -> None:
    tp = _trace_pull()
    us = 1000
    # Two pulls at 0 and 10 ms. The first has a REPLY written that the second lacks;
    # a process that traced no pull step is left out, and so is what follows a pull's
    # PullDone (an event of another kind does not end it).
    _write(tmp_path / "1.log", [
        (0, "engine.pull>"), (300 * us, "engine.pull<"),
        (400 * us, "engine.event.released>"), (900 * us, "engine.event.pull_done>"),
        (10_000 * us, "engine.pull>"), (10_700 * us, "engine.event.pull_done>"),
    ])  # fmt: skip
    _write(tmp_path / "2.log", [
        (100 * us, "decode.Pull>"), (200 * us, "lane.write.REPLY.Pull>"),
        (500 * us, "decode.post>@nixl"), (800 * us, "lane.write.ITEM.WatchEvents>"),
        (950 * us, "lane.write.ERROR.Abort>"),
        (10_100 * us, "decode.Pull>"), (10_600 * us, "lane.write.ITEM.WatchEvents>"),
    ])  # fmt: skip
    _write(tmp_path / "3.log", [(50 * us, "lane.read.UNARY.Publish>")])

    events = tp.read_logs(tmp_path)
    assert {e.role for e in events} == {"engine", "decode"}
    traced = tp.pulls(events)
    assert [len(p) for p in traced] == [8, 4]
    assert "decode lane.write.ERROR.Abort>" not in {e.point for p in traced for e in p}

    steps = {s.point: s for s in tp.timeline(traced)}
    assert list(steps) == [
        "engine.pull>", "decode.Pull>", "decode lane.write.ITEM.WatchEvents>",
        "engine.event.pull_done>",
    ]  # fmt: skip
    assert (steps["decode.Pull>"].median_us, steps["decode.Pull>"].pulls) == (100.0, 2)
    # 800 and 600 us after the call; 700 and 500 us after decode.Pull> in each pull.
    write = steps["decode lane.write.ITEM.WatchEvents>"]
    assert (write.median_us, write.step_us) == (700.0, 600.0)
    done = steps["engine.event.pull_done>"]
    assert (done.median_us, done.step_us) == (800.0, 100.0)  # 900 and 700; 100 after each write
    assert tp.missing(list(steps.values())) == ["decode.post>@nixl", "decode.post<@nixl"]


def test_a_step_passed_twice_in_a_pull_is_two_steps() -> None:
    tp = _trace_pull()
    pull = [
        tp.Event(0, "engine", "engine.pull>"),
        tp.Event(100_000, "prefill", "prefill lane.read.UNARY.Heartbeat>"),
        tp.Event(400_000, "prefill", "prefill lane.read.UNARY.Heartbeat>"),
        tp.Event(500_000, "engine", "engine.event.pull_done>"),
    ]
    steps = [(s.point, s.median_us, s.step_us) for s in tp.timeline([pull])]
    assert steps == [
        ("engine.pull>", 0.0, 0.0),
        ("prefill lane.read.UNARY.Heartbeat>", 100.0, 100.0),
        ("prefill lane.read.UNARY.Heartbeat>#2", 400.0, 300.0),
        ("engine.event.pull_done>", 500.0, 100.0),
    ]


def test_a_step_most_pulls_passed_is_shown_at_its_median() -> None:
    tp = _trace_pull()
    pulls = []
    for i in range(10):
        start = i * 1_000_000
        pull = [tp.Event(start, "engine", "engine.pull>")]
        if i < 8:  # 8 of 10 pulls pass it: at the 80% line, shown
            pull.append(tp.Event(start + (100 + i) * 1000, "decode", "decode.Pull>"))
        if i < 7:  # 7 of 10: not
            pull.append(tp.Event(start + 150_000, "decode", "decode.outcome>"))
        pull.append(tp.Event(start + 500_000, "engine", "engine.event.pull_done>"))
        pulls.append(pull)
    steps = tp.timeline(pulls)
    assert [s.point for s in steps] == ["engine.pull>", "decode.Pull>", "engine.event.pull_done>"]
    assert steps[1].median_us == 103.5 and steps[1].pulls == 8
    # Since decode.Pull>, in the 8 pulls that passed it: 400-393 us, median 396.5.
    assert steps[2].step_us == 396.5 and steps[2].median_us == 500.0


def _python(code: str, trace_dir: Path | None, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`code` in a new interpreter with the tracer on its path, run in `cwd` (outside the
    checkout, whose kvxfer/ lacks the server and client the installed one has)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PULL_TRACE_DIR")}
    env["PYTHONPATH"] = str(BENCHMARKS / "pull_trace")
    if trace_dir is not None:
        env["PULL_TRACE_DIR"] = str(trace_dir)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
        check=False, cwd=cwd,
    )  # fmt: skip


STEPS = """
from kvxfer.client import engine
from kvxfer.dataplane import adapter, executor
from kvxfer.server import lane, peers, pulls, servicers, sidecar
steps = [
    engine.EngineClient.pull, engine.event_from_proto, lane._Connection._dispatch,
    lane._Connection._send, servicers.EngineServicer.Pull, servicers.params_from_proto,
    sidecar.plan_transfer, pulls.execute_plan, executor.handle_jobs,
    adapter.NixlAgent.post_all, adapter.NixlAgent._post, executor._at_once,
    peers.PeerLinks.begin_read, servicers.PeerServicer.BeginRead,
]
"""


def test_the_tracer_wraps_every_step_and_changes_nothing_they_do(tmp_path: Path) -> None:
    code = (
        STEPS
        + """
import inspect, json
print(json.dumps([hasattr(f, "__pull_trace__") for f in steps]))
print(json.dumps([inspect.iscoroutinefunction(f) for f in steps]))
from kvxfer.v1 import sidecar_pb2 as pb
done = engine.event_from_proto(pb.WatchEventsResponse(pull_done=pb.PullDone(request_id="r")))
print(type(done).__name__, done.request_id)
try:
    engine.event_from_proto(pb.WatchEventsResponse())
except Exception as exc:
    print(type(exc).__name__)
"""
    )
    done = _python(code, tmp_path, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    marked, coroutines, event, raised = done.stdout.splitlines()
    assert json.loads(marked) == [True] * 14
    # The async steps are still coroutine functions (gRPC aio tells its handlers apart
    # by that), the others are not.
    async_steps = [True, False, False, False, True, False, False, False, False, False, False,
                   True, True, True]  # fmt: skip
    assert json.loads(coroutines) == async_steps
    assert event == "PullDone r"  # what it returned, unchanged
    assert raised == "InvalidInputError"  # what it raised, unchanged
    (log,) = tmp_path.glob("*.log")
    points = [line.split()[1] for line in log.read_text().splitlines()]
    assert points == [
        "engine.event.pull_done>", "engine.event.pull_done<",
        "engine.event.None>", "engine.event.None<",
    ]  # fmt: skip


def test_the_tracer_does_nothing_unless_told_where_to_write(tmp_path: Path) -> None:
    done = _python(
        STEPS + "print(any(hasattr(f, '__pull_trace__') for f in steps))", None, tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_a_step_the_tracer_cannot_find_fails_its_whole_install(tmp_path: Path) -> None:
    install = f"""
del pulls.execute_plan
import sitecustomize
try:
    sitecustomize.install({str(tmp_path)!r})
except AttributeError as exc:
    print("refused:", exc)
print(any(hasattr(f, "__pull_trace__") for f in steps))
"""
    done = _python(STEPS + install, None, tmp_path)  # not installed at start-up: here
    assert done.returncode == 0, done.stderr[-2000:]
    refused, wrapped = done.stdout.splitlines()
    assert refused.startswith("refused:") and "execute_plan" in refused
    assert wrapped == "False"  # none of the others was wrapped either
    assert not list(tmp_path.glob("*.log"))  # nor a log opened


@pytest.mark.nixl
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_traced_bench_lines_up_a_pulls_steps_in_causal_order(tmp_path: Path) -> None:
    """The real thing: a short bench with every process traced. Whatever the machine's
    speed, each step comes after the one that causes it."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "trace_pull.py"), "--size", "16", "--repeat", "6",
         "--skip", "2", "--json"],
        capture_output=True, text=True, timeout=170, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["model"] == "gpt-oss-20b" and report["tokens"] == 16
    assert report["pulls"] >= 4
    at = {step["point"]: step["median_us"] for step in report["steps"]}
    causal = [
        "engine.pull>",
        "decode lane.read.UNARY.Pull>",
        "decode.Pull>",
        "decode.params_from_proto>",
        "decode.plan_transfer>",
        "decode.execute_plan>",
        "decode.bind>",
        "decode.post_all>",
        "decode.post>@nixl",
        "decode.post<@nixl",
        "decode.outcome<",
        "decode lane.write.ITEM.WatchEvents>",
        "engine.event.pull_done>",
    ]
    assert [at[p] for p in causal] == sorted(at[p] for p in causal), at
    # Pull's answer waits for the post (the copy starts first); it races the copy's end.
    assert at["decode.post>@nixl"] < at["decode.Pull<"], at
    begin = ["decode.begin_read>", "prefill.BeginRead>", "decode.begin_read<"]
    assert [at[p] for p in begin] == sorted(at[p] for p in begin), at
    assert at["decode.begin_read<"] < at["decode lane.write.ITEM.WatchEvents>"], at
