"""Tests for ampscaler.master.MasterWeightOptimizer (fp16/bf16 weights, fp32 masters).

torch.amp.GradScaler stands in for the scaler here: it knows nothing about masters, so the
tests call copy_grads_to_masters() themselves, as its users must.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

from ampscaler.master import MasterWeightOptimizer

HALF_ULP_BELOW_2 = 2.0**-11  # half an fp16 ulp on [1, 2), a whole one on [0.5, 1)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # The models here are tiny: a second intra-op thread only adds spin-waiting, and on a
    # busy machine that made the training test 20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_mlp(seed: int, dtype: torch.dtype = torch.float16, width: int = 32) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)
    )
    return model.to(dtype)


def regression_data(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 4, generator=generator)
    signal = torch.sin(x @ torch.tensor([[1.0], [-2.0], [0.5], [1.5]])) + 0.1 * x[:, :1] ** 2
    return x, signal + 0.2 * torch.randn(n, 1, generator=generator)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def scaled_step(
    model: nn.Module,
    opt: MasterWeightOptimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
) -> float:
    """One training step the way a torch.amp.GradScaler user writes it with masters."""
    loss = mse(model, x, y)
    scaler.scale(loss).backward()
    opt.copy_grads_to_masters()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return loss.item()


def masters(opt: MasterWeightOptimizer) -> list[torch.Tensor]:
    return list(opt.master_params())


# --- (1) updates below half an ulp ----------------------------------------------------------


def test_sub_half_ulp_updates_accumulate_with_masters_but_not_in_plain_fp16() -> None:
    w0 = torch.linspace(0.95, 1.05, 101, dtype=torch.float16)
    lr, steps = 1e-5, 300  # each update 1e-5 < 2**-12, half the smallest ulp here

    plain = nn.Parameter(w0.clone())
    plain_opt = torch.optim.SGD([plain], lr=lr)
    mastered = nn.Parameter(w0.clone())
    opt = MasterWeightOptimizer(torch.optim.SGD([mastered], lr=lr))
    for _ in range(steps):
        for param, optimizer in ((plain, plain_opt), (mastered, opt)):
            param.sum().backward()  # constant gradient of ones
            optimizer.step()
            optimizer.zero_grad()

    assert torch.equal(plain, w0), "plain fp16 SGD was expected to lose every update"

    expected = w0.double() - steps * lr
    master = opt.master_of(mastered)
    assert master.dtype == torch.float32
    torch.testing.assert_close(master.double(), expected, rtol=0, atol=1e-5)
    assert mastered.dtype == torch.float16
    assert torch.equal(mastered, master.half()), "the model holds the rounded master"
    moved = w0.double() - mastered.double()
    torch.testing.assert_close(
        moved, torch.full_like(moved, steps * lr), rtol=0, atol=HALF_ULP_BELOW_2 + 1e-5
    )
    assert moved.min() > 0.5 * steps * lr


# --- (2) training reaches the fp32 loss ---------------------------------------------------


def test_fp16_training_with_masters_reaches_fp32_loss() -> None:
    x, y = regression_data()
    steps, lr = 300, 3e-3  # a smooth trajectory: with lr 1e-2 even fp32 seeds differ by 2x

    reference = make_mlp(0, torch.float32)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=lr)
    for _ in range(steps):
        loss = mse(reference, x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

    model = make_mlp(0, torch.float16)
    opt = MasterWeightOptimizer(torch.optim.Adam(model.parameters(), lr=lr))
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        scaled_step(model, opt, scaler, x, y)

    with torch.no_grad():
        initial = mse(make_mlp(0, torch.float32), x, y).item()
        loss32 = mse(reference, x, y).item()
        loss16 = mse(model, x, y).item()
    assert loss32 < 0.1 * initial, "the fp32 reference should have learned something"
    assert abs(loss16 - loss32) <= 0.10 * loss32, (loss16, loss32)
    assert all(p.dtype == torch.float16 for p in model.parameters())


def test_torch_scaler_refuses_fp16_grads_but_accepts_masters() -> None:
    x, y = regression_data(32)
    model = make_mlp(0)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(mse(model, x, y)).backward()
    with pytest.raises(ValueError, match="FP16"):
        scaler.unscale_(plain)

    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu")
    before = [p.clone() for p in model.parameters()]
    scaler.scale(mse(model, x, y)).backward()
    opt.copy_grads_to_masters()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert not any(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


# --- (3) checkpoints ------------------------------------------------------------------------


def _train(
    model: nn.Module,
    opt: MasterWeightOptimizer,
    scaler: torch.amp.GradScaler,
    sched: StepLR,
    steps: range,
) -> None:
    x, y = regression_data(64)
    for i in steps:
        shift = 0.01 * i  # a different batch every step
        scaled_step(model, opt, scaler, x + shift, y)
        sched.step()


def _fresh(
    seed: int,
) -> tuple[nn.Module, MasterWeightOptimizer, torch.amp.GradScaler, StepLR]:
    model = make_mlp(seed)
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    scaler = torch.amp.GradScaler("cpu")  # starts at 2**16: the first steps overflow and skip
    sched = StepLR(opt, step_size=7, gamma=0.5)
    return model, opt, scaler, sched


def test_checkpoint_resumes_bit_for_bit(tmp_path: Path) -> None:
    model, opt, scaler, sched = _fresh(0)
    _train(model, opt, scaler, sched, range(0, 40))

    model_a, opt_a, scaler_a, sched_a = _fresh(0)
    _train(model_a, opt_a, scaler_a, sched_a, range(0, 20))
    path = tmp_path / "ckpt.pt"
    torch.save(
        {
            "model": model_a.state_dict(),
            "opt": opt_a.state_dict(),
            "scaler": scaler_a.state_dict(),
            "sched": sched_a.state_dict(),
        },
        path,
    )
    del model_a, opt_a, scaler_a, sched_a

    model_b, opt_b, scaler_b, sched_b = _fresh(99)  # different init: the load must set it all
    checkpoint = torch.load(path)
    model_b.load_state_dict(checkpoint["model"])
    opt_b.load_state_dict(checkpoint["opt"])
    scaler_b.load_state_dict(checkpoint["scaler"])
    sched_b.load_state_dict(checkpoint["sched"])
    _train(model_b, opt_b, scaler_b, sched_b, range(20, 40))

    for p, q in zip(model.parameters(), model_b.parameters(), strict=True):
        assert p.dtype == q.dtype == torch.float16
        assert torch.equal(p, q)
    for m, n in zip(masters(opt), masters(opt_b), strict=True):
        assert torch.equal(m, n)
    assert scaler.get_scale() == scaler_b.get_scale()


def test_masters_carry_the_bits_the_fp16_weights_lose() -> None:
    # Resuming from the fp16 model weights alone is *not* exact: that is why the masters
    # are in the optimizer's state dict.
    model, opt, scaler, sched = _fresh(0)
    _train(model, opt, scaler, sched, range(0, 20))
    assert any(
        not torch.equal(m, p.float()) for m, p in zip(masters(opt), model.parameters(), strict=True)
    )


def test_load_state_dict_checks_master_layout_and_warns_without_masters() -> None:
    _, opt, _, _ = _fresh(0)
    state = opt.state_dict()
    assert set(state["master_weights"]) == {0, 1, 2, 3, 4, 5}

    broken = copy.deepcopy(state)
    del broken["master_weights"][5]
    with pytest.raises(ValueError, match="same parameters"):
        opt.load_state_dict(broken)
    broken = copy.deepcopy(state)
    broken["master_weights"][0] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(broken)

    plain = torch.optim.AdamW(make_mlp(1).parameters(), lr=3e-3)
    with pytest.warns(UserWarning, match="no master weights"):
        opt.load_state_dict(plain.state_dict())


def test_model_weights_written_from_outside_are_picked_up() -> None:
    model = make_mlp(0)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    model.load_state_dict(make_mlp(1).state_dict())  # e.g. pretrained weights, after wrapping
    expected = [p.clone() for p in model.parameters()]
    opt.step()  # lr 0: the step must not put the old weights back
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p, e)
        assert torch.equal(opt.master_of(p), e.float())


# --- (4) fused optimizers, schedulers, groups, zero_grad, closures -------------------------


class RecordingFused(torch.optim.SGD):
    """Claims fused-style scaling support and records what the scaler handed it."""

    def __init__(self, params: object) -> None:
        super().__init__(params, lr=0.1)  # type: ignore[arg-type]
        self._step_supports_amp_scaling = True
        self.seen: list[tuple[object, object]] = []

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.seen.append((getattr(self, "grad_scale", None), getattr(self, "found_inf", None)))


def test_grad_scale_and_found_inf_reach_the_inner_optimizer_for_one_step() -> None:
    x, y = regression_data(32)
    model = make_mlp(0)
    inner = RecordingFused(model.parameters())
    opt = MasterWeightOptimizer(inner)
    assert opt._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(mse(model, x, y)).backward()
    opt.copy_grads_to_masters()
    scaler.step(opt)

    ((grad_scale, found_inf),) = inner.seen
    assert isinstance(grad_scale, torch.Tensor) and grad_scale.item() == 256.0
    assert isinstance(found_inf, torch.Tensor) and found_inf.item() == 0.0
    for holder in (opt, inner):
        assert not hasattr(holder, "grad_scale") and not hasattr(holder, "found_inf")


def test_fused_step_without_copying_first_is_an_error() -> None:
    x, y = regression_data(32)
    model = make_mlp(0)
    opt = MasterWeightOptimizer(torch.optim.Adam(model.parameters(), fused=True))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(mse(model, x, y)).backward()
    with pytest.raises(RuntimeError, match="copy_grads_to_masters"):
        scaler.step(opt)  # forgot opt.copy_grads_to_masters(): the scaler checked nothing


def test_non_fused_inner_is_reported_as_such() -> None:
    opt = MasterWeightOptimizer(torch.optim.Adam(make_mlp(0).parameters(), foreach=False))
    assert not opt._step_supports_amp_scaling


def _run_adam(
    fused: bool, steps: int, poison_at: int | None = None
) -> tuple[list[torch.Tensor], Any]:
    x, y = regression_data(64)
    model = make_mlp(0)
    if fused:
        inner = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    else:
        inner = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    opt = MasterWeightOptimizer(inner)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for i in range(steps):
        loss = mse(model, x, y)
        if i == poison_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        opt.copy_grads_to_masters()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return [m.detach().clone() for m in masters(opt)], (opt, scaler, model)


def test_fused_adam_through_the_wrapper_matches_unfused() -> None:
    fused, (opt, _, model) = _run_adam(fused=True, steps=20)
    plain, _ = _run_adam(fused=False, steps=20)
    assert opt._step_supports_amp_scaling
    for f, p in zip(fused, plain, strict=True):
        torch.testing.assert_close(f, p, rtol=1e-4, atol=1e-5)
    assert all(p.dtype == torch.float16 for p in model.parameters())


def test_fused_adam_skips_in_kernel_on_overflow() -> None:
    before, _ = _run_adam(fused=True, steps=3)
    after, (opt, scaler, _) = _run_adam(fused=True, steps=4, poison_at=3)
    for b, a in zip(before, after, strict=True):
        assert torch.equal(b, a)  # the poisoned step changed no master
    assert all(s["step"].item() == 3 for s in opt.state.values())
    assert scaler.get_scale() == 2.0**7


def test_lr_scheduler_drives_the_inner_optimizer() -> None:
    model = make_mlp(0)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "optimizer.step() has been overridden"
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(3):
            mse(model, *regression_data(8)).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.05)
    assert sched.get_last_lr() == [pytest.approx(0.05)]
    assert isinstance(opt, torch.optim.Optimizer)


def test_add_param_group_makes_masters_and_rejects_bad_groups() -> None:
    body, head = make_mlp(0), nn.Linear(1, 1).half()
    opt = MasterWeightOptimizer(torch.optim.SGD(body.parameters(), lr=0.1))
    opt.add_param_group({"params": head.parameters(), "lr": 0.5})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.5
    assert all(m.dtype == torch.float32 for m in opt.param_groups[1]["params"])
    weight_before = head.weight.detach().clone()
    head(body(torch.ones(2, 4, dtype=torch.float16))).float().sum().backward()
    opt.step()
    assert head.weight.dtype == torch.float16 and not torch.equal(head.weight, weight_before)

    n_groups = len(opt.param_groups)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [head.bias]})
    stray = torch.ones(3, dtype=torch.float16, requires_grad=True)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [stray, stray]})  # rolled back: stray has no master
    with pytest.raises(ValueError, match="non-leaf"):
        opt.add_param_group({"params": [torch.ones(3, requires_grad=True).half()]})
    with pytest.raises(TypeError, match="set"):
        opt.add_param_group({"params": {stray}})
    assert len(opt.param_groups) == n_groups
    opt.add_param_group({"params": stray})  # a bare tensor is a group of one
    assert opt.master_of(stray).dtype == torch.float32


def test_named_parameters_keep_their_names() -> None:
    model = make_mlp(0)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.named_parameters(), lr=0.1))
    names = [name for name, _ in model.named_parameters()]
    assert opt.param_groups[0]["param_names"] == names
    extra = nn.Linear(2, 2).half()
    opt.add_param_group({"params": list(extra.named_parameters())})
    assert opt.param_groups[1]["param_names"] == ["weight", "bias"]
    assert opt.param_groups[1]["params"][0] is opt.master_of(extra.weight)


def test_zero_grad_clears_model_and_master_grads() -> None:
    model = make_mlp(0)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = regression_data(8)

    mse(model, x, y).backward()
    opt.copy_grads_to_masters()
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        assert p.grad is not None and not p.grad.any()
        assert opt.master_of(p).grad is not None and not opt.master_of(p).grad.any()

    mse(model, x, y).backward()
    opt.copy_grads_to_masters()  # zero_grad reset the "copied" flag: this copies again
    for p in model.parameters():
        torch.testing.assert_close(opt.master_of(p).grad, p.grad.float())
    opt.zero_grad()
    for p in model.parameters():
        assert p.grad is None and opt.master_of(p).grad is None


def test_copy_grads_is_idempotent_until_new_grads() -> None:
    model = make_mlp(0)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = regression_data(8)
    weight = model[0].weight
    mse(model, x, y).backward()
    opt.copy_grads_to_masters()
    master_grad = opt.master_of(weight).grad
    assert master_grad is not None and master_grad.dtype == torch.float32
    master_grad.mul_(0.5)  # what a scaler's unscale_ does in place
    opt.copy_grads_to_masters()  # a second caller must not undo it
    torch.testing.assert_close(opt.master_of(weight).grad, 0.5 * weight.grad.float())

    # A skipped step never calls opt.step(); with model.zero_grad() the next backward
    # brings new grads, which must be copied even though the flag is still set.
    model.zero_grad()
    (2 * mse(model, x, y)).backward()
    opt.copy_grads_to_masters()
    torch.testing.assert_close(opt.master_of(weight).grad, weight.grad.float())


def test_none_grads_stay_none_and_fp32_params_are_shared() -> None:
    model = make_mlp(0)
    model[4].float()  # the last layer stays fp32: stepped directly, no master
    model[0].requires_grad_(False)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.master_of(model[4].weight) is model[4].weight
    assert opt.master_of(model[2].weight).dtype == torch.float32

    x, _ = regression_data(8)
    model[4](model[:4](x.half()).float()).sum().backward()
    opt.copy_grads_to_masters()
    assert opt.master_of(model[0].weight).grad is None
    assert opt.master_of(model[2].weight).grad is not None
    before = model[4].weight.detach().clone()
    opt.step()
    assert model[4].weight.dtype == torch.float32 and not torch.equal(before, model[4].weight)


def test_sparse_grads_are_refused_with_advice() -> None:
    embedding = nn.Embedding(10, 4, sparse=True).half()
    opt = MasterWeightOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1))
    embedding(torch.tensor([1, 2])).float().sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.copy_grads_to_masters()


def test_editing_model_grads_after_the_copy_is_an_error() -> None:
    model = make_mlp(0)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    mse(model, *regression_data(8)).backward()
    opt.copy_grads_to_masters()
    nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # should have been the masters
    with pytest.raises(RuntimeError, match="master_params"):
        opt.step()


def test_closure_evaluates_at_the_masters() -> None:
    target = torch.tensor([0.3, -1.7, 2.2], dtype=torch.float16)
    w = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt = MasterWeightOptimizer(torch.optim.LBFGS([w], lr=1.0, max_iter=20))

    def closure() -> float:
        opt.zero_grad()
        loss = ((w.float() - target.float()) ** 2).sum()
        loss.backward()
        return loss.item()

    first = opt.step(closure)
    assert first == pytest.approx(((target.float()) ** 2).sum().item())
    assert w.dtype == torch.float16
    torch.testing.assert_close(w, target, rtol=0, atol=2e-3)


def test_step_hooks_registered_on_the_wrapper_run() -> None:
    model = make_mlp(0)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    mse(model, *regression_data(8)).backward()
    opt.step()
    assert calls == ["pre", "post"]


def test_bf16_params_get_masters_too() -> None:
    model = make_mlp(0, torch.bfloat16)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    mse(model, *regression_data(8)).backward()
    opt.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in masters(opt))
    assert "bf16" in repr(opt)


def test_repr_deepcopy_and_pickle() -> None:
    model = make_mlp(0)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    text = repr(opt)
    assert text.startswith("MasterWeightOptimizer(") and "6 fp16" in text and "SGD" in text
    StepLR(opt, step_size=1)  # patches opt.step on the instance, as torch's schedulers do
    opt.register_step_post_hook(lambda *_: None)  # a lambda: not picklable, dropped
    for twin in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert twin.param_groups is not opt.param_groups
        for m, n in zip(masters(opt), masters(twin), strict=True):
            assert torch.equal(m, n) and m is not n
        weight = twin._pairs[0][0]  # the copy's own model parameter
        assert twin.master_of(weight) is twin.param_groups[0]["params"][0]
        before = weight.detach().clone()
        weight.float().sum().backward()
        twin.step()  # the copy still steps and copies back
        assert not torch.equal(before, weight)


def test_wrapping_an_optimizer_that_already_stepped_moves_its_state() -> None:
    model = make_mlp(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mse(model, *regression_data(8)).backward()
    inner.step()
    opt = MasterWeightOptimizer(inner)
    buffers = [opt.state[m]["momentum_buffer"] for m in masters(opt)]
    assert all(b.dtype == torch.float32 for b in buffers)
    assert not any(p in opt.state for p in model.parameters())


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argument", "hint"),
    [
        (nn.Linear(2, 2).half(), "module"),
        (list(nn.Linear(2, 2).half().parameters()), "parameters"),
        ("adam", "SGD"),
    ],
)
def test_non_optimizer_argument_is_a_type_error(argument: object, hint: str) -> None:
    with pytest.raises(TypeError, match=hint):
        MasterWeightOptimizer(argument)  # type: ignore[arg-type]


def test_wrapping_twice_is_an_error() -> None:
    opt = MasterWeightOptimizer(torch.optim.SGD(make_mlp(0).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already"):
        MasterWeightOptimizer(opt)


def test_non_leaf_param_is_an_error() -> None:
    leaf = torch.ones(3, dtype=torch.float16, requires_grad=True)
    other = torch.ones(3, dtype=torch.float16, requires_grad=True)
    inner = torch.optim.SGD([{"params": [leaf]}, {"params": [other]}], lr=0.1)
    inner.param_groups[1]["params"].append(torch.ones(2, requires_grad=True).half())
    with pytest.raises(ValueError, match="non-leaf"):
        MasterWeightOptimizer(inner)
    assert inner.param_groups[0]["params"][0] is leaf, "a failed wrap must not rewire"


def test_no_low_precision_params_warns_and_passes_through() -> None:
    model = make_mlp(0, torch.float32)
    with pytest.warns(UserWarning, match="no fp16 or bf16"):
        opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert [id(t) for t in opt.master_params()] == [id(p) for p in model.parameters()]
    before = model[0].weight.detach().clone()
    mse(model, *regression_data(8)).backward()
    opt.step()
    assert not torch.equal(before, model[0].weight)


def test_model_converted_after_wrapping_is_an_error_at_step() -> None:
    model = make_mlp(0, torch.float32)
    with pytest.warns(UserWarning):
        opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model.half()
    mse(model, *regression_data(8)).backward()
    with pytest.raises(RuntimeError, match="after the optimizer was"):
        opt.step()


# --- with ampscaler's own scaler, once it exists -------------------------------------------


def test_ampscaler_gradscaler_copies_grads_itself() -> None:
    import ampscaler

    scaler_cls = getattr(ampscaler, "GradScaler", None)
    if scaler_cls is None:
        pytest.skip("ampscaler.GradScaler is not implemented yet")
    x, y = regression_data(64)
    model = make_mlp(0)
    opt = MasterWeightOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    scaler = scaler_cls("cpu")
    first = mse(model, x, y).item()
    for _ in range(30):
        loss = mse(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)  # no copy_grads_to_masters() here: the scaler's job
        scaler.update()
        opt.zero_grad()
    assert mse(model, x, y).item() < first
