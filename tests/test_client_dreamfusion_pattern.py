"""stable-dreamfusion's (and torch-ngp's) NeRF ``Trainer`` driving a scaler, re-created.

stable-dreamfusion optimises a NeRF so that its renders satisfy a frozen diffusion model (score
distillation); its ``Trainer`` comes from torch-ngp. Read in ``ashawkey/stable-dreamfusion``
``nerf/utils.py``:

- ``self.scaler = torch.cuda.amp.GradScaler(enabled=self.fp16)`` with torch's defaults;
- every step: ``optimizer.zero_grad()``; the render and the guidance loss under
  ``torch.cuda.amp.autocast(enabled=self.fp16)`` (the SDS loss is
  ``0.5 * mse_loss(latents.float(), (latents - grad).detach(), reduction="sum") / B``, so its
  gradient w.r.t. the render is the guidance's ``grad``, times the scale);
- with ``grad_clip_rgb >= 0`` a hook on the rendered images clamps their gradient *during the
  scaled backward*: it reads ``self.scaler._get_scale_async()`` (the live scale tensor) and
  clamps to ``scale * ±grad_clip_rgb`` (unscaled bounds when ``opt.fp16`` is off). An inf in
  the guidance gradient is clamped to a finite value there; a NaN passes;
- ``post_train_step()``: ``unscale_(optimizer)``, ``clip_grad_value_(grad_clip)``, then
  regularisers written straight into the unscaled gradients (``grad_total_variation`` and
  ``grad_weight_decay`` of the hash grid), then ``step`` and ``update``;
- ``save_checkpoint(full=True)`` stores ``state["scaler"] = scaler.state_dict()``;
  ``load_checkpoint`` does ``if self.scaler and "scaler" in checkpoint_dict:`` and loads it
  inside ``try/except`` ("[WARN] Failed to load scaler.").

Why it matters: the hook reads the scaler's private live scale in the middle of a backward, and
the result must be the same clamped gradients; the truthiness test and the broad ``except``
around ``load_state_dict`` decide whether a resumed run gets its scale back.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler

Factory = Callable[..., Any]
STEPS, B = 10, 2
GRAD_CLIP_RGB, GRAD_CLIP = 1.0, 0.5
# step -> poison: inf in the guidance grad (clamped by the hook: no skip), NaN there (a skip),
# inf in a parameter's gradient after backward (a skip)
POISON = {2: "guidance-inf", 4: "guidance-nan", 7: "param-inf"}


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class TinyNeRF(torch.nn.Module):
    """A 'hash grid' (a plain parameter table) and a colour MLP rendering a 3x4x4 image."""

    def __init__(self) -> None:
        super().__init__()
        self.grid = torch.nn.Parameter(torch.randn(16, 4) * 0.1)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
        )

    def forward(self, rays: torch.Tensor) -> torch.Tensor:  # rays: (B, 16) indices' weights
        features = rays @ self.grid  # (B, 4)
        colour = torch.sigmoid(self.mlp(features))  # (B, 3)
        return colour[:, :, None, None].expand(-1, -1, 4, 4) * rays[:, :16].reshape(-1, 1, 4, 4)


def train(scaler: Any, fp16: bool = True, start: dict[str, Any] | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyNeRF()
    encoder = torch.nn.Conv2d(3, 4, 2, stride=2)  # the frozen VAE, to latents
    unet = torch.nn.Conv2d(4, 4, 1)  # the frozen noise predictor
    for frozen in (encoder, unet):
        frozen.requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-15)
    if start is not None:
        model.load_state_dict(start["model"])
        optimizer.load_state_dict(start["optimizer"])
        if scaler and "scaler" in start:
            with contextlib.suppress(Exception):  # stable-dreamfusion's "[WARN] Failed to load"
                scaler.load_state_dict(start["scaler"])
    data = torch.Generator().manual_seed(1)
    scales, seen, clamped = [], [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        rays = torch.rand(B, 16, generator=data)
        noise = torch.randn(B, 4, 2, 2, generator=data)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            pred_rgbs = model(rays)
            latents = encoder(pred_rgbs)
            with torch.no_grad():
                grad = unet(latents + noise) - noise
            if POISON.get(step, "").startswith("guidance"):
                grad[0, 1, 0, 0] = float("inf") if POISON[step] == "guidance-inf" else float("nan")
            targets = (latents - grad).detach()
            loss = 0.5 * torch.nn.functional.mse_loss(latents.float(), targets, reduction="sum") / B

        def hook(g: torch.Tensor) -> torch.Tensor:
            if fp16:  # the scale tensor itself, read during the backward
                grad_scale = scaler._get_scale_async()
                seen.append(float(grad_scale))
                bound = grad_scale * GRAD_CLIP_RGB
            else:
                bound = torch.tensor(GRAD_CLIP_RGB)
            clamped.append(bool((g.abs() > bound).any()))
            return g.clamp(-bound, bound)

        pred_rgbs.register_hook(hook)
        scaler.scale(loss).backward()
        if POISON.get(step) == "param-inf":
            assert model.mlp[0].weight.grad is not None
            model.mlp[0].weight.grad[0, 0] = float("inf")
        # post_train_step
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_value_(model.parameters(), GRAD_CLIP)
        assert model.grid.grad is not None
        model.grid.grad.add_(model.grid.detach(), alpha=1e-3)  # grad_weight_decay
        model.grid.grad[:, 1:].add_(model.grid.detach().diff(dim=1), alpha=1e-3)  # "TV"
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {
        "scales": scales,
        "seen": seen,
        "clamped": clamped,
        "params": [p.detach().clone() for p in model.parameters()],
        "checkpoint": {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
        },
    }


def assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["scales"] == theirs["scales"]
    assert ours["seen"] == theirs["seen"]
    assert ours["clamped"] == theirs["clamped"]
    for a, b in zip(ours["params"], theirs["params"], strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def saved(checkpoint: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def test_hooked_rgb_clamp_reading_the_live_scale_matches_torch() -> None:
    theirs = train(torch.amp.GradScaler("cpu"))
    ours = train(ampscaler.GradScaler("cpu"))
    assert_same(ours, theirs)
    # the hook saw the scale the loss was scaled by, and clamped the float16 overflow of the
    # first step (65536) and the guidance's inf: the first step still skips (the float16
    # backward behind the hook overflows again at that scale), the clamped inf steps, the NaN
    # passes the clamp and skips, as does the parameter's inf
    assert theirs["seen"] == [65536.0] + [32768.0] * 4 + [16384.0] * 3 + [8192.0] * 2
    assert [i for i, c in enumerate(theirs["clamped"]) if c] == [0, 2]
    assert theirs["scales"] == [32768.0] * 4 + [16384.0] * 3 + [8192.0] * 3
    assert all(p.isfinite().all() for p in ours["params"])
    ours_sd, theirs_sd = ours["checkpoint"]["scaler"], theirs["checkpoint"]["scaler"]
    assert {k: ours_sd[k] for k in TORCH_KEYS} == {k: theirs_sd[k] for k in TORCH_KEYS}


@pytest.mark.parametrize("into", ["ampscaler", "torch"])
def test_resume_from_a_full_checkpoint_of_the_other_scaler(into: str) -> None:
    """A run saved by one scaler (through ``torch.save``/``torch.load(weights_only=True)``)
    resumed by the other goes on as torch resuming torch's."""
    first = train(torch.amp.GradScaler("cpu"))
    reference = train(torch.amp.GradScaler("cpu"), start=saved(first["checkpoint"]))
    source = train((ampscaler.GradScaler if into == "torch" else torch.amp.GradScaler)("cpu"))
    resumed_by = ampscaler.GradScaler if into == "ampscaler" else torch.amp.GradScaler
    scaler = resumed_by("cpu")
    resumed = train(scaler, start=saved(source["checkpoint"]))
    assert scaler.get_scale() == reference["scales"][-1] == 2048.0
    assert reference["seen"][0] == 8192.0  # it went on from the saved scale
    assert_same(resumed, reference)


def test_a_checkpoint_of_a_disabled_scaler_fails_to_load_and_is_passed_over_as_by_torch() -> None:
    """An fp32 run's checkpoint holds ``"scaler": {}``; an fp16 run resuming it takes the
    ``except`` branch with either scaler (both raise ``RuntimeError``) and starts at 65536."""
    fp32 = train(torch.amp.GradScaler("cpu", enabled=False), fp16=False)
    assert fp32["checkpoint"]["scaler"] == {}
    for factory in (torch.amp.GradScaler, ampscaler.GradScaler):
        with pytest.raises(RuntimeError):
            factory("cpu").load_state_dict({})
    theirs = train(torch.amp.GradScaler("cpu"), start=saved(fp32["checkpoint"]))
    ours = train(ampscaler.GradScaler("cpu"), start=saved(fp32["checkpoint"]))
    assert_same(ours, theirs)
    assert theirs["seen"][0] == 65536.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scaler disables itself without CUDA")
@pytest.mark.parametrize("fp16", [True, False])
def test_under_patch_torch_the_cuda_scaler_off_cuda_trains_as_torch(fp16: bool) -> None:
    """``torch.cuda.amp.GradScaler(enabled=self.fp16)`` on a CPU machine: disabled (with
    torch's warning when ``fp16``); with ``opt.fp16`` set the hook still reads
    ``_get_scale_async()``, which a disabled scaler does not have: the backward fails with
    ``AttributeError`` alike. With ``fp16`` off it trains unscaled alike."""

    def run() -> tuple[Any, list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler = torch.cuda.amp.GradScaler(enabled=fp16)
        if fp16:
            with pytest.raises(AttributeError, match="_scale"):
                train(scaler, fp16=True)
            return None, [str(w.message).split(" (ampscaler")[0] for w in caught]
        return train(scaler, fp16=False), [str(w.message).split(" (ampscaler")[0] for w in caught]

    theirs, their_warnings = run()
    ampscaler.patch_torch()
    ours, our_warnings = run()
    assert our_warnings == their_warnings
    if not fp16:
        assert_same(ours, theirs)
        assert ours["checkpoint"]["scaler"] == theirs["checkpoint"]["scaler"] == {}
