"""`kvxfer-cli handshake | peers | status`: look at sidecars without moving data.

`handshake` is a dry run: it asks the peer sidecar for its registered
engine's layout (no NIXL metadata is handed out and no agent is added) and
negotiates locally, as a decode engine with the given model would. Exit 0
when compatible, 1 with each mismatch, 3 with one line naming an unreachable
address (docs/cli.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from kvxfer._exceptions import InvalidInputError
from kvxfer.cli.main import EXIT_FAILED, EXIT_OK, layout_from_args
from kvxfer.cli.planning import human_bytes
from kvxfer.core.layout import EngineLayout
from kvxfer.core.negotiation import PROTOCOL_VERSION, find_mismatches, negotiate
from kvxfer.core.requests import check_address
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.errors import guarded
from kvxfer.wire.sidecar import PeerHello, hello_from_proto, hello_request
from kvxfer.wire.tls import certificate_problem, key_problem

T = TypeVar("T")


async def _call(
    address: str,
    what: str,
    rpc: Callable[[grpc.aio.Channel], Awaitable[T]],
    deadline_s: float,
    credentials: grpc.ChannelCredentials | None = None,
) -> T:
    """One call `rpc` makes on a new channel to `address`, with a deadline of
    `deadline_s`."""
    channel = (
        grpc.aio.insecure_channel(address)
        if credentials is None
        else grpc.aio.secure_channel(address, credentials)
    )
    async with channel:
        return await guarded(f"{what} at {address}", lambda: rpc(channel), deadline_s)


async def fetch_hello(
    address: str,
    layout: EngineLayout,
    *,
    dry_run: bool,
    timeout_s: float,
    sidecar_id: str = "kvxfer-cli",
    credentials: grpc.ChannelCredentials | None = None,
    peer_rank: int | None = None,
) -> PeerHello:
    """Handshake with a peer sidecar as an engine with `layout` would; a dry run hands
    out no NIXL metadata and loads no agent anywhere."""
    request = hello_request(
        layout, epoch=1, sidecar_id=sidecar_id, dry_run=dry_run, peer_tp_rank=peer_rank
    )
    reply = await _call(
        address,
        "handshake",
        lambda ch: pb_grpc.PeerServiceStub(ch).Handshake(request, timeout=timeout_s),
        timeout_s,
        credentials,
    )
    return hello_from_proto(reply, dry_run=dry_run)


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """mTLS toward a peer sidecar that requires it: --tls-cert, --tls-key, --tls-ca."""
    flags = {"--tls-cert": args.tls_cert, "--tls-key": args.tls_key, "--tls-ca": args.tls_ca}
    for flag, value in flags.items():  # `--tls-ca "$UNSET"` must not mean plaintext
        if value == "":
            raise InvalidInputError(flag, "is empty: give a file's path")
    given = list(flags.values())
    if all(value is None for value in given):
        return None
    if not all(given):
        raise InvalidInputError("--tls-cert/--tls-key/--tls-ca", "give all three or none")
    cert_file, key_file, ca_file = (Path(p) for p in given)
    # Loaded here as the sidecar loads its own: gRPC reports a file that is not PEM only
    # as a peer it cannot reach ("Failed to create security handshaker"), exit 3.
    _refuse_pem("--tls-cert", cert_file, certificate_problem(cert_file))
    _refuse_pem("--tls-key", key_file, key_problem(cert_file, key_file))
    _refuse_pem("--tls-ca", ca_file, certificate_problem(ca_file))
    try:
        cert, key, ca = (p.read_bytes() for p in (cert_file, key_file, ca_file))
    except OSError as exc:
        raise InvalidInputError("--tls-*", f"cannot read {exc.filename}: {exc.strerror}") from exc
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def _refuse_pem(flag: str, path: Path, problem: str | None) -> None:
    if problem:
        raise InvalidInputError(flag, f"{path} {problem}")


def run_handshake(args: argparse.Namespace) -> int:
    check_address(args.peer, "--peer")
    local = layout_from_args(args, args.layout)
    credentials = _credentials(args)
    start = time.perf_counter()
    hello = asyncio.run(
        fetch_hello(
            args.peer,
            local,
            dry_run=True,
            timeout_s=args.timeout,
            credentials=credentials,
            peer_rank=args.peer_rank,
        )
    )
    elapsed_ms = (time.perf_counter() - start) * 1000
    mismatches = find_mismatches(local, hello.layout, PROTOCOL_VERSION, hello.protocol_version)
    agreement = None if mismatches else negotiate(local, hello.layout)
    accepted = sorted(m.value for m in hello.modes)
    report: dict[str, Any] = {
        "compatible": not mismatches,
        # Who would start the transfer: the peer must take part in that mode (its
        # transfer.modes); the asking sidecar's own setting is checked when it transfers.
        "mode": {"asked": args.mode, "peer_accepts": accepted, "agreed": args.mode in accepted},
        "mismatches": [asdict(m) for m in mismatches],
        "agreement": None if agreement is None else asdict(agreement),
        "peer": {
            "engine_id": hello.engine_id,
            "epoch": hello.epoch,
            "protocol_version": hello.protocol_version,
            "sidecar_id": hello.sidecar_id,
            "model": hello.layout.model,
        },
        "handshake_ms": round(elapsed_ms, 3),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(_handshake_text(args.peer, report))
    return EXIT_OK if not mismatches and report["mode"]["agreed"] else EXIT_FAILED


def _mode_text(mode: dict[str, Any]) -> str:
    accepts = ", ".join(mode["peer_accepts"])
    if mode["agreed"]:
        return f"mode {mode['asked']} agreed (peer's transfer.modes: {accepts})"
    return (
        f"mode {mode['asked']} REFUSED: the peer takes part only in {accepts} "
        "(its transfer.modes setting)"
    )


def _tp_text(agreement: dict[str, Any]) -> str:
    """Equal TP: rank r <- rank r; different: the prefill ranks this rank reads."""
    rank, sources = agreement["tp_rank"], agreement["source_ranks"]
    if agreement["peer_tp_size"] == agreement["tp_size"]:
        return f"TP {agreement['tp_size']} (rank {rank} <- rank {rank})"
    return (
        f"TP {agreement['peer_tp_size']} -> {agreement['tp_size']} (rank {rank} <- prefill "
        f"ranks {', '.join(map(str, sources))}; this peer is rank {agreement['peer_tp_rank']})"
    )


def _handshake_text(address: str, report: dict[str, Any]) -> str:
    peer = report["peer"]
    lines = [
        f"peer {address}: engine {peer['engine_id']} ({peer['model']}), epoch {peer['epoch']}, "
        f"protocol {peer['protocol_version']}, {report['handshake_ms']:.1f} ms",
        _mode_text(report["mode"]),
    ]
    if report["compatible"]:
        agreement = report["agreement"]
        sizes = f"block size {agreement['block_size']}"
        if agreement["peer_block_size"] != agreement["block_size"]:
            sizes += f" <- peer's {agreement['peer_block_size']}"
        lines.append(
            f"compatible: {agreement['model']}, {agreement['kv_dtype']}, {sizes}, "
            + _tp_text(agreement)
        )
        for group in agreement["groups"]:
            window = f" W={group['sliding_window']}" if group["sliding_window"] else ""
            chunk = f" S={group['chunk_size']}" if group["chunk_size"] else ""
            lines.append(
                f"  group {group['local_group']} <- peer group {group['peer_group']}: "
                f"{group['kind']}{window}{chunk}, {group['num_layers']} layers, "
                f"{human_bytes(group['bytes_per_block'])}/block; {_block_mapping(group)}"
            )
            if group["replicated"]:
                lines.append(
                    "    latent replicated on every TP rank: read whole from one prefill "
                    "rank (the lowest this rank reads for other groups, else d mod TP)"
                )
            for read in group["head_reads"]:
                src, dst = read["src_heads"], read["dst_heads"]
                lines.append(
                    f"    heads {dst[0]}..{dst[1] - 1} <- prefill rank {read['src_rank']} "
                    f"heads {src[0]}..{src[1] - 1}"
                )
            lines += _state_text(group["state_reads"])
        return "\n".join(lines)
    lines.append(f"NOT compatible: {len(report['mismatches'])} mismatch(es)")
    for m in report["mismatches"]:
        lines.append(f"  {m['field']}: local {m['local']}, peer {m['peer']}")
        lines.append(f"    hint: {m['hint']}")
    return "\n".join(lines)


def _state_text(reads: list[dict[str, Any]]) -> list[str]:
    """Different TP sizes, a state group: each tensor's byte ranges and their source."""
    lines = []
    for read in reads:
        start, length = read["dst_at"], read["length"]
        lines.append(
            f"    {read['tensor']} bytes {start}..{start + length - 1} <- prefill rank "
            f"{read['src_rank']} bytes {read['src_at']}..{read['src_at'] + length - 1}"
        )
    return lines


def _block_mapping(group: dict[str, Any]) -> str:
    """How this group's blocks map to the peer's (docs/sidecar.md, Negotiation)."""
    mine, theirs = group["local_block_size"], group["peer_block_size"]
    if group["block_mapping"] == "state":
        if group["state_reads"]:  # different TP sizes
            return "state block by byte ranges, each from the prefill rank holding it"
        return "state block moves whole"
    if group["block_mapping"] == "same":
        return f"block i <- peer block i ({mine} tokens)"
    if group["block_mapping"] == "heads":
        how = {
            "block": "a run of heads is a byte range of every block",
            "token": "a run of heads is a byte range of every token",
            "rows": f"a head at a time, {group['slice_tokens']} of its token rows per byte range",
        }[group["head_cut"]]
        return f"{mine}-token blocks <- peer's {theirs}-token blocks by heads ({how})"
    unit = group["slice_tokens"]
    how = "whole blocks where they align, " if unit in (mine, theirs) else ""
    return (
        f"{mine}-token blocks <- peer's {theirs}-token blocks by token ranges "
        f"({how}slices of {unit} tokens)"
    )


def _admin(args: argparse.Namespace, what: str, method: str, request: Message) -> Any:
    """One AdminService call against --sidecar (a peer or an engine address)."""
    check_address(args.sidecar, "--sidecar", allow_unix=True)

    def rpc(channel: grpc.aio.Channel) -> Awaitable[Any]:
        stub = pb_grpc.AdminServiceStub(channel)
        return getattr(stub, method)(request, timeout=args.timeout)  # type: ignore[no-any-return]

    return asyncio.run(_call(args.sidecar, what, rpc, args.timeout))


def run_peers(args: argparse.Namespace) -> int:
    reply: pb.ListPeersResponse = _admin(args, "list peers", "ListPeers", pb.ListPeersRequest())
    if args.json:
        print(json.dumps(_as_dict(reply)))
        return EXIT_OK
    if not reply.peers:
        print("no peers yet (a peer is added by the first pull from it)")
    for p in reply.peers:
        when = time.strftime("%H:%M:%S", time.localtime(p.last_handshake_unix_ms / 1000))
        print(
            f"{p.address} rank {p.tp_rank}: epoch {p.epoch}, engine {p.engine_id} ({p.model}, "
            f"{p.groups} groups), {p.handshakes} handshake(s), last {when}, "
            f"agent {'loaded' if p.agent_loaded else 'stale'}"
        )
    return EXIT_OK


def run_status(args: argparse.Namespace) -> int:
    reply: pb.GetStatusResponse = _admin(args, "status", "GetStatus", pb.GetStatusRequest())
    if args.json:
        print(json.dumps(_as_dict(reply)))
        return EXIT_OK
    print(
        f"sidecar {reply.sidecar_id} at {reply.peer_address}, epoch {reply.epoch}, "
        f"up {reply.uptime_ms / 1000:.0f}s"
    )
    print(f"engines: {len(reply.engines)}")
    for e in reply.engines:
        print(
            f"  {e.engine_id} {e.engine_name}: {e.model} rank {e.tp_rank}, {e.buffers} buffers, "
            f"{human_bytes(e.registered_bytes)}"
        )
    print(f"leases: {len(reply.leases)}")
    for lease in reply.leases:
        state = "reading" if lease.reading else "held"
        print(
            f"  {lease.request_id}: {lease.blocks} blocks, {state}, "
            f"expires in {lease.expires_in_ms / 1000:.1f}s"
        )
    print(f"pulls in flight: {len(reply.pulls)}")
    for pull in reply.pulls:
        print(
            f"  {pull.request_id} from {pull.peer_address}: {human_bytes(pull.bytes_planned)}, "
            f"{pull.running_ms} ms"
        )
    return EXIT_OK


def _as_dict(message: Message) -> dict[str, Any]:
    """Every field, integers as JSON numbers (proto3's JSON mapping would quote uint64)."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.is_repeated:
            out[field.name] = [_as_dict(item) for item in value]
        elif field.message_type is not None:
            out[field.name] = _as_dict(value)
        elif field.is_repeated:
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out
