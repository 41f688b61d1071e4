"""VITS's GAN training loop (and the TTS / voice-conversion projects that copied it), re-created:
ampscaler's scaler against torch's, bit for bit.

VITS is not installed here; this file re-creates, in its own words, what
``jaywalnut310/vits`` (``train.py``, ``commons.py``, ``utils.py``) does with its scaler, as copied
into GPT-SoVITS (``GPT_SoVITS/s2_train.py``), RVC (``infer/modules/train/train.py``),
so-vits-svc and many more:

- one ``GradScaler(enabled=hps.train.fp16_run)`` (``torch.cuda.amp``'s name), built after the
  optimizers and the per-epoch ``ExponentialLR`` schedulers, shared by the discriminator's and
  the generator's ``AdamW``;
- each iteration: the generator's forward and the discriminator on ``y_hat.detach()`` under
  ``autocast(enabled=fp16_run)``, the losses in a nested ``autocast(enabled=False)``; then
  ``optim_d.zero_grad()``, ``scaler.scale(loss_disc_all).backward()``, ``scaler.unscale_(optim_d)``,
  ``commons.clip_grad_value_(net_d.parameters(), None)`` (a norm summed through ``.item()``,
  nothing clipped: inf/NaN when the gradients overflowed), ``scaler.step(optim_d)``; then the
  discriminator again, on ``y_hat`` with its graph (so the generator's backward also writes scaled
  gradients into the discriminator's ``.grad``, after it stepped), the generator's loss,
  ``optim_g.zero_grad()``, ``scale(...).backward()``, ``unscale_(optim_g)``, the norm,
  ``step(optim_g)``, and one ``scaler.update()``;
- ``scheduler_g.step()``, ``scheduler_d.step()`` after each epoch (torch's "lr_scheduler.step()
  before optimizer.step()" warning when the scaler skipped every step of the first epoch);
- ``utils.save_checkpoint`` saves the model, the optimizer, the learning rate and the epoch:
  **not the scaler**. A resumed run loads the two, rebuilds the schedulers with
  ``last_epoch=epoch_str - 2`` and starts a fresh scaler at 2**16;
- a variant (a VITS2 trainer) accumulates ``accum_steps`` micro-batches: both backwards every
  micro-batch, ``unscale_``/``step`` of each optimizer and ``update()`` only at the last, the
  discriminator's gradients zeroed after its step point in every micro-batch.

Why it matters: two optimizers, one scale, an overflow in either's backward skipping that
optimizer only and backing the scale off once; the norms logged from unscaled gradients, and a
schedule warning that depends on whether the scaler called ``optimizer.step()``.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.nn import functional

import ampscaler
from twins import Trace, assert_same_trace

Factory = Callable[..., Any]
EPOCHS, BATCHES = 3, 4
D_INF_AT = {(2, 1)}  # (epoch, batch): an inf in the discriminator's gradient
G_NAN_AT = {(3, 2)}  # a NaN in the generator's gradient


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class Generator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y_hat = self.net(x)
        return y_hat, (y_hat.float() ** 2).mean()  # a stand-in for the KL term


class Discriminator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 8)
        self.last = torch.nn.Linear(8, 1)

    def score(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fmap = functional.leaky_relu(self.first(y), 0.1)
        return self.last(fmap), fmap

    def forward(self, y: torch.Tensor, y_hat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        real, fmap_r = self.score(y)
        fake, fmap_g = self.score(y_hat)
        return real, fake, fmap_r, fmap_g


def clip_grad_value_(parameters: Any, clip_value: float | None) -> float:
    """commons.clip_grad_value_: the 2-norm summed through ``.item()``, clamped when asked."""
    total = 0.0
    for p in [p for p in parameters if p.grad is not None]:
        total += p.grad.data.norm(2).item() ** 2
        if clip_value is not None:
            p.grad.data.clamp_(min=-clip_value, max=clip_value)
    return total**0.5


def poison(module: torch.nn.Module, value: float) -> None:
    next(iter(module.parameters())).grad.view(-1)[0] = value


def train(
    factory: Factory,
    fp16_run: bool = True,
    epochs: int = EPOCHS,
    resume: bytes | None = None,
    accum_steps: int = 1,
) -> tuple[Trace, list[str], bytes]:
    """VITS's run(): the nets, the optimizers, the schedulers, the scaler; ``resume`` holds
    the model and optimizer checkpoint of utils.save_checkpoint (no scaler in it)."""
    torch.manual_seed(0)
    net_g, net_d = Generator(), Discriminator()
    optim_g = torch.optim.AdamW(net_g.parameters(), 2e-3, betas=(0.8, 0.99), eps=1e-9)
    optim_d = torch.optim.AdamW(net_d.parameters(), 2e-3, betas=(0.8, 0.99), eps=1e-9)
    epoch_str = 1
    if resume is not None:
        saved = torch.load(io.BytesIO(resume), weights_only=True)
        for module, optimizer, key in ((net_g, optim_g, "g"), (net_d, optim_d, "d")):
            module.load_state_dict(saved[key]["model"])
            optimizer.load_state_dict(saved[key]["optimizer"])
        epoch_str = saved["g"]["iteration"]
    scheduler_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, 0.9, last_epoch=epoch_str - 2)
    scheduler_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, 0.9, last_epoch=epoch_str - 2)
    scaler = factory(enabled=fp16_run)
    data = torch.Generator().manual_seed(epoch_str)
    trace = Trace()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(epoch_str, epochs + 1):
            for batch in range(BATCHES * accum_steps):
                x, y = torch.randn(5, 4, generator=data), torch.randn(5, 6, generator=data)
                iteration(
                    scaler, (net_g, net_d), (optim_g, optim_d), (x, y), fp16_run,
                    (epoch, batch // accum_steps), (batch, accum_steps), trace,
                )  # fmt: skip
            scheduler_g.step()
            scheduler_d.step()
            trace.returns.append((optim_g.param_groups[0]["lr"], optim_d.param_groups[0]["lr"]))
    checkpoint = io.BytesIO()
    torch.save(
        {
            key: {"model": m.state_dict(), "optimizer": o.state_dict(), "iteration": epochs}
            for key, m, o in (("g", net_g, optim_g), ("d", net_d, optim_d))
        },
        checkpoint,
    )
    return trace, [f"{w.category.__name__}: {w.message}" for w in caught], checkpoint.getvalue()


def iteration(
    scaler: Any,
    nets: tuple[Generator, Discriminator],
    optims: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    batch: tuple[torch.Tensor, torch.Tensor],
    fp16_run: bool,
    where: tuple[int, int],
    micro: tuple[int, int],
    trace: Trace,
) -> None:
    """One batch of train_and_evaluate (a micro-batch when ``accum_steps`` > 1)."""
    (net_g, net_d), (optim_g, optim_d), (x, y) = nets, optims, batch
    number, accum_steps = micro
    first, last = number % accum_steps == 0, (number + 1) % accum_steps == 0
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16_run):
        y_hat, kl = net_g(x)
        real, fake, _, _ = net_d(y, y_hat.detach())
        with torch.autocast("cpu", enabled=False):
            loss_disc = ((1 - real.float()) ** 2).mean() + (fake.float() ** 2).mean()
    if first:
        optim_d.zero_grad()
    scaler.scale(loss_disc / accum_steps).backward()
    if where in D_INF_AT and last:
        poison(net_d, float("inf"))
    if last:
        scaler.unscale_(optim_d)
        norm_d = clip_grad_value_(net_d.parameters(), None)
        scaler.step(optim_d)
    if accum_steps > 1:
        optim_d.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16_run):
        real, fake, fmap_r, fmap_g = net_d(y, y_hat)
        with torch.autocast("cpu", enabled=False):
            loss_mel = functional.l1_loss(y, y_hat.float()) * 45
            loss_fm = 2 * (fmap_r.float().detach() - fmap_g.float()).abs().mean()
            loss_gen = ((1 - fake.float()) ** 2).mean()
            loss_gen_all = loss_gen + loss_fm + loss_mel + kl
    if first:
        optim_g.zero_grad()
    scaler.scale(loss_gen_all / accum_steps).backward()
    if where in G_NAN_AT and last:
        poison(net_g, float("nan"))
    if not last:
        return
    scaler.unscale_(optim_g)
    norm_g = clip_grad_value_(net_g.parameters(), None)
    scaler.step(optim_g)
    scaler.update()
    trace.params.append([p.detach().clone() for m in nets for p in m.parameters()])
    trace.grads.append([p.grad.clone() for p in net_d.parameters()])  # the generator's, scaled
    trace.scales.append(scaler.get_scale())
    trace.trackers.append(scaler._get_growth_tracker() if scaler.is_enabled() else 0)
    trace.returns.append((repr(norm_d), repr(norm_g), [steps(optim_g), steps(optim_d)]))


def steps(optimizer: torch.optim.Optimizer) -> int:
    """How many steps ``optimizer`` has taken (0 before its first)."""
    states = list(optimizer.state.values())
    return int(states[0]["step"]) if states else 0


def torch_scaler(**kwargs: Any) -> Any:
    return torch.amp.GradScaler("cpu", **kwargs)


def our_scaler(**kwargs: Any) -> Any:
    return ampscaler.GradScaler("cpu", **kwargs)


def patched_scaler(**kwargs: Any) -> Any:
    return torch.cuda.amp.GradScaler(**kwargs)  # VITS's name; patch_torch(device="cpu")


@pytest.mark.parametrize("fp16_run", [True, False], ids=["fp16", "fp32"])
@pytest.mark.parametrize("how", ["direct", "patched"])
def test_vits_training_matches_torch(fp16_run: bool, how: str) -> None:
    theirs, torch_warnings, _ = train(torch_scaler, fp16_run)
    if how == "patched":
        with ampscaler.patch_torch(device="cpu"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp's deprecation
            ours, our_warnings, _ = train(patched_scaler, fp16_run)
            assert isinstance(patched_scaler(), ampscaler.GradScaler)
    else:
        ours, our_warnings, _ = train(our_scaler, fp16_run)
    assert_same_trace(ours, theirs)
    assert [w for w in our_warnings if "FutureWarning" not in w] == torch_warnings
    if fp16_run:
        norms = [r for r in theirs.returns if len(r) == 3]
        # the first iteration overflows (fp16 gradients at 2**16): both skipped, inf norms
        assert norms[0][0] == "inf" and norms[0][2] == [0, 0]
        # the discriminator's inf skips its step only; the generator's NaN its own only
        (_, _, (g0, d0)), inf_d = norms[BATCHES], norms[BATCHES + 1]
        assert inf_d[0] == "inf" and float(inf_d[1]) < float("inf")
        assert inf_d[2] == [g0 + 1, d0]
        (_, _, (g1, d1)), nan_g = norms[2 * BATCHES + 1], norms[2 * BATCHES + 2]
        assert nan_g[1] == "nan" and nan_g[2] == [g1, d1 + 1]
        assert theirs.scales[BATCHES + 1] < theirs.scales[BATCHES]
    else:
        assert set(theirs.scales) == {1.0}


def test_a_first_epoch_of_skips_warns_of_the_schedule_as_torch() -> None:
    """Every step of the first epoch skipped (the scale at 2**16 is far too high for these
    losses times 2**12): the schedulers' first step() warns that no optimizer.step() ran, with
    either scaler (ampscaler does not call optimizer.step() on a skip either)."""

    def high(**kwargs: Any) -> Any:
        return kwargs.pop("make")(init_scale=2.0**40, **kwargs)

    theirs, torch_warnings, _ = train(lambda **k: high(make=torch_scaler, **k), epochs=2)
    ours, our_warnings, _ = train(lambda **k: high(make=our_scaler, **k), epochs=2)
    assert_same_trace(ours, theirs)
    assert our_warnings == torch_warnings
    assert any("lr_scheduler.step()` before `optimizer.step()" in w for w in torch_warnings)


@pytest.mark.parametrize("direction", ["same", "torch-then-ours", "ours-then-torch"])
def test_a_resume_without_the_scaler_starts_it_afresh_as_torch(direction: str) -> None:
    """utils.save_checkpoint leaves the scaler out: the resumed epochs start at 2**16 again
    (and skip their first step again), the schedulers pick up at last_epoch=epoch_str - 2."""
    first = {"same": our_scaler, "torch-then-ours": torch_scaler, "ours-then-torch": our_scaler}
    then = {"same": our_scaler, "torch-then-ours": our_scaler, "ours-then-torch": torch_scaler}
    _, _, saved_theirs = train(torch_scaler, epochs=1)
    _, _, saved = train(first[direction], epochs=1)
    theirs, torch_warnings, _ = train(torch_scaler, resume=saved_theirs)
    ours, our_warnings, _ = train(then[direction], resume=saved)
    assert_same_trace(ours, theirs)
    assert our_warnings == torch_warnings
    assert theirs.scales[0] < 2.0**16 and theirs.trackers[0] == 0  # a fresh scaler skipped


def test_vits2_accumulation_matches_torch() -> None:
    """The accumulating variant: scaled backwards into both nets every micro-batch, the
    discriminator's gradients thrown away after its step point, one update() per step."""
    theirs, torch_warnings, _ = train(torch_scaler, accum_steps=3)
    ours, our_warnings, _ = train(our_scaler, accum_steps=3)
    assert_same_trace(ours, theirs)
    assert our_warnings == torch_warnings
    assert len(theirs.scales) == EPOCHS * BATCHES
