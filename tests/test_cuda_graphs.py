"""Captured graphs read the live scale: the behaviours torch's CUDA-graph scaling tests check.

A CUDA graph captures ``scaler.scale(loss)`` once and replays it; every replay multiplies by the
tensor that was the scale at capture time. That only works if ``update()`` writes the new scale
into that same tensor. On the CPU the capture is emulated: the replayed loss is multiplied by
the tensor ``scale()`` multiplied by at "capture" time, and nothing calls ``scale()`` again.
On a CUDA device (``benchmarks/gpu_check.sh``) real graphs are captured and replayed.
"""

from __future__ import annotations

import pytest
import torch

import ampscaler

# Inputs, and after each replayed step: the scale, the growth tracker and the gradient value.
# Inputs of 20000 and 40000 overflow fp16 once scaled, so those steps are skipped.
INPUTS = [5.0, 20000.0, 5.0, 40000.0]
SCALES = [4.0, 2.0, 2.0, 1.0]
TRACKERS = [1, 0, 1, 0]
GRADS = [5.0 * 4, float("inf"), 5.0 * 2, float("inf")]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _replayed(factory: type, device: str) -> None:
    weight = torch.ones(100, device=device, requires_grad=True)
    opt = torch.optim.SGD([weight], lr=0.1)
    scaler = factory(device, init_scale=4.0)
    static_input = torch.ones_like(weight)
    # "Capture": the loss is scaled once; the replays below multiply by the tensor it used.
    scaler.scale((weight.half() * static_input).sum())
    captured_scale = scaler._scale
    assert captured_scale is not None
    for value, scale, tracker, grad in zip(INPUTS, SCALES, TRACKERS, GRADS, strict=True):
        static_input.fill_(value)
        weight.grad = None  # a replayed backward writes the gradient afresh
        ((weight.half() * static_input).sum() * captured_scale).backward()  # the "replay"
        assert torch.equal(weight.grad, torch.full_like(weight, grad))
        scaler.step(opt)
        scaler.update()
        assert scaler._scale is captured_scale  # the same tensor, updated in place
        assert captured_scale.item() == scale
        assert scaler._get_growth_tracker() == tracker


@pytest.mark.parametrize("factory", [torch.amp.GradScaler, ampscaler.GradScaler])
def test_replayed_scale_follows_update_like_torch_on_the_cpu(factory: type) -> None:
    _replayed(factory, "cpu")


@needs_cuda
@pytest.mark.cuda
def test_captured_scale_and_backward_replay_with_skips_and_backoff() -> None:
    """torch's test_graph_grad_scaling, with ampscaler: capture scale + backward, replay."""
    scaler = ampscaler.GradScaler("cuda", init_scale=4.0)
    weight = torch.ones(100, device="cuda", requires_grad=True)
    opt = torch.optim.SGD([weight], lr=0.1)
    static_input = torch.ones_like(weight)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as capture requires
        scaler.scale((weight.half() * static_input).sum()).backward()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        scaler.scale((weight.half() * static_input).sum()).backward()
    for value, scale, tracker, grad in zip(INPUTS, SCALES, TRACKERS, GRADS, strict=True):
        static_input.fill_(value)
        graph.replay()
        assert torch.equal(weight.grad, torch.full_like(weight, grad))
        scaler.step(opt)
        scaler.update()
        assert scaler._scale is not None and scaler._scale.item() == scale
        assert scaler._get_growth_tracker() == tracker


@needs_cuda
@pytest.mark.cuda
def test_captured_fused_step_and_update_replay_like_eager() -> None:
    """Capture scale, backward, a capturable fused Adam step and update; replay with skips and
    growth; the scales and parameters follow an eager run of the same steps."""

    def run(captured: bool) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 16).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True, capturable=True)
        scaler = ampscaler.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
        static_input = torch.ones(4, 16, device="cuda")
        poison = torch.ones((), device="cuda")

        def step() -> None:
            loss = model(static_input).float().pow(2).mean() * poison
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=False)

        replay = step
        if captured:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            replay = graph.replay
        else:
            for _ in range(3):  # the warm-up (the captured step itself does not run)
                step()
        scales = []
        for index in range(12):
            poison.fill_(float("inf") if index % 5 == 2 else 1.0)
            replay()
            scales.append(float(scaler._scale.item()))  # type: ignore[union-attr]
        return scales, model.weight.detach().clone()

    captured_scales, captured_weight = run(captured=True)
    eager_scales, eager_weight = run(captured=False)
    assert captured_scales == eager_scales
    assert len(set(captured_scales)) > 2  # backoffs and growth happened
    torch.testing.assert_close(captured_weight, eager_weight)
