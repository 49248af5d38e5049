"""``shuttle extract --base A --tuned B -o OUT``: an adapter from two checkpoints."""

from __future__ import annotations

import argparse
import json

import torch

from shuttle.apply.extract import DEFAULT_RANK, ExtractReport, extract_lora
from shuttle.cli.args import device_arg, dtype_arg, fraction_arg, positive_int_arg
from shuttle.cli.table import format_bytes, render_table

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SHOWN = 20


def add_parser(sub: argparse._SubParsersAction) -> None:  # noqa: D103
    p = sub.add_parser(
        "extract", help="write tuned - base as an adapter (low-rank where it saves bytes)"
    )
    p.add_argument("--base", required=True, nargs="+",
                   help="base checkpoint: .safetensors file(s), an index.json or a directory")
    p.add_argument("--tuned", required=True, nargs="+", help="fine-tuned checkpoint, same forms")
    p.add_argument("-o", "--out", required=True, help="adapter file to write (.safetensors)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--rank", type=positive_int_arg, help=f"rank of each low-rank payload "
                      f"(default {DEFAULT_RANK})")
    size.add_argument("--energy", type=fraction_arg,
                      help="per matrix, the smallest rank capturing this fraction of ||delta||^2")
    p.add_argument("--device", type=device_arg,
                   help="where the SVDs run (default cuda when available, else cpu)")
    p.add_argument("--dtype", type=dtype_arg(_DTYPES),
                   help="dtype of factors and diffs: bf16, fp16 or fp32 (or bfloat16, float16, "
                        "float32; default: the checkpoint's, where exact)")
    p.add_argument("--prefix", default="", help="put before every key, e.g. diffusion_model.")
    p.add_argument("--seed", type=int, default=0, help="seed of the randomized SVD")
    p.add_argument("--strict", action="store_true",
                   help="fail on parameters only in the base or changed integer tensors")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--all", action="store_true", help=f"list every parameter, not {_SHOWN}")


def _one(paths: list[str]) -> str | list[str]:
    return paths[0] if len(paths) == 1 else paths


def _rows(report: ExtractReport, show_all: bool) -> tuple[list[list[object]], int]:
    changed = [r for r in report.rows if r.kind != "identical"]
    shown = changed if show_all else changed[:_SHOWN]
    table = [[r.name, r.kind, r.rank if r.rank is not None else "-",
              "x".join(map(str, r.shape)) or "scalar", format_bytes(r.bytes),
              format_bytes(r.dense_bytes), f"{r.energy:.4f}", f"{r.error:.2e}", r.note]
             for r in shown]
    return table, len(changed) - len(shown)


def run(args: argparse.Namespace) -> int:  # noqa: D103
    report = extract_lora(
        _one(args.base), _one(args.tuned), args.out, rank=args.rank, energy=args.energy,
        device=args.device, dtype=args.dtype,
        progress=None if not args.json else False, seed=args.seed, strict=args.strict,
        prefix=args.prefix,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    table, more = _rows(report, args.all)
    print(render_table(
        ["parameter", "kind", "rank", "shape", "bytes", "dense", "energy", "rel. error", "note"],
        table,
    ))
    if more:
        print(f"... {more} more (--all lists every parameter)")
    counts = report.counts()
    ratio = report.bytes / report.dense_bytes if report.dense_bytes else 0.0
    print()
    print(f"wrote         {report.path}")
    print("parameters    " + ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())))
    print(f"bytes         {format_bytes(report.bytes)} of {format_bytes(report.dense_bytes)} "
          f"dense ({ratio:.1%})")
    print(f"energy        {report.energy:.6f} of ||tuned - base||^2 captured "
          f"(rel. error {report.error:.2e})")
    if report.base_only:
        print(f"base only     {len(report.base_only)} parameter(s) an adapter cannot remove: "
              + ", ".join(report.base_only[:5]) + (" ..." if len(report.base_only) > 5 else ""))
    for name, why in report.skipped.items():
        print(f"skipped       {name}: {why}")
    return 0
