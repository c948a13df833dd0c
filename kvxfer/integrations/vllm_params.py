"""What the vLLM connector puts in `kv_transfer_params`, and how a pull's outcome
becomes vLLM's recompute instructions. Pure: no vLLM, no gRPC.

`kv_transfer_params` travel as JSON through the router (prefill's request
output -> decode's request), so transfer params become a plain dict under the
key "kvxfer" and are validated again by the domain constructors when read
back; a bad dict is an InvalidInputError/LayoutError naming the field.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from kvxfer._exceptions import InvalidInputError
from kvxfer.core.layout import BlockId, BlockSpan, GroupId, StateShard
from kvxfer.core.requests import PullDone, PullStatus, TransferParams
from kvxfer.core.tp_map import head_sources, state_pieces

NULL_BLOCK = 0  # vLLM's BlockPool reserves block 0 as the null block

KEY = "kvxfer"
# The prefill request's kv_transfer_params field naming the decode engine's TP size
# (default: the prefill's own): a prefill rank publishes once per decode rank it serves.
DECODE_TP = "decode_tp_size"
_PUBLICATION = re.compile(r"(?P<request>.+)~p(?P<source>\d+)d(?P<reader>\d+)of(?P<readers>\d+)")


EVENT_LOOPS = ("uvloop", "asyncio")


def connector_event_loop(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The `event_loop` of the connector's `kv_connector_extra_config` as keyword
    arguments for its sidecar clients: none given, kvxfer's default (uvloop)."""
    loop = extra.get("event_loop")
    if loop is None:
        return {}
    if loop not in EVENT_LOOPS:
        raise InvalidInputError(
            "kv_connector_extra_config.event_loop", f"{loop!r} is not one of {EVENT_LOOPS}"
        )
    return {"event_loop": loop}


def pulled_tokens(params: object) -> int | None:
    """The prompt tokens a decode request's `kv_transfer_params` say its prefill computed,
    or None when they ask for no pull (no `do_remote_prefill`, or no kvxfer part). What
    vLLM's scheduler reads of them: anything it raised there would end the engine, so a
    malformed part is an InvalidInputError naming the field, which the connector turns
    into a local prefill. The rest is checked when the worker pulls (`rank_params`)."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise InvalidInputError(
            "kv_transfer_params", f"must be an object, got {type(params).__name__}"
        )
    if not params.get("do_remote_prefill") or KEY not in params:
        return None
    value = params[KEY]
    if not isinstance(value, Mapping):
        raise InvalidInputError(
            f"kv_transfer_params.{KEY}", f"must be an object, got {type(value).__name__}"
        )
    num_tokens = value.get("num_tokens")
    if type(num_tokens) is not int or num_tokens < 0:
        raise InvalidInputError(
            f"kv_transfer_params.{KEY}.num_tokens",
            f"must be a non-negative integer, got {num_tokens!r}",
        )
    return num_tokens


def params_to_dict(params: TransferParams) -> dict[str, Any]:
    return {
        "peer_address": params.peer_address,
        "engine_id": params.engine_id,
        "epoch": params.epoch,
        "tp_rank": params.tp_rank,
        "request_id": params.request_id,
        "num_tokens": params.num_tokens,
        "spans": [[s.group_id, s.first_block, list(s.block_ids)] for s in params.spans],
    }


def params_from_dict(value: object, field: str = f"kv_transfer_params.{KEY}") -> TransferParams:
    if not isinstance(value, Mapping):
        raise InvalidInputError(field, f"must be an object, got {type(value).__name__}")
    try:
        spans = tuple(
            BlockSpan(GroupId(int(g)), int(first), tuple(BlockId(int(b)) for b in ids))
            for g, first, ids in value["spans"]
        )
        return TransferParams(
            peer_address=value["peer_address"],
            engine_id=value["engine_id"],
            epoch=value["epoch"],
            tp_rank=value["tp_rank"],
            request_id=value["request_id"],
            num_tokens=value["num_tokens"],
            spans=spans,
        )
    except KeyError as exc:
        raise InvalidInputError(f"{field}.{exc.args[0]}", "missing") from exc
    except InvalidInputError:  # a field TransferParams refused: it names that field
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{field}.spans", f"must be [group, first, [ids]]: {exc}") from exc


# ---- different TP sizes: one publication per (prefill rank, decode rank) ---------------
#
# A lease has one reader, so a prefill rank publishes a request once for every decode
# rank that reads heads from it (`reader_sources`), as `<request>~p<prefill rank>d<decode
# rank>of<decode TP size>` (unique per decode engine, which pulls each id once);
# kv_transfer_params carry, per decode rank, the params of each of its sources. The
# ids say which reader a publication is for, so a prefill worker knows from its
# Released events alone when every publication of a request has been read.


def publication_id(request_id: str, source: int, reader: int, readers: int) -> str:
    return f"{request_id}~p{source}d{reader}of{readers}"


def publication_of(publication: str) -> tuple[str, int, int, int] | None:
    """(request id, prefill rank, decode rank, decode TP size) of a publication id, None
    for a plain request id (TP 1 on both sides)."""
    found = _PUBLICATION.fullmatch(publication)
    if found is None:
        return None
    return found["request"], int(found["source"]), int(found["reader"]), int(found["readers"])


def published_request(params: Mapping[str, Any]) -> str:
    """The prefill's vLLM request id behind the kv_transfer_params it returned (the
    request its workers report in `finished_sending` once every lease was released)."""
    value = params.get(KEY)
    if not isinstance(value, Mapping):
        raise InvalidInputError(f"kv_transfer_params.{KEY}", "missing")
    readers = value.get("readers")
    if readers is None:
        return str(value.get("request_id"))
    first = readers[0][0]["request_id"] if readers and readers[0] else ""
    named = publication_of(str(first))
    if named is None:
        raise InvalidInputError(f"kv_transfer_params.{KEY}.readers", f"{first!r} is no publication")
    return named[0]


def reader_sources(
    num_kv_heads: int | None,
    prefill_tp: int,
    decode_tp: int,
    reader: int,
    states: Sequence[StateShard] = (),
) -> list[int]:
    """The prefill ranks decode rank `reader` reads its KV heads from (none for a model
    without attention: `num_kv_heads` None or 0), and the pieces of its state tensors
    cut as `states` say (the sidecar plans each pull the same way: kvxfer.core.tp_map)."""
    ranks: set[int] = set()
    if num_kv_heads:
        ranks = {s.src_rank for s in head_sources(num_kv_heads, prefill_tp, decode_tp, reader)}
    for shard in states:
        ranks |= {p.src_rank for p in state_pieces(shard, prefill_tp, decode_tp, reader)}
    return sorted(ranks)


def readers_of(
    num_kv_heads: int | None,
    prefill_tp: int,
    decode_tp: int,
    source: int,
    states: Sequence[StateShard] = (),
) -> list[int]:
    """The decode ranks that read heads or state from prefill rank `source`."""
    return [
        d
        for d in range(decode_tp)
        if source in reader_sources(num_kv_heads, prefill_tp, decode_tp, d, states)
    ]


MAX_DECODE_TP = 256


def decode_tp_size(
    params: Mapping[str, Any],
    default: int,
    num_kv_heads: int,
    states: Sequence[StateShard] | str = (),
) -> int:
    """The decode TP size a prefill request names (`decode_tp_size`), else `default`; it
    must place the model's `num_kv_heads` as vLLM would (split evenly or replicated),
    and every state tensor cut as `states` says. `states` is a string where the model
    keeps state whose cut is not known (why): then only `default` is accepted."""
    field = f"kv_transfer_params.{DECODE_TP}"
    value = params.get(DECODE_TP, default)
    if type(value) is not int or not 1 <= value <= MAX_DECODE_TP:
        raise InvalidInputError(field, f"must be an integer 1..{MAX_DECODE_TP}, got {value!r}")
    if num_kv_heads and num_kv_heads % value and value % num_kv_heads:
        raise InvalidInputError(
            field, f"{num_kv_heads} KV heads cannot be placed on {value} decode ranks"
        )
    if isinstance(states, str):
        if value != default:
            raise InvalidInputError(
                field,
                f"{value} differs from this engine's TP size {default}, and its state pages "
                f"cannot be cut over TP ranks ({states})",
            )
        return value
    for index, shard in enumerate(states):
        problem = shard.placement_problem(value)
        if problem is not None:
            raise InvalidInputError(field, f"state tensor {index}: {problem}")
    return value


def reader_params(value: object, tp_size: int, tp_rank: int) -> list[TransferParams]:
    """The publications decode rank `tp_rank` of `tp_size` reads, as the params name them
    (`rank_params` checks them against the prefill's ranks): one per prefill rank it
    reads from (`readers`), or the one of a single-rank publication."""
    field = f"kv_transfer_params.{KEY}"
    if not isinstance(value, Mapping):
        raise InvalidInputError(field, f"must be an object, got {type(value).__name__}")
    readers = value.get("readers")
    if readers is None:
        if tp_size != 1:
            raise InvalidInputError(
                f"kv_transfer_params.{DECODE_TP}",
                f"the prefill published for one decode rank, but this engine runs TP "
                f"{tp_size}: send {DECODE_TP}={tp_size} with the prefill request",
            )
        return [params_from_dict(value)]
    if not isinstance(readers, list) or len(readers) != tp_size:
        count = len(readers) if isinstance(readers, list) else type(readers).__name__
        raise InvalidInputError(
            f"{field}.readers",
            f"published for {count} decode ranks, but this engine runs TP {tp_size}: send "
            f"{DECODE_TP}={tp_size} with the prefill request",
        )
    where = f"{field}.readers[{tp_rank}]"
    mine = readers[tp_rank]
    if not isinstance(mine, list) or not mine:
        raise InvalidInputError(where, "must be a non-empty list")
    every = [params_from_dict(p, f"{where}[{i}]") for i, p in enumerate(mine)]
    if len({p.request_id for p in every}) != len(every):
        raise InvalidInputError(where, "names a publication twice")
    return every


def rank_params(
    value: object,
    tp_size: int,
    tp_rank: int,
    num_kv_heads: int | None,
    states: Sequence[StateShard] = (),
) -> list[TransferParams]:
    """The params decode rank `tp_rank` of `tp_size` pulls with: one per prefill rank it
    reads from (`readers`), or the one of a single-rank publication. Every publication
    must be this rank's, of the request's length, and together they must be exactly the
    prefill ranks holding this rank's heads: a missing one would leave heads unwritten
    and reported received. `states` are the cuts of this engine's state tensors."""
    every = reader_params(value, tp_size, tp_rank)
    if not isinstance(value, Mapping) or value.get("readers") is None:
        return every
    field, where = f"kv_transfer_params.{KEY}", f"kv_transfer_params.{KEY}.readers[{tp_rank}]"
    prefill_tp = value.get("prefill_tp_size")
    if type(prefill_tp) is not int or not 1 <= prefill_tp <= MAX_DECODE_TP:
        raise InvalidInputError(
            f"{field}.prefill_tp_size", f"must be an integer 1..{MAX_DECODE_TP}, got {prefill_tp!r}"
        )
    sources = []
    for i, params in enumerate(every):
        named = publication_of(params.request_id)
        if named is None or named[1:] != (params.tp_rank, tp_rank, tp_size):
            raise InvalidInputError(
                f"{where}[{i}].request_id",
                f"{params.request_id!r} is not prefill rank {params.tp_rank}'s publication for "
                f"decode rank {tp_rank} of {tp_size}",
            )
        if params.num_tokens != value.get("num_tokens"):
            raise InvalidInputError(
                f"{where}[{i}].num_tokens",
                f"{params.num_tokens}, but the request has {value.get('num_tokens')!r}",
            )
        sources.append(params.tp_rank)
    if num_kv_heads or states:
        want = reader_sources(num_kv_heads, prefill_tp, tp_size, tp_rank, states)
        if sorted(sources) != want:
            raise InvalidInputError(
                where,
                f"publications of prefill ranks {sorted(sources)}, but decode rank {tp_rank} "
                f"of {tp_size} reads its heads{' and state' if states else ''} from prefill "
                f"ranks {want} of {prefill_tp}",
            )
    return every


def load_errors(
    done: PullDone,
    local_block_ids: Sequence[Sequence[int]],
    block_size: int,
    local_block: int,
    computed_tokens: int = 0,
) -> set[int] | None:
    """Local block ids to report from `get_block_ids_with_load_errors` for a one-group
    cache: vLLM resumes at the first reported block, so the block holding token
    `valid_tokens` goes first; every failed block follows (all must be recomputed).
    `block_size` is the registered one, in which the sidecar counts failed blocks, and
    `local_block` the engine's own (they differ where it reads another block size,
    vllm_reblock): a failed block fails every local block holding any of its tokens.

    Blocks below `computed_tokens` (the engine's own prefix hit, which a pull of whole
    prefill blocks may have asked for again, vllm_reblock) are never reported either:
    other requests share them, and vLLM would roll those back. vLLM's null block (where
    a window dropped blocks) is never reported: vLLM would take every request holding it
    as failed. None where the resume point falls in one: the request is then recomputed
    whole."""
    if done.status is PullStatus.OK or len(local_block_ids) != 1:
        return set()
    ids = [int(b) for b in local_block_ids[0]]
    own = -(-computed_tokens // local_block)  # blocks held before the pull
    resume = max(done.valid_tokens // local_block, own)
    if resume < len(ids) and ids[resume] == NULL_BLOCK:
        return None
    logical = {resume}
    for b in done.failed_blocks.get(0, ()):
        logical.update(
            range(b * block_size // local_block, -(-(b + 1) * block_size // local_block))
        )
    return {ids[b] for b in logical if own <= b < len(ids) and ids[b] != NULL_BLOCK}


# ---- the worker's registration, for a scheduler the handshake channel did not reach ----
#
# vLLM passes one handshake object from the workers to the scheduler. Under a
# MultiConnector that object is the *first* child's that returns one, so beside a
# sibling that also uses the channel (NixlConnector, Mooncake, ...) kvxfer's
# registration may never arrive. The worker therefore also leaves it in a file
# only this user can write, named after vLLM's engine id (the same in the
# scheduler and worker processes of one engine), and the scheduler reads it when
# the channel brought nothing of kvxfer's. The file names the worker's pid: a
# worker killed without its `close()` cannot remove it, so a file whose writer is
# gone is no registration (the scheduler waits for the new worker's), and the next
# worker of that engine replaces it. Nothing here touches another engine's file: a
# shared /tmp holds other users' and other containers' (other pid namespaces)
# files, and removing one safely needs more than a pid check.

HANDSHAKE_FIELDS = ("engine_id", "epoch", "peer_address")


def handshake_path(vllm_engine_id: str, tp_rank: int = 0, directory: str | None = None) -> str:
    """Where the worker of `vllm_engine_id` (vLLM's kv_transfer_config.engine_id) leaves
    its registration; the id is hashed, so any string makes a safe file name."""
    if not vllm_engine_id:
        raise InvalidInputError("kv_transfer_config.engine_id", "empty")
    digest = hashlib.sha256(vllm_engine_id.encode()).hexdigest()[:20]
    return os.path.join(
        directory or tempfile.gettempdir(), f"kvxfer-vllm-{digest}-tp{tp_rank}.json"
    )


def write_handshake(path: str, fields: Mapping[str, Any]) -> None:
    """Atomically replace `path` with `fields` and this process's pid (0600: the scheduler
    trusts its contents)."""
    record = {key: fields[key] for key in HANDSHAKE_FIELDS} | {"pid": os.getpid()}
    temporary = f"{path}.{os.getpid()}.tmp"
    # One with this pid in its name is a killed process's whose pid this one reuses (a
    # sticky /tmp lets nobody else remove ours, nor us theirs).
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(record, out)
    try:
        os.replace(temporary, path)
    except OSError as exc:  # another user's file there, in a sticky /tmp
        os.unlink(temporary)
        raise InvalidInputError(path, f"cannot be replaced: {exc.strerror}") from exc


def remove_handshake(path: str) -> None:
    """Remove `path` if it is still this process's registration (a worker shutting down
    after its replacement wrote must leave the replacement's)."""
    with contextlib.suppress(InvalidInputError, OSError):
        record = _handshake_record(path)
        if record is not None and record["pid"] == os.getpid():
            os.unlink(path)


def read_handshake(path: str) -> dict[str, Any] | None:
    """The registration at `path`, None if there is none yet or its worker is gone; a
    file another user owns or others may write, one that is not a regular file, or one
    missing a field, is refused naming what is wrong."""
    record = _handshake_record(path)
    if record is None or not _alive(record["pid"]):
        return None  # none, or left by a worker killed before its close()
    return {key: record[key] for key in HANDSHAKE_FIELDS}


def _handshake_record(path: str) -> dict[str, Any] | None:
    try:
        # Non-blocking: a FIFO planted at the path must not hang the engine.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:  # another user's 0600 file, a symlink (ELOOP)
        raise InvalidInputError(path, f"cannot be opened: {exc.strerror}") from exc
    try:  # checked on the descriptor, before anything reads it (a directory cannot be)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidInputError(path, "not a regular file")
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise InvalidInputError(path, "not owned by this user or writable by others")
        source = os.fdopen(fd)
    except BaseException:
        os.close(fd)
        raise
    with source:
        try:
            record = json.load(source)
        except ValueError as exc:
            raise InvalidInputError(path, f"not JSON: {exc}") from exc
    if not isinstance(record, dict):
        raise InvalidInputError(path, "must hold an object")
    for key, kind in zip((*HANDSHAKE_FIELDS, "pid"), (str, int, str, int), strict=True):
        if not isinstance(record.get(key), kind) or isinstance(record[key], bool):
            raise InvalidInputError(f"{path}.{key}", f"missing or not {kind.__name__}")
    if record["pid"] <= 0:
        raise InvalidInputError(f"{path}.pid", f"must be positive, got {record['pid']}")
    return record


def _alive(pid: int) -> bool:
    """Whether a process `pid` runs (one of another user's counts: it may be ours reused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
