"""Measuring how many activation gradients underflow in fp16, with backward hooks on the model.

What is counted. An *activation gradient* here is the gradient of the loss with respect to the
output of a ``nn.Linear`` layer (the ``grad_output`` its full backward hook receives); under fp16
autocast it is an fp16 tensor, because the layer's output is. On a probed step the same step is
first run as an fp32 *reference* (same weights, same batch, no autocast, no loss scaling), then as
the arm really runs it. Per element:

- it *carries signal* when its fp32 reference value is non-zero (elements whose exact gradient is
  zero have nothing to lose and are left out of every fraction);
- it *underflowed* when, as the arm holds it in fp16, it is zero or subnormal: ``|g| < 2**-14``
  (about 6.1e-5, fp16's smallest normal number), where fp16 keeps fewer than 10 significant bits;
- it was *flushed* when it is exactly zero there: below about ``2**-25`` (3e-8) it rounds to 0.

``fraction`` is underflowed / carrying signal and ``flushed_fraction`` is flushed / carrying signal,
summed over the probed steps and layers. The values are taken as the arm has them: a scaled arm's
gradients include its loss scale, which is what lifts them out of the subnormal range. An fp32 arm
has no fp16 values; its gradients are rounded to fp16 and counted, so for it the numbers say how
many *would* underflow (the statistic the Mixed Precision Training paper reports for SSD).

Hooks are registered only for a probed step and removed after it, so unprobed steps run as usual.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

FP16_SMALLEST_NORMAL = torch.finfo(torch.float16).tiny
"""2**-14: fp16 values below this in magnitude are subnormal (or zero)."""

# torch warns when a full backward hook fires on a module whose inputs do not require grad, as the
# first layer's (the data) do not; its grad_output, all the probe reads, is still correct.
_NO_INPUT_GRAD_WARNING = "Full backward hook is firing when gradients are computed with respect"

_BackwardHook = Callable[[nn.Module, object, tuple[Tensor, ...]], None]


@dataclass
class LayerCounts:
    """Element counts for one layer, summed over the probed steps (see the module docstring)."""

    carrying_signal: int = 0
    underflowed: int = 0
    flushed: int = 0

    def add(self, other: LayerCounts) -> None:
        """Add ``other``'s counts to these."""
        self.carrying_signal += other.carrying_signal
        self.underflowed += other.underflowed
        self.flushed += other.flushed

    @property
    def fraction(self) -> float:
        """Underflowed (zero or subnormal in fp16) among elements carrying signal; 0 if none."""
        return self.underflowed / self.carrying_signal if self.carrying_signal else 0.0

    @property
    def flushed_fraction(self) -> float:
        """Exactly zero in fp16 among elements carrying signal; 0 if none."""
        return self.flushed / self.carrying_signal if self.carrying_signal else 0.0


def count_underflow(observed: Tensor, reference: Tensor) -> LayerCounts:
    """Counts for one gradient tensor as the arm holds it, against its fp32 reference.

    ``observed`` is rounded to fp16 first (a no-op for fp16 tensors). Syncs (``.item()``).
    """
    if observed.shape != reference.shape:
        raise ValueError(
            f"observed gradient has shape {tuple(observed.shape)} but its reference has "
            f"{tuple(reference.shape)}; both must come from the same layer and batch"
        )
    signal = reference != 0
    held = observed.detach().to(torch.float16).abs()
    return LayerCounts(
        carrying_signal=int(signal.sum().item()),
        underflowed=int((signal & (held < FP16_SMALLEST_NORMAL)).sum().item()),
        flushed=int((signal & (held == 0)).sum().item()),
    )


@dataclass
class UnderflowStats:
    """Underflow counts per linear layer (by module name) and the number of probed steps."""

    layers: dict[str, LayerCounts] = field(default_factory=dict)
    probes: int = 0

    def total(self) -> LayerCounts:
        """The counts of all layers together."""
        total = LayerCounts()
        for counts in self.layers.values():
            total.add(counts)
        return total

    @property
    def fraction(self) -> float:
        """Share of signal-carrying activation-gradient elements that were zero or subnormal."""
        return self.total().fraction

    @property
    def flushed_fraction(self) -> float:
        """Share of signal-carrying activation-gradient elements that were exactly zero."""
        return self.total().flushed_fraction

    def by_layer(self) -> dict[str, float]:
        """``fraction`` per layer name, in the model's order."""
        return {name: counts.fraction for name, counts in self.layers.items()}


class UnderflowProbe:
    """Captures the output gradients of every ``nn.Linear`` in a model and counts underflow.

    Example, for one probed step::

        probe = UnderflowProbe(model)
        with probe.capture() as reference:
            loss_fn(model, fp16=False).backward()
        optimizer.zero_grad()
        with probe.capture() as observed:
            loss_fn(model, fp16=True).backward()
        probe.record(observed, reference)
        probe.stats.fraction
    """

    def __init__(self, model: nn.Module) -> None:
        self._layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not self._layers:
            raise ValueError("UnderflowProbe needs a model with at least one nn.Linear layer")
        self.stats = UnderflowStats(layers={name: LayerCounts() for name, _ in self._layers})

    @contextmanager
    def capture(self) -> Iterator[dict[str, Tensor]]:
        """Hook the layers for the backward passes run inside; yields ``{layer name: grad_output}``.

        The dict fills in during backward; the hooks are removed on exit.
        """
        grads: dict[str, Tensor] = {}

        def hook_for(name: str) -> _BackwardHook:
            def hook(_module: nn.Module, _grad_in: object, grad_out: tuple[Tensor, ...]) -> None:
                if grad_out and grad_out[0] is not None:
                    grads[name] = grad_out[0].detach()

            return hook

        handles = [m.register_full_backward_hook(hook_for(n)) for n, m in self._layers]
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NO_INPUT_GRAD_WARNING)
                yield grads
        finally:
            for handle in handles:
                handle.remove()

    def record(self, observed: dict[str, Tensor], reference: dict[str, Tensor]) -> None:
        """Add one probed step: each layer's ``observed`` gradient against its ``reference``.

        Pass the same dict twice for an fp32 arm (its own gradients are the reference).
        """
        for name, grad in observed.items():
            if name in reference:
                self.stats.layers[name].add(count_underflow(grad, reference[name]))
        self.stats.probes += 1
