"""offload_weights under torch.compile (torch 2.x): a compiled model whose
layers are offloaded trains bit for bit like the same model compiled
without offload (the hooks and the forward wrapper object run under
dynamo; the emptied parameters make it guard and fall back as needed)."""
import pytest
import torch

from ferry.weights import offload_weights

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile: torch 2.x")


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                 for _ in range(4)])


def train(offload):
    m = net()
    w = offload_weights(m, ["1", "2"]) if offload else None
    cm = torch.compile(m, backend="aot_eager")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
    losses = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        loss = torch.nn.functional.mse_loss(cm(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return m, w, losses


def test_compiled_offloaded_model_trains_like_the_compiled_plain_one():
    torch._dynamo.reset()
    ref, _, ref_losses = train(False)
    torch._dynamo.reset()
    m, w, losses = train(True)
    assert losses == ref_losses
    assert w.offloads >= 3 * 2 and w.reloads >= 3 * 2
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(),
                                                 ref.state_dict().values()))
