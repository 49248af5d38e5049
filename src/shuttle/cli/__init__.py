"""The ``shuttle`` command: ``inspect``, ``convert``, ``merge``, ``extract``, ``demo``.

Each subcommand is a thin front over the library: parsing arguments and printing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shuttle.cli import convert, demo, extract, inspect, merge
from shuttle.errors import ShuttleError

__all__ = ["main"]

_COMMANDS = {
    "inspect": inspect, "convert": convert, "merge": merge, "extract": extract, "demo": demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shuttle`` command line; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="shuttle", description="Read, convert and apply LoRA-style adapters exactly."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _COMMANDS.values():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command].run(args)
    except ShuttleError as e:
        print(f"shuttle {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
