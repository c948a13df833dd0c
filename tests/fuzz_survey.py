"""Survey of the fuzz tier: every (RPC, kind of body), N bodies each, tabulated.

The tier itself (tests/test_fuzz.py) stops at the first bad answer of each
test; this runs the same bodies against the same fleet without stopping and
prints, per RPC and kind, how many answers were UNKNOWN/INTERNAL (and with
which message) and how many tracebacks the sidecar logged, as figures for
docs/reliability.md. Run as root from the repository:
    .venv/bin/python tests/fuzz_survey.py [BODIES_PER_CASE]
"""

from __future__ import annotations

import collections
import sys
import tempfile
import time
from pathlib import Path

import grpc
from fuzz_bodies import KINDS, bodies
from hypothesis import HealthCheck, Phase, given, settings
from test_fuzz import BAD_CODES, TARGETS, LogTail, Target, call, running_fleet


def survey(n: int) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="kvxfer-fuzz-") as tmp,
        running_fleet(Path(tmp)) as fleet,
    ):
        total = 0
        start = time.monotonic()
        print("| RPC | kind | bodies | UNKNOWN/INTERNAL | tracebacks | answers |")
        print("|---|---|---|---|---|---|")
        for target in TARGETS:
            for kind in KINDS:
                total += n
                print(_case(fleet, target, kind, n), flush=True)
        alive = fleet.p.popen.poll() is None
        print(f"\n{total} bodies in {time.monotonic() - start:.0f} s; sidecar alive: {alive}")


def _case(fleet, target: Target, kind: str, n: int) -> str:  # type: ignore[no-untyped-def]
    address = fleet.p.ready["engine_address"] if target.port == "engine" else fleet.peer_address
    log = LogTail(fleet.p.log)
    bad: collections.Counter[str] = collections.Counter()
    tracebacks = 0

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(bodies(target.request, fleet.vocabulary, kind))
    def one(body: bytes) -> None:
        nonlocal tracebacks
        code, details = call(channel, target, body)
        if code in BAD_CODES:
            bad[f"{code.name} {details[:70]!r}"] += 1
        tracebacks += log.new_text().count("Traceback")

    with grpc.insecure_channel(address) as channel:
        one()
    answers = "; ".join(f"{count}x {what}" for what, count in bad.most_common(3))
    return f"| {target} | {kind} | {n} | {sum(bad.values())} | {tracebacks} | {answers} |"


if __name__ == "__main__":
    survey(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
