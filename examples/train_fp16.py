"""Train a tiny regression model in fp16 autocast on the CPU with ampscaler's GradScaler.

Run: python examples/train_fp16.py [--steps N]

It prints the loss, the loss scale and the number of skipped steps as training goes; the scale
doubles every 50 clean steps and would halve at any step whose gradients overflowed.
"""

from __future__ import annotations

import argparse

import torch

from ampscaler import GradScaler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler("cpu", growth_interval=50)
    inputs = torch.randn(256, 16)
    targets = (inputs[:, :4].sum(dim=1, keepdim=True) * 0.1).sin()

    for step in range(1, args.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(inputs).float(), targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        if step % max(1, args.steps // 10) == 0 or step == 1:
            print(
                f"step {step:4d}  loss {loss.item():.5f}  scale {scaler.get_scale():>8g}  "
                f"skipped {scaler.metrics('')['skips']}"
            )
    print(f"done: {scaler.metrics('')}")


if __name__ == "__main__":
    main()
