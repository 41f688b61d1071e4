"""Accelerate's own scaler construction under ``patch_torch`` (the functions its ``Accelerator``
calls for fp16: ``get_grad_scaler`` for single devices, DDP and FSDP1, and
``get_fsdp2_grad_scaler`` for FSDP2), and ``use_scaler`` on an accelerator whose backend is
FSDP. Accelerate builds no scaler on a CPU, so the FSDP backend is set on a real Accelerator's
state here; the 2-rank FSDP tests (test_sharded_scaler) cover the training itself."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("accelerate")
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, GradScalerKwargs
from accelerate.utils.fsdp_utils import get_fsdp2_grad_scaler
from accelerate.utils.modeling import get_grad_scaler

import ampscaler
from ampscaler.integrations import standins
from ampscaler.integrations.accelerate import use_scaler

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture
def patched() -> Iterator[None]:
    with ampscaler.patch_torch(hysteresis=2):
        yield


@pytest.mark.usefixtures("patched")
def test_accelerates_constructors_build_ampscalers_scalers() -> None:
    kwargs = GradScalerKwargs(init_scale=1024.0, growth_interval=7).to_kwargs()
    fsdp2 = get_fsdp2_grad_scaler(device="cpu", **kwargs)
    with pytest.warns(UserWarning, match="CUDA is not available"):  # "cuda", as torch's
        fsdp1 = get_grad_scaler(DistributedType.FSDP, **kwargs)
        default = get_grad_scaler(**kwargs)
    assert isinstance(fsdp1, ampscaler.ShardedGradScaler)
    assert type(fsdp2) is type(default) is standins.TorchGradScaler
    for scaler in (fsdp1, fsdp2, default):  # Accelerate's kwargs reach ampscaler's scaler
        assert scaler.policy.growth_interval == 7 and scaler.policy.hysteresis == 2
    assert fsdp2.get_scale() == 1024.0 and fsdp2.get_growth_interval() == 7
    for disabled in (fsdp1, default):  # built for "cuda" on this CPU: as torch's, no getters
        assert not disabled.is_enabled()
        with pytest.raises(AttributeError, match="disabled"):
            disabled.get_growth_interval()


def fsdp_accelerator(version: int) -> Accelerator:
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
    return accelerator


def test_use_scaler_builds_fsdp1s_sharded_scaler_and_refuses_a_plain_one(
    world_of_one: dist.ProcessGroup,
) -> None:
    accelerator = fsdp_accelerator(1)
    with pytest.raises(ampscaler.InvalidConfigError, match="ShardedGradScaler"):
        use_scaler(accelerator, ampscaler.GradScaler("cpu"))
    assert isinstance(use_scaler(accelerator), ampscaler.ShardedGradScaler)
    assert accelerator.scaler.process_group is None  # the default group, as torch's


def test_use_scaler_builds_fsdp2s_plain_scaler_agreeing_over_the_ranks(
    world_of_one: dist.ProcessGroup,
) -> None:
    scaler = use_scaler(fsdp_accelerator(2))
    assert type(scaler) is ampscaler.GradScaler
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.last_overflow
    assert report is not None and report.ranks == (0,)  # agreed over the default group
    # The accelerator and the scaler hold the group in reference cycles: free them before the
    # group is destroyed, or its threads outlive the test and a later fork can hang on them.
    del scaler, report
    gc.collect()
