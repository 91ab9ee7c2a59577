"""Kept holders are reused from a free list (hooks.c, issue 38): a holder
must never be handed out while torch still holds it. Graphs dropped without
backward fill the free list while a retained graph's holders stay alive;
the new graphs' holders come from the list; every backward, the retained
graph's twice, must match the gradients of the same steps without hooks."""
import gc

import pytest
import torch
import torch.nn as nn

import ferry.torch as ft


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 4))


def run(hooked):
    m = model()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=gen, requires_grad=True) for _ in range(40)]
    ctx = ft.offload(policy="default", backend="host", steps="manual",
                     min_offload_bytes=1 << 30) if hooked else None
    if ctx:
        ctx.__enter__()
    try:
        kept = m(xs[0]).pow(2).sum()
        for x in xs[1:30]:  # dropped without backward: their holders are freed
            m(x).sum()
        gc.collect()
        later = [m(x).exp().sum() for x in xs[30:]]  # holders from the free list
        kept.backward(retain_graph=True)
        for loss in later:
            loss.backward()
        kept.backward()
        if hooked:  # all kept as Kepts, more than the free list holds
            assert ctx.engine.stats()["kept_small"] > 300
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
            ft.step()
            ft.close()
    return [p.grad for p in m.parameters()] + [x.grad for x in xs if x.grad is not None]


@pytest.mark.filterwarnings("ignore:.*overrule policy")
def test_reused_holders_give_the_gradients_of_no_hooks():
    with_ferry, without = run(True), run(False)
    assert len(with_ferry) == len(without) == 6 + 11  # parameters, inputs of the graphs run backward
    for a, b in zip(with_ferry, without):
        assert torch.equal(a, b)
