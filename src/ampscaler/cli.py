"""The command line, ``python -m ampscaler COMMAND`` (or the ``ampscaler`` script).

Each command is a function in :data:`COMMANDS` that adds its subparser and sets ``run`` to the
function that carries it out; adding a command is adding one such function. A user mistake
(a missing or foreign log, a folder that cannot be made) raises :class:`CommandError`,
:class:`~ampscaler.LogFormatError` or :class:`~ampscaler.SinkError`; :func:`main` prints it as
one line on stderr and returns exit status 2, never a traceback.

Example:
    >>> main(["report", "/nonexistent/steps.jsonl", "--out", "/tmp/r"])
    2
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import LogFormatError, SinkError
from .records import read_log

__all__ = ["COMMANDS", "CommandError", "build_parser", "main"]

USAGE_ERROR = 2

class CommandError(Exception):
    """A user mistake that a command reports as one line (exit status 2)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def output_folder(path: Path) -> Path:
    """Create ``path`` (and its parents) if needed; :class:`CommandError` if that fails."""
    if path.exists() and not path.is_dir():
        raise CommandError(f"--out {path} exists and is not a folder; pass a folder path.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CommandError(
            f"cannot create the output folder {path} ({error.strerror or error})."
        ) from error
    return path


# ---------------------------------------------------------------------- report


def _add_report(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "report",
        help="plot a step log written by ampscaler.JsonlSink",
        description=(
            "Plot a step log written by ampscaler.JsonlSink: the loss scale over steps with "
            "skipped steps marked (scale.png), skipped steps per window (skips.png) and, when "
            "the run used probe_every, underflow and headroom (probe.png, probe_modules.png)."
        ),
    )
    parser.add_argument("log", type=Path, metavar="LOG.jsonl", help="the step log to plot")
    parser.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="folder for the PNG files"
    )
    parser.add_argument(
        "--window",
        type=_positive_int,
        default=None,
        metavar="N",
        help="steps per bar in skips.png (default: about 50 bars)",
    )
    parser.set_defaults(run=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    try:
        records = read_log(args.log)
    except OSError as error:
        raise CommandError(f"cannot read {args.log} ({error.strerror or error}).") from error
    try:
        from .report import render_report
    except ImportError as error:
        raise CommandError(
            f"report needs matplotlib ({error}); pip install 'ampscaler[report]'."
        ) from error
    out = output_folder(args.out)
    try:
        paths = render_report(records, out, window=args.window)
    except OSError as error:
        raise CommandError(
            f"cannot write the plots into {out} ({error.strerror or error})."
        ) from error
    skipped = sum(r.skipped for r in records)
    print(f"{len(records)} steps, {skipped} skipped, final scale {records[-1].new_scale:g}")
    for path in paths:
        print(path)
    return 0


# ---------------------------------------------------------------------- entry point

COMMANDS: tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...] = (
    _add_report,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="ampscaler",
        description="ampscaler: dynamic loss scaling for fp16 training in PyTorch.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (2 for a user mistake, with one line on stderr)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed the usage and the error
        return exit_.code if isinstance(exit_.code, int) else USAGE_ERROR
    try:
        status: int = args.run(args)
    except (CommandError, LogFormatError, SinkError) as error:
        print(f"ampscaler {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    return status
