"""``shuttle inspect FILE``: what an adapter holds, from its header alone; for a checkpoint
written by ``shuttle compress``, how much its coding saves.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from shuttle.cli.table import format_bytes, render_table
from shuttle.formats import FORMATS, LoRA, load_lora
from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.weights.lossless_file import LOSSLESS_KEY, coded_entries

_DENSE = ("diff", "set")


def add_parser(sub: argparse._SubParsersAction) -> None:  # noqa: D103
    p = sub.add_parser("inspect", help="describe an adapter file (format, kinds, ranks, bytes)")
    p.add_argument("source", help=".safetensors / .bin file or PEFT adapter directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--all", action="store_true", help="list every patch, not the first 20")


def summarize(lora: LoRA) -> dict[str, Any]:
    """The facts ``inspect`` prints, as a JSON-ready dict."""
    rows = lora.describe()
    dense = sum(r["bytes"] for r in rows if r["kind"] in _DENSE)
    fmt = FORMATS.get(lora.format)
    return {
        "source": lora.source,
        "format": lora.format,
        "format_description": fmt.description if fmt else "",
        "modules": len(lora),
        "patches": len(rows),
        "kinds": lora.kinds(),
        "ranks": dict(Counter(r["rank"] for r in rows if r["rank"] is not None)),
        "alphas": dict(Counter(r["alpha"] for r in rows if r["alpha"] is not None)),
        "dtypes": dict(Counter(r["dtype"] for r in rows)),
        "bytes": lora.nbytes,
        "dense_payload_bytes": dense,
        "skipped": lora.skipped,
        "patch_list": rows,
    }


def _counts(d: dict) -> str:
    return ", ".join(f"{k} x{n}" for k, n in sorted(d.items(), key=lambda kv: -kv[1])) or "-"


def summarize_compressed(path: str) -> dict[str, Any] | None:
    """The coding of a checkpoint ``shuttle compress`` wrote, as a JSON-ready dict; None for
    any other source.
    """
    if not (path.endswith(".safetensors") and Path(path).is_file()):
        return None
    file = SafetensorsFile(path)
    if LOSSLESS_KEY not in file.metadata:
        return None
    coded = coded_entries(file.metadata, path)
    refs = {k: file.tensor_ref(k) for k in file}
    raw = {k: (math.prod(coded[k][1]) * 2 if k in coded else r.nbytes) for k, r in refs.items()}
    stored = sum(r.nbytes for r in refs.values())
    coded_raw = sum(raw[k] for k in coded)
    return {"source": path, "format": "shuttle lossless checkpoint", "tensors": len(refs),
            "coded": len(coded), "raw_bytes": sum(raw.values()), "stored_bytes": stored,
            "ratio": stored / max(1, sum(raw.values())),
            "coded_ratio": sum(refs[k].nbytes for k in coded) / max(1, coded_raw)}


def _run_compressed(info: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"source        {info['source']}")
    print(f"format        {info['format']}")
    print(f"tensors       {info['tensors']} ({info['coded']} coded)")
    print(f"bytes         {format_bytes(info['stored_bytes'])} stored, "
          f"{format_bytes(info['raw_bytes'])} decoded")
    print(f"ratio         {info['ratio']:.3f}x (coded tensors {info['coded_ratio']:.3f}x)")
    return 0


def run(args: argparse.Namespace) -> int:  # noqa: D103
    compressed = summarize_compressed(args.source)
    if compressed is not None:
        return _run_compressed(compressed, args.json)
    lora = load_lora(args.source, strict=False)
    info = summarize(lora)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"source        {info['source']}")
    print(f"format        {info['format']}  ({info['format_description']})")
    print(f"modules       {info['modules']}  ({info['patches']} patches)")
    print(f"kinds         {_counts(info['kinds'])}")
    print(f"ranks         {_counts(info['ranks'])}")
    print(f"alphas        {_counts(info['alphas'])}")
    print(f"dtypes        {_counts(info['dtypes'])}")
    print(f"bytes         {format_bytes(info['bytes'])}")
    print(f"dense payload {format_bytes(info['dense_payload_bytes'])} (diff / set tensors)")
    if lora.skipped:
        print(f"skipped       {len(lora.skipped)} key(s):")
        for k, why in list(lora.skipped.items())[:10]:
            print(f"  {k}: {why}")
    rows = info["patch_list"] if args.all else info["patch_list"][:20]
    print()
    print(render_table(
        ["module", "param", "kind", "rank", "alpha", "scale", "shapes", "dtype", "bytes"],
        [[r["module"], r["param"], r["kind"], r["rank"] if r["rank"] is not None else "-",
          "-" if r["alpha"] is None else f"{r['alpha']:g}",
          "-" if r["scale"] is None else f"{r['scale']:.4g}",
          " ".join(f"{k}{list(v)}" for k, v in r["shapes"].items()), r["dtype"],
          format_bytes(r["bytes"])] for r in rows],
    ))
    if len(rows) < len(info["patch_list"]):
        print(f"... {len(info['patch_list']) - len(rows)} more (--all lists every patch)")
    return 0
