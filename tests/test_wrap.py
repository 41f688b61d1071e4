"""``scaler.wrap(model, optimizer)`` in one process: the fp32-style loop trains bit for bit as
the same loop with torch's ``GradScaler`` written in (parameters, scales, clip norms, learning
rates), and what it cannot do is refused with a clear error or shown as a documented symptom."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import pytest
import torch

import ampscaler
from ampscaler.wrap import HalfLossError
from wrap_loops import (
    FAULTS,
    SCALER_KWARGS,
    Mlp,
    TinyTransformer,
    adamw,
    batch,
    side_by_side,
    train,
)


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("make_model", [Mlp, TinyTransformer], ids=["mlp", "transformer"])
def test_wrapped_loop_is_torchs_loop_bit_for_bit(make_model: type, accumulation: int) -> None:
    theirs, ours = side_by_side(make_model, accumulation=accumulation)
    assert ours.same_as(theirs)
    backoffs = sum(b < a for a, b in zip(theirs.scales, theirs.scales[1:], strict=False))
    assert 3 <= backoffs <= len(FAULTS)  # inf and NaN skip; a huge input where S is high
    assert ours.metrics["scaler/steps"] == 16 and ours.metrics["scaler/skips"] == backoffs


def test_engine_that_skips_the_step_itself_backs_the_scale_off() -> None:
    """verl's engine: no optimizer.step() on a non-finite norm, an LR scheduler; the skip
    counts at the next zero_grad(), as torch's loop's update() counts it."""
    theirs, ours = side_by_side(Mlp, engine=True, accumulation=2)
    assert ours.same_as(theirs)
    assert min(theirs.scales) < theirs.scales[0] and theirs.lrs[-1] < theirs.lrs[0]


def test_several_optimizers_and_a_fused_one() -> None:
    def two(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
        first, _, second = model.children()
        return [
            torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(second.parameters(), lr=1e-2, fused=True),
        ]

    # Faults that reach both optimizers' gradients (see the next test for one that does not).
    theirs, ours = side_by_side(Mlp, two, accumulation=2, faults={2: "nan", 5: "huge", 9: "huge"})
    assert ours.same_as(theirs)
    assert ours.metrics["scaler/skips"] == 3


def test_one_clip_over_several_optimizers_checks_after_the_clip() -> None:
    """Where wrap is not torch's loop, on purpose: an inf input overflows only the first
    layer's gradients. torch's loop checks each optimizer in ``unscale_()`` before the clip,
    so the second one is clean there, then the clip over both (norm inf) writes NaN into its
    gradients and it steps with them. Wrapped, each optimizer is checked at its step, after
    the clip: both skip, and the parameters stay finite."""

    def two(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
        first, _, second = model.children()
        return [torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters())]

    theirs, ours = side_by_side(Mlp, two, steps=4, faults={2: "inf"})
    assert torch.isnan(theirs.params[2]).all() and torch.isfinite(ours.params[2]).all()
    assert ours.metrics["scaler/skips"] == 1


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant: bool) -> None:
    class Checkpointed(Mlp):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def top(hidden: torch.Tensor) -> torch.Tensor:
                return self[2](self[1](hidden))  # type: ignore[no-any-return]

            # The segment's input requires grad (reentrant checkpointing needs one that does).
            out = torch.utils.checkpoint.checkpoint(top, self[0](x), use_reentrant=reentrant)
            return out  # type: ignore[no-any-return]

    theirs, ours = side_by_side(Checkpointed)
    assert ours.same_as(theirs)


def _wrapped_mlp() -> tuple[Mlp, torch.optim.Optimizer, ampscaler.GradScaler]:
    torch.manual_seed(0)
    model = Mlp()
    opt = adamw(model)[0]
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    scaler.wrap(model, opt)
    return model, opt, scaler


def _backward(model: torch.nn.Module, step: int = 0) -> None:
    x, y = batch(step, 0, 0, None)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    ((out.float() - y) ** 2).mean().backward()


def test_gradients_are_true_between_backwards_and_state_is_the_scalers() -> None:
    model, opt, scaler = _wrapped_mlp()
    _backward(model)
    wrapped_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    torch.manual_seed(0)
    plain = Mlp()
    _backward(plain)
    for ours, fp32_loop in zip(wrapped_grads, (p.grad for p in plain.parameters()), strict=True):
        assert torch.allclose(ours, fp32_loop, rtol=1e-2, atol=1e-4)  # fp16 forward vs fp16
    opt.step()
    assert scaler.metrics()["scaler/steps"] == 1
    expected = torch.amp.GradScaler("cpu", init_scale=2.0**10).state_dict()
    saved = scaler.state_dict()
    assert {key: saved[key] for key in expected} == expected | {"_growth_tracker": 1}


def test_unwrap_gives_the_optimizer_its_methods_back() -> None:
    model, opt, scaler = _wrapped_mlp()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 2)  # wraps opt.step over ours
    assert "step" in vars(opt)
    scaler.unwrap()
    _backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # the optimizer's own step: no scaler involved
    scheduler.step()
    assert scaler.metrics()["scaler/steps"] == 0
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert "zero_grad" not in vars(opt)
    scaler.wrap(model, opt)  # wrapping again is allowed after unwrap()
    scaler.unwrap()
    scaler.unwrap()  # not wrapped: nothing to do


def test_a_scheduler_built_before_wrap_does_not_warn_that_step_was_overridden() -> None:
    """An engine builds its optimizer and LR scheduler, then the loop is wrapped: torch's
    scheduler checks at its first step() that the optimizer's step is still the one it wrapped,
    and warns when not; the scheduler's wrapper still runs, inside the scaler's."""
    torch.manual_seed(0)
    model = Mlp()
    opt = adamw(model)[0]
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    scaler.wrap(model, opt)
    _backward(model)
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.step()
    assert scaler.metrics()["scaler/steps"] == 1 and scheduler.get_last_lr() == [0.5e-2]
    scaler.unwrap()
    assert hasattr(opt.step, "_wrapped_by_lr_sched")  # the scheduler's own wrapper, restored


def test_refusals() -> None:
    model, opt, scaler = _wrapped_mlp()
    with pytest.raises(ampscaler.ScalerUsageError, match="already wraps"):
        scaler.wrap(model, opt)
    other = ampscaler.GradScaler("cpu")
    stray = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="does not own"):
        other.wrap(model, torch.optim.SGD([*model.parameters(), stray], lr=0.1))
    with pytest.raises(TypeError, match="at least one optimizer"):
        other.wrap(model)
    with pytest.raises(TypeError, match="Module"):
        other.wrap(opt, opt)  # type: ignore[arg-type]
    assert "step" not in vars(torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_loss_computed_in_fp16_inside_the_model_is_refused() -> None:
    class LossInside(Mlp):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).pow(2).mean()  # fp16 under autocast

    model = LossInside()
    scaler = ampscaler.GradScaler("cpu")
    scaler.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(HalfLossError, match="float32"):
        model(torch.ones(2, 8))
    assert isinstance(HalfLossError("x"), RuntimeError)


def test_gradients_that_bypass_the_outputs_are_refused_at_the_step() -> None:
    model, opt, _ = _wrapped_mlp()
    model[0].weight.sum().backward()  # a loss that never used the model's outputs
    grad = model[0].weight.grad.clone()  # type: ignore[union-attr]
    with pytest.raises(ampscaler.ScalerUsageError, match="never scaled"):
        opt.step()
    assert torch.equal(model[0].weight.grad, grad)  # nothing changed


def test_a_parameter_used_in_the_loss_directly_gets_its_term_divided_by_the_scale() -> None:
    """The documented limit (docs/loop-free.md): a term of the loss that uses a parameter
    outside the model's outputs (an L2 penalty on a tied weight) reaches its gradient
    unscaled, and the scaler divides it by the scale anyway."""
    model, _, scaler = _wrapped_mlp()
    weight = model[2].weight
    x, _ = batch(0, 0, 0, None)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    (out.float().sum() * 0.0 + weight.pow(2).sum()).backward()
    assert torch.allclose(weight.grad, 2 * weight.detach() / scaler.get_scale())  # type: ignore[arg-type]


def test_disabled_scaler_wraps_nothing() -> None:
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ampscaler.GradScaler("cpu", enabled=False).wrap(model, opt)
    assert "step" not in vars(opt) and model(torch.ones(1, 8)).dtype == torch.float32


def test_checkpoints_sinks_and_the_skip_limit_are_the_scalers() -> None:
    """A wrapped run saved and resumed mid-way (model, optimizer, scaler state dicts) ends
    where the uninterrupted one does; step records reach the scaler's sinks; the skip limit
    raises from ``optimizer.step()``."""

    def fresh() -> tuple[Mlp, list[torch.optim.Optimizer], ampscaler.GradScaler]:
        torch.manual_seed(0)
        model = Mlp()
        scaler = ampscaler.GradScaler("cpu", **SCALER_KWARGS)
        return model, adamw(model), scaler

    model, opts, scaler = fresh()
    history = scaler.add_sink(ampscaler.StepHistory(100))
    whole = train(model, opts, scaler, wrapped=True, steps=12)
    skips = scaler.metrics()["scaler/skips"]
    assert [record.skipped for record in history.records].count(True) == skips > 0

    model, opts, scaler = fresh()
    first = train(model, opts, scaler, wrapped=True, steps=6)
    saved = [model.state_dict(), opts[0].state_dict(), scaler.state_dict()]
    scaler.unwrap()
    model, opts, scaler = fresh()
    model.load_state_dict(saved[0])
    opts[0].load_state_dict(saved[1])
    scaler.load_state_dict(saved[2])
    rest = train(model, opts, scaler, wrapped=True, steps=12, start=6)
    assert first.scales[:-1] + rest.scales == whole.scales
    assert all(torch.equal(a, b) for a, b in zip(rest.params, whole.params, strict=True))

    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    limited = ampscaler.GradScaler("cpu", max_consecutive_skips=2)
    limited.wrap(model, opt)
    with pytest.raises(ampscaler.PersistentOverflowError):
        for _ in range(3):
            model(torch.full((2, 8), float("nan"))).sum().backward()
            opt.step()
            opt.zero_grad()
    assert limited.metrics()["scaler/consecutive_skips"] == 2


def test_a_headroom_policy_backs_off_on_a_nan_loss_it_cannot_see() -> None:
    """The documented difference (docs/loop-free.md): the written-in loop hands the loss to
    ``scale()``, and a HeadroomPolicy holds its scale on an inf/NaN loss; wrapped, the loss is
    not seen, and the NaN it leaves in the gradients backs the scale off. (Its measurements
    differ too: wrapped, it measures the parameters' gradients after the loop's clipping.)"""

    def run(wrapped: bool) -> list[float]:
        torch.manual_seed(0)
        model = Mlp()
        scaler = ampscaler.GradScaler("cpu", policy=ampscaler.HeadroomPolicy())
        scaler.watch(model)
        nan_at_9 = {9: "nan"}
        return train(model, adamw(model), scaler, wrapped=wrapped, steps=11, faults=nan_at_9).scales

    written_in, wrapped = run(False), run(True)
    assert written_in[10] == written_in[9] and wrapped[10] == wrapped[9] / 2


class _Outputs(dict):  # type: ignore[type-arg]
    """A dict subclass, as transformers' ModelOutput is."""


class _Pair(NamedTuple):
    main: torch.Tensor
    extra: list[torch.Tensor]


class _Containers(Mlp):
    def forward(self, x: torch.Tensor) -> Any:
        hidden = self[1](self[0](x))
        return _Outputs(out=self[2](hidden), pair=_Pair(hidden, [hidden.sum(-1)]), ids=x.argmax(-1))


def test_outputs_in_dicts_named_tuples_and_lists_are_scaled_once() -> None:
    """Every output that requires grad is scaled wherever it sits; the loop's loss from
    several of them gets the written-in loop's gradients bit for bit."""

    def grads(wrapped: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _Containers()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler: Any = ampscaler.GradScaler("cpu", init_scale=2.0**12)
        if wrapped:
            scaler.wrap(model, opt)
        with torch.autocast("cpu", dtype=torch.float16):
            outputs = model(torch.randn(6, 8))
        assert isinstance(outputs, _Outputs) and isinstance(outputs["pair"], _Pair)
        assert outputs["ids"].dtype == torch.int64
        loss = outputs["out"].float().square().mean() + outputs["pair"].main.float().mean()
        loss = loss + outputs["pair"].extra[0].float().mean()
        if wrapped:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    for ours, theirs in zip(grads(True), grads(False), strict=True):
        assert torch.equal(ours, theirs)


def test_the_loop_may_modify_outputs_in_place() -> None:
    """verl divides a view of the logits by the temperature in place; the wrapped outputs are
    new tensors, not views, so that works, with the written-in loop's gradients."""

    def grads(wrapped: bool, make_model: type[torch.nn.Module]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ampscaler.GradScaler("cpu", init_scale=2.0**12)
        if wrapped:
            scaler.wrap(model, opt)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(torch.randn(6, 8)).float().squeeze(0)
        logits.div_(0.7)  # on a view of the output (wrapped: .float() returned the output)
        loss = torch.log_softmax(logits, -1)[:, 0].mean()
        if wrapped:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    class Float32Out(Mlp):  # the model upcasts its own output, as some LLMs do
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).float()

    for make_model in (Mlp, Float32Out):
        for ours, theirs in zip(grads(True, make_model), grads(False, make_model), strict=True):
            assert torch.equal(ours, theirs)


def test_a_loss_computed_in_fp16_outside_the_model_underflows_as_without_a_scaler() -> None:
    """The documented limit: a loss computed in fp16 from the (float32) outputs runs its
    backward unscaled in fp16, so gradients below fp16's range flush to zero there, as with no
    scaler at all; torch's loop, which scales that fp16 loss, keeps them."""

    def grad(wrapped: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ampscaler.GradScaler("cpu", init_scale=2.0**16)
        if wrapped:
            scaler.wrap(model, opt)
        out = model(torch.ones(8, 4))
        loss = (out.half() * 1e-8).sum()  # fp16: d(loss)/d(out) = 1e-8 flushes to 0 in fp16
        if wrapped:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        return model.weight.grad  # type: ignore[return-value]

    assert torch.count_nonzero(grad(wrapped=False)) == 4
    assert torch.count_nonzero(grad(wrapped=True)) == 0
