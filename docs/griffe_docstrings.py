"""Griffe extension for the API reference: read ampscaler's docstrings as their authors meant.

The docstrings follow Google style as Sphinx/napoleon reads it; mkdocstrings differs in two places:

- an ``Example:`` section is an admonition to it, so the ``>>>`` lines inside render as quotes;
  this renames it ``Examples:``, which mkdocstrings renders as a code block.
- Sphinx roles (``:class:`~ampscaler.GradScaler```) are not markdown; this renders them as code
  spans, shortened after ``~`` as Sphinx shortens them, with ``()`` after functions and methods.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_SECTION = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(class|meth|attr|func|mod|exc|data|obj):`(~?)([^`]+)`")


def _role_to_code(match: re.Match[str]) -> str:
    kind, short, target = match.groups()
    name = target.rsplit(".", 1)[-1] if short else target
    if kind in ("meth", "func"):
        name += "()"
    return f"`{name}`"


def _rewrite(obj: griffe.Object) -> None:
    docstring = obj.docstring
    if docstring is not None:
        value = _EXAMPLE_SECTION.sub(r"\1Examples:", docstring.value)
        docstring.value = _ROLE.sub(_role_to_code, value)


class SphinxStyleDocstrings(griffe.Extension):
    """Rewrite each docstring once the object tree is built, before mkdocstrings parses it."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        _rewrite(obj)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        # The top-level package gets this hook instead of on_object.
        _rewrite(pkg)
