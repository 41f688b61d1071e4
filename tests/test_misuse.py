"""Every row of the misuse catalogue (tests/misuse_catalogue.py, rendered as docs/misuse.md)."""

from __future__ import annotations

import pytest
import torch

import ampscaler
from misuse_catalogue import CASES, DOC, Misuse, render, run


@pytest.mark.parametrize("case", CASES, ids=[f"{i}:{c.code[:40]}" for i, c in enumerate(CASES)])
def test_misuse_raises_the_catalogued_error(case: Misuse) -> None:
    error = run(case, ampscaler.GradScaler)
    assert type(error) is case.raises, error
    for word in case.mentions:
        assert word in str(error)
    if not case.in_torch:
        assert not case.deviation
        return
    theirs = run(case, torch.amp.GradScaler)
    if theirs is None:
        assert not case.deviation  # torch accepts it: nothing for ours to be compatible with
        return
    # Code written for torch catches ours too, except where the catalogue says why not.
    assert isinstance(error, type(theirs)) is not bool(case.deviation), (theirs, error)


@pytest.mark.parametrize("case", CASES, ids=[f"{i}:{c.code[:40]}" for i, c in enumerate(CASES)])
def test_misuse_messages_are_one_line(case: Misuse) -> None:
    """A message names what was passed in one line (an optimizer's repr spans many)."""
    assert "\n" not in str(run(case, ampscaler.GradScaler))


def _without_torch_column(text: str) -> list[str]:
    """The page's lines, table rows cut before their last cell (it depends on torch's version)."""
    lines = text.split("\n")
    return [line.rsplit(" | ", 1)[0] if line.startswith("| `") else line for line in lines]


def test_doc_is_what_the_catalogue_renders() -> None:
    assert _without_torch_column(DOC.read_text()) == _without_torch_column(render()), (
        "docs/misuse.md is out of date: regenerate it with `python tests/misuse_catalogue.py`."
    )


def test_catalogue_covers_every_bad_constructor_value_of_issue_3() -> None:
    constructor = [c for c in CASES if c.section == "Constructor arguments"]
    named = {word for c in constructor for word in c.mentions}
    assert {
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "hysteresis",
        "min_scale",
        "max_scale",
        "init_scale",
        "max_consecutive_skips",
    } <= named
    calls = " ".join(c.code for c in constructor)
    for bad in (
        "growth_factor=1.0",
        "backoff_factor=1.0",
        "backoff_factor=0.0",
        "growth_interval=0",
        "hysteresis=0",
        "min_scale=4.0, max_scale=2.0",
        'init_scale=float("nan")',
        'init_scale=float("inf")',
        "init_scale=0.0",
        "init_scale=-1.0",
        "max_scale=1024.0",
        "init_scale=0.5, min_scale=1.0",
        "max_consecutive_skips=0",
    ):
        assert bad in calls
    # ValueError as the issue asks, and AssertionError as torch raises for what it checks.
    assert all(issubclass(c.raises, ValueError) for c in constructor)
    assert all(issubclass(c.raises, AssertionError) for c in constructor)
