"""``shuttle compress IN OUT``: a checkpoint (one ``.safetensors`` file, or a folder such as a
diffusers pipeline or a transformers model) with its bfloat16/float16 tensors lossless coded
(about 0.7x the bytes, decoded to the same bits; see :mod:`shuttle.weights.lossless_file`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shuttle.cli.table import format_bytes
from shuttle.weights.lossless_file import CompressReport, compress_file, compress_folder


def add_parser(sub: argparse._SubParsersAction) -> None:  # noqa: D103
    p = sub.add_parser("compress", help="code a checkpoint's bf16/fp16 tensors losslessly")
    p.add_argument("source", help="the .safetensors checkpoint, or a folder of them, to read")
    p.add_argument("out", help="the .safetensors file (for a folder: the folder) to write")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:  # noqa: D103
    progress = not (args.quiet or args.json)
    if Path(args.source).is_dir():
        reports = compress_folder(args.source, args.out, overwrite=args.force,
                                  progress=progress)
    else:
        reports = [compress_file(args.source, args.out, overwrite=args.force,
                                 progress=progress)]
    total = CompressReport(Path(args.out), sum(r.tensors for r in reports),
                           sum(r.coded for r in reports), sum(r.raw_bytes for r in reports),
                           sum(r.stored_bytes for r in reports))
    if args.json:
        print(json.dumps({"path": str(total.path), "files": len(reports),
                          "tensors": total.tensors, "coded": total.coded,
                          "raw_bytes": total.raw_bytes, "stored_bytes": total.stored_bytes,
                          "ratio": total.ratio}))
        return 0
    files = f" in {len(reports)} files" if len(reports) > 1 else ""
    print(f"wrote {total.path}: {total.coded} of {total.tensors} tensors coded{files}, "
          f"{format_bytes(total.raw_bytes)} -> {format_bytes(total.stored_bytes)} "
          f"({total.ratio:.3f}x)")
    return 0
