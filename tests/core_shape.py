"""Measures of the package's shape: how far optional features reach into the core.

``python tests/core_shape.py [SRC]`` prints them (``SRC`` defaults to this checkout's
``src/ampscaler``); ``tests/test_core_shape.py`` holds them to the design's targets
(docs/design.md). Everything is read from the source with :mod:`ast`, so docstrings, comments
and strings never count.

- **feature names in the core**: references (names, attributes, imported names) in the core
  modules to classes and functions defined in an optional feature's module (the HeadroomPolicy
  and its meter, guards, observers, master weights, flat buffers), protocols left out;
- **type checks on policies and state**: ``isinstance``/``issubclass`` calls outside the policy
  and state modules whose second argument names a policy or state class;
- **settle calls**: calls of a method named ``settle`` outside ``state.py`` (the state settles
  itself on every read);
- **long functions**: function bodies of more than 50 lines anywhere in the package;
- **a default iteration, traced** (:func:`trace_default_iteration`): ``scale``, ``backward``,
  ``unscale_``, ``step``, ``update`` with nothing attached, the third iteration followed with
  ``sys.setprofile``: which of the package's modules it enters, how many times a call goes from
  one of its modules into another (a jump between files), and whether it runs anything of
  ``observe/``;
- **branches on optional parts**: ``self._x is None`` / ``is not None`` in ``scaler.py`` on an
  attribute that holds an optional part (anything but the configuration);
- **the policy protocol**: the public methods and properties of ``ampscaler.Policy``;
- **lines of code**: of the library without ``integrations/``, ``demo/``, ``cli.py`` and
  ``report.py``, docstrings, comments and blank lines aside.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

SRC = Path(__file__).resolve().parents[1] / "src" / "ampscaler"

#: The modules a reader follows one step through (relative to the package).
CORE = (
    "scaler.py",
    "state.py",
    "checkpoint.py",
    "compat.py",
    "iteration.py",
    "grads/__init__.py",
    "grads/collect.py",
    "grads/check.py",
    "grads/fused.py",
    "grads/pow2.py",
)

#: Optional features: delete one of these and the core should still stand.
OPTIONAL = (
    "headroom.py",
    "policy/headroom.py",
    "guards.py",
    "master.py",
    "grads/flat.py",
    "observe",
)

#: Where policy and state types may be asked what they are.
TYPE_HOMES = ("policy.py", "policy", "state.py")

POLICY_AND_STATE = {
    "Policy",
    "ScalePolicy",
    "StaticPolicy",
    "HeadroomPolicy",
    "PolicyState",
    "ScaleState",
    "HeadroomState",
    "LiveState",
    "HostState",
    "ScalerState",
}

LONGEST_BODY = 50


def _modules(root: Path, entries: tuple[str, ...]) -> Iterator[Path]:
    for entry in entries:
        path = root / entry
        if path.is_dir():
            yield from sorted(path.rglob("*.py"))
        elif path.exists():
            yield path


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


#: Optional features' classes that lived beside core code in earlier layouts (so that the
#: measure reads the same before and after a feature moves into its own module).
FEATURE_CLASSES = {"HeadroomPolicy", "HeadroomState", "HeadroomMeter", "MasterWeightOptimizer"}


def _is_protocol(node: ast.ClassDef) -> bool:
    return any("Protocol" in ast.unparse(base) for base in node.bases)


def feature_names(root: Path) -> set[str]:
    """Top-level classes and functions of the optional features' modules; protocols (the
    plug-in points, such as ``Guard`` and ``Sink``) are what the core may name, and are left
    out."""
    names: set[str] = set(FEATURE_CLASSES)
    for path in _modules(root, OPTIONAL):
        for node in _tree(path).body:
            if isinstance(node, ast.ClassDef) and _is_protocol(node):
                continue
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
                names.add(node.name)
    return names


def _referenced(node: ast.AST) -> Iterator[str]:
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            yield child.id
        elif isinstance(child, ast.Attribute):
            yield child.attr
        elif isinstance(child, ast.alias):
            yield child.asname or child.name.split(".")[-1]


@dataclass(frozen=True)
class Mention:
    """One place a name appears."""

    module: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} {self.name}"


def _relative(root: Path, path: Path) -> str:
    return str(path.relative_to(root))


def feature_mentions(root: Path) -> list[Mention]:
    """References in the core modules to optional features' classes and functions."""
    features = feature_names(root)
    found = []
    for path in _modules(root, CORE):
        for node in ast.walk(_tree(path)):
            names: list[str] = []
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.alias):
                names = [node.asname or node.name.split(".")[-1]]
            for name in names:
                if name in features:
                    line = getattr(node, "lineno", 0)
                    found.append(Mention(_relative(root, path), line, name))
    return found


def _in_type_home(root: Path, path: Path) -> bool:
    relative = _relative(root, path)
    return any(relative == home or relative.startswith(home + "/") for home in TYPE_HOMES)


def type_checks(root: Path) -> list[Mention]:
    """``isinstance``/``issubclass`` on a policy or state class outside their modules."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if _in_type_home(root, path):
            continue
        for node in ast.walk(_tree(path)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
            ):
                named = set(_referenced(node.args[1])) & POLICY_AND_STATE
                for name in sorted(named):
                    found.append(Mention(_relative(root, path), node.lineno, name))
    return found


def settle_calls(root: Path) -> list[Mention]:
    """Calls of ``.settle()`` on the state outside ``state.py``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if _relative(root, path) == "state.py":
            continue
        for node in ast.walk(_tree(path)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "settle"
                and "state" in ast.unparse(node.func.value).lower()
            ):
                found.append(Mention(_relative(root, path), node.lineno, "settle"))
    return found


def long_functions(root: Path, limit: int = LONGEST_BODY) -> list[Mention]:
    """Functions whose body (after the docstring) spans more than ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if (
                    body
                    and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)
                ):
                    body = body[1:]
                if not body:
                    continue
                first = body[0].lineno
                last = max(getattr(n, "end_lineno", first) or first for n in body)
                lines = last - first + 1
                if lines > limit:
                    name = f"{node.name} ({lines})"
                    found.append(Mention(_relative(root, path), node.lineno, name))
    return found


def scaler_bases(root: Path) -> list[str]:
    """The base classes of ``GradScaler``."""
    for node in ast.walk(_tree(root / "scaler.py")):
        if isinstance(node, ast.ClassDef) and node.name == "GradScaler":
            return [ast.unparse(base) for base in node.bases]
    return []


#: Attributes of ``GradScaler`` that hold its configuration, not an optional part.
CONFIGURATION = {"_device", "_enabled", "_max_consecutive_skips", "_init_scale"}


def optional_branches(root: Path) -> list[Mention]:
    """``self._x is None`` / ``self._x is not None`` in ``scaler.py`` where ``_x`` holds an
    optional part (the rank agreement, the planner, ...), not the configuration."""
    found = []
    for node in ast.walk(_tree(root / "scaler.py")):
        if (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], (ast.Is, ast.IsNot))
            and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value is None
            and isinstance(node.left, ast.Attribute)
            and isinstance(node.left.value, ast.Name)
            and node.left.value.id == "self"
            and node.left.attr not in CONFIGURATION
        ):
            found.append(Mention("scaler.py", node.lineno, node.left.attr))
    return found


def policy_members(root: Path) -> list[str]:
    """The public methods and properties of ``Policy`` (``policy/base.py``)."""
    for node in _tree(root / "policy" / "base.py").body:
        if isinstance(node, ast.ClassDef) and node.name == "Policy":
            return [
                item.name
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                and not item.name.startswith("_")
            ]
    return []


#: Left out of the library's size: adapters, the demo, the command line and the plots.
NOT_COUNTED = ("integrations", "demo", "cli.py", "report.py")


def _code_lines(path: Path) -> int:
    source = path.read_text()
    prose: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            prose.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    code: set[int] = set()
    skipped = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped and token.type != tokenize.ENDMARKER:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - prose)


def lines_of_code(root: Path) -> int:
    """Lines of code of the library (without :data:`NOT_COUNTED`): docstrings and other bare
    strings, comments and blank lines aside."""
    return sum(
        _code_lines(path)
        for path in sorted(root.rglob("*.py"))
        if path.relative_to(root).parts[0] not in NOT_COUNTED
    )


@dataclass(frozen=True)
class Trace:
    """What one traced iteration ran of the package."""

    modules: list[str]  # entered, relative to the package
    jumps: list[tuple[str, str, str]]  # (caller's module, callee's module, function)

    @property
    def observers(self) -> list[str]:
        """The modules of ``observe/`` it entered."""
        return [module for module in self.modules if module.startswith("observe/")]


def trace_default_iteration(iterations: int = 3) -> Trace:
    """Run ``iterations`` default iterations of a tiny model (``scale``, ``backward``,
    ``unscale_``, ``step``, ``update``; nothing attached) and trace the last with
    ``sys.setprofile``."""
    import torch

    import ampscaler

    package = Path(ampscaler.__file__).resolve().parent

    def module(frame: FrameType | None) -> str | None:
        if frame is None:
            return None
        path = Path(frame.f_code.co_filename).resolve()
        return str(path.relative_to(package)) if package in path.parents else None

    calls: list[tuple[str | None, str, str]] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        callee = module(frame) if event == "call" else None
        if callee is not None:
            calls.append((module(frame.f_back), callee, frame.f_code.co_name))

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu")
    for number in range(iterations):
        traced = number == iterations - 1
        if traced:
            sys.setprofile(profile)
        try:
            scaler.scale(model(torch.ones(1, 4)).sum()).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        finally:
            sys.setprofile(None)
        opt.zero_grad()
    modules = sorted({callee for _, callee, _ in calls})
    jumps = [(a, b, name) for a, b, name in calls if a is not None and a != b]
    return Trace(modules, jumps)


def main(argv: list[str]) -> None:
    root = Path(argv[1]).resolve() if len(argv) > 1 else SRC
    sections = [
        ("feature names in the core", feature_mentions(root)),
        ("type checks on policies and state outside their modules", type_checks(root)),
        ("settle() calls outside state.py", settle_calls(root)),
        (f"function bodies over {LONGEST_BODY} lines", long_functions(root)),
    ]
    for title, mentions in sections:
        print(f"{title}: {len(mentions)}")
        for mention in mentions:
            print(f"    {mention}")
    print(f"GradScaler's base classes: {len(scaler_bases(root))} {scaler_bases(root)}")
    branches = optional_branches(root)
    print(f"self._x is (not) None on optional parts in scaler.py: {len(branches)}")
    for mention in branches:
        print(f"    {mention}")
    members = policy_members(root)
    print(f"ampscaler.Policy's public methods and properties: {len(members)} {members}")
    print(f"lines of code (without {', '.join(NOT_COUNTED)}): {lines_of_code(root)}")
    trace = trace_default_iteration()
    print(f"a default iteration enters {len(trace.modules)} modules: {trace.modules}")
    print(
        f"  and jumps between files {len(trace.jumps)} times; observe/ entered: {trace.observers}"
    )
    for caller, callee, name in trace.jumps:
        print(f"    {caller} -> {callee}:{name}")


if __name__ == "__main__":
    main(sys.argv)
