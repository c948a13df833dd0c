"""`kvxfer.wire.loops`: the loop kvxfer runs where it picks one (sidecar, the engine
client's thread, kvxfer-cli). uvloop by default, asyncio on request, and a loop that
cannot be had is an error naming the setting, never a quiet fallback."""

from __future__ import annotations

import asyncio
import sys

import pytest

from kvxfer._exceptions import KvxferError
from kvxfer.client.engine import SyncEngineClient
from kvxfer.wire.loops import DEFAULT_EVENT_LOOP, loop_factory, loop_name


@pytest.mark.parametrize("name", ["uvloop", "asyncio"])
def test_each_loop_runs_and_says_what_it_is(name: str) -> None:
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        assert runner.run(_running_loop_name()) == name


async def _running_loop_name() -> str:
    await asyncio.sleep(0)
    return loop_name(asyncio.get_running_loop())


def test_an_unknown_or_missing_loop_is_an_error_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(KvxferError, match="event_loop: 'trio' is not uvloop or asyncio"):
        loop_factory("trio")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    with pytest.raises(KvxferError, match=r"event_loop: uvloop cannot be imported.*asyncio"):
        loop_factory("uvloop")
    assert loop_factory("asyncio") is asyncio.new_event_loop


@pytest.mark.parametrize("name", ["uvloop", "asyncio", None])
def test_the_sync_engine_client_runs_its_calls_on_the_loop_it_is_given(
    tmp_path: object, name: str | None
) -> None:
    """What the vLLM connector calls through: its thread's loop is kvxfer's choice,
    uvloop unless told otherwise."""
    chosen = {} if name is None else {"event_loop": name}
    client = SyncEngineClient(f"unix:{tmp_path}/absent.sock", connect_timeout_s=0.1,
                              **chosen)  # type: ignore[arg-type]  # fmt: skip
    try:
        assert client._run(_running_loop_name()) == (name or DEFAULT_EVENT_LOOP)
    finally:
        client.close()
    assert DEFAULT_EVENT_LOOP == "uvloop"
