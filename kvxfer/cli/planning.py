"""`kvxfer-cli layout` and `kvxfer-cli plan`: pure planning, no data moved."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvxfer.cli.render import Column, table
from kvxfer.core.layout import EngineLayout, GroupKind, KVGroup
from kvxfer.core.planner import full_attention_bytes, plan_blocks
from kvxfer.core.profiles import layout_for_model


def _layout(args: argparse.Namespace, tp_size: int = 1) -> EngineLayout:
    return layout_for_model(
        args.model,
        kv_dtype=args.kv_dtype,
        block_size=args.block_size,
        tp_size=tp_size,
        state_dtype=args.state_dtype,
    )


def _bytes_per_token(group: KVGroup, block_size: int) -> int | None:
    if group.kind is GroupKind.MAMBA:
        return None  # a fixed-size state per request, not per token
    return group.bytes_per_block // block_size


def layout_report(layout: EngineLayout) -> dict[str, Any]:
    groups = [
        {
            "group_id": g.group_id,
            "kind": g.kind.value,
            "sliding_window": g.sliding_window,
            "chunk_size": g.chunk_size,
            "num_layers": len(g.layers),
            "layers": list(g.layers),
            "num_tensors": len(g.tensors),
            "bytes_per_token": _bytes_per_token(g, layout.block_size),
            "bytes_per_block": g.bytes_per_block,
            "replicated_across_tp": g.kind is GroupKind.MLA,
        }
        for g in layout.groups
    ]
    return {
        "model": layout.model,
        "fingerprint": layout.fingerprint,
        "kv_dtype": layout.kv_dtype,
        "block_size": layout.block_size,
        "tp_size": layout.tp_size,
        "groups": groups,
    }


def plan_report(layout: EngineLayout, num_tokens: int, computed_tokens: int) -> dict[str, Any]:
    plans = plan_blocks(layout, num_tokens, computed_tokens)
    groups = [
        {
            "kind": p.group.kind.value,
            "sliding_window": p.group.sliding_window,
            "chunk_size": p.group.chunk_size,
            "num_layers": len(p.group.layers),
            "first_block": p.blocks.start if p.blocks else None,
            "last_block": p.blocks.stop - 1 if p.blocks else None,
            "num_blocks": len(p.blocks),
            "bytes": p.nbytes,
        }
        for p in plans
    ]
    return {
        "model": layout.model,
        "tokens": num_tokens,
        "block_size": layout.block_size,
        "computed_tokens": computed_tokens,
        "kv_dtype": layout.kv_dtype,
        "groups": groups,
        "total_bytes": sum(p.nbytes for p in plans),
        "full_attention_bytes": full_attention_bytes(layout, num_tokens, computed_tokens),
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _kind_label(group: dict[str, Any]) -> str:
    if group["sliding_window"] is not None:
        return f"{group['kind']}(W={group['sliding_window']})"
    if group["chunk_size"] is not None:
        return f"{group['kind']}(S={group['chunk_size']})"
    if group["kind"] == GroupKind.MLA.value:
        return "mla(latent)"
    return str(group["kind"])


def run_layout(args: argparse.Namespace) -> int:
    report = layout_report(_layout(args, args.tp_size))
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"{report['model']}  kv_dtype={report['kv_dtype']}  block_size={report['block_size']}"
        f"  tp_size={report['tp_size']}  {report['fingerprint']}"
    )
    rows = [
        [
            str(g["group_id"]),
            _kind_label(g),
            str(g["num_layers"]),
            "-" if g["bytes_per_token"] is None else human_bytes(g["bytes_per_token"]),
            human_bytes(g["bytes_per_block"]),
        ]
        for g in report["groups"]
    ]
    columns = [Column("group"), Column("kind"), Column("layers", "right")]
    columns += [Column("bytes/token", "right"), Column("bytes/block", "right")]
    print(table(columns, rows))
    if any(g["replicated_across_tp"] for g in report["groups"]):
        print(
            "mla: one latent per layer (kv_lora_rank + qk_rope_head_dim per token), "
            "the same on every TP rank"
        )
    return 0


def run_plan(args: argparse.Namespace) -> int:
    report = plan_report(_layout(args), args.tokens, args.computed)
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"{report['model']}: N={report['tokens']} tokens, C={report['computed_tokens']} computed,"
        f" B={report['block_size']}, {report['kv_dtype']}"
    )
    rows = [
        [
            str(i),
            _kind_label(g),
            str(g["num_layers"]),
            "-" if g["first_block"] is None else f"{g['first_block']}..{g['last_block']}",
            str(g["num_blocks"]),
            human_bytes(g["bytes"]),
        ]
        for i, g in enumerate(report["groups"])
    ]
    columns = [Column("group"), Column("kind"), Column("layers", "right"), Column("blocks")]
    print(table([*columns, Column("count", "right"), Column("bytes", "right")], rows))
    total, full = report["total_bytes"], report["full_attention_bytes"]
    saved = 1 - total / full if full else 0.0
    print(f"total {human_bytes(total)}; as full attention {human_bytes(full)} ({saved:.1%} saved)")
    return 0
