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


TORCH2 = int(torch.__version__.split(".")[0]) >= 2


def loop(m, opt, steps):
    for i in steps:
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_patched_methods_take_torch_keyword_names():
    """Callers pass torch's parameter names by keyword (DCP's
    set_optimizer_state_dict: load_state_dict(state_dict=...)); before, the
    patched methods named them otherwise and raised TypeError."""
    m = small_model()
    opt = offload_optimizer(torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False),
                            fraction=0.5)
    loop(m, opt, range(2))
    opt.load_state_dict(state_dict=opt.state_dict())
    extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.warns(RuntimeWarning, match="added after wrapping"):
        opt.add_param_group(param_group={"params": [extra]})
    assert opt.param_groups[-1]["params"] == [extra]


@pytest.mark.skipif(not TORCH2, reason="torch.distributed.checkpoint.state_dict: torch 2.x")
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_dcp_set_optimizer_state_dict_resumes_bit_identical(fraction, tmp_path):
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    def run(offload):
        m = small_model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
        if offload:
            offload_optimizer(opt, fraction=fraction)
        loop(m, opt, range(3))
        torch.save({"m": m.state_dict(), "o": get_optimizer_state_dict(m, opt)},
                   tmp_path / f"{offload}.pt")
        sd = torch.load(tmp_path / f"{offload}.pt")
        m2 = small_model()
        m2.load_state_dict(sd["m"])
        opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=False)
        if offload:
            offload_optimizer(opt2, fraction=fraction)
        set_optimizer_state_dict(m2, opt2, sd["o"])
        loop(m2, opt2, range(3, 6))
        return m2, opt2
    ref, _ = run(False)
    m, opt = run(True)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    host = opt.ferry_offload.host_opt.state
    assert host and all(float(s["step"]) == 6 for s in host.values())
    assert all(v.device.type == "cpu" for s in host.values() for v in s.values())
