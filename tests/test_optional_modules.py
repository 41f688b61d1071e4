"""The test of the shape (issue 36): delete an optional feature's module and the core still
builds and trains after removing only its import and registration lines.

The package is copied to a temporary directory, the feature's modules are deleted, and every
line of code that names what they define (their public module-level names) is removed: a name
in an import list is taken out of the list; a line that is only a registration (an entry of
``__all__`` or of a table, a hook added to the scaler's list, the object an opt-in switch turns
on) is dropped, and ``pass`` stands in for it inside a block. A name in an annotation stays where
the module has ``from __future__ import annotations`` (every core module that annotates does):
its annotations are never evaluated, so the copy imports and runs with them (a type checker
would ask for them to go too). Any other line naming it fails the test: the core would need
more than its registration removed. Then a subprocess trains, checkpoints and resumes with the
copy.
"""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

import ampscaler

PACKAGE = Path(ampscaler.__file__).resolve().parent

#: Each optional feature: its modules (relative to the package; a folder: all of it) and names
#: it defines that the core must do without (besides every public name its modules define).
FEATURES = {
    "master weights": (["master.py"], ["MasterWeightOptimizer"]),
    "HeadroomPolicy and its meter": (
        ["policy/headroom.py", "policy/meter.py"],
        ["HeadroomPolicy", "HeadroomState", "HeadroomMeter"],
    ),
    "guards": (["guards.py"], ["SpikeGuard", "GuardSet", "Guard", "StepMeasurements"]),
    "observers": (["observe"], ["Monitor", "Sink", "StepRecord", "OverflowReport"]),
    "flat buffers": (["grads/flat.py"], ["GradPlanner", "GradPlan"]),
}

#: What a registration line looks like once the name is known to be on it.
_REGISTRATION = (
    r'^\s*"{name}",?\s*$',  # an entry of __all__
    r"^\s*{name},\s*$",  # a name in a parenthesized import list
    r'^\s*"?{name}"?\s*:\s*.*,\s*$',  # an entry of a table
    r"^\s*(self\._\w+ = )?self\._hooks\.add\({name}\(.*\)\).*$",  # a hook registered
    r"^\s*self\._\w+ = {name}\(\)$",  # the object an opt-in switch turns on (inside its if)
)

#: Loaded only where used (the command line, the demo, the adapters): not the core.
_NOT_CORE = ("integrations", "demo", "cli.py", "report.py")

TRAIN = """
import io, torch, ampscaler
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
for step in range(4):
    loss = model(torch.ones(2, 4)).sum() * (float("inf") if step == 1 else 1.0)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
buffer = io.BytesIO()
torch.save(scaler.state_dict(), buffer)
resumed = ampscaler.GradScaler("cpu")
resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
print(scaler.get_scale(), resumed.get_scale(), scaler.metrics("")["skips"])
"""


def _defined_names(module: Path) -> set[str]:
    """The public names ``module`` defines at its top level (classes, functions, constants)."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return {name for name in names if not name.startswith("_")}


def _annotation_spots(source: str) -> set[tuple[int, int]]:
    """Where names stand in annotations, as ``(line, column)``, if the module never evaluates
    its annotations (``from __future__ import annotations``); else none."""
    tree = ast.parse(source)
    if not any(
        isinstance(node, ast.ImportFrom)
        and node.module == "__future__"
        and any(alias.name == "annotations" for alias in node.names)
        for node in tree.body
    ):
        return set()
    annotations: list[ast.expr | None] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            given = node.args
            every = [*given.posonlyargs, *given.args, *given.kwonlyargs, given.vararg, given.kwarg]
            annotations += [arg.annotation for arg in every if arg is not None] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
    return {
        (name.lineno, name.col_offset)
        for annotation in annotations
        if annotation is not None
        for name in ast.walk(annotation)
        if isinstance(name, ast.Name)
    }


def _code_lines_naming(source: str, names: set[str]) -> set[int]:
    """The lines where one of ``names`` appears as code (not in a string, a comment or an
    annotation that is never evaluated)."""
    annotated = _annotation_spots(source)
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.string in names and token.start not in annotated:
            lines.add(token.start[0])
    return lines


def _statement_starts(source: str) -> set[int]:
    """The lines that begin a statement inside a block (indented, not inside brackets): a
    line removed there leaves ``pass`` in its place, so that the block stays a block."""
    depth_at: dict[int, int] = {}
    depth = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        depth_at.setdefault(token.start[0], depth)
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
    lines = source.split("\n")
    return {n for n, d in depth_at.items() if d == 0 and lines[n - 1][:1] in (" ", "\t")}


def _strip(source: str, names: set[str], where: str) -> str:
    """``source`` without its import and registration lines for ``names``.

    Raises:
        AssertionError: a line names one of them otherwise.
    """
    lines = source.split("\n")
    entries = [rf'^\s*"{name}",?\s*$' for name in names]  # of __all__: strings, not code
    naming = _code_lines_naming(source, names)
    naming |= {n for n, line in enumerate(lines, 1) if any(re.match(e, line) for e in entries)}
    in_block = _statement_starts(source)
    for number in sorted(naming, reverse=True):
        line = lines[number - 1]
        gone = f"{line[: len(line) - len(line.lstrip())]}pass" if number in in_block else None
        found = [name for name in names if re.search(rf"\b{name}\b", line)]
        if line.lstrip().startswith(("from ", "import ")) and " import " in line + " ":
            kept = [
                item.strip()
                for item in line.split(" import ", 1)[1].split(",")
                if item.strip() and item.strip() not in names
            ]
            head = line.split(" import ", 1)[0]
            lines[number - 1] = f"{head} import {', '.join(kept)}" if kept else gone or ""
            continue
        registered = all(
            any(re.match(pattern.format(name=name), line) for pattern in _REGISTRATION)
            for name in found
        )
        assert registered, f"{where}:{number} needs more than a registration removed: {line!r}"
        if gone is None:
            del lines[number - 1]
        else:
            lines[number - 1] = gone
    return "\n".join(lines)


def _core_without(tmp_path: Path, modules: list[str], names: list[str]) -> Path:
    root = tmp_path / "site"
    copy = root / "ampscaler"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    defined = set(names)
    for module in modules:
        path = copy / module
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            defined |= _defined_names(file)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    for path in sorted(copy.rglob("*.py")):
        relative = path.relative_to(copy)
        if relative.parts[0] in _NOT_CORE:
            continue
        source = path.read_text()
        stripped = _strip(source, defined, str(relative))
        if stripped != source:
            path.write_text(stripped)
    return root


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_the_core_trains_without_an_optional_module(feature: str, tmp_path: Path) -> None:
    modules, names = FEATURES[feature]
    root = _core_without(tmp_path, modules, names)
    environment = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", TRAIN],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["512.0", "512.0", "1"]


def test_a_line_that_needs_the_feature_is_found(tmp_path: Path) -> None:
    """The stripping refuses a line that uses a deleted class beyond registering it."""
    source = 'from .x import A, B\n__all__ = [\n    "A",\n]\nvalue = A() + 1\n'
    with pytest.raises(AssertionError, match="needs more than a registration"):
        _strip(source, {"A"}, "pkg.py")
    assert _strip('from .x import A, B\n__all__ = [\n    "A",\n]\n', {"A"}, "pkg.py") == (
        "from .x import B\n__all__ = [\n]\n"
    )


def test_annotations_stay_and_emptied_blocks_keep_a_pass() -> None:
    """A name only in never-evaluated annotations is left; a removed line inside a block leaves
    ``pass``; without the ``__future__`` import an annotation is code like any other."""
    source = (
        "from __future__ import annotations\n"
        "if TYPE_CHECKING:\n"
        "    from .x import A\n"
        "def f(a: A | None) -> A:\n"
        "    if on:\n"
        "        self._a = A()\n"
    )
    assert _strip(source, {"A"}, "pkg.py") == (
        "from __future__ import annotations\n"
        "if TYPE_CHECKING:\n"
        "    pass\n"
        "def f(a: A | None) -> A:\n"
        "    if on:\n"
        "        pass\n"
    )
    with pytest.raises(AssertionError, match="needs more than a registration"):
        _strip("def f(a: A) -> None:\n    pass\n", {"A"}, "pkg.py")
