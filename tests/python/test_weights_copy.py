"""copy.deepcopy of a model under offload_weights (swa_utils.AveragedModel
and EMA helpers copy the model they are given): the copy runs its own
layers from its own host copies (before: the copied forward wrapper was the
original's closure, so the copy ran the original's emptied module and
raised, and its state_dict had empty entries)."""
import copy

import pytest
import torch

from ferry.weights import offload_weights

OFFLOADED = ["1", "2"]


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])


def batch(i):
    g = torch.Generator().manual_seed(10 + i)
    return torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)


def train(m, steps):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for i in steps:
        x, y = batch(i)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return m


def values(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("when", ["after wrap", "after a step"])
def test_deepcopy_of_an_offloaded_model_is_a_working_independent_copy(when):
    m = net()
    w = offload_weights(m, OFFLOADED)
    ref = net()
    if when == "after a step":
        train(m, range(1))
        train(ref, range(1))
    c = copy.deepcopy(m)
    assert values(c).keys() == values(ref).keys()
    assert all(torch.equal(a, b) for a, b in zip(values(c).values(), values(ref).values()))
    x, _ = batch(99)
    assert torch.equal(c(x), ref(x))
    # the copy trains on its own: the original does not move, and each
    # matches a plain model trained the same way
    train(c, range(1, 3))
    plain_copy = train(copy.deepcopy(ref), range(1, 3))
    assert all(torch.equal(a, b) for a, b in zip(values(c).values(), values(plain_copy).values()))
    assert all(torch.equal(a, b) for a, b in zip(values(m).values(), values(ref).values()))
    # the copy's layers are offloaded too, from their own host buffers
    c(x)
    assert all(p.numel() == 0 for p in c[1].parameters())
    with torch.no_grad():
        m.train()(x)  # the original's own forward offloads its own layers
    assert all(p.numel() == 0 for p in m[1].parameters())
    w.remove()
    assert torch.equal(m(x), ref(x))


def test_averaged_model_of_an_offloaded_model_runs():
    m = net()
    offload_weights(m, OFFLOADED)
    avg = torch.optim.swa_utils.AveragedModel(m)
    x, _ = batch(0)
    assert torch.equal(avg(x), net()(x))
