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
    # Two pulls at 0 and 10 ms; the decode sidecar writes twice in the first (a REPLY,
    # then the ITEM: the second write is "#2"), once in the second; a process that
    # traced no pull step is left out, and so is what comes after a pull's PullDone.
    _write(tmp_path / "1.log", [
        (0, "engine.pull>"), (300 * us, "engine.pull<"), (900 * us, "engine.event>"),
        (10_000 * us, "engine.pull>"), (10_700 * us, "engine.event>"),
    ])  # fmt: skip
    _write(tmp_path / "2.log", [
        (100 * us, "decode.Pull>"), (200 * us, "lane.write.REPLY>"),
        (500 * us, "decode.post>@nixl"), (800 * us, "lane.write.ITEM>"),
        (950 * us, "lane.write.ERROR>"),
        (10_100 * us, "decode.Pull>"), (10_600 * us, "lane.write.ITEM>"),
    ])  # fmt: skip
    _write(tmp_path / "3.log", [(50 * us, "lane.read.UNARY>")])

    events = tp.read_logs(tmp_path)
    assert {e.role for e in events} == {"engine", "decode"}
    traced = tp.pulls(events)
    assert [len(p) for p in traced] == [7, 4]
    assert "decode lane.write.ERROR>" not in {e.point for p in traced for e in p}

    steps = {s.point: (s.median_us, s.pulls) for s in tp.timeline(traced)}
    assert steps["engine.pull>"] == (0.0, 2)
    assert steps["decode.Pull>"] == (100.0, 2)
    assert steps["decode lane.write.ITEM>"] == (700.0, 2)  # 800 and 600 us after the call
    assert steps["engine.event>"] == (800.0, 2)  # 900 and 700 us
    # In one pull of two (under 80%): left out.
    assert "decode lane.write.REPLY>" not in steps and "decode.post>@nixl" not in steps
    assert next(s.point for s in tp.timeline(traced)) == "engine.pull>"


def test_a_step_passed_twice_in_a_pull_is_two_steps() -> None:
    tp = _trace_pull()
    pull = [
        tp.Event(0, "engine", "engine.pull>"),
        tp.Event(100_000, "decode", "decode lane.write.REPLY>"),
        tp.Event(400_000, "decode", "decode lane.write.REPLY>"),
        tp.Event(500_000, "engine", "engine.event>"),
    ]
    steps = [(s.point, s.median_us) for s in tp.timeline([pull])]
    assert steps == [
        ("engine.pull>", 0.0),
        ("decode lane.write.REPLY>", 100.0),
        ("decode lane.write.REPLY>#2", 400.0),
        ("engine.event>", 500.0),
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
        pull.append(tp.Event(start + 500_000, "engine", "engine.event>"))
        pulls.append(pull)
    steps = tp.timeline(pulls)
    assert [s.point for s in steps] == ["engine.pull>", "decode.Pull>", "engine.event>"]
    assert steps[1].median_us == 103.5 and steps[1].pulls == 8


def _python(code: str, trace_dir: Path | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(BENCHMARKS / "pull_trace")
    if trace_dir is not None:
        env["PULL_TRACE_DIR"] = str(trace_dir)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip


def test_the_tracer_wraps_every_step_it_names_and_records_their_calls(tmp_path: Path) -> None:
    code = """
import json
from kvxfer.client import engine
from kvxfer.dataplane import adapter, executor
from kvxfer.server import lane, peers, pulls, servicers
wrapped = [
    engine.EngineClient.pull, engine.event_from_proto, lane._Connection._dispatch,
    lane._Connection._send, servicers.EngineServicer.Pull, pulls.execute_plan,
    adapter.NixlAgent.post_all, adapter.NixlAgent._post, executor._at_once,
    peers.PeerLinks.begin_read, servicers.PeerServicer.BeginRead,
]
print(json.dumps([hasattr(f, "__pull_trace__") for f in wrapped]))
from kvxfer.v1 import sidecar_pb2 as pb
engine.event_from_proto(pb.WatchEventsResponse(pull_done=pb.PullDone(request_id="r")))
"""
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == [True] * 11
    (log,) = tmp_path.glob("*.log")
    points = [line.split()[1] for line in log.read_text().splitlines()]
    assert points == ["engine.event>", "engine.event<"]


def test_the_tracer_does_nothing_unless_told_where_to_write() -> None:
    done = _python(
        "from kvxfer.server import servicers; "
        "print(hasattr(servicers.EngineServicer.Pull, '__pull_trace__'))",
        None,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_a_step_the_tracer_cannot_find_fails_its_install(tmp_path: Path) -> None:
    code = """
from kvxfer.server import pulls
del pulls.execute_plan
import sitecustomize
try:
    sitecustomize.install()
except AttributeError as exc:
    print("refused:", exc)
"""
    done = _python(code, None)  # not installed at start-up: installed here, once
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "execute_plan" in done.stdout


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
        "decode lane.read.UNARY>",
        "decode.Pull>",
        "decode.post_all>",
        "decode.post>@nixl",
        "decode.post<@nixl",
        "decode.outcome<",
        "decode lane.write.ITEM>",
        "engine.event>",
    ]
    assert [at[p] for p in causal] == sorted(at[p] for p in causal), at
    assert at["prefill.BeginRead>"] < at["decode.begin_read<"], at
