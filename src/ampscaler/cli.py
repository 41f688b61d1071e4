"""The command line, ``python -m ampscaler COMMAND`` (or the ``ampscaler`` script).

Each command is a function in :data:`COMMANDS` that adds its subparser and sets ``run`` to the
function that carries it out; adding a command is adding one such function. A user mistake
(a missing or foreign log, a folder that cannot be made) raises :class:`CommandError`,
:class:`~ampscaler.LogFormatError` or :class:`~ampscaler.SinkError`; :func:`main` prints it as
one line on stderr and returns exit status 2, never a traceback.

Example:
    >>> main(["report", "/nonexistent/steps.jsonl"])
    2
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import runpy
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torch import __version__ as torch_version

from . import __version__
from .errors import InvalidConfigError, LogFormatError, SinkError
from .observe.records import StepRecord, load_log

__all__ = ["COMMANDS", "CommandError", "build_parser", "main", "report_folders"]

USAGE_ERROR = 2


class CommandError(Exception):
    """A user mistake that a command reports as one line (exit status 2)."""


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage dump), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see --help)\n")


if TYPE_CHECKING:
    _Commands = argparse._SubParsersAction[_OneLineParser]


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting whole numbers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {value}")
        return value

    return parse


_non_negative_int = _int_at_least(0)
_positive_int = _int_at_least(1)


def require_extra(command: str, extra: str, modules: Sequence[str]) -> None:
    """:class:`CommandError` naming the extra to install if any of ``modules`` is missing.

    Called before a command does any work, so a missing package leaves nothing half-written.
    """
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise CommandError(
            f"{command} needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed; "
            f"pip install 'ampscaler[{extra}]'."
        )


def output_folder(path: Path) -> Path:
    """Create ``path`` (and its parents) if needed and check that files can be written there;
    :class:`CommandError` if not."""
    if path.exists() and not path.is_dir():
        raise CommandError(f"--out {path} exists and is not a folder; pass a folder path.")
    probe = path / ".ampscaler-write-check"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise CommandError(
            f"cannot write into the output folder {path} ({error.strerror or error}); pass "
            "a folder you can write to."
        ) from error
    return path


# ---------------------------------------------------------------------- report


def _add_report(commands: _Commands) -> None:
    parser = commands.add_parser(
        "report",
        help="plot step logs written by ampscaler.JsonlSink (or the demo)",
        description=(
            "Plot step logs written by ampscaler.JsonlSink or by the demo: the loss scale over "
            "steps with skipped steps marked (scale.png), skipped steps per window (skips.png) "
            "and, when the run had a GradientProbe attached, gradient underflow and headroom "
            "(probe.png, probe_modules.png). A log of several labelled runs (the demo's) gets "
            "the per-run charts once per run: skips-LABEL.png, probe-LABEL.png, ... Prints "
            "one line per run, the charts left out and why, and the files written."
        ),
    )
    parser.add_argument(
        "logs", type=Path, nargs="+", metavar="LOG.jsonl", help="the step logs to plot"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help=(
            "folder for the PNG files; with several logs, one subfolder per log, named after "
            "the log's folder (default: LOG-report beside each LOG.jsonl)"
        ),
    )
    parser.add_argument(
        "--window",
        type=_positive_int,
        default=None,
        metavar="N",
        help="steps per bar in skips.png (default: about 50 bars)",
    )
    parser.set_defaults(run=_run_report)


def report_folders(logs: Sequence[Path], out: Path | None) -> list[Path]:
    """Where each log's charts go: ``out`` for one log; for several, a subfolder of ``out``
    per log, named after the folder holding it (``ampscaler-demo-20260101-120000``), else
    after its file name, else both, else numbered; without ``out``, ``LOG-report`` beside
    each ``LOG.jsonl``.

    Example:
        >>> logs = [Path("a/steps.jsonl"), Path("b/steps.jsonl")]
        >>> [str(folder) for folder in report_folders(logs, Path("plots"))]
        ['plots/a', 'plots/b']
        >>> [str(folder) for folder in report_folders([Path("runs/steps.jsonl")], None)]
        ['runs/steps-report']
    """
    if out is None:
        return [log.parent / f"{log.stem}-report" for log in logs]
    if len(logs) == 1:
        return [out]
    namings: tuple[Callable[[Path], str], ...] = (
        lambda log: log.resolve().parent.name,
        lambda log: log.stem,
        lambda log: f"{log.resolve().parent.name}-{log.stem}",
    )
    for naming in namings:
        names = [naming(log) for log in logs]
        if all(names) and len(set(names)) == len(names):
            return [out / name for name in names]
    return [out / f"{number}-{log.stem}" for number, log in enumerate(logs, start=1)]


def _read(path: Path) -> list[StepRecord]:
    try:
        log = load_log(path)
    except OSError as error:
        raise CommandError(f"cannot read {path} ({error.strerror or error}).") from error
    if log.cut_short:
        print(
            f"{path}: its last line was cut short (a run stopped while writing it); "
            "1 line left out."
        )
    return log.records


def _run_report(args: argparse.Namespace) -> int:
    require_extra("report", "report", ["matplotlib"])
    logs = list(dict.fromkeys(args.logs))  # a log named twice is drawn once
    records = [_read(path) for path in logs]  # every log is checked before anything is written
    folders = [output_folder(folder) for folder in report_folders(logs, args.out)]
    from .report import render_report, report_notes, report_summary

    indent = "  " if len(logs) > 1 else ""
    for path, run, out in zip(logs, records, folders, strict=True):
        try:
            paths = render_report(run, out, window=args.window)
        except OSError as error:
            raise CommandError(
                f"cannot write the plots into {out} ({error.strerror or error})."
            ) from error
        if indent:
            print(f"{path}:")
        for line in [*report_summary(run), *report_notes(run), *map(str, paths)]:
            print(indent + line)
    return 0


# ---------------------------------------------------------------------- demo


def _add_demo(commands: _Commands) -> None:
    parser = commands.add_parser(
        "demo",
        help="train a small model three ways and show what loss scaling rescues",
        description=(
            "Train one small embedded model three ways with identical initialisation and data: "
            "fp32, fp16 autocast without loss scaling, and fp16 autocast with ampscaler's "
            "GradScaler. Prints a summary table and writes summary.json, steps.jsonl, loss.png "
            "and scale.png. --policy headroom adds a fourth way, fp16_headroom: the scale set "
            "from measured gradients (HeadroomPolicy) instead of grown until it overflows."
        ),
    )
    parser.add_argument(
        "--policy",
        choices=("default", "headroom"),
        default="default",
        help="default: the three arms; headroom: also fp16 with HeadroomPolicy",
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=300, metavar="N", help="steps per arm (300)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="output folder (default: a new ampscaler-demo-TIMESTAMP folder here)",
    )
    parser.add_argument(
        "--seed", type=_non_negative_int, default=0, metavar="S", help="random seed (0)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an --out folder that holds an earlier demo's results",
    )
    parser.set_defaults(run=_run_demo)


def _new_demo_folder() -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = Path(f"ampscaler-demo-{stamp}")
    suffix = 1
    while candidate.exists():
        suffix += 1
        candidate = Path(f"ampscaler-demo-{stamp}-{suffix}")
    return candidate


def _run_demo(args: argparse.Namespace) -> int:
    require_extra("demo", "demo", ["matplotlib", "tqdm"])
    from .demo import FP16_AMPSCALER, FP16_HEADROOM, FP32, DemoConfig
    from .demo.run import DEMO_FILES, GROWTH_INTERVAL, run_demo, summary_table

    if args.out is not None and not args.overwrite:
        earlier = [name for name in DEMO_FILES if (args.out / name).exists()]
        if earlier:
            raise CommandError(
                f"--out {args.out} already holds an earlier demo's results ({', '.join(earlier)}); "
                "pass a new folder, or --overwrite to replace them."
            )
    out = output_folder(args.out if args.out is not None else _new_demo_folder())
    config = DemoConfig(steps=args.steps, seed=args.seed)
    ways = "four" if args.policy == "headroom" else "three"
    print(f"Training the demo model {ways} ways, {config.steps} steps each ...", flush=True)
    try:
        outcome = run_demo(config, out, policy=args.policy)
    except OSError as error:
        raise CommandError(f"cannot write into {out} ({error.strerror or error}).") from error
    print()
    print(summary_table(outcome))
    print()
    print(
        f"fp16 without scaling ends {outcome.unscaled_over_scaled:.1f}x above fp16 with "
        f"ampscaler; ampscaler ends {outcome.scaled_vs_fp32:+.1%} from fp32."
    )
    if FP16_HEADROOM in outcome.results:
        headroom = outcome.results[FP16_HEADROOM]
        print(
            f"HeadroomPolicy skipped {headroom.skipped_steps} steps where growing every "
            f"{GROWTH_INTERVAL} steps skipped {outcome.results[FP16_AMPSCALER].skipped_steps}; "
            f"it ends {headroom.final_loss / outcome.results[FP32].final_loss - 1:+.1%} from "
            "fp32."
        )
    print(f"Wrote {', '.join(path.name for path in outcome.files)} to {out}/")
    print(f"Every arm's charts: python -m ampscaler report {out / 'steps.jsonl'}")
    return 0


# ---------------------------------------------------------------------- entry point

# ---------------------------------------------------------------------- run


def _add_run(commands: _Commands) -> None:
    parser = commands.add_parser(
        "run",
        help="run a script or module with torch's scalers patched (settings: AMPSCALER_PATCH)",
        description=(
            "Patch torch (ampscaler.patch_torch) with the settings in the environment variable "
            "AMPSCALER_PATCH, a JSON object such as '{\"hysteresis\": 2}', then run SCRIPT or "
            "-m MODULE with the arguments after it, as python would. For processes a launcher "
            "starts: torchrun --nproc-per-node 2 -m ampscaler run train.py --lr 1e-4"
        ),
    )
    parser.add_argument(
        "-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ...",
        help="run the module (then its arguments) as python -m does",
    )  # fmt: skip
    parser.add_argument(
        "target", nargs=argparse.REMAINDER, metavar="SCRIPT ...",
        help="the script to run, then its arguments",
    )  # fmt: skip
    parser.set_defaults(run=_run_target)


def _run_target(args: argparse.Namespace) -> int:
    module: list[str] | None = args.module
    target: list[str] = args.target
    if not (module or target):
        raise CommandError(
            "name what to run: ampscaler run train.py [ARGS], or ampscaler run -m "
            "package.module [ARGS]."
        )
    from .integrations.patch import setup_hook

    try:
        setup_hook()
    except InvalidConfigError as error:
        raise CommandError(str(error)) from error
    if module:
        sys.argv = module
        runpy.run_module(module[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        sys.path[0] = os.path.dirname(os.path.abspath(target[0]))  # as python script.py does
        runpy.run_path(target[0], run_name="__main__")
    # DDP and FSDP keep their process group in reference cycles: freed here, while Python is
    # whole, gloo's threads are joined; left to interpreter shutdown, a process group still
    # alive aborts the rank after its work is done ("terminate called without an active
    # exception").
    gc.collect()
    return 0


COMMANDS: tuple[Callable[[_Commands], None], ...] = (
    _add_demo,
    _add_report,
    _add_run,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command of :data:`COMMANDS`."""
    parser = _OneLineParser(
        prog="ampscaler",
        description="ampscaler: dynamic loss scaling for fp16 training in PyTorch.",
    )
    parser.add_argument(
        "--version", action="version", version=f"ampscaler {__version__} (torch {torch_version})"
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
