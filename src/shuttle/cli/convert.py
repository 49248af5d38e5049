"""``shuttle convert IN OUT --to peft|kohya|comfy``: rename an adapter's keys for another tool.

A PEFT directory adapts one model, so a diffusers pipeline file converts to peft one component
at a time (``--component transformer``), its ``<component>.`` prefix dropped; a file of one
component needs no ``--component``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shuttle.errors import OutputIsInputError
from shuttle.formats import load_lora, save_lora
from shuttle.formats.writer import TARGETS, pipeline_components


def add_parser(sub: argparse._SubParsersAction) -> None:  # noqa: D103
    p = sub.add_parser("convert", help="write an adapter in another tool's key spelling")
    p.add_argument("source", help="adapter file or PEFT directory")
    p.add_argument("out", help="output .safetensors (a directory for --to peft)")
    p.add_argument("--to", required=True, choices=TARGETS,
                   help="target spelling; a kohya file converts to kohya or comfy only (its "
                        "names do not give module paths: in Python, save_lora(..., to='peft', "
                        "mapping=...) names them, resolved against the model)")
    p.add_argument("--component", default=None, metavar="NAME",
                   help="with --to peft, the pipeline component of a diffusers file to write "
                        "(transformer, unet, text_encoder, ...), needed when the file holds "
                        "several; its prefix is dropped, as PEFT names modules inside one model")


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
    path = save_lora(lora, args.out, to=args.to, component=args.component)
    found = pipeline_components(lora) if args.to == "peft" else {}
    if found:
        component = args.component or next(iter(found))
        print(f"wrote {found[component]} modules of component {component!r} "
              f"({lora.format} -> {args.to}) to {path}")
        for other, n in sorted(found.items()):
            if other != component:
                hint = f"--component {other} writes them" if other else "outside any component"
                print(f"left out {n} modules of {other or 'no component'} ({hint})")
    else:
        print(f"wrote {len(lora)} modules ({lora.format} -> {args.to}) to {path}")
    return 0
