"""32k-token gpt-oss-20b requests for the freeze, thaw and shutdown tests.

Group 1 (full attention) moves every block of a request; group 0 (sliding
window of 128 tokens) only its last few, so the engines need few window
blocks (`SIZES`) and most of a pull is one long full-attention read.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sidecars import EngineSim, Events, being_read, engine_link, spans, start_engine, start_sidecar

from kvxfer.cli.fleet import Proc
from kvxfer.client.engine import EngineClient
from kvxfer.core.layout import BlockSpan

MODEL = "gpt-oss-20b"
B = 16
TOKENS = 32 * 1024
PER_REQUEST = TOKENS // B
WINDOW_BLOCKS = 10  # covers the 128-token window of group 0 at any alignment
SIZES = ("--sliding-blocks", str(2 * WINDOW_BLOCKS))


def request_spans(i: int, *, blocks: int = PER_REQUEST, reverse: bool = False) -> list[BlockSpan]:
    """Spans of request `i` of `blocks` blocks: every full-attention block, the window's
    last blocks. `reverse` lays the same ids out backwards (a decode side's choice)."""
    ids = list(range(i * PER_REQUEST, i * PER_REQUEST + blocks))
    window = list(range(i * WINDOW_BLOCKS, (i + 1) * WINDOW_BLOCKS))
    if reverse:
        ids, window = ids[::-1], window[::-1]
    return spans({1: ids}) + spans({0: window}, first=blocks - WINDOW_BLOCKS)


@dataclass
class Pair:
    p: Proc
    d: Proc
    pe: EngineSim
    de: EngineSim
    p_client: EngineClient
    d_client: EngineClient
    p_events: Events
    d_events: Events


@contextlib.asynccontextmanager
async def reads_under_way(
    tmp: Path, tag: str, *, p_args: Sequence[str] = (), d_args: Sequence[str] = (), count: int = 2
) -> AsyncIterator[Pair]:
    """A prefill and a decode sidecar with engines; `count` 32k-token requests published
    as TAG-0.. and pulled, yielded once the last one's read has begun at the prefill."""
    p = start_sidecar(tmp, "p", *p_args)
    procs: list[Proc | EngineSim] = [p]
    try:
        d = start_sidecar(tmp, "d", *d_args)
        procs.append(d)
        pe = start_engine(tmp, p, MODEL, "prefill", *SIZES, num_blocks=count * PER_REQUEST)
        procs.append(pe)
        de = start_engine(tmp, d, MODEL, "decode", *SIZES, num_blocks=count * PER_REQUEST)
        procs.append(de)
        async with engine_link(p, pe) as (pc, p_events), engine_link(d, de) as (dc, d_events):
            for i in range(count):
                params = await pc.publish(f"{tag}-{i}", TOKENS, request_spans(i))
                await dc.pull(params, request_spans(i, reverse=True), 0)
            await being_read(p, f"{tag}-{count - 1}")  # a pull is accepted before it reads
            yield Pair(p, d, pe, de, pc, dc, p_events, d_events)
    finally:
        for proc in reversed(procs):
            proc.stop()
