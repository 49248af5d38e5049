"""``shuttle compress IN.safetensors OUT``: a checkpoint with its bfloat16/float16 tensors
lossless coded (about 0.7x the bytes, decoded to the same bits; see
:mod:`shuttle.weights.lossless_file`).
"""

from __future__ import annotations

import argparse
import json

from shuttle.cli.table import format_bytes
from shuttle.weights.lossless_file import compress_file


def add_parser(sub: argparse._SubParsersAction) -> None:  # noqa: D103
    p = sub.add_parser("compress", help="code a checkpoint's bf16/fp16 tensors losslessly")
    p.add_argument("source", help="the .safetensors checkpoint to read")
    p.add_argument("out", help="the .safetensors file to write")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:  # noqa: D103
    report = compress_file(args.source, args.out, overwrite=args.force,
                           progress=not (args.quiet or args.json))
    if args.json:
        print(json.dumps({"path": str(report.path), "tensors": report.tensors,
                          "coded": report.coded, "raw_bytes": report.raw_bytes,
                          "stored_bytes": report.stored_bytes, "ratio": report.ratio}))
        return 0
    print(f"wrote {report.path}: {report.coded} of {report.tensors} tensors coded, "
          f"{format_bytes(report.raw_bytes)} -> {format_bytes(report.stored_bytes)} "
          f"({report.ratio:.3f}x)")
    return 0
