"""The ``shuttle`` command: ``inspect``, ``convert``, ``merge``, ``extract``, ``compress``,
``cast``, ``demo``.

Each subcommand is a thin front over the library: parsing arguments and printing. Exit status:
0 success, 2 a usage or input error (one line on stderr, no traceback), 130/143/129 interrupted
by SIGINT/SIGTERM/SIGHUP (temporary files removed), 141 stdout closed early (``| head``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from types import FrameType

import shuttle
from shuttle.cli import cast, compress, convert, demo, extract, inspect, merge
from shuttle.errors import ShuttleError

__all__ = ["main"]

_COMMANDS = {
    "inspect": inspect, "convert": convert, "merge": merge, "extract": extract,
    "compress": compress, "cast": cast, "demo": demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shuttle`` command line; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="shuttle", description="Read, convert and apply LoRA-style adapters exactly."
    )
    parser.add_argument("--version", action="version", version=f"shuttle {shuttle.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _COMMANDS.values():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        with _signals_exit():
            return _COMMANDS[args.command].run(args)
    except (ShuttleError, OSError) as e:
        if isinstance(e, BrokenPipeError):
            return _stdout_gone()
        print(f"shuttle {args.command}: error: {e}", file=sys.stderr)
        return 2
    except _Interrupted as e:
        print(f"shuttle {args.command}: interrupted by {e.name}; nothing was published",
              file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"shuttle {args.command}: interrupted; nothing was published", file=sys.stderr)
        return 128 + signal.SIGINT


class _Interrupted(BaseException):
    """Raised in the main thread by a SIGTERM/SIGHUP handler, so that every ``finally`` and
    ``except BaseException`` on the way out runs (a merge removes its temporary files).
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


@contextlib.contextmanager
def _signals_exit() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into an exception while a command runs (SIGINT already raises
    KeyboardInterrupt); Python's default for them is to die at once, skipping all cleanup.
    """
    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted(signum)

    wanted = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    try:
        previous = {s: signal.signal(s, handler) for s in wanted}
    except ValueError:  # not the main thread (main() called from a thread): leave them
        previous = {}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _stdout_gone() -> int:
    """The reader of stdout went away (``shuttle inspect --json | head``): stop quietly, as
    other command-line tools do, without a traceback at interpreter exit's flush.
    """
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + 13  # as if killed by SIGPIPE, what a shell reports for `cmd | head`


if __name__ == "__main__":
    sys.exit(main())
