"""ShardedGradScaler: torch's FSDP scaler (``torch.distributed.fsdp.ShardedGradScaler``), as a
small :class:`~ampscaler.GradScaler`.

Torch's sharded scaler differs from its plain one in four ways, and so does this one:

- the arguments: ``(device, init_scale, backoff_factor, growth_factor, growth_interval,
  enabled, process_group)``, in that order (``backoff_factor`` before ``growth_factor``);
- the ranks of ``process_group`` agree on each optimizer's inf/NaN flag before the step
  decision; ``process_group=None`` means the default group, looked up at the first
  :meth:`~ShardedGradScaler.scale` (so the scaler may be built before ``init_process_group``,
  as Lightning's ``FSDPPrecision`` does);
- ``unscale_`` (and so ``step``) accepts float16 gradients (FSDP1 with ``param_dtype=float16``
  and no fp32 reduce leaves them in float16);
- ``scale(loss)`` returns the scaled loss in the loss's own dtype (a float16 loss stays float16,
  as FSDP's mixed precision returns it).

Gradients on another device than the scale (FSDP's CPU offload) are checked where they are and
their flags joined on the scale's device, as :class:`~ampscaler.GradScaler` always does.
FSDP1 (flat, plain-tensor shards) and FSDP2 (DTensor shards, checked through their local
tensors) are both handled by the agreement.

Example (one process; real runs start every rank with ``torchrun``)::

    >>> import torch, torch.distributed as dist
    >>> from ampscaler import ShardedGradScaler
    >>> scaler = ShardedGradScaler("cpu", init_scale=1024.0)     # before init_process_group
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler.scale(model(torch.ones(2, 4)).sum()).backward()   # binds the default group
    >>> scaler.unscale_(opt)                                     # one all_reduce of the verdict
    >>> scaler.step(opt)
    >>> scaler.update()
    >>> scaler.get_scale(), scaler.last_step_skipped
    (1024.0, False)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, overload

import torch

from .arguments import refusing_removed_options
from .errors import InvalidConfigError
from .scaler import GradScaler

if TYPE_CHECKING:
    from .distributed import GroupSpec
    from .policy import Policy

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """A drop-in ``torch.distributed.fsdp.ShardedGradScaler`` (FSDP1 and FSDP2), with
    ampscaler's policies, guards, diagnostics and checkpoints.

    With its default arguments the parameters, scales and skipped steps are bit for bit those
    of torch's ``ShardedGradScaler`` (checked on FSDP2 ranks with injected overflows), and its
    ``state_dict`` is interchangeable with torch's. Everything :class:`~ampscaler.GradScaler`
    offers applies (``attach`` for guards and sinks, ``watch``, ``last_overflow.ranks``, ...).

    Example::

        from ampscaler import ShardedGradScaler
        scaler = ShardedGradScaler("cuda", growth_interval=400, hysteresis=2)
        for micro_batch in micro_batches:                # FSDP's no-sync accumulation
            scaler.scale(loss_of(micro_batch)).backward()
        scaler.unscale_(optimizer)                       # the ranks agree on overflow here
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)                           # every rank steps, or every rank skips
        scaler.update()

    What syncs: as :class:`~ampscaler.GradScaler`, plus the agreement's collectives (one
    ``all_reduce`` of a small verdict per optimizer and iteration; on skipped steps one gather
    naming the ranks that overflowed; when the ranks' settings or state differ, one gather
    naming the differences before every rank raises); see :mod:`ampscaler.distributed`.

    Args:
        device: device type of the scale ("cuda", "cpu", ...), or ``None`` for the device of
            the first scaled tensor. torch's default is ``"cuda"`` (which, without CUDA, warns
            and disables the scaler); ampscaler's is ``None``, as for its ``GradScaler``.
        init_scale: the initial scale.
        backoff_factor: multiplies the scale after an overflow (in (0, 1)).
        growth_factor: multiplies the scale after ``growth_interval`` clean steps (> 1).
        growth_interval: clean steps in a row before the scale grows (>= 1).
        enabled: ``False`` makes every method a pass-through.
        process_group: the group whose ranks hold the shards (one group, or a list of groups
            whose union must agree); ``None``: the default group, looked up at the first
            :meth:`scale`.
        policy: see :class:`~ampscaler.GradScaler`; likewise ``hysteresis``, ``min_scale``,
            ``max_scale``, ``max_consecutive_skips``, ``flat_grads`` and ``one_pass_fused``.

    Raises:
        InvalidConfigError: (a ``ValueError``) as :class:`~ampscaler.GradScaler`; and at the
            first :meth:`scale` with ``process_group=None``, when torch.distributed is not
            initialized (torch's scaler fails there too, at its first ``all_reduce``).
    """

    _unscale_allows_fp16 = True
    # torch's sharded scaler gives an optimizer without gradients on any rank a clean flag
    _refuses_unchecked = False

    @refusing_removed_options
    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: GroupSpec | None = None,
        *,
        policy: Policy | None = None,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        max_consecutive_skips: int | None = None,
        flat_grads: bool = False,
        one_pass_fused: bool = False,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
            policy=policy,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            max_consecutive_skips=max_consecutive_skips,
            process_group=process_group,
            flat_grads=flat_grads,
            one_pass_fused=one_pass_fused,
        )
        #: The group given (torch's attribute); ``None``: the default group.
        self.process_group = process_group

    def _bind_default_group(self) -> None:
        """Agree over the default group from now on (at the first ``scale()`` of a scaler
        given ``process_group=None``, which agrees over no group until then)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidConfigError(
                "ShardedGradScaler makes the ranks of its process group agree on overflow, and "
                "with process_group=None that is the default group, but torch.distributed is "
                "not initialized. Call torch.distributed.init_process_group() before the first "
                "scaler.scale(loss); in a single process use ampscaler.GradScaler instead."
            )
        self._agree_over(dist.group.WORLD)  # type: ignore[arg-type]

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(
        self, outputs: torch.Tensor | Iterable[torch.Tensor]
    ) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply a tensor, or every tensor in nested lists/tuples/iterables, by the scale,
        keeping each tensor's dtype (a float16 loss gives a float16 scaled loss, as in torch's
        sharded scaler: with the default ``init_scale`` of 2**16 its first steps overflow and
        back off). No host sync.

        The first call with ``process_group=None`` looks up the default group.

        Example:
            >>> import torch, ampscaler
            >>> scaler = ampscaler.ShardedGradScaler("cpu", init_scale=8.0, enabled=False)
            >>> scaler.scale(torch.tensor(1.0, dtype=torch.float16))   # disabled: unchanged
            tensor(1., dtype=torch.float16)

        Raises:
            ValueError: a leaf that is not a tensor; torch.distributed not initialized (see
                the class docstring).
        """
        if not self._enabled:
            return outputs
        if self._agreement.ranks is None:  # process_group=None, not bound yet
            self._bind_default_group()
        scaled: torch.Tensor | Iterable[torch.Tensor] = self._scaled_keeping_dtype(outputs)
        return scaled

    def _scaled_keeping_dtype(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return super().scale(value).type(value.dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(self._scaled_keeping_dtype(item) for item in value)
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            not_tensors: Any = value
            return super().scale(not_tensors)  # GradScaler's error for what is not a tensor
        return (self._scaled_keeping_dtype(item) for item in value)

    def __repr__(self) -> str:
        return "Sharded" + super().__repr__()
