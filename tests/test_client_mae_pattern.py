"""MAE's ``NativeScalerWithGradNormCount`` (also in BEiT, ConvNeXt, Swin, MultiMAE, 4M),
re-created: ampscaler's scaler against torch's, bit for bit.

None of these projects is installed here; this file re-creates, in its own words, the loss
scaler wrapper of ``facebookresearch/mae`` (``util/misc.py``) and the variants copied from it:

- ``__call__(loss, optimizer, clip_grad=None, parameters=None, create_graph=False,
  update_grad=True)``: ``scale(loss).backward(create_graph=create_graph)``; only when
  ``update_grad`` (the last micro-batch of an accumulation of ``accum_iter``): ``unscale_()``
  **always**, then ``clip_grad_norm_`` (its norm returned) when ``clip_grad`` is given, else
  ``get_grad_norm_`` (a norm of the unscaled ``p.grad.detach()``, inf on an overflow); then
  ``step()`` and ``update()``; the norm is returned (``None`` when not updating);
- EPFL's MultiMAE and 4M add ``skip_grad``: after ``unscale_()`` and ``get_grad_norm_``, a norm
  ``>= skip_grad`` returns at once after ``update()``, **without** ``step()``;
- BEiT and ConvNeXt log ``loss_scaler.state_dict()["scale"]`` after each iteration;
- the training loop divides the loss by ``accum_iter``, calls ``optimizer.zero_grad()`` after
  each update, and stops on a non-finite loss (so overflows here come from gradients);
- ``save_model`` writes ``{"model", "optimizer", "epoch", "scaler": loss_scaler.state_dict()}``;
  ``load_model`` gives ``checkpoint["scaler"]`` to the new wrapper's ``load_state_dict``.

Why it matters: an ``update()`` with no ``step()`` after ``unscale_()`` must count the iteration
as torch's does (from the flags ``unscale_()`` recorded), the grad norm is read from gradients
the scaler unscaled, and the scale logged through ``state_dict()`` is torch's float.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch

import ampscaler
from twins import Trace, assert_same_trace, nan_equal

Factory = Callable[..., Any]
STEPS = 12
GRAD_INF_AT = {3, 8}  # micro-batches whose gradient gets an inf after backward
SKIP_GRAD = 1.5  # MultiMAE's skip_grad: a larger (unscaled) norm skips the step


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def get_grad_norm_(parameters: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> Any:
    """MAE's grad norm over the parameters that have a gradient."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    if norm_type == float("inf"):
        return max(g.abs().max() for g in grads)
    return torch.norm(torch.stack([torch.norm(g, norm_type) for g in grads]), norm_type)


class NormCountingLossScaler:
    """The wrapper, as module docstring describes it."""

    state_dict_key = "amp_scaler"

    def __init__(self, factory: Factory) -> None:
        self._scaler = factory("cpu", growth_interval=2)

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_grad: float | None = None,
        skip_grad: float | None = None,
        parameters: list[torch.nn.Parameter] | None = None,
        create_graph: bool = False,
        update_grad: bool = True,
    ) -> Any:
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if not update_grad:
            return None
        assert parameters is not None
        self._scaler.unscale_(optimizer)
        if clip_grad is not None:
            norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        else:
            norm = get_grad_norm_(parameters)
            if skip_grad is not None and norm >= skip_grad:
                self._scaler.update()
                return norm
        self._scaler.step(optimizer)
        self._scaler.update()
        return norm

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self._scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scaler.load_state_dict(state_dict)


def vit_like() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.LayerNorm(12), torch.nn.GELU(), torch.nn.Linear(12, 6)
    )


def overflowed(grad: torch.Tensor) -> torch.Tensor:
    return grad.index_fill(0, torch.tensor([1]), float("inf"))


def train_like_mae(
    factory: Factory,
    *,
    accum_iter: int = 1,
    clip_grad: float | None = None,
    skip_grad: float | None = None,
    create_graph: bool = False,
    resume_at: int | None = None,
    resume_into: Factory | None = None,
) -> tuple[Trace, list[Any]]:
    """MAE's ``train_one_epoch`` (a masked reconstruction loss); returns the trace and the grad
    norms the wrapper returned. After micro-batch ``resume_at`` the wrapper goes through
    ``save_model``/``load_model`` into one made by ``resume_into``."""
    model = vit_like()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.05)
    loss_scaler = NormCountingLossScaler(factory)
    data = torch.Generator().manual_seed(1)
    trace, norms = Trace(), []
    for it in range(STEPS):
        images = torch.randn(4, 6, generator=data)
        mask = (torch.rand(4, 6, generator=data) > 0.25).float()
        with torch.autocast("cpu", dtype=torch.float16):
            prediction = model(images * (1 - mask))
        loss = (((prediction.float() - images) ** 2) * mask).sum() / mask.sum() / accum_iter
        update = (it + 1) % accum_iter == 0
        hook = None
        if it in GRAD_INF_AT:  # an overflow in this micro-batch's gradient, as an fp16 one would
            hook = params[0].register_hook(overflowed)
        norm = loss_scaler(
            loss, optimizer, clip_grad=clip_grad, skip_grad=skip_grad, parameters=params,
            create_graph=create_graph, update_grad=update,
        )  # fmt: skip
        if hook is not None:
            hook.remove()
        norms.append(norm)
        if update:
            optimizer.zero_grad()
        trace.params.append([p.detach().clone() for p in params])
        trace.scales.append(loss_scaler.state_dict()["scale"])  # as BEiT and ConvNeXt log it
        trace.trackers.append(loss_scaler._scaler._get_growth_tracker())
        if it == resume_at:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "scaler": loss_scaler.state_dict()}, buffer)
            buffer.seek(0)
            checkpoint = torch.load(buffer, weights_only=True)
            loss_scaler = NormCountingLossScaler(resume_into or factory)
            if "scaler" in checkpoint:
                loss_scaler.load_state_dict(checkpoint["scaler"])
    return trace, norms


def assert_same_norms(ours: list[Any], theirs: list[Any]) -> None:
    assert len(ours) == len(theirs)
    for mine, other in zip(ours, theirs, strict=True):
        assert (mine is None) == (other is None)
        if mine is not None:
            assert nan_equal(mine, other), (mine, other)


CASES: dict[str, dict[str, Any]] = {
    "grad-norm": {},
    "clip": {"clip_grad": 0.5},
    "accumulation": {"accum_iter": 3, "clip_grad": 1.0},
    "skip-grad": {"skip_grad": SKIP_GRAD},
    "create-graph": {"create_graph": True, "clip_grad": 0.5},
    "resume": {"accum_iter": 2, "resume_at": 5},
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
@pytest.mark.filterwarnings("ignore:.*create_graph=True.*reference cycle")
def test_mae_loss_scaler_matches_torch(options: dict[str, Any]) -> None:
    theirs, their_norms = train_like_mae(torch.amp.GradScaler, **options)
    ours, our_norms = train_like_mae(ampscaler.GradScaler, **options)
    assert_same_trace(ours, theirs)
    assert_same_norms(our_norms, their_norms)
    assert all(type(s) is float for s in ours.scales)  # state_dict()["scale"], as torch's
    assert min(ours.scales) < 2.0**16  # the overflows were seen and backed off


def test_skip_grad_update_without_step_counts_as_torch_does() -> None:
    """MultiMAE's ``skip_grad``: a large but finite norm ends the iteration with ``update()``
    and no ``step()``: the parameters stay, the growth tracker still counts it as clean (torch's
    ``update()`` reads the flags ``unscale_()`` recorded); an inf norm backs off."""
    theirs, their_norms = train_like_mae(torch.amp.GradScaler, skip_grad=SKIP_GRAD)
    ours, our_norms = train_like_mae(ampscaler.GradScaler, skip_grad=SKIP_GRAD)
    assert_same_trace(ours, theirs)
    assert_same_norms(our_norms, their_norms)
    skipped = [i for i, n in enumerate(our_norms) if torch.isfinite(n) and n >= SKIP_GRAD]
    assert skipped, "no finite norm was large enough to take the skip_grad branch"
    for i in skipped:
        assert all(
            torch.equal(a, b) for a, b in zip(ours.params[i - 1], ours.params[i], strict=True)
        )
        assert ours.trackers[i] == ours.trackers[i - 1] + 1 or ours.scales[i] > ours.scales[i - 1]


@pytest.mark.parametrize(
    ("first", "then"),
    [(torch.amp.GradScaler, ampscaler.GradScaler), (ampscaler.GradScaler, torch.amp.GradScaler)],
    ids=["torch-to-ampscaler", "ampscaler-to-torch"],
)
def test_mae_checkpoint_resumes_across_scalers(first: Factory, then: Factory) -> None:
    theirs, _ = train_like_mae(torch.amp.GradScaler, accum_iter=2, resume_at=5)
    switched, _ = train_like_mae(first, accum_iter=2, resume_at=5, resume_into=then)
    assert_same_trace(switched, theirs)


def test_mae_under_patch_torch_matches_torch() -> None:
    """The wrapper builds ``torch.cuda.amp.GradScaler()``; under ``patch_torch()`` torch's names
    build ampscaler's scaler, with the same results."""
    theirs, their_norms = train_like_mae(torch.amp.GradScaler, accum_iter=2, clip_grad=0.5)
    with ampscaler.patch_torch():
        ours, our_norms = train_like_mae(torch.amp.GradScaler, accum_iter=2, clip_grad=0.5)
        assert isinstance(torch.amp.GradScaler("cpu"), ampscaler.GradScaler)
    assert_same_trace(ours, theirs)
    assert_same_norms(our_norms, their_norms)


class HutchinsonStep(torch.optim.Optimizer):
    """A second-order step as timm's AdaHessian takes it (DeiT passes ``create_graph=True`` for
    it, ``is_second_order``): the Hessian's diagonal estimated from the gradients' own graph
    (``torch.autograd.grad(grads, params, grad_outputs=z)``), read inside ``step()``, after the
    scaler unscaled the gradients in place."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        probes = torch.Generator().manual_seed(0)
        zs = [torch.randint(0, 2, p.shape, generator=probes).float() * 2 - 1 for p in params]
        hz = torch.autograd.grad([p.grad for p in params], params, grad_outputs=zs)
        with torch.no_grad():
            for p, z, h in zip(params, zs, hz, strict=True):
                p.sub_(self.param_groups[0]["lr"] * p.grad / ((z * h).abs() + 1e-3))


def second_order_like_deit(factory: Factory) -> Trace:
    """DeiT's ``loss_scaler(loss, optimizer, clip_grad=..., parameters=..., create_graph=True)``
    with a Hessian-reading optimizer; an inf loss at step 3."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = HutchinsonStep(model.parameters())
    loss_scaler = NormCountingLossScaler(factory)
    data = torch.Generator().manual_seed(1)
    trace = Trace()
    for step in range(6):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(5, 4, generator=data))
        loss = out.float().pow(2).mean() * (float("inf") if step == 3 else 1.0)
        optimizer.zero_grad(set_to_none=True)
        loss_scaler(
            loss, optimizer, clip_grad=0.5, parameters=list(model.parameters()), create_graph=True
        )
        trace.params.append([p.detach().clone() for p in model.parameters()])
        trace.scales.append(loss_scaler._scaler.get_scale())
    return trace


@pytest.mark.filterwarnings("ignore:.*create_graph=True.*reference cycle")
def test_deit_second_order_step_reads_the_unscaled_gradients_graph_as_torch() -> None:
    theirs = second_order_like_deit(torch.amp.GradScaler)
    ours = second_order_like_deit(ampscaler.GradScaler)
    assert_same_trace(ours, theirs)
    assert ours.scales[3] < ours.scales[2]  # the inf loss was skipped
