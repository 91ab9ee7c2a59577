"""A torchtune-style training loop switched to ferry by one import.

    python examples/torchtune_recipe.py [--steps 3]

torchtune's recipes wrap the forward in OffloadActivations and the output
head in NoOpManager; ferry.torch has both under the same arguments."""
import argparse

import torch

from ferry.torch import NoOffload, OffloadActivations, stats  # was: torchtune.training


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=128, d=64, layers=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
            for _ in range(layers))
        self.output = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        with NoOffload():  # the head's activations: backward needs them first
            return self.output(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    steps = ap.parse_args().steps
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        tokens = torch.randint(0, 128, (4, 32))
        with OffloadActivations(max_fwd_stash_size=5, min_offload_size=1024):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128),
                                                     tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        s = stats()
        print(f"step {step}: loss {loss.item():.4f}, {s['tensors_offloaded']} tensors offloaded "
              f"so far, {s['bytes_h2d']} bytes reloaded")
    assert stats()["tensors_offloaded"] > 0


if __name__ == "__main__":
    main()
