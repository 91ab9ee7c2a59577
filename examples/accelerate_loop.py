"""An accelerate training loop with ferry: wrap each step's forward in
ferry.torch.offload(model).

    python examples/accelerate_loop.py [--steps 3]"""
import argparse

import torch
from accelerate import Accelerator

import ferry.torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    steps = ap.parse_args().steps
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 64)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                       batch_size=16)
    model, opt, data = accelerator.prepare(model, opt, data)
    for step, (xb, yb) in zip(range(steps), data):
        with ferry.torch.offload(model, policy="default"):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    s = ferry.torch.stats()
    print(f"{s['tensors_offloaded']} tensors offloaded, {s['bytes_h2d']} bytes reloaded")
    assert s["tensors_offloaded"] > 0


if __name__ == "__main__":
    main()
