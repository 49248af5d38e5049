"""``shuttle merge --base MODEL --lora A:0.8 -o OUT``: merge adapters into a checkpoint file.

Adapters of which no key reaches a tensor of the base (an adapter made for another model) are an
error: exit status 2, nothing written. ``--strict`` makes any unmatched key one.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from shuttle.apply.merge_files import OUTPUT_DTYPES, merge_files
from shuttle.cli.args import dtype_arg
from shuttle.cli.table import format_bytes
from shuttle.formats.json_text import load_json

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_lora(text: str) -> tuple[str, float]:
    """``PATH[:STRENGTH]`` -> ``(path, strength)``, the strength 1.0 when not given.

    Only the text after the last ``:`` is a strength, and only when it reads as a number and
    the whole text is not itself an existing path, so paths with colons (``C:\\x``, ``a:b/c``)
    still work.

    Raises:
        argparse.ArgumentTypeError: the text ends with ``:`` and no strength.
    """
    path, sep, tail = text.rpartition(":")
    if not sep or not path or Path(text).exists():
        return text, 1.0
    if not tail.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} ends with ':' but no strength; write PATH:0.8 or just PATH"
        )
    try:
        return path, float(tail)  # "nan"/"inf" parse; the merge rejects them with a typed error
    except ValueError:
        return text, 1.0


def parse_size(text: str) -> int:
    """``5GB`` (10**9 bytes), ``5GiB`` (2**30), ``500MB``, or a plain number of bytes -> bytes.

    Raises:
        argparse.ArgumentTypeError: not a positive size with a known unit.
    """
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 5GB, 4GiB, 500MB or a number of bytes"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def parse_mapping(path: str) -> dict[str, str | tuple[str, tuple[int, int]]]:
    """A JSON file ``{adapter module key: "tensor.module.path"}`` (or ``[path, [start, end]]``
    for rows of a fused tensor) -> a ``mapping=`` for :func:`~shuttle.merge_files`.

    Raises:
        argparse.ArgumentTypeError: the file is missing, not JSON, or not such an object.
    """
    try:
        data = load_json(Path(path).read_bytes())
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {e.strerror or e}") from None
    except ValueError as e:  # not JSON, not UTF-8, or nested too deep
        raise argparse.ArgumentTypeError(f"{path!r} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(
            f"{path!r}: expected a JSON object {{adapter key: module path}}, got "
            f"{type(data).__name__}")
    out: dict[str, str | tuple[str, tuple[int, int]]] = {}
    for key, value in data.items():
        if isinstance(value, str):
            out[key] = value
        elif (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
              and isinstance(value[1], list) and len(value[1]) == 2
              and all(isinstance(r, int) and not isinstance(r, bool) for r in value[1])):
            out[key] = (value[0], (value[1][0], value[1][1]))
        else:
            raise argparse.ArgumentTypeError(
                f"{path!r}: the value of {key!r} is {value!r}; expected a module path or "
                '["module.path", [start, end]]')
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:  # noqa: D103
    p = sub.add_parser("merge", help="merge adapters into a checkpoint, writing a new one")
    p.add_argument("--base", required=True, nargs="+", metavar="FILE",
                   help="base .safetensors file(s), or a *.safetensors.index.json")
    p.add_argument("--lora", action="append", default=[], type=parse_lora,
                   metavar="PATH[:STRENGTH]", help="adapter and strength (default 1.0); repeat")
    p.add_argument("-o", "--out", required=True,
                   help="output NAME.safetensors (shards go beside it) or a directory")
    p.add_argument("--dtype", type=dtype_arg(OUTPUT_DTYPES.values()),
                   help="output dtype of floating-point tensors: bf16 (bfloat16), fp16 "
                        "(float16), fp32 (float32), ... (default: keep each one's)")
    p.add_argument("--rounding", choices=["nearest", "stochastic"], default=None,
                   help="rounding to the output dtype (default: nearest, stochastic into "
                        "float8)")
    p.add_argument("--seed", type=int, default=None, help="stochastic rounding seed")
    p.add_argument("--shard-size", type=parse_size, default=None, metavar="SIZE",
                   help="most tensor bytes per file, e.g. 5GB or 4GiB (default 5GiB)")
    p.add_argument("--mapping", type=parse_mapping, default=None, metavar="FILE.json",
                   help='adapter module key -> tensor module path, as JSON: {"key": '
                        '"blocks.0.attn.qkv"} or {"key": ["blocks.0.attn.qkv", [0, 3072]]} '
                        "for rows of a fused tensor (keys it names skip the built-in rules)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--strict", action="store_true",
                   help="fail (nothing written) if any adapter key matches no tensor; without "
                        "it, unmatched keys are listed, and only adapters of which no key "
                        "matches fail")


def run(args: argparse.Namespace) -> int:  # noqa: D103
    base = args.base[0] if len(args.base) == 1 else args.base
    kwargs = {} if args.shard_size is None else {"max_shard_bytes": args.shard_size}
    report = merge_files(base, args.lora, args.out, dtype=args.dtype, rounding=args.rounding,
                         seed=args.seed, mapping=args.mapping,
                         progress=False if args.no_progress else None,
                         strict=args.strict, allow_empty=False, **kwargs)
    where = report.index or report.files[0]
    print(f"merged {len(args.lora)} adapter(s) into {len(report.applied)} tensor(s); wrote "
          f"{len(report.files)} file(s), {format_bytes(report.total_size)}: {where}")
    if report.unmatched:
        print(f"{len(report.unmatched)} adapter key(s) matched no tensor:")
        for key, why in list(report.unmatched.items())[:10]:
            print(f"  {key}: {why}")
    for note in report.notes:
        print(f"note ({note.kind}, {len(note.keys)} module(s)): {note.text}")
    return 0
