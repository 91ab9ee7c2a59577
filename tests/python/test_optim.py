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
from optim_dist_worker import CASES

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
    # The host share's state lives in the host optimizer; the wrapped one's
    # opt.state shows that same dict (readers of opt.state see every state).
    for _, p, hp, _ in off.pairs:
        assert opt.state[p] is off.host_opt.state[hp]
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
        assert off3.state[p] is off3.ferry_offload.host_opt.state[hp]

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


def fsdp2_missing():
    """Why FSDP2 (fully_shard) cannot run here, or None."""
    if not torch.distributed.is_available():
        return "torch.distributed missing"
    try:
        import torch.distributed.fsdp as fsdp
    except Exception as ex:  # noqa: BLE001 - torch 1.13 on Python 3.11: a ValueError
        return ("torch %s: torch.distributed.fsdp does not import (%s: %s), so no FSDP at all"
                % (torch.__version__, type(ex).__name__, str(ex)[:120]))
    if not hasattr(fsdp, "fully_shard"):
        return "torch %s has no torch.distributed.fsdp.fully_shard (FSDP2)" % torch.__version__
    return None


def two_ranks(mode, out, timeout=240):
    """Both ranks of optim_dist_worker.py in mode over gloo on a free port;
    their results (rank0, rank1). Their stderr goes to files: a full pipe
    would stall one rank and, through the collectives, the other."""
    port = free_port()
    worker = os.path.join(HERE, "optim_dist_worker.py")
    logs = [open(str(out / ("rank%d.err" % r)), "w+") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, worker, str(r), "2", str(port), str(out), mode],
                              stdout=subprocess.DEVNULL, stderr=logs[r])
             for r in range(2)]
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [p.poll() is None for p in procs]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        logs[r].seek(0)
        err = logs[r].read()
        logs[r].close()
        assert not timed_out[r] and p.returncode == 0, (
            "rank %d %s:\n%s" % (r, "timed out after %d s" % timeout if timed_out[r]
                                 else "exited %s" % p.returncode, err[-3000:]))
    return tuple(torch.load(str(out / ("rank%d.pt" % r))) for r in range(2))


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed missing")
    return two_ranks("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    why = fsdp2_missing()
    if why:
        pytest.skip(why)
    return two_ranks("fsdp", tmp_path_factory.mktemp("fsdp"))


def check_case(runs, kind, fraction, overlap):
    """Bit for bit with the plain run on every rank, ranks equal, and the
    host share what the fraction says."""
    for res in runs:
        case = res["cases"][(kind, fraction, overlap)]
        # DDP writes the averaged gradient at the end of backward, FSDP the
        # reduced shard: both after any post-accumulate hook.
        assert not case["early_grads"]
        plain = res["plain"][kind]
        assert sorted(case["params"]) == sorted(plain)
        for name in plain:
            assert torch.equal(case["params"][name], plain[name]), name
        if fraction == 0.0:
            assert case["pairs"] == 0 and case["host_steps"] == 0
        else:
            assert 0 < case["pairs"] <= case["n_params"] and case["host_steps"] == 5
            assert (case["pairs"] == case["n_params"]) == (fraction == 1.0)
    a, b = (res["cases"][(kind, fraction, overlap)]["params"] for res in runs)
    for name in a:
        assert torch.equal(a[name], b[name]), name  # the ranks agree


# One pair of worker processes per mode runs every case (a few seconds);
# each case is its own test.
@pytest.mark.parametrize("kind,fraction,overlap", CASES)
def test_ddp_gloo_two_ranks(ddp_runs, kind, fraction, overlap):
    """DistributedDataParallel over 2 gloo ranks: after 5 steps the
    parameters equal a plain DDP run's bit for bit on both ranks."""
    check_case(ddp_runs, kind, fraction, overlap)


@pytest.mark.parametrize("kind,fraction,overlap", CASES)
def test_fsdp2_gloo_two_ranks(fsdp_runs, kind, fraction, overlap):
    """FSDP2 (fully_shard, DTensor parameters sharded over 2 gloo ranks):
    the host share steps each rank's local shard; after 5 steps the full
    parameters equal a plain FSDP2 run's bit for bit on both ranks."""
    check_case(fsdp_runs, kind, fraction, overlap)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_fsdp2_state_dict(fsdp_runs, kind):
    """Under FSDP2, state_dict() equals the plain optimizer's after 5 steps
    (its states DTensors laid out like the parameters, the values bit for
    bit), and a plain FSDP2 run's state dict loaded into an offloaded
    optimizer (fraction 0.5) after 3 of 5 steps puts the host share's state
    in the host optimizer as plain host tensors and trains on bit for bit."""
    for res in fsdp_runs:
        st = res["state"][kind]
        assert st["state_dict"] == []
        assert st["host_state"]
        for only_host, in_host_opt, types in st["host_state"]:
            assert only_host and in_host_opt and types
            assert "DTensor" not in types, types
        for name in st["plain"]:
            assert torch.equal(st["loaded"][name], st["plain"][name]), name


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
    for early in (False, True):
        m = build()
        opt = offload_optimizer(make_opt(kind, m.parameters()), fraction=1.0, early_grads=early)
        off = opt.ferry_offload
        assert off.early_grads == (early and HAVE_GRAD_HOOK)  # the hook path on torch 2.x
        accumulate(m, opt, data)
        assert same_params(m, ref)
    hp_unused = [hp for _, p, hp, _ in off.pairs if p is m.unused][0]
    assert hp_unused not in off.host_opt.state and torch.equal(m.unused, torch.ones(7))


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_steps_host_share_on_a_worker_thread(overlap):
    import threading
    m = make_model()
    opt = offload_optimizer(make_opt("adamw", m.parameters()), fraction=0.5, overlap=overlap)
    off = opt.ferry_offload
    seen = []
    orig = off._host_step

    def spy(*a, **k):
        seen.append(threading.current_thread().name)
        return orig(*a, **k)
    off._host_step = spy
    train(m, opt, batches(2))
    main = threading.current_thread().name
    assert seen == (["ferry-host-optim"] * 2 if overlap else [main] * 2)


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_gradients_changed_after_backward(fraction, early):
    """clip_grad_norm_ and an ordinary in-place scaling change gradients
    between backward and step: the host share must step on the changed ones,
    also with early_grads (the hook's copy is stale: its version counter says
    so). The real GradScaler: test_optim_loops.py."""
    def run(offload):
        m = make_model()
        opt = make_opt("adamw", m.parameters())
        if offload:
            opt = offload_optimizer(opt, fraction=fraction, early_grads=early)
        for x, y in batches(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            for p in m.parameters():
                p.grad.mul_(0.5)  # an unscale
            opt.step()
        return m
    assert same_params(run(True), run(False))
