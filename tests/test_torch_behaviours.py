"""The behaviours PyTorch's own GradScaler tests check, in our words, each against torch.

Most tests run the same function with ``torch.amp.GradScaler`` and ``ampscaler.GradScaler``
and require identical results; the rest check a documented outcome directly.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any
from unittest.mock import Mock

import pytest
import torch

import ampscaler
from scaler_readings import counts

BOTH = pytest.mark.parametrize(
    "make", [torch.amp.GradScaler, ampscaler.GradScaler], ids=["torch", "ampscaler"]
)
Factory = Callable[..., Any]


def _same(fn: Callable[[Factory], Any]) -> Any:
    """Run ``fn`` with each scaler class; the results must be equal, bit for bit."""
    torch.manual_seed(0)
    theirs = fn(torch.amp.GradScaler)
    torch.manual_seed(0)
    ours = fn(ampscaler.GradScaler)
    flat_ours, flat_theirs = _flatten(ours), _flatten(theirs)
    assert len(flat_ours) == len(flat_theirs)
    for a, b in zip(flat_ours, flat_theirs, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num())
            assert torch.equal(a.isnan(), b.isnan())
        else:
            assert a == b
    return ours


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _flatten(item)]
    if isinstance(value, dict):
        return [x for key in sorted(value) for x in _flatten(value[key])]
    return [value]


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(n)]


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------- unscale and check


def test_unscale_multiplies_by_inverse_and_flags_inf() -> None:
    def run(make: Factory) -> Any:
        param = torch.nn.Parameter(torch.zeros(3))
        opt = torch.optim.SGD([param], lr=1.0)
        scaler = make("cpu", init_scale=4.0)
        scaler.scale(torch.tensor(1.0))
        param.grad = torch.tensor([4.0, 8.0, 12.0])
        scaler.unscale_(opt)
        clean = param.grad.clone()
        scaler.step(opt)
        scaler.update()
        param.grad = torch.tensor([4.0, float("inf"), 1.0])
        scaler.scale(torch.tensor(1.0))
        scaler.step(opt)
        scaler.update()
        return clean, param.detach().clone(), scaler.get_scale()

    clean, param, scale = _same(run)
    assert clean.tolist() == [1.0, 2.0, 3.0]
    assert param.tolist() == [-1.0, -2.0, -3.0]  # the inf step was skipped
    assert scale == 2.0


def _scales_and_trackers(
    make: Factory, overflows: list[bool], poison: float, **kwargs: Any
) -> list[tuple[float, int]]:
    """Step an SGD once per entry (its gradient holding ``poison`` where the entry is true);
    the scale and growth tracker after each update."""
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = make("cpu", **kwargs)
    seen = []
    for bad in overflows:
        scaler.scale(torch.tensor(1.0))
        param.grad = torch.tensor([poison if bad else 1.0, 1.0])
        scaler.step(opt)
        scaler.update()
        seen.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return seen


def test_update_scale_grows_and_backs_off_like_torch() -> None:
    overflows = [False, False, True, False, False, False, True, True]
    kwargs = {"init_scale": 2.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 2}
    seen = _same(lambda make: _scales_and_trackers(make, overflows, float("nan"), **kwargs))
    assert seen[1] == (6.0, 0) and seen[2] == (1.5, 0)


@pytest.mark.parametrize("interval", [1, 3])
def test_growth_and_backoff_at_the_growth_interval_boundaries(interval: int) -> None:
    """An overflow one step before the growth would come, growth exactly after ``interval``
    clean steps, an overflow right after a growth, two in a row: torch's sequence."""
    pattern = [False] * (interval - 1) + [True] + [False] * interval + [True, True]
    pattern += [False] * (2 * interval)

    seen = _same(
        lambda make: _scales_and_trackers(
            make, pattern, float("inf"), init_scale=64.0, growth_interval=interval
        )
    )
    scale, tracker, expected = 64.0, 0, []
    for bad in pattern:  # torch's rule, spelled out
        tracker = 0 if bad else tracker + 1
        scale *= 0.5 if bad else 1.0
        if tracker == interval:
            scale, tracker = scale * 2.0, 0
        expected.append((scale, tracker))
    assert seen == expected


def _storm_of_gradients(inject: int, value: float) -> list[torch.Tensor]:
    """torch's "perfect storm": gradients of several dtypes and layouts (contiguous,
    transposed, sliced), one of them holding ``value`` when ``inject >= 0``."""
    g = torch.full((6, 6), 4.0)
    half = g.to(torch.float16)
    grads = [g.clone(), g.clone().t(), g.clone()[:, :3], half.clone(), half.clone().t(), g.double()]
    if inject >= 0:
        grads[inject][2, 1] = value
    return grads


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_unscale_grads_finds_a_nonfinite_value_in_any_gradient(value: float) -> None:
    def run(make: Factory) -> list[Any]:
        results = []
        for inject in range(-1, 6):
            grads = _storm_of_gradients(inject, value)
            params = [torch.nn.Parameter(torch.empty_like(grad)) for grad in grads]
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            opt = torch.optim.SGD(params, lr=1.0)
            flags = make("cpu")._unscale_grads_(opt, torch.tensor(0.25), torch.zeros(1), True)
            results.append(([p.grad.clone() for p in params], flags[torch.device("cpu")]))
        return results

    results = _same(run)
    clean_grads, clean_flag = results[0]
    assert float(clean_flag) == 0.0 and all((g == 1.0).all() for g in clean_grads)
    assert all(float(flag) == 1.0 for _, flag in results[1:])


def test_inf_and_nan_in_some_gradients_of_mixed_dtypes_and_layouts() -> None:
    """Through the public calls: inf in one parameter's gradient, NaN in another's, the rest
    finite, float32 and float64, contiguous or not; the step is skipped, the rest unscaled."""

    def run(make: Factory) -> Any:
        grads = _storm_of_gradients(-1, 0.0)
        grads = [grads[0], grads[1], grads[2], grads[5]]  # dense fp16 would be refused
        params = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in grads]
        opt = torch.optim.SGD(params, lr=1.0)
        scaler = make("cpu", init_scale=4.0)
        trace = []
        for poison in ({}, {1: float("inf"), 3: float("nan")}, {2: float("nan")}, {}):
            scaler.scale(torch.tensor(1.0))
            for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
                param.grad = grad.clone()
                if index in poison:
                    param.grad[0, 1] = poison[index]
            scaler.unscale_(opt)
            trace.append([p.grad.clone() for p in params])
            scaler.step(opt)
            scaler.update()
            trace.append((_params_of(params), scaler.get_scale()))
        return trace

    trace = _same(run)
    assert [scale for _, scale in trace[1::2]] == [4.0, 2.0, 1.0, 1.0]
    assert torch.equal(trace[3][0][0], trace[1][0][0])  # the poisoned steps moved nothing


def _params_of(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def test_unscale_grads_groups_by_device_like_torch() -> None:
    """torch's _unscale_grads_ flags each device's gradients separately, and scale() copies the
    scale to each device of its outputs (torch's multi-GPU tests). A CPU has one device; the
    meta device stands in for a second one, whose tensors have a shape and no data. That
    checks the grouping: which devices get a flag, and the CPU part's values. A whole step over
    two devices cannot be emulated: the per-device flags are combined on one device before the
    skip decision, and a meta flag has no value to combine. torch's two-GPU training runs are
    therefore not re-created here."""

    def run(make: Factory) -> Any:
        on_cpu = torch.nn.Parameter(torch.zeros(3))
        on_meta = torch.nn.Parameter(torch.zeros(2, device="meta"))
        on_cpu.grad = torch.tensor([8.0, float("inf"), 4.0])
        on_meta.grad = torch.ones(2, device="meta")
        opt = torch.optim.SGD([on_cpu, on_meta], lr=1.0)
        scaler = make("cpu", init_scale=4.0)
        flags = scaler._unscale_grads_(opt, torch.tensor(0.25), torch.zeros(()), True)
        meta_flag = flags[torch.device("meta")]
        outputs = scaler.scale([torch.tensor(2.0), (torch.ones(2, device="meta"),)])
        return (
            sorted(str(device) for device in flags), flags[torch.device("cpu")],
            (meta_flag.device.type, meta_flag.dtype, tuple(meta_flag.shape)), on_cpu.grad,
            outputs[0], (outputs[1][0].device.type, tuple(outputs[1][0].shape)),
        )  # fmt: skip

    devices, cpu_flag, _, cpu_grad, cpu_output, _ = _same(run)
    assert devices == ["cpu", "meta"] and float(cpu_flag) == 1.0
    assert cpu_grad[0] == 2.0 and cpu_output == 8.0


def test_unscale_sparse_gradients() -> None:
    def run(make: Factory) -> Any:
        embed = torch.nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(embed.parameters(), lr=0.5)
        scaler = make("cpu", init_scale=8.0)
        results = []
        for poison in (False, True):
            loss = embed(torch.tensor([1, 1, 4])).sum()
            scaler.scale(loss).backward()
            if poison:
                embed.weight.grad._values()[0, 0] = float("inf")
            scaler.unscale_(opt)
            results.append(embed.weight.grad.to_dense().clone())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            results.append(embed.weight.detach().clone())
        return results, scaler.get_scale()

    _same(run)


def test_fp16_sparse_gradients_are_coalesced_before_the_check() -> None:
    """Duplicate fp16 indices whose sum overflows must be caught (torch coalesces first)."""
    indices = torch.tensor([[0, 0]])
    values = torch.tensor([40000.0, 40000.0], dtype=torch.float16)  # sum: 80000 > fp16 max
    for make in (torch.amp.GradScaler, ampscaler.GradScaler):
        param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
        opt = torch.optim.SGD([param], lr=1.0)
        opt._step_supports_amp_scaling = True  # the check path that admits fp16 gradients
        opt.step = lambda: None  # type: ignore[method-assign]
        scaler = make("cpu")
        scaler.scale(torch.tensor(1.0))
        param.grad = torch.sparse_coo_tensor(indices, values, (2,), check_invariants=True)
        scaler.step(opt)
        assert param.grad.is_coalesced()
        assert (
            scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
            if (make is torch.amp.GradScaler)
            else scaler.last_step_skipped
        )
        scaler.update()
        assert scaler.get_scale() == 2.0**15


def test_fp16_dense_gradients_are_refused_with_torchs_message() -> None:
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    param.grad = torch.ones(2, dtype=torch.float16)
    opt = torch.optim.SGD([param], lr=1.0)
    for make in (torch.amp.GradScaler, ampscaler.GradScaler):
        scaler = make("cpu")
        scaler.scale(torch.tensor(1.0))
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            scaler.unscale_(opt)
    scaler = ampscaler.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(ValueError, match="MasterWeightOptimizer"):
        scaler.step(opt)


# ---------------------------------------------------------------- scale()


def test_scale_nested_outputs_keep_their_structure() -> None:
    def run(make: Factory) -> Any:
        scaler = make("cpu", init_scale=4.0)
        a, b, c = torch.tensor(1.0), torch.tensor([2.0, 3.0]), torch.tensor(0.5)
        nested = scaler.scale([a, (b, [c])])
        lazy = scaler.scale(iter([a, b]))
        assert type(nested) is list and type(nested[1]) is tuple and type(nested[1][1]) is list
        return nested, list(lazy)

    nested, lazy = _same(run)
    assert nested[0].item() == 4.0 and lazy[1].tolist() == [8.0, 12.0]


def test_scale_rejects_non_tensors() -> None:
    for make in (torch.amp.GradScaler, ampscaler.GradScaler):
        with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable"):
            make("cpu").scale([torch.tensor(1.0), 3.0])
    with pytest.raises(ValueError, match="str"):
        ampscaler.GradScaler("cpu").scale("loss")


def test_scaled_dtype_follows_torchs_promotion() -> None:
    def run(make: Factory) -> Any:
        scaler = make("cpu", init_scale=3.0)
        half = torch.tensor(1.5, dtype=torch.float16)
        return scaler.scale(half), scaler.scale(half.reshape(1))

    zero_dim, one_dim = _same(run)
    assert zero_dim.dtype == torch.float32 and one_dim.dtype == torch.float16


def test_default_device_follows_the_first_scaled_tensor() -> None:
    scaler = ampscaler.GradScaler()
    assert scaler.is_enabled()
    scaler.scale(torch.tensor(1.0))
    assert scaler._scale is not None and scaler._scale.device.type == "cpu"
    assert scaler._device == "cpu"


def test_cuda_without_cuda_warns_and_disables_like_torch() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = ampscaler.GradScaler("cuda")
    assert not scaler.is_enabled()


# ---------------------------------------------------------------- training patterns


def _train(make: Factory, pattern: str, fused: bool = False, enabled: bool = True) -> Any:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    scaler = make("cpu", init_scale=2.0**14, growth_interval=2, enabled=enabled)
    trace = []
    for i, (x, y) in enumerate(_data()):
        loss_scale = 1e6 if i == 2 else 1.0  # an fp16 overflow on the third step
        if pattern == "accumulation":
            for chunk in range(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x[chunk::2]).float(), y[chunk::2])
                scaler.scale(loss * loss_scale / 2).backward()
        elif pattern == "penalty":
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) * loss_scale
            params = list(model.parameters())
            scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
            inv = 1.0 / scaler.get_scale()
            penalty = sum((g * inv).pow(2).sum() for g in scaled_grads)
            with torch.autocast("cpu", dtype=torch.float16):
                total = loss + penalty
            scaler.scale(total).backward()
        elif pattern == "clipping_inf":
            # torch's clipping test: a whole gradient set to inf before unscale_ and clipping
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if i == 2:
                model[2].weight.grad.fill_(float("inf"))
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) * loss_scale
            scaler.scale(loss).backward()
        if pattern in ("clipping_separate_unscale", "clipping_inf"):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif pattern == "clipping":
            # Clip the scaled gradients by a scaled max norm, without unscale_.
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5 * scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if pattern == "pickled":  # torch's autocast test pickles the scaler every iteration
            scaler = pickle.loads(pickle.dumps(scaler))
        trace.append((_params(model), scaler.get_scale()))
    return trace


@pytest.mark.parametrize(
    "pattern",
    [
        "plain",
        "accumulation",
        "penalty",
        "clipping",
        "clipping_separate_unscale",
        "clipping_inf",
        "pickled",
    ],
)
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_training_patterns_match_torch(pattern: str, fused: bool) -> None:
    trace = _same(lambda make: _train(make, pattern, fused))
    assert trace[2][1] < trace[1][1]  # the injected overflow backed off
    assert not torch.equal(trace[0][0][0], trace[-1][0][0])  # and training moved the weights


FUSED_CASES = {  # name: (optimizer, its arguments, init_scale)
    "adam": (torch.optim.Adam, {}, 128.0),
    "adam-amsgrad-decay": (torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.1}, 128.0),
    "adamw-maximize": (torch.optim.AdamW, {"maximize": True}, 128.0),
    # not a power of two: the kernel unscales (ampscaler's check pass does for powers of two)
    "adamw-scale-3000": (torch.optim.AdamW, {}, 3000.0),
    "sgd-nesterov": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, 128.0),
    "adagrad-decay": (torch.optim.Adagrad, {"weight_decay": 0.1}, 128.0),
}
SKIP_ITER = 2


def _fused_beside_forloop(make: Factory, case: str, separate_unscale: bool) -> list[Any]:
    """torch's fused-optimizer scaling test: the same model trained by the for-loop optimizer
    and by its fused twin, each under its own scaler, one iteration with an inf gradient."""
    ctor, kwargs, init_scale = FUSED_CASES[case]
    torch.manual_seed(20)
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fused = copy.deepcopy(control)
    arms = [
        (control, ctor(control.parameters(), lr=0.1, **kwargs), make("cpu", init_scale=init_scale)),
        (fused, ctor(fused.parameters(), lr=0.1, fused=True, **kwargs),
         make("cpu", init_scale=init_scale)),
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(4)]
    trace: list[Any] = []
    for i, (x, y) in enumerate(data):
        for model, opt, scaler in arms:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if i == SKIP_ITER:
                model[1].weight.grad.fill_(float("inf"))
            if separate_unscale and model is fused:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
            grads = [p.grad.clone() for p in model.parameters()] if i != SKIP_ITER else []
            trace.append((_params(model), [t.clone().reshape(-1) for t in state], grads))
    return trace


@pytest.mark.parametrize("separate_unscale", [False, True], ids=["step", "unscale_-step"])
@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_fused_optimizers_beside_their_forloop_twins(case: str, separate_unscale: bool) -> None:
    """Bit for bit torch's for both arms; and, as torch's test checks, the fused arm (which
    unscales inside its kernel, or in ampscaler's check pass) stays within rounding of the
    for-loop arm (which steps on gradients unscaled by unscale_)."""
    trace = _same(lambda make: _fused_beside_forloop(make, case, separate_unscale))
    for (control, _, _), (fused, _, _) in zip(trace[::2], trace[1::2], strict=True):
        for a, b in zip(control, fused, strict=True):
            torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5)
    before, after = trace[2 * SKIP_ITER - 1][0], trace[2 * SKIP_ITER + 1][0]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # skipped


def test_a_preset_grad_scale_is_handed_over_alone_after_unscale() -> None:
    """After unscale_, torch hands a fused optimizer the grad_scale set on it (and nothing of
    its own): the optimizer divides by that factor alone."""

    def run(make: Factory) -> Any:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        scaler = make("cpu", init_scale=2.0**10)
        trace = []
        for x, y in _data(3):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            scaler.unscale_(opt)
            opt.grad_scale = torch.tensor(3.0)  # type: ignore[attr-defined]
            scaler.step(opt)
            scaler.update()
            assert not hasattr(opt, "grad_scale")  # removed after the step, as torch does
            trace.append((_params(model), [p.grad.clone() for p in model.parameters()]))
        return trace

    _same(run)


def test_multiple_losses_and_optimizers_match_torch() -> None:
    def run(make: Factory) -> Any:
        model_a, model_b = _mlp(), _mlp()
        opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1, momentum=0.9)
        opt_b = torch.optim.AdamW(model_b.parameters(), lr=0.01, fused=True)
        scaler = make("cpu", init_scale=2.0**10, growth_interval=2)
        trace = []
        for i, (x, y) in enumerate(_data()):
            with torch.autocast("cpu", dtype=torch.float16):
                out_a, out_b = model_a(x), model_b(x)
                loss_a = torch.nn.functional.mse_loss(out_a.float() * 3 + out_b.float(), y)
                loss_b = torch.nn.functional.mse_loss(out_a.float() - out_b.float(), y)
            scaler.scale(loss_a).backward(retain_graph=True)
            scaler.scale(loss_b * (1e8 if i == 3 else 1.0)).backward()
            scaler.unscale_(opt_a)  # one optimizer unscaled early, the other not
            trace.append((scaler.step(opt_a), scaler.step(opt_b)))
            scaler.update()
            opt_a.zero_grad()
            opt_b.zero_grad()
            trace.append((_params(model_a), _params(model_b), scaler.get_scale()))
        return trace

    _same(run)


def test_params_invalidated_between_unscale_and_step() -> None:
    """The check happens at unscale_: grads broken afterwards are stepped on, as in torch."""

    def run(make: Factory) -> Any:
        model = _mlp()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        scaler = make("cpu", init_scale=128.0)
        x, y = _data(1)[0]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        for j, param in enumerate(model.parameters()):
            param.grad.fill_(float("inf") if j % 2 else float("nan"))
        scaler.step(opt)
        scaler.update()
        return _params(model)

    params = _same(run)
    assert all(not torch.isfinite(p).all() for p in params)


def test_scale_will_not_overflow() -> None:
    def run(make: Factory) -> Any:
        model = torch.nn.Linear(5, 1)
        opt = torch.optim.Adam(model.parameters())
        scaler = make("cpu", growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
        loss = ((model(torch.randn(1, 5)) - 1e-30 * torch.randn(1, 1)) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return scaler.get_scale()

    scale = _same(run)
    assert scale == pytest.approx(1e38, rel=1e-6)


# ---------------------------------------------------------------- state and copies


def test_state_dict_loads_both_ways() -> None:
    ours = ampscaler.GradScaler(
        "cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.125, growth_interval=7
    )
    ours.scale(torch.tensor(1.0))
    ours._growth_tracker.fill_(5)  # type: ignore[union-attr]
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state_dict() == {
        "scale": 3.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.125,
        "growth_interval": 7,
        "_growth_tracker": 5,
    }
    back = ampscaler.GradScaler("cpu")
    back.load_state_dict(theirs.state_dict())
    assert {k: back.state_dict()[k] for k in theirs.state_dict()} == theirs.state_dict()
    assert counts(back) == ampscaler.ScalerStats()


@pytest.mark.parametrize("used", [False, True], ids=["lazy", "used"])
def test_load_state_dict_into_a_scaler_whose_scale_exists_or_not(used: bool) -> None:
    """torch's state-dict test: the loaded values replace the target's, whether or not its
    scale tensor was made yet, and the next scale() uses them."""

    def run(make: Factory) -> Any:
        source = make(
            "cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2
        )
        target = make(
            "cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1
        )
        if used:
            target.scale(torch.tensor(4.0))
        target.load_state_dict(source.state_dict())
        return (
            target.get_scale(), target.get_growth_factor(), target.get_backoff_factor(),
            target.get_growth_interval(), target._get_growth_tracker(),
            target.scale(torch.tensor(2.0)),
        )  # fmt: skip

    assert _same(run) == (3.0, 4.0, 0.5, 2, 0, torch.tensor(6.0))


def test_disabled_scalers_train_alike() -> None:
    """torch runs each scaling test disabled too: the loop stays the same and nothing is
    scaled, checked or skipped (the overflowing step is taken)."""
    trace = _same(lambda make: _train(make, "clipping_separate_unscale", enabled=False))
    assert {scale for _, scale in trace} == {1.0}
    assert not all(torch.isfinite(p).all() for p in trace[2][0])


def test_state_dict_of_an_unused_scaler_and_a_disabled_one() -> None:
    def run(make: Factory) -> Any:
        fresh = make("cpu", init_scale=5.0)
        disabled = make("cpu", enabled=False)
        state = fresh.state_dict()
        return {k: state[k] for k in ("scale", "_growth_tracker")}, disabled.state_dict()

    _same(run)
    with pytest.raises(RuntimeError, match="empty"):
        ampscaler.GradScaler("cpu").load_state_dict({})


@BOTH
def test_pickle_and_deepcopy_round_trip(make: Factory) -> None:
    scaler = make("cpu", init_scale=16.0, growth_interval=3)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    for _ in range(2):
        scaler.scale(torch.tensor(1.0))
        param.grad = torch.ones(1)
        scaler.step(opt)
        scaler.update()
    for copied in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert copied.get_scale() == 16.0
        assert copied._get_growth_tracker() == 2
        assert copied.get_growth_interval() == 3
    scaler.scale(torch.tensor(1.0))
    param.grad = torch.ones(1)
    scaler.step(opt)
    with pytest.raises(AssertionError, match="pickled"):
        pickle.dumps(scaler)


def test_disabled_scaler_is_a_pass_through() -> None:
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = ampscaler.GradScaler("cpu", enabled=False)
    loss = torch.tensor(2.0)
    assert scaler.scale(loss) is loss
    param.grad = torch.tensor([float("inf")])
    scaler.unscale_(opt)
    closure_calls = []

    def closure() -> torch.Tensor:
        closure_calls.append(1)
        return loss

    assert scaler.step(opt, closure) is loss
    scaler.update()
    assert closure_calls == [1]
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
    assert param.item() == float("-inf")  # nothing was checked: a pure pass-through


def test_setters_and_getters() -> None:
    scaler = ampscaler.GradScaler("cpu")
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(10)
    assert (
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    ) == (3.0, 0.25, 10)
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(0.5)
    with pytest.raises(ValueError, match="growth_interval"):
        scaler.set_growth_interval(0)


# ---------------------------------------------------------------- update(new_scale)


@pytest.mark.parametrize(
    "new_scale", [256.0, torch.tensor(256.0), torch.tensor([256.0])], ids=["float", "0d", "1d"]
)
def test_update_with_new_scale(new_scale: Any) -> None:
    scaler = ampscaler.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))
    scaler.update(new_scale)
    assert scaler.get_scale() == 256.0
    if isinstance(new_scale, torch.Tensor):
        new_scale.fill_(3.0)  # later changes to the tensor do not reach the scaler
        assert scaler.get_scale() == 256.0


def test_torch_rejects_the_shape_1_tensor_that_ours_accepts() -> None:
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(RuntimeError):
        scaler.update(torch.tensor([256.0]))


@pytest.mark.parametrize(
    "bad",
    [0.0, -1.0, float("inf"), float("nan"), torch.ones(2), torch.ones((), requires_grad=True)],
)
def test_update_rejects_bad_new_scale(bad: Any) -> None:
    scaler = ampscaler.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(bad)


# ---------------------------------------------------------------- misuse: torch's types


def _scaled_opt(make: Factory) -> tuple[Any, torch.optim.Optimizer]:
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    scaler = make("cpu")
    scaler.scale(torch.tensor(1.0))
    return scaler, torch.optim.SGD([param], lr=1.0)


@BOTH
def test_misuse_raises_torchs_exception_types(make: Factory) -> None:
    scaler, opt = _scaled_opt(make)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: None)
    fresh = make("cpu")
    with pytest.raises(AssertionError):
        fresh.step(opt)
    with pytest.raises(AssertionError):
        fresh.update()
    fresh.scale(torch.tensor(1.0))
    with pytest.raises(AssertionError, match="No inf checks"):
        fresh.update()


def test_misuse_messages_say_what_to_do() -> None:
    scaler, opt = _scaled_opt(ampscaler.GradScaler)
    with pytest.raises(RuntimeError, match="without a closure"):
        scaler.step(opt, closure=lambda: None)  # the keyword form is refused, as in torch
    with pytest.raises(AssertionError, match="scaler.scale\\(loss\\).backward\\(\\)"):
        ampscaler.GradScaler("cpu").step(opt)
    empty = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(AssertionError, match="none of its parameters has a gradient"):
        scaler.step(empty)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        scaler.step(object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"device": 3}, "device"),
        ({"device": Mock()}, "device"),  # as Lightning's test_amp_precision_default_scaler
        ({"device": "nonsense"}, "nonsense"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ValueError, match=argument) as info:
        ampscaler.GradScaler(**kwargs)
    assert isinstance(info.value, AssertionError)  # what torch raises for its own checks


def test_legacy_grad_scaler_protocol_is_refused_not_silently_ignored() -> None:
    """torch passes itself as ``grad_scaler=`` to such optimizers; ours says it does not."""

    class Legacy(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure: Any = None, grad_scaler: Any = None) -> None:  # type: ignore[override]
            raise AssertionError("must not be called")

    scaler, _ = _scaled_opt(ampscaler.GradScaler)
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    with pytest.raises(TypeError, match="legacy protocol"):
        scaler.step(Legacy([param], lr=1.0))


def test_init_growth_tracker_is_kept_as_torch_keeps_it() -> None:
    """torch's pickling and state-dict tests read ``_init_growth_tracker``: 0 at construction,
    the loaded tracker after ``load_state_dict``, the tracker at pickling in a copy."""
    scalers = [
        cls("cpu", init_scale=4.0, growth_interval=10)
        for cls in (torch.amp.GradScaler, ampscaler.GradScaler)
    ]
    for scaler in scalers:
        assert scaler._init_growth_tracker == 0
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    copies = [pickle.loads(pickle.dumps(scaler)) for scaler in scalers]
    assert [c._init_growth_tracker for c in copies] == [3, 3]
    assert [c._init_scale for c in copies] == [4.0, 4.0]
    saved = scalers[1].state_dict()
    for cls in (torch.amp.GradScaler, ampscaler.GradScaler):
        fresh = cls("cpu")
        fresh.load_state_dict(saved)
        assert fresh._init_growth_tracker == 3 and fresh._get_growth_tracker() == 3
