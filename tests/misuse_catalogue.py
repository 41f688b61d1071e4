"""Every wrong call order and bad argument, with the error a user gets; source of docs/misuse.md.

Each ``Misuse`` is a few statements run after a prelude, against ``ampscaler.GradScaler`` and,
where torch has the same API, against ``torch.amp.GradScaler``. tests/test_misuse.py checks
every row (the exception class, the words the message must contain, that it is also the
exception torch raises) and that docs/misuse.md is exactly what :func:`render` writes from the
errors raised now. After changing a message or a row, regenerate the page::

    python tests/misuse_catalogue.py
"""

from __future__ import annotations

import copy
import gc
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import ampscaler

DOC = Path(__file__).resolve().parent.parent / "docs" / "misuse.md"

PRELUDES = {
    "none": "",
    "model": (
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        'scaler = GradScaler("cpu")\n'
    ),
    "backward": (
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        'scaler = GradScaler("cpu")\n'
        "scaler.scale(model(torch.ones(1, 2)).sum()).backward()\n"
    ),
    "group": (
        'dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)\n'
        'scaler = GradScaler("cpu", process_group=dist.group.WORLD)\n'
    ),
}


@dataclass(frozen=True)
class Misuse:
    """One wrong call.

    Attributes:
        section: the heading it is listed under.
        code: statements run after ``PRELUDES[prelude]``; the last one raises.
        raises: the exception class ampscaler raises (exactly this class).
        mentions: words the message must contain (the argument's name, the fix).
        prelude: which setup runs first.
        in_torch: whether torch's scaler has this API, so the row can be compared with it.
        deviation: why ampscaler's exception is not a subclass of torch's, where it is not.
    """

    section: str
    code: str
    raises: type[BaseException]
    mentions: tuple[str, ...] = ()
    prelude: str = "none"
    in_torch: bool = True
    deviation: str = ""


_C, _O, _N, _S, _K, _H, _R, _P, _G = (
    "Constructor arguments",
    "Call order",
    "update(new_scale)",
    "Checkpoints and copies",
    "Other calls",
    "Guards, watches and summaries",
    "HeadroomPolicy",
    "Replay (attempts())",
    "Process groups",
)
_CFG = ampscaler.InvalidConfigError
_USE = ampscaler.ScalerUsageError
_SD = ampscaler.InvalidStateDictError
_SAVED = 'saved = GradScaler("cpu").state_dict(); '

CASES: tuple[Misuse, ...] = (
    Misuse(_C, 'GradScaler("cpu", growth_factor=1.0)', _CFG, ("growth_factor", "> 1.0")),
    Misuse(_C, 'GradScaler("cpu", growth_factor=float("inf"))', _CFG, ("growth_factor",)),
    Misuse(_C, 'GradScaler("cpu", backoff_factor=1.0)', _CFG, ("backoff_factor", "(0, 1)")),
    Misuse(_C, 'GradScaler("cpu", backoff_factor=0.0)', _CFG, ("backoff_factor", "(0, 1)")),
    Misuse(_C, 'GradScaler("cpu", growth_interval=0)', _CFG, ("growth_interval", ">= 1")),
    Misuse(_C, 'GradScaler("cpu", growth_interval=2.5)', _CFG, ("growth_interval", "int")),
    Misuse(_C, 'GradScaler("cpu", init_scale=0.0)', _CFG, ("init_scale", "> 0")),
    Misuse(_C, 'GradScaler("cpu", init_scale=-1.0)', _CFG, ("init_scale", "> 0")),
    Misuse(_C, 'GradScaler("cpu", init_scale=float("nan"))', _CFG, ("init_scale", "finite")),
    Misuse(_C, 'GradScaler("cpu", init_scale=float("inf"))', _CFG, ("init_scale", "finite")),
    Misuse(_C, 'GradScaler("cpu", init_scale=1e39)', _CFG, ("init_scale", "float32")),
    Misuse(_C, 'GradScaler("cpu", init_scale="65536")', _CFG, ("init_scale", "number")),
    Misuse(_C, 'GradScaler("cpu", init_scale=1e-40)', _CFG, ("init_scale", "2**-126")),
    Misuse(_C, "GradScaler(0)", _CFG, ("device", "'cpu'")),
    Misuse(_C, "GradScaler(opt)", _CFG, ("device", "SGD", "scaler.step(optimizer)"), "model"),
    Misuse(_C, 'GradScaler("gpu")', _CFG, ("device", "'cpu'")),
    Misuse(_C, 'GradScaler("cpu", hysteresis=0)', _CFG, ("hysteresis", ">= 1"), in_torch=False),
    Misuse(_C, 'GradScaler("cpu", hysteresis=2.0)', _CFG, ("hysteresis", "int"), in_torch=False),
    Misuse(_C, 'GradScaler("cpu", min_scale=0.0)', _CFG, ("min_scale", "> 0"), in_torch=False),
    Misuse(
        _C,
        'GradScaler("cpu", max_scale=float("inf"))',
        _CFG,
        ("max_scale", "finite"),
        in_torch=False,
    ),
    Misuse(
        _C,
        'GradScaler("cpu", init_scale=3.0, min_scale=4.0, max_scale=2.0)',
        _CFG,
        ("min_scale", "max_scale"),
        in_torch=False,
    ),
    Misuse(
        _C,
        'GradScaler("cpu", max_scale=1024.0)',
        _CFG,
        ("init_scale", "[0, 1024.0]"),
        in_torch=False,
    ),
    Misuse(
        _C,
        'GradScaler("cpu", init_scale=0.5, min_scale=1.0)',
        _CFG,
        ("init_scale", "[1.0, inf]"),
        in_torch=False,
    ),
    Misuse(
        _C,
        'GradScaler("cpu", max_consecutive_skips=0)',
        _CFG,
        ("max_consecutive_skips", ">= 1"),
        in_torch=False,
    ),
    Misuse(
        _C,
        'GradScaler("cpu", max_consecutive_skips=2.5)',
        _CFG,
        ("max_consecutive_skips", "int"),
        in_torch=False,
    ),
    Misuse(
        _C, 'GradScaler("cpu", policy="static")', _CFG, ("policy", "StaticPolicy"), in_torch=False
    ),
    Misuse(
        _C,
        'GradScaler("cpu", policy=ScalePolicy(), hysteresis=2)',
        _CFG,
        ("policy=", "hysteresis"),
        in_torch=False,
    ),
    Misuse(
        _C,
        'GradScaler("cpu", policy={"hysteresis": 2})',
        _CFG,
        ("policy", "ScalePolicy"),
        in_torch=False,
    ),
    Misuse(_C, 'GradScaler("cpu", flat_grads="yes")', _CFG, ("flat_grads",), in_torch=False),
    Misuse(
        _C,
        'GradScaler("cpu", max_scale=1024.0)',
        _CFG,
        ("the default", "Pass an init_scale"),
        in_torch=False,
    ),
    Misuse(_K, 'GradScaler("cpu", history_size=100)', TypeError, ("history_size", "StepHistory")),
    Misuse(_K, 'GradScaler("cpu", probe_every=10)', TypeError, ("probe_every", "GradientProbe")),
    Misuse(_K, 'GradScaler("cpu", trace_nonfinite=True)', TypeError, ("trace_nonfinite", "Tracer")),
    Misuse(_K, 'GradScaler("cpu", dynamic=False)', TypeError, ("dynamic", "StaticPolicy")),
    Misuse(_O, "scaler.step(opt)", _USE, ("step()", "scaler.scale(loss)"), "model"),
    Misuse(_O, "scaler.unscale_(opt)", _USE, ("unscale_()", "scaler.scale(loss)"), "model"),
    Misuse(_O, "scaler.update()", _USE, ("update()", "scaler.scale(loss)"), "model"),
    Misuse(_O, "scaler.update()", _USE, ("No inf checks", "scaler.step(optimizer)"), "backward"),
    Misuse(_O, "scaler.unscale_(opt); scaler.unscale_(opt)", RuntimeError, ("once",), "backward"),
    Misuse(
        _O, "scaler.step(opt); scaler.unscale_(opt)", RuntimeError, ("after step()",), "backward"
    ),
    Misuse(_O, "scaler.step(opt); scaler.step(opt)", RuntimeError, ("update()",), "backward"),
    Misuse(
        _O,
        "scaler.unscale_(opt); scaler.scale(model(torch.ones(1, 2)).sum())",
        _USE,
        ("after scaler.unscale_(optimizer)", "scaler.update()"),
        "backward",
    ),
    Misuse(_O, "scaler.step(opt, closure=lambda: 0.0)", RuntimeError, ("Closure",), "backward"),
    Misuse(
        _O,
        "frozen = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1); "
        "scaler.step(frozen)",
        _USE,
        ("No inf checks", "none of its parameters has a gradient"),
        "backward",
    ),
    Misuse(
        _O,
        "frozen = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], fused=True); "
        "scaler.step(frozen); scaler.update()",
        _USE,
        ("No inf checks",),
        "backward",
    ),
    Misuse(
        _O,
        "half = torch.nn.Linear(2, 1).half(); "
        "opt16 = torch.optim.SGD(half.parameters(), lr=0.1); "
        "scaler.scale(half(torch.ones(1, 2).half()).float().sum()).backward(); "
        "scaler.unscale_(opt16)",
        ValueError,
        ("FP16", "autocast", "MasterWeightOptimizer"),
        "model",
    ),
    Misuse(
        _O,
        'scaler.step("sgd")',
        TypeError,
        ("Optimizer", "str"),
        "backward",
        deviation="torch fails inside with AttributeError ('str' object has no attribute "
        "'param_groups'); a TypeError says what was wrong with the argument.",
    ),
    Misuse(_O, "scaler.scale([1.0])", ValueError, ("Tensor", "float"), "model"),
    Misuse(_O, 'scaler.scale("loss")', ValueError, ("Tensor", "str"), "model"),
    Misuse(_N, "scaler.step(opt); scaler.update(0.0)", _CFG, ("new_scale", "> 0"), "backward"),
    Misuse(
        _N,
        'scaler.step(opt); scaler.update(float("nan"))',
        _CFG,
        ("new_scale", "finite"),
        "backward",
    ),
    Misuse(
        _N,
        "scaler.step(opt); scaler.update(torch.ones(2))",
        _CFG,
        ("new_scale", "1-element"),
        "backward",
    ),
    Misuse(
        _N,
        "scaler.step(opt); scaler.update(torch.ones((), requires_grad=True))",
        _CFG,
        ("new_scale", "requires_grad"),
        "backward",
    ),
    Misuse(
        _N,
        'scaler.step(opt); scaler.update("2.0")',
        _CFG,
        ("new_scale", "number"),
        "backward",
        deviation="torch fails inside with AttributeError ('str' object has no attribute "
        "'device'); ampscaler names the argument and the values it accepts.",
    ),
    Misuse(
        _N,
        'scaler = GradScaler("cpu", init_scale=8.0, max_scale=1024.0); '
        "scaler.scale(model(torch.ones(1, 2)).sum()).backward(); "
        "scaler.step(opt); scaler.update(4096.0)",
        _CFG,
        ("new_scale", "1024.0"),
        "model",
        in_torch=False,
    ),
    Misuse(_S, "scaler.load_state_dict({})", RuntimeError, ("empty", "disabled"), "model"),
    Misuse(_S, 'scaler.load_state_dict({"scale": 1024.0})', _SD, ("_growth_tracker",), "model"),
    Misuse(_S, 'scaler.load_state_dict(["scale"])', TypeError, ("state_dict()",), "model"),
    Misuse(
        _S,
        _SAVED + 'scaler.load_state_dict({**saved, "scale": -1.0})',
        _SD,
        ("scale", "> 0"),
        "model",
    ),
    Misuse(
        _S,
        _SAVED + 'scaler.load_state_dict({**saved, "scale": 0.0})',
        _SD,
        ("scale", "2**-126", "collapsed run", "state_dict['scale']"),
        "model",
    ),
    Misuse(
        _S,
        _SAVED + 'scaler.load_state_dict({**saved, "scale": 1e-40})',
        _SD,
        ("scale", "2**-126"),
        "model",
    ),
    Misuse(
        _S,
        _SAVED + 'scaler.load_state_dict({**saved, "_growth_tracker": -1})',
        _SD,
        ("_growth_tracker", ">= 0"),
        "model",
    ),
    Misuse(
        _S,
        _SAVED + 'scaler.load_state_dict({**saved, "growth_factor": 0.5})',
        _SD,
        ("growth_factor",),
        "model",
    ),
    Misuse(
        _S,
        _SAVED + 'scaler.load_state_dict({**saved, "stats": {"steps": -3}})',
        _SD,
        ("stats['steps']",),
        "model",
        in_torch=False,
    ),
    Misuse(
        _S,
        _SAVED + 'scaler.load_state_dict({**saved, "max_consecutive_skips": 0})',
        _SD,
        ("max_consecutive_skips",),
        "model",
        in_torch=False,
    ),
    Misuse(
        _S,
        _SAVED + 'scaler.load_state_dict({**saved, "_hysteresis_tracker": 5})',
        _SD,
        ("_hysteresis_tracker", "hysteresis"),
        "model",
        in_torch=False,
    ),
    Misuse(
        _S,
        _SAVED + 'scaler.load_state_dict({**saved, "_growth_tracker": 2**31})',
        _SD,
        ("_growth_tracker", "2**31 - 1"),
        "model",
    ),
    Misuse(
        _S,
        _SAVED + 'scaler.load_state_dict({**saved, "stats": {"steps": 2**64}})',
        _SD,
        ("stats['steps']", "2**63 - 1"),
        "model",
        in_torch=False,
    ),
    Misuse(
        _S,
        _SAVED + 'scaler.load_state_dict({**saved, "hysteresis": 2**31})',
        _SD,
        ("hysteresis", "2**31 - 1"),
        "model",
        in_torch=False,
    ),
    Misuse(_S, "scaler.step(opt); copy.deepcopy(scaler)", _USE, ("pickled",), "backward"),
    Misuse(
        _S,
        'scaler.load_state_dict(GradScaler("cpu", init_scale=8.0).state_dict())',
        _USE,
        ("middle of an iteration", "after scaler.update()"),
        "backward",
    ),
    Misuse(
        _K,
        'GradScaler("cpu", policy=StaticPolicy()).set_growth_factor(4.0)',
        _USE,
        ("never moves", "ScalePolicy"),
        in_torch=False,
    ),
    Misuse(_K, "scaler.set_growth_factor(0.5)", _CFG, ("growth_factor",), "model"),
    Misuse(_K, "scaler.set_backoff_factor(1.5)", _CFG, ("backoff_factor",), "model"),
    Misuse(_K, "scaler.set_growth_interval(0)", _CFG, ("growth_interval",), "model"),
    Misuse(_K, "scaler.watch(opt)", TypeError, ("nn.Module",), "model", in_torch=False),
    Misuse(_H, "SpikeGuard(sigma=0.0)", _CFG, ("sigma", "> 0"), in_torch=False),
    Misuse(_H, "SpikeGuard(window=1)", _CFG, ("window", ">= 2"), in_torch=False),
    Misuse(_H, "SpikeGuard(warmup=-1)", _CFG, ("warmup", ">= 0"), in_torch=False),
    Misuse(
        _H,
        "scaler.add_guard(object())",
        TypeError,
        ("add_guard", "SpikeGuard"),
        "model",
        in_torch=False,
    ),
    Misuse(
        _H,
        "g = SpikeGuard(); scaler.add_guard(g); scaler.add_guard(g)",
        _CFG,
        ("already",),
        "model",
        in_torch=False,
    ),
    Misuse(
        _H, "scaler.step_skipped(opt)", _USE, ("scaler.step(optimizer)",), "model", in_torch=False
    ),
    Misuse(_H, "CollapseWatch(scale_drop=2.0)", _CFG, ("scale_drop", "(0, 1)"), in_torch=False),
    Misuse(_H, "CollapseWatch(window=1)", _CFG, ("window", ">= 10"), in_torch=False),
    Misuse(_H, "LoggingSink(every=0)", _CFG, ("every", ">= 1"), in_torch=False),
    Misuse(_H, 'scaler.on("colapse", print)', _CFG, ("'collapse'",), "model", in_torch=False),
    Misuse(_R, "HeadroomPolicy(margin=0.5)", _CFG, ("margin", ">= 1"), in_torch=False),
    Misuse(
        _R, "HeadroomPolicy(history_length=0)", _CFG, ("history_length", ">= 1"), in_torch=False
    ),
    Misuse(
        _R,
        "HeadroomPolicy(backoff_factor=0.3)",
        _CFG,
        ("backoff_factor", "power of two"),
        in_torch=False,
    ),
    Misuse(
        _R, "HeadroomPolicy(first_scale=1000.0)", _CFG, ("first_scale", "2.0**10"), in_torch=False
    ),
    Misuse(
        _R,
        "HeadroomPolicy(min_scale=2.0**8, max_scale=2.0**4)",
        _CFG,
        ("min_scale", "max_scale"),
        in_torch=False,
    ),
    Misuse(
        _R,
        'scaler = GradScaler("cpu", policy=HeadroomPolicy()); '
        "scaler.scale(model(torch.ones(1, 2)).sum()).backward(); "
        "scaler.step(opt); scaler.update(1000.0)",
        _CFG,
        ("new_scale", "power of two"),
        "model",
        in_torch=False,
    ),
    Misuse(
        _R,
        'GradScaler("cpu", policy=HeadroomPolicy()).set_growth_interval(10)',
        _USE,
        ("measured gradients", "ScalePolicy"),
        in_torch=False,
    ),
    Misuse(
        _R,
        'saved = GradScaler("cpu", policy=HeadroomPolicy()).state_dict(); '
        'scaler.load_state_dict({**saved, "headroom": {**saved["headroom"], "history": [1.0]}})',
        _SD,
        ("headroom['history']", "history_length"),
        "model",
        in_torch=False,
    ),
    Misuse(
        _P,
        "next(iter(scaler.attempts(max_attempts=0)))",
        _CFG,
        ("max_attempts", ">= 1"),
        "model",
        in_torch=False,
    ),
    Misuse(
        _P,
        "for _ in scaler.attempts(): scaler.scale(model(torch.ones(1, 2)).sum()).backward(); "
        "scaler.step(opt)",
        _USE,
        ("did not call update()", "exactly once"),
        "model",
        in_torch=False,
    ),
    Misuse(
        _P,
        "for _ in scaler.attempts(): "
        "[(scaler.scale(model(torch.ones(1, 2)).sum()).backward(), scaler.step(opt), "
        "scaler.update()) for _ in range(2)]",
        _USE,
        ("called more than once", "exactly once"),
        "model",
        in_torch=False,
    ),
    Misuse(
        _P,
        "ScalePolicy(backoff_on_nonfinite_loss=0)",
        _CFG,
        ("backoff_on_nonfinite_loss", "True or False"),
        in_torch=False,
    ),
    Misuse(
        _G,
        "frozen = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1); "
        "scaler.scale(torch.ones(())); scaler.step(frozen)",
        _USE,
        ("No inf checks", "on any rank of process_group"),
        "group",
        in_torch=False,
    ),
    Misuse(
        _G,
        "frozen = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], fused=True); "
        "scaler.scale(torch.ones(())); scaler.step(frozen); scaler.update()",
        _USE,
        ("No inf checks", "update()"),
        "group",
        in_torch=False,
    ),
)


def run(case: Misuse, factory: type) -> BaseException | None:
    """Run ``case`` against a scaler class; the exception it raised, or ``None``."""
    namespace = {
        "torch": torch, "copy": copy, "dist": dist, "GradScaler": factory,
        "ScalePolicy": ampscaler.ScalePolicy, "StaticPolicy": ampscaler.StaticPolicy,
        "SpikeGuard": ampscaler.SpikeGuard, "CollapseWatch": ampscaler.CollapseWatch,
        "LoggingSink": ampscaler.LoggingSink, "HeadroomPolicy": ampscaler.HeadroomPolicy,
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            exec(PRELUDES[case.prelude], namespace)
            exec(case.code, namespace)
        except Exception as error:
            return error
        finally:
            if dist.is_initialized():  # the "group" prelude's world of one
                namespace.clear()
                gc.collect()  # the scaler holds the group: freed before it is destroyed
                dist.destroy_process_group()
    return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _torch_cell(case: Misuse) -> str:
    if not case.in_torch:
        return "no such API"
    error = run(case, torch.amp.GradScaler)
    if error is None:
        return "accepted"
    return f"`{type(error).__name__}`"


def render() -> str:
    """docs/misuse.md, from the errors the catalogue's calls raise now."""
    lines = [
        "# Misuse catalogue",
        "",
        "Every wrong call order and bad argument we know of, with the exception and the exact",
        "message `ampscaler.GradScaler` gives. Each exception is also the built-in type that",
        "`torch.amp.GradScaler` raises in the same situation (the last column), so `except`",
        "clauses written for torch keep working: `InvalidConfigError` is a `ValueError` and an",
        "`AssertionError`, `ScalerUsageError` a `RuntimeError` and an `AssertionError`,",
        '`InvalidStateDictError` a `KeyError` and a `ValueError`. "accepted" means torch takes',
        "the value silently (and usually fails later, or trains with it).",
        "",
        "Generated by `python tests/misuse_catalogue.py`; `tests/test_misuse.py` runs every row",
        "and fails when this page and the library disagree.",
        "",
        "Rows start from one of these preludes (`scaler` is `ampscaler.GradScaler`):",
        "",
    ]
    for name, code in PRELUDES.items():
        if code:
            lines += [f"`{name}`:", "", "```python", code.rstrip(), "```", ""]
    deviations = []
    for section in dict.fromkeys(case.section for case in CASES):
        lines += [
            f"## {section}",
            "",
            "| Call | Prelude | ampscaler raises | Message | torch raises |",
            "| --- | --- | --- | --- | --- |",
        ]
        for case in CASES:
            if case.section != section:
                continue
            error = run(case, ampscaler.GradScaler)
            message = str(error) if error is not None else "(no error)"
            kind = type(error).__name__ if error is not None else "nothing"
            torch_kind = _torch_cell(case)
            if case.deviation:
                deviations.append(case)
                torch_kind += f" [{len(deviations)}]"
            lines.append(
                f"| `{_cell(case.code)}` | {case.prelude} | `{kind}` | {_cell(message)} "
                f"| {torch_kind} |"
            )
        lines.append("")
    if deviations:
        lines += ["## Where the exception type differs from torch's", ""]
        lines += [f"{i}. `{_cell(c.code)}`: {c.deviation}" for i, c in enumerate(deviations, 1)]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(render())
    sys.stdout.write(f"wrote {DOC}\n")
