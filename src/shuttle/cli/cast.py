"""``shuttle cast IN OUT --dtype bfloat16``: a pipeline or model folder written again in the
dtypes the model computes in, one tensor in memory at a time (see
:mod:`shuttle.integrations.cast`): a float32 release so cast streams from disk under a host
ceiling, where it would otherwise be converted while read and held in host memory.
"""

from __future__ import annotations

import argparse
import json

from shuttle.cli.table import format_bytes
from shuttle.integrations.cast import cast


def add_parser(sub: argparse._SubParsersAction) -> None:  # noqa: D103
    p = sub.add_parser("cast", help="write a pipeline or model folder in the dtypes it computes "
                                    "in (kept-float32 modules stay float32)")
    p.add_argument("source", help="a diffusers pipeline or transformers model folder (or Hub "
                                  "repo id)")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--dtype", default="bfloat16",
                   help="the dtype the copy will be loaded in (default bfloat16)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:  # noqa: D103
    report = cast(args.source, args.out, args.dtype, overwrite=args.force,
                  progress=not (args.quiet or args.json))
    if args.json:
        print(json.dumps({"path": str(report.out), "files": report.files, "cast": report.cast,
                          "tensors": report.tensors, "bytes_before": report.bytes_before,
                          "bytes_after": report.bytes_after}))
        return 0
    print(f"wrote {report.out}: {report.cast} of {report.tensors} tensors cast to "
          f"{args.dtype} in {report.files} files, {format_bytes(report.bytes_before)} -> "
          f"{format_bytes(report.bytes_after)}")
    return 0
