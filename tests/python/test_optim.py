"""ferry.torch.offload_optimizer (ferry/optim.py, docs/optimizer-offload.md):
the host share steps with torch's own CPU kernels, so on a CPU-only machine
the parameters after N steps equal a plain run's bit for bit. Both sides use
foreach=False (the single-tensor kernels) so the arithmetic is the same
whichever share a parameter is in."""
import copy
import io
import os
import socket
import subprocess
import sys

import pytest
import torch

import ferry.torch as ft
from ferry.optim import offload_optimizer

HERE = os.path.dirname(os.path.abspath(__file__))


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
        torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))


def make_opt(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=False)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(n)]


def train(model, opt, data, sched=None):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def same_state(sa, sb):
    assert sa["param_groups"] == sb["param_groups"]
    assert sorted(sa["state"]) == sorted(sb["state"])
    for k in sa["state"]:
        x, y = sa["state"][k], sb["state"][k]
        assert sorted(x) == sorted(y)
        for n in x:
            if torch.is_tensor(x[n]):
                assert torch.equal(x[n].cpu(), y[n].cpu()), (k, n)
            else:
                assert x[n] == y[n], (k, n)
    return True


def test_reexported_from_ferry_torch():
    assert ft.offload_optimizer is offload_optimizer


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("overlap", [True, False])
def test_bit_identical_to_plain(kind, fraction, overlap):
    data = batches(5)
    ref = make_model()
    ref_losses = train(ref, make_opt(kind, ref.parameters()), data)
    m = make_model()
    opt = offload_optimizer(make_opt(kind, m.parameters()), fraction=fraction, overlap=overlap)
    losses = train(m, opt, data)
    assert losses == ref_losses
    assert same_params(m, ref)
    off = opt.ferry_offload
    n_params = len(list(m.parameters()))
    if fraction == 0.0:
        assert off.host_bytes == 0 and off.host_opt is None
    elif fraction == 1.0:
        assert len(off.pairs) == n_params and off.host_steps == 5
    else:
        assert 0 < off.host_bytes <= 0.5 * off.total_bytes and len(off.pairs) < n_params
        assert off.host_steps == 5
    # The host share's state lives in the host optimizer, not the wrapped one.
    for _, p, hp, _ in off.pairs:
        assert p not in opt.state
        assert hp.device.type == "cpu" and hp in off.host_opt.state


def test_host_share_is_largest_first_and_deterministic():
    m = make_model()
    opt = offload_optimizer(make_opt("adamw", m.parameters()), fraction=0.5)
    off = opt.ferry_offload
    names = {id(p): n for n, p in m.named_parameters()}
    chosen = [names[id(p)] for _, p, _, _ in off.pairs]
    # 27680 bytes in all: the 64x64 weight (16384) alone is over half, so it
    # stays; the next largest (64x32, 8192) and then every smaller one fit.
    assert off.total_bytes == 27680
    assert chosen == ["0.weight", "0.bias", "2.bias", "4.weight", "4.bias", "5.weight",
                      "5.bias"]
    assert off.host_bytes == 27680 - 16384
    m2 = make_model()
    opt2 = offload_optimizer(make_opt("adamw", m2.parameters()), fraction=0.5)
    names2 = {id(p): n for n, p in m2.named_parameters()}
    assert chosen == [names2[id(p)] for _, p, _, _ in opt2.ferry_offload.pairs]


def test_policy_chooses_host_share():
    m = make_model()
    opt = offload_optimizer(make_opt("sgd", m.parameters()),
                            policy=lambda p: p.dim() == 1)
    assert all(p.dim() == 1 for _, p, _, _ in opt.ferry_offload.pairs)
    assert len(opt.ferry_offload.pairs) == sum(1 for p in m.parameters() if p.dim() == 1)


RESIDENT_POLICY = """local R = require "ferry.rules"
return R.policy {
  optimizer = R.host_fraction(0.5),
}
"""


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_lua_policy_chooses_what_fraction_would(kind, tmp_path):
    """optimizer = R.host_fraction(0.5) picks the parameters fraction=0.5
    picks (largest first within half the bytes), names them from the model,
    gives each its reason, and trains bit for bit like the plain optimizer."""
    pol = tmp_path / "half.lua"
    pol.write_text(RESIDENT_POLICY)
    data = batches(4)
    ref = make_model()
    ref_losses = train(ref, make_opt(kind, ref.parameters()), data)
    m = make_model()
    opt = offload_optimizer(make_opt(kind, m.parameters()), policy=str(pol), model=m)
    by_fraction = offload_optimizer(make_opt(kind, make_model().parameters()), fraction=0.5)
    off = opt.ferry_offload
    names = [c.name for c in off.choices if c.host]
    assert names == ["0.weight", "0.bias", "2.bias", "4.weight", "4.bias", "5.weight", "5.bias"]
    assert off.host_bytes == by_fraction.ferry_offload.host_bytes == 27680 - 16384
    assert [c.name for c in off.choices] == [n for n, _ in m.named_parameters()]
    # the rule and its line (the policy's path, its start cut when long)
    assert all(c.rule == "host_fraction(0.5)" and c.where.endswith("half.lua:3")
               for c in off.choices), off.choices
    assert train(m, opt, data) == ref_losses
    assert same_params(m, ref)
    assert off.host_steps == 4


def test_lua_policy_is_asked_largest_first(tmp_path):
    """r.index counts from the largest parameter; r carries the model's
    names, layers (none in a Sequential of mixed layers) and byte totals."""
    pol = tmp_path / "first.lua"
    pol.write_text("return { api = 1, decide = function() end,\n"
                   "  resident = function(r)\n"
                   "    assert(r.kind == 'optimizer' and r.count == 8 and r.total_bytes == 27680)\n"
                   "    assert(r.layer == -1 and r.module .. '.weight' == r.name or\n"
                   "           r.module .. '.bias' == r.name)\n"
                   "    return r.index == 0 end }\n")
    m = make_model()
    opt = offload_optimizer(make_opt("adamw", m.parameters()), policy=str(pol), model=m)
    assert [c.name for c in opt.ferry_offload.choices if c.host] == ["2.weight"]
    assert all(c.rule == "resident" for c in opt.ferry_offload.choices)


def test_lua_policy_needs_resident(tmp_path):
    with pytest.raises(ValueError, match="has no resident"):
        offload_optimizer(make_opt("adamw", make_model().parameters()), policy="default")


def test_rejects_bad_arguments():
    m = make_model()
    with pytest.raises(ValueError):
        offload_optimizer(make_opt("sgd", m.parameters()), fraction=1.5)
    with pytest.raises(TypeError):
        offload_optimizer(object())
    opt = offload_optimizer(make_opt("sgd", m.parameters()))
    with pytest.raises(RuntimeError):
        offload_optimizer(opt)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_state_dict_round_trip(kind):
    data = batches(5)
    ref = make_model()
    ref_opt = make_opt(kind, ref.parameters())
    train(ref, ref_opt, data[:3])
    ref_sd = copy.deepcopy(ref_opt.state_dict())  # state_dict() aliases the live state

    m = make_model()
    opt = offload_optimizer(make_opt(kind, m.parameters()), fraction=0.5)
    train(m, opt, data[:3])
    sd = opt.state_dict()
    assert same_state(sd, ref_sd)  # the wrapped optimizer's format, every parameter
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)

    # Offloaded state into a plain optimizer, and a plain one into an offloaded one.
    m2 = make_model()
    m2.load_state_dict(m.state_dict())
    plain = make_opt(kind, m2.parameters())
    plain.load_state_dict(loaded)
    m3 = make_model()
    m3.load_state_dict(ref.state_dict())
    off3 = offload_optimizer(make_opt(kind, m3.parameters()), fraction=0.5)
    off3.load_state_dict(ref_sd)
    for _, p, hp, _ in off3.ferry_offload.pairs:
        assert p not in off3.state and hp in off3.ferry_offload.host_opt.state

    train(ref, ref_opt, data[3:])
    train(m, opt, data[3:])
    train(m2, plain, data[3:])
    train(m3, off3, data[3:])
    for other in (m, m2, m3):
        assert same_params(other, ref)
    assert same_state(off3.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_lr_scheduler(kind):
    data = batches(6)
    ref = make_model()
    ref_opt = make_opt(kind, ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.3)
    train(ref, ref_opt, data, ref_sched)
    m = make_model()
    opt = offload_optimizer(make_opt(kind, m.parameters()), fraction=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
    train(m, opt, data, sched)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert ref_opt.param_groups[0]["lr"] < ref_opt.defaults["lr"] * 0.3 ** 2  # it decayed
    opt.state_dict()  # hyperparameters reach the host optimizer at step and state_dict
    assert opt.ferry_offload.host_opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert same_params(m, ref)


def test_remove_restores_plain_optimizer():
    data = batches(4)
    ref = make_model()
    ref_opt = make_opt("adamw", ref.parameters())
    train(ref, ref_opt, data)
    m = make_model()
    opt = offload_optimizer(make_opt("adamw", m.parameters()), fraction=0.5)
    train(m, opt, data[:2])
    opt.ferry_offload.remove()
    assert "step" not in opt.__dict__
    train(m, opt, data[2:])
    assert same_params(m, ref)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_ddp_gloo_two_ranks(tmp_path):
    port = free_port()
    worker = os.path.join(HERE, "optim_dist_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(r), "2", str(port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        assert p.returncode == 0, err[-3000:]
    a = torch.load(str(tmp_path / "rank0.pt"))
    b = torch.load(str(tmp_path / "rank1.pt"))
    for k in a["offload"]:
        assert torch.equal(a["offload"][k], a["plain"][k]), k  # bit for bit with plain DDP
        assert torch.equal(a["offload"][k], b["offload"][k]), k  # ranks agree


HAVE_GRAD_HOOK = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_grad_accumulation_and_unused_parameter(kind):
    """Two backward passes per step (the host copy must hold the sum, whichever
    way gradients reach it) and a parameter that gets no gradient (skipped on
    both sides, its state never created)."""
    def build():
        m = make_model()
        m.unused = torch.nn.Parameter(torch.ones(7))
        return m

    def accumulate(m, opt, data):
        for i in range(0, len(data), 2):
            opt.zero_grad()
            for x, y in data[i:i + 2]:
                torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()

    data = batches(8)
    ref = build()
    accumulate(ref, make_opt(kind, ref.parameters()), data)
    m = build()
    opt = offload_optimizer(make_opt(kind, m.parameters()), fraction=1.0)
    off = opt.ferry_offload
    assert off.early_grads == HAVE_GRAD_HOOK  # the hook path is the one tested on torch 2.x
    accumulate(m, opt, data)
    assert same_params(m, ref)
    hp_unused = [hp for _, p, hp, _ in off.pairs if p is m.unused][0]
    assert hp_unused not in off.host_opt.state and torch.equal(m.unused, torch.ones(7))


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_steps_host_share_on_a_worker_thread(overlap):
    import threading
    m = make_model()
    opt = offload_optimizer(make_opt("adamw", m.parameters()), fraction=0.5, overlap=overlap)
    host_opt = opt.ferry_offload.host_opt
    seen = []
    orig = host_opt.step

    def spy(*a, **k):
        seen.append(threading.current_thread().name)
        return orig(*a, **k)
    host_opt.step = spy
    train(m, opt, batches(2))
    main = threading.current_thread().name
    assert seen == (["ferry-host-optim"] * 2 if overlap else [main] * 2)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_gradients_changed_after_backward(fraction):
    """clip_grad_norm_ and GradScaler-style unscaling change gradients in place
    between backward and step: the host share must step on the changed ones,
    not on what the post-accumulate hook copied."""
    def run(offload):
        m = make_model()
        opt = make_opt("adamw", m.parameters())
        if offload:
            opt = offload_optimizer(opt, fraction=fraction)
        for x, y in batches(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            for p in m.parameters():
                p.grad.mul_(0.5)  # an unscale
            opt.step()
        return m
    assert same_params(run(True), run(False))
