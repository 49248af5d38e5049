"""``shuttle convert IN OUT --to peft|kohya|comfy``: rename an adapter's keys for another tool."""

from __future__ import annotations

import argparse
from pathlib import Path

from shuttle.errors import OutputIsInputError
from shuttle.formats import load_lora, save_lora
from shuttle.formats.writer import TARGETS


def add_parser(sub: argparse._SubParsersAction) -> None:  # noqa: D103
    p = sub.add_parser("convert", help="write an adapter in another tool's key spelling")
    p.add_argument("source", help="adapter file or PEFT directory")
    p.add_argument("out", help="output .safetensors (a directory for --to peft)")
    p.add_argument("--to", required=True, choices=TARGETS,
                   help="target spelling; a kohya file converts to kohya or comfy only (its "
                        "names do not give module paths: in Python, save_lora(..., to='peft', "
                        "model=model) resolves them)")


def run(args: argparse.Namespace) -> int:  # noqa: D103
    source, out = Path(args.source), Path(args.out)
    weights = out / "adapter_model.safetensors" if args.to == "peft" else out
    for written in (out, weights):
        if written.exists() and source.exists() and (
                written.samefile(source) or source.is_dir() and written.parent.samefile(source)):
            raise OutputIsInputError(
                f"{args.out}: is the adapter being converted ({args.source}); converting in place "
                "would replace it. Write to another path."
            )
    lora = load_lora(args.source)
    path = save_lora(lora, args.out, to=args.to)
    print(f"wrote {len(lora)} modules ({lora.format} -> {args.to}) to {path}")
    return 0
