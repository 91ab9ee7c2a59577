"""ferry.optim.offload_optimizer: edges found reviewing issue 39's fixes
(docs/optimizer-offload.md)."""
import pytest
import torch

from ferry.optim import offload_optimizer


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_closure_driven_optimizer_is_refused_at_wrap(fraction):
    """LBFGS re-evaluates its closure over every parameter inside step():
    its state cannot be split. Before, wrapping passed and step() raised
    "missing 1 required positional argument" after running the closure."""
    m = small_model()
    opt = torch.optim.LBFGS(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(TypeError, match="LBFGS.step needs a closure"):
        offload_optimizer(opt, fraction=fraction)
    assert getattr(opt, "ferry_offload", None) is None
    assert "step" not in opt.__dict__  # not patched: it still works as itself

    def closure():
        opt.zero_grad()
        loss = m(torch.ones(2, 8)).pow(2).mean()
        loss.backward()
        return loss
    opt.step(closure)
    assert any(not torch.equal(a, p) for a, p in zip(before, m.parameters()))


def test_optional_closure_optimizers_are_still_wrapped():
    m = small_model()
    for cls in (torch.optim.Adam, torch.optim.SGD, torch.optim.RMSprop):
        opt = offload_optimizer(cls(m.parameters(), lr=1e-2), fraction=0.5)
        assert opt.ferry_offload is not None
        opt.ferry_offload.remove()
