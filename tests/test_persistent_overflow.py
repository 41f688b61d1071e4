"""max_consecutive_skips: a clear PersistentOverflowError instead of skipping forever."""

from __future__ import annotations

import re

import pytest
import torch

import ampscaler

INF, NAN = float("inf"), float("nan")


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(3, 3)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _setup(
    fused: bool = False, watch: bool = True, **kwargs: object
) -> tuple[_Net, torch.optim.Optimizer, ampscaler.GradScaler]:
    torch.manual_seed(0)
    net = _Net()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01, fused=fused)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**8, **kwargs)  # type: ignore[arg-type]
    if watch:
        scaler.watch(net)
    return net, optimizer, scaler


def _iterate(
    net: _Net,
    optimizer: torch.optim.Optimizer,
    scaler: ampscaler.GradScaler,
    poison: dict[str, float],
) -> None:
    scaler.scale(net(torch.ones(2, 3)).sum()).backward()
    params = dict(net.named_parameters())
    for name, value in poison.items():
        params[name].grad.view(-1)[0] = value
    scaler.step(optimizer)
    try:
        scaler.update()
    finally:
        optimizer.zero_grad()


def test_raised_at_the_update_that_completes_the_run_and_not_before() -> None:
    net, optimizer, scaler = _setup(max_consecutive_skips=3)
    bad = {"head.bias": INF}
    for poison in (bad, bad, {}, bad, bad):  # a clean step in between restarts the count
        _iterate(net, optimizer, scaler, poison)
    with pytest.raises(ampscaler.PersistentOverflowError) as raised:
        _iterate(net, optimizer, scaler, bad)
    assert isinstance(raised.value, RuntimeError)
    assert scaler.metrics("")["consecutive_skips"] == 3
    assert scaler.metrics("")["skips"] == 5
    # The update was applied before raising: a caller who catches it can go on training.
    assert scaler.get_scale() == 2.0**8 * 0.5**5
    _iterate(net, optimizer, scaler, {})
    assert scaler.metrics("")["consecutive_skips"] == 0


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_message_names_watched_parameters_and_says_inf(fused: bool) -> None:
    net, optimizer, scaler = _setup(fused=fused, max_consecutive_skips=2)
    _iterate(net, optimizer, scaler, {"body.weight": INF})
    with pytest.raises(ampscaler.PersistentOverflowError) as raised:
        _iterate(net, optimizer, scaler, {"body.weight": -INF, "head.bias": INF})
    message = str(raised.value)
    assert message.startswith(
        "2 optimizer steps in a row were skipped because the gradients held inf "
        "(max_consecutive_skips=2); the scale is now 64."
    )
    assert "body.weight (inf), head.bias (inf)" in message
    assert "held NaN" not in message and "bug in the model" not in message
    # The loss was finite: the advice is the one for overflowing gradients.
    assert raised.value.cause == "gradients"
    for hint in ("init_scale", "min_scale", "lower the learning rate", "clip", "bfloat16"):
        assert hint in message
    assert "cannot help" not in message


def test_message_for_nan_points_at_a_model_bug() -> None:
    net, optimizer, scaler = _setup(max_consecutive_skips=1)
    with pytest.raises(ampscaler.PersistentOverflowError) as raised:
        _iterate(net, optimizer, scaler, {"head.weight": NAN})
    message = str(raised.value)
    assert "held NaN " in message
    assert "head.weight (nan)" in message
    assert "bug in the model or the data" in message


def test_message_for_inf_and_nan_together_and_unwatched_names() -> None:
    net, optimizer, scaler = _setup(watch=False, max_consecutive_skips=1)
    with pytest.raises(ampscaler.PersistentOverflowError) as raised:
        _iterate(net, optimizer, scaler, {"body.weight": NAN, "head.bias": INF})
    message = str(raised.value)
    assert "held inf and NaN " in message
    # Unwatched parameters are named by their place in the optimizer.
    assert re.search(r"group0\.param0 \(nan\), group0\.param3 \(inf\)", message)


def test_static_scale_still_raises() -> None:
    net, optimizer, scaler = _setup(policy=ampscaler.StaticPolicy(), max_consecutive_skips=2)
    _iterate(net, optimizer, scaler, {"head.bias": NAN})
    with pytest.raises(ampscaler.PersistentOverflowError, match="the scale is now 256"):
        _iterate(net, optimizer, scaler, {"head.bias": NAN})


def test_without_a_limit_skipping_goes_on_silently() -> None:
    net, optimizer, scaler = _setup()
    for _ in range(6):
        _iterate(net, optimizer, scaler, {"head.bias": INF})
    assert scaler.metrics("")["consecutive_skips"] == 6


def test_message_describes_the_latest_skip_not_an_earlier_one() -> None:
    """A plain optimizer's report from an earlier skip must not stand in for a fused one's."""
    torch.manual_seed(0)
    net = _Net()
    plain = torch.optim.SGD(net.body.parameters(), lr=0.1)
    fused = torch.optim.Adam(net.head.parameters(), lr=0.1, fused=True)
    scaler = ampscaler.GradScaler("cpu", max_consecutive_skips=2)
    scaler.watch(net)
    for poisoned in (net.body.weight, net.head.bias):
        scaler.scale(net(torch.ones(2, 3)).sum()).backward()
        poisoned.grad.view(-1)[0] = INF if poisoned is net.body.weight else NAN
        scaler.step(plain)
        scaler.step(fused)
        if poisoned is net.body.weight:
            scaler.update()
            net.zero_grad()
    with pytest.raises(ampscaler.PersistentOverflowError) as raised:
        scaler.update()
    message = str(raised.value)
    assert "held NaN " in message
    assert "step 1: non-finite gradients" in message
    assert "head.bias (nan)" in message and "body.weight" not in message
