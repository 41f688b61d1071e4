"""The wrapped fp32-style loop on 2 gloo ranks, beside the same loop with torch's scaler written
in, in every rank: DDP (with and without ``no_sync()``), FSDP2 with float16 parameters (with
and without ``set_requires_gradient_sync(False)``), FSDP1, and the shape of verl's FSDP engine.

Importing this module adds the scenarios ``wrap_ddp``, ``wrap_fsdp2``, ``wrap_fsdp1`` and
``wrap_engine`` to ``multirank.SCENARIOS``; each returns
``{setting: (torch's run, the wrapped run)}``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import ampscaler
import multirank
from wrap_loops import SCALER_KWARGS, Mlp, Run, adamw, side_by_side

STEPS = 8
#: faults in rank 1's batches only: every rank must skip with it
FAULTS = {1: "huge", 3: "inf", 5: "nan", 6: "huge"}
ACCUMULATIONS = (1, 3)


def _ddp_setting(rank: int, accumulation: int, no_sync: bool) -> tuple[Run, Run]:
    from torch.nn.parallel import DistributedDataParallel

    models: list[DistributedDataParallel] = []

    def make_model() -> torch.nn.Module:
        models.append(DistributedDataParallel(Mlp()))
        return models[-1]

    def sync(last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if last or not no_sync else models[-1].no_sync()

    return side_by_side(
        make_model, steps=STEPS, accumulation=accumulation, faults=FAULTS, fault_ranks=(1,),
        rank=rank, sync=sync,
    )  # fmt: skip


def _ddp(rank: int, world: int) -> dict[str, tuple[Run, Run]]:
    return {
        f"accumulation={accumulation} no_sync={no_sync}": _ddp_setting(rank, accumulation, no_sync)
        for accumulation in ACCUMULATIONS
        for no_sync in ((False, True) if accumulation > 1 else (False,))
    }


def _fsdp2(
    world: int, sharded: list[torch.nn.Module], reduce_dtype: torch.dtype = torch.float32
) -> Callable[[], torch.nn.Module]:
    """A maker of the MLP sharded as verl shards its actor: each layer, then the root, with
    float16 parameters and ``reduce_dtype`` reduction (``sharded`` collects what it made)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=reduce_dtype)

    def make() -> torch.nn.Module:
        model = Mlp()
        fully_shard(model[0], mesh=mesh, mp_policy=policy)
        fully_shard(model[2], mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        sharded.append(model)
        return model

    return make


def _gradient_sync(sharded: list[torch.nn.Module]) -> Callable[[bool], Iterator[None]]:
    @contextlib.contextmanager
    def sync(last: bool) -> Iterator[None]:
        sharded[-1].set_requires_gradient_sync(last)  # type: ignore[operator]
        yield

    return sync


def _sharded_scalers(with_group: bool = True) -> dict[str, Any]:
    """torch's ``ShardedGradScaler`` for the written-in loop; ampscaler's ``GradScaler``
    (agreeing over the default group, or leaving it to DTensor's check) for the wrapped one."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    group = dist.group.WORLD if with_group else None
    return {
        "make_torch_scaler": lambda: ShardedGradScaler("cpu", **SCALER_KWARGS),
        "make_scaler": lambda: ampscaler.GradScaler("cpu", **SCALER_KWARGS, process_group=group),
    }


def _fsdp2_setting(
    rank: int, world: int, accumulation: int, with_group: bool, reduce_dtype: torch.dtype
) -> tuple[Run, Run]:
    sharded: list[torch.nn.Module] = []
    return side_by_side(
        _fsdp2(world, sharded, reduce_dtype), adamw, **_sharded_scalers(with_group), steps=STEPS,
        accumulation=accumulation, faults=FAULTS, fault_ranks=(1,), rank=rank,
        sync=_gradient_sync(sharded),
    )  # fmt: skip


def _fsdp2_runs(rank: int, world: int) -> dict[str, tuple[Run, Run]]:
    fp32 = torch.float32
    runs = {
        f"accumulation={accumulation}": _fsdp2_setting(rank, world, accumulation, True, fp32)
        for accumulation in ACCUMULATIONS
    }
    runs["no process group"] = _fsdp2_setting(rank, world, 1, False, fp32)
    runs["float16 reduction"] = _fsdp2_setting(rank, world, 3, True, torch.float16)
    return runs


def _fsdp1_setting(rank: int, accumulation: int, use_orig_params: bool) -> tuple[Run, Run]:
    """FSDP1 (flat parameters) with float16 parameters and float32 reduction; ``no_sync()``
    for all micro-batches but the last."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    models: list[FullyShardedDataParallel] = []
    precision = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)

    def make_model() -> torch.nn.Module:
        model = FullyShardedDataParallel(
            Mlp(), device_id=torch.device("cpu"), use_orig_params=use_orig_params,
            mixed_precision=precision,
        )  # fmt: skip
        models.append(model)
        return model

    def sync(last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if last else models[-1].no_sync()

    return side_by_side(
        make_model, adamw, **_sharded_scalers(), steps=STEPS, accumulation=accumulation,
        faults=FAULTS, fault_ranks=(1,), rank=rank, sync=sync,
    )  # fmt: skip


def _fsdp1(rank: int, world: int) -> dict[str, tuple[Run, Run]]:
    return {
        "flat parameters": _fsdp1_setting(rank, 1, False),
        "use_orig_params, accumulation=3": _fsdp1_setting(rank, 3, True),
    }


def _decay_groups(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW with weight decay on the matrices only: two parameter groups, each spanning
    both FSDP modules, as engines build it."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
    ]
    return [torch.optim.AdamW(groups, lr=1e-2)]


def _engine(rank: int, world: int) -> dict[str, tuple[Run, Run]]:
    """verl's FSDP engine's shape: micro-batches, clipping, no ``optimizer.step()`` on a
    non-finite norm, an LR scheduler, parameter groups; torch's ``ShardedGradScaler`` written
    in, or wrap."""
    sharded: list[torch.nn.Module] = []
    runs = side_by_side(
        _fsdp2(world, sharded), _decay_groups, **_sharded_scalers(), steps=STEPS,
        accumulation=2, faults=FAULTS, fault_ranks=(1,), rank=rank, engine=True,
    )  # fmt: skip
    return {"engine": runs}


multirank.SCENARIOS.update(
    wrap_ddp=_ddp, wrap_fsdp2=_fsdp2_runs, wrap_fsdp1=_fsdp1, wrap_engine=_engine
)
