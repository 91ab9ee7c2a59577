"""Lightning with ferry: activations offloaded in every training step.

    python examples/lightning_train.py [--steps 3]"""
import argparse

import lightning.pytorch as pl
import torch

from ferry.lightning import ActivationOffload


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                       torch.nn.Linear(256, 256), torch.nn.GELU(),
                                       torch.nn.Linear(256, 1))

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    steps = ap.parse_args().steps
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                       batch_size=16)
    offload = ActivationOffload(policy="default", backend="host")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[offload])
    trainer.fit(Model(), data)
    import ferry.torch
    s = ferry.torch.stats()
    print(f"{trainer.global_step} steps, {s['tensors_offloaded']} tensors offloaded, "
          f"{s['bytes_d2h']} bytes to the host")
    assert s["tensors_offloaded"] > 0


if __name__ == "__main__":
    main()
