"""ferry.torch.offload_optimizer in real training loops (issue 39): the real
torch.amp.GradScaler (fused and not, with and without unscale_ and
clipping), resumed runs (load then wrap, wrap then load, steps before
wrapping), DCP's get_optimizer_state_dict, step hooks and snapshot fences,
a frozen-parameter fine-tune, delete-and-collect, load_state_dict straight to
the host, add_param_group. Everything is compared bit for bit with the plain
optimizer on CPU (docs/optimizer-offload.md)."""
import copy
import gc
import warnings
import weakref

import pytest
import torch

from ferry.optim import offload_optimizer

TORCH2 = int(torch.__version__.split(".")[0]) >= 2
HAVE_CPU_SCALER = hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler")
HAVE_STEP_HOOKS = hasattr(torch.optim.Optimizer, "register_step_pre_hook")
HAVE_GRAD_HOOK = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def cpu_fused_ok():
    """torch has CPU kernels for fused Adam/AdamW/SGD (2.4+)."""
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True)
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


needs_scaler = pytest.mark.skipif(not HAVE_CPU_SCALER,
                                  reason="torch.amp.GradScaler on CPU needs torch >= 2.3")
needs_fused = pytest.mark.skipif(not (HAVE_CPU_SCALER and cpu_fused_ok()),
                                 reason="fused CPU optimizers need torch >= 2.4")


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
        torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))


def make_opt(kind, params, fused=False):
    extra = {"fused": True} if fused else {"foreach": False}
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **extra)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3, **extra)


def batches(n, seed=1, inf_at=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        if i == inf_at:
            x[0, 0] = float("inf")  # a step GradScaler skips
        out.append((x, y))
    return out


def train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def assert_same_state(sa, sb):
    assert sorted(sa["state"]) == sorted(sb["state"])
    for k in sa["state"]:
        x, y = sa["state"][k], sb["state"][k]
        assert sorted(x) == sorted(y), k
        for n in x:
            if torch.is_tensor(x[n]):
                assert torch.equal(x[n].cpu(), y[n].cpu()), (k, n)
            else:
                assert x[n] == y[n], (k, n)


# ---- 1, 2: the real GradScaler ----------------------------------------------------

def scaler_run(kind, fraction, fused, unscale, clip, early=None):
    m = make_model()
    opt = make_opt(kind, m.parameters(), fused=fused)
    if fraction is not None:
        opt = offload_optimizer(opt, fraction=fraction, early_grads=early)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    scales = []
    for x, y in batches(6, inf_at=2):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        scaler.scale(loss).backward()
        if unscale:
            scaler.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return m, opt, scales


@needs_scaler
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("unscale,clip", [(False, False), (True, False), (True, True)])
def test_grad_scaler_unfused_bit_identical(kind, fraction, unscale, clip):
    """GradScaler's unscale kernel changes the gradients in place without a
    version bump: the host share must step on the unscaled gradients (before:
    the early hook copy of the scaled ones, parameters to 1e12 with SGD), and
    skip the inf step as the plain optimizer does."""
    ref, ref_opt, ref_scales = scaler_run(kind, None, False, unscale, clip)
    m, opt, scales = scaler_run(kind, fraction, False, unscale, clip)
    assert scales == ref_scales and scales[2] < scales[1]  # step 2 found an inf and was skipped
    assert same_params(m, ref)
    assert opt.ferry_offload.host_steps == 5  # not the skipped one
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


@needs_fused
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("unscale,clip", [(False, False), (True, True)])
@pytest.mark.parametrize("overlap", [True, False])
def test_grad_scaler_fused_bit_identical(kind, fraction, unscale, clip, overlap):
    """A fused optimizer gets grad_scale/found_inf from the scaler: the host
    share (fused too, torch's CPU kernel) must unscale and skip the inf step
    as the device share does (before: fused dropped on the host, scaled
    gradients stepped, NaN)."""
    ref, ref_opt, _ = scaler_run(kind, None, True, unscale, clip)
    m = make_model()
    opt = offload_optimizer(make_opt(kind, m.parameters(), fused=True), fraction=fraction,
                            overlap=overlap)
    assert opt.ferry_offload.host_fused
    assert all(g["fused"] for g in opt.ferry_offload.host_opt.param_groups)
    del m, opt
    m, opt, _ = scaler_run(kind, fraction, True, unscale, clip)
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert same_params(m, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    assert not hasattr(opt.ferry_offload.host_opt, "grad_scale")  # only for the step


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_gradient_written_through_data_is_seen(fraction):
    """p.grad.data.clamp_ (no version bump on p.grad): seen, as the gradient
    is taken when step() runs."""
    def run(offload):
        m = make_model()
        opt = make_opt("adamw", m.parameters())
        if offload:
            opt = offload_optimizer(opt, fraction=fraction)
        for x, y in batches(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            for p in m.parameters():
                p.grad.data.clamp_(-1e-3, 1e-3)
            opt.step()
        return m
    assert same_params(run(True), run(False))


# ---- 3: resumed runs ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("order", ["load_then_wrap", "wrap_then_load", "steps_then_wrap"])
def test_resume_keeps_the_host_share_state(kind, order):
    """A run resumed from a checkpoint (loaded before or after wrapping) or
    wrapped after some plain steps goes on as the plain run: the host
    optimizer starts from the existing state, not from zero, and the device
    copies of that state are dropped (before: step 3 instead of 6)."""
    data = batches(6)
    ref = make_model()
    ref_opt = make_opt(kind, ref.parameters())
    train(ref, ref_opt, data[:3])
    sd = {"model": {k: v.clone() for k, v in ref.state_dict().items()},
          "opt": ref_opt.state_dict()}
    sd["opt"] = copy.deepcopy(sd["opt"])
    train(ref, ref_opt, data[3:])

    if order == "steps_then_wrap":
        m = make_model()
        opt = make_opt(kind, m.parameters())
        train(m, opt, data[:3])
    else:
        m = make_model()
        m.load_state_dict(sd["model"])
        opt = make_opt(kind, m.parameters())
        if order == "load_then_wrap":
            opt.load_state_dict(copy.deepcopy(sd["opt"]))  # torch 2.x aliases CPU states
    old = {id(p): weakref.ref(v) for p in m.parameters() if p in opt.state
           for v in opt.state[p].values() if torch.is_tensor(v)}
    opt = offload_optimizer(opt, fraction=0.5)
    if order == "wrap_then_load":
        opt.load_state_dict(sd["opt"])
    off = opt.ferry_offload
    for _, p, hp, _ in off.pairs:
        assert opt.state[p] is off.host_opt.state[hp]  # the host's dict, no device copy left
        if kind == "adamw":
            assert float(off.host_opt.state[hp]["step"]) == 3
    gc.collect()
    host_ids = {id(p) for _, p, _, _ in off.pairs}
    assert not [k for k, r in old.items() if k in host_ids and r() is not None]
    train(m, opt, data[3:])
    assert same_params(m, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


def test_load_state_dict_goes_straight_to_the_host():
    """load_state_dict hands torch's own load only the device share's states:
    the host share's are not put on the parameters' device first (a transient
    of the whole host share there, an OOM where offload is needed)."""
    ref = make_model()
    ref_opt = make_opt("adamw", ref.parameters())
    train(ref, ref_opt, batches(2))
    sd = ref_opt.state_dict()
    m = make_model()
    opt = offload_optimizer(make_opt("adamw", m.parameters()), fraction=0.5)
    off = opt.ferry_offload
    seen = []
    orig = off._orig_load_state_dict

    def spy(d):
        seen.append(sorted(d["state"]))
        return orig(d)
    off._orig_load_state_dict = spy
    opt.load_state_dict(sd)
    params = [p for g in opt.param_groups for p in g["params"]]
    host_ids = [i for i, p in enumerate(params) if any(p is q for _, q, _, _ in off.pairs)]
    assert host_ids and seen and not set(seen[0]) & set(host_ids)
    assert_same_state(opt.state_dict(), sd)


def test_load_state_dict_of_another_shape_is_refused_and_nothing_lost():
    m = make_model()
    opt = offload_optimizer(make_opt("adamw", m.parameters()), fraction=0.5)
    train(m, opt, batches(1))
    before = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
              for k, s in opt.state_dict()["state"].items()}
    other = make_opt("adamw", torch.nn.Linear(2, 2).parameters()).state_dict()
    with pytest.raises(ValueError):
        opt.load_state_dict(other)
    assert_same_state(opt.state_dict(), {"state": before})


# ---- 4: readers of opt.state, step hooks, snapshot fences -------------------------

@pytest.mark.skipif(not TORCH2, reason="torch.distributed.checkpoint.state_dict: torch 2.x")
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_dcp_get_optimizer_state_dict_adds_no_step(fraction):
    """DCP's get_optimizer_state_dict initialises an optimizer whose
    opt.state looks empty with a zero-gradient step: opt.state must show the
    host share's states (before: an extra host step at every checkpoint)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def run(offload):
        m = make_model()
        opt = make_opt("adamw", m.parameters())
        if offload:
            opt = offload_optimizer(opt, fraction=fraction)
        sds = []
        for x, y in batches(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)  # as Lightning and most loops leave it
            sds.append(get_optimizer_state_dict(m, opt))
        return m, sds
    ref, ref_sds = run(False)
    m, sds = run(True)
    assert same_params(m, ref)
    for a, b in zip(sds, ref_sds):
        assert_same_state(a, b)
    assert float(sds[-1]["state"]["0.weight"]["step"]) == 4


@pytest.mark.skipif(not HAVE_STEP_HOOKS, reason="optimizer step hooks: torch 2.x")
@pytest.mark.parametrize("overlap", [True, False])
def test_step_hooks_run_around_the_whole_step(overlap):
    """A step pre-hook sees every gradient and the states before either
    share steps; a post-hook sees the updated parameters copied back."""
    m = make_model()
    opt = offload_optimizer(make_opt("adamw", m.parameters()), fraction=0.5, overlap=overlap)
    off = opt.ferry_offload
    pre, post = [], []

    def pre_hook(o, args, kwargs):
        pre.append((off.host_steps, all(p.grad is not None for p in m.parameters()),
                    all(not off.host_opt.state.get(hp) or float(off.host_opt.state[hp]["step"])
                        == off.host_steps for _, _, hp, _ in off.pairs)))

    def post_hook(o, args, kwargs):
        post.append((off.host_steps,
                     all(torch.equal(p, hp) for _, p, hp, _ in off.pairs)))
    opt.register_step_pre_hook(pre_hook)
    opt.register_step_post_hook(post_hook)
    train(m, opt, batches(3))
    assert pre == [(0, True, True), (1, True, True), (2, True, True)]
    assert post == [(1, True), (2, True), (3, True)]


@pytest.mark.skipif(not HAVE_STEP_HOOKS, reason="optimizer step hooks: torch 2.x")
def test_global_step_pre_hook_runs_once_before_the_host_step():
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    m = make_model()
    opt = offload_optimizer(make_opt("adamw", m.parameters()), fraction=1.0)
    off = opt.ferry_offload
    seen = []
    h = register_optimizer_step_pre_hook(lambda o, a, k: seen.append((o is opt, off.host_steps)))
    try:
        train(m, opt, batches(2))
    finally:
        h.remove()
    assert seen == [(True, 0), (True, 1)]  # once per step, not also for the host optimizer


@pytest.mark.parametrize("overlap", [True, False])
def test_snapshot_fences_before_the_host_step(tmp_path, overlap):
    """ferry.torch.snapshot(optimizer=opt): the file holds the states as of
    the snapshot; the fence (a step pre-hook on torch 2.x) runs before the
    host share steps."""
    import ferry.torch as ft
    m = make_model()
    opt = offload_optimizer(make_opt("adamw", m.parameters()), fraction=1.0, overlap=overlap)
    off = opt.ferry_offload
    train(m, opt, batches(2))
    fenced_at = []
    real_step = off._host_step

    def spy(*a, **k):
        fenced_at.append(h.fenced)
        return real_step(*a, **k)
    off._host_step = spy
    want = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
    h = ft.snapshot({"optimizer": opt.state_dict()}, str(tmp_path / "o.pt"), optimizer=opt,
                    backend="host")
    train(m, opt, batches(1, seed=5))
    h.wait()
    assert fenced_at == [True]
    got = torch.load(str(tmp_path / "o.pt"))["optimizer"]
    assert_same_state(got, {"state": want})


# ---- 7: frozen parameters -------------------------------------------------------------

@pytest.mark.parametrize("early", [None, True])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_frozen_parameter_fine_tune(early, fraction):
    """The usual fine-tune: frozen layers left in the optimizer (torch 2.x
    raised 'cannot register a hook on a tensor that doesn't require
    gradient' at wrap)."""
    def run(offload):
        m = make_model()
        for p in m[0].parameters():
            p.requires_grad_(False)
        opt = make_opt("adamw", m.parameters())
        if offload:
            opt = offload_optimizer(opt, fraction=fraction, early_grads=early)
        train(m, opt, batches(3))
        return m, opt
    ref, ref_opt = run(False)
    m, opt = run(True)
    assert same_params(m, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    assert torch.equal(m[0].weight, make_model()[0].weight)


# ---- 8: delete and collect ------------------------------------------------------------

@pytest.mark.parametrize("early", [None, True])
def test_deleted_offload_is_freed(early):
    """Nothing of a deleted model, optimizer and offload stays alive (before:
    the gradient hook's closure held the offload, and through it the
    optimizer and parameters, from torch's C++ hook storage: RSS grew by the
    model's size per round)."""
    refs = []
    for _ in range(2):
        m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        opt = offload_optimizer(torch.optim.AdamW(m.parameters(), foreach=False), fraction=1.0,
                                early_grads=early)
        m(torch.randn(4, 256)).sum().backward()
        opt.step()
        off = opt.ferry_offload
        refs.append([weakref.ref(x) for x in (m, opt, off, off.host_opt)])
        refs.append([weakref.ref(t) for _, p, hp, hg in off.pairs for t in (p, hp, hg)])
        refs.append([weakref.ref(v) for s in off.host_opt.state.values() for v in s.values()])
        del m, opt, off
        gc.collect()
    alive = [r for group in refs for r in group if r() is not None]
    assert not alive, "%d objects of deleted offloads are alive" % len(alive)


# ---- 11: add_param_group, fused ----------------------------------------------------

def test_add_param_group_after_wrapping_says_where_it_lives():
    m = make_model()
    extra = torch.nn.Linear(8, 8)
    opt = offload_optimizer(make_opt("adamw", m.parameters()), fraction=1.0)
    with pytest.warns(RuntimeWarning, match="keeps its optimizer state on the device"):
        opt.add_param_group({"params": list(extra.parameters())})
    x = torch.randn(4, 32)
    opt.zero_grad()
    extra(m(x)).sum().backward()
    opt.step()
    assert all(extra.weight is not p for _, p, _, _ in opt.ferry_offload.pairs)
    assert extra.weight in opt.state and "exp_avg" in opt.state[extra.weight]


def test_fused_without_cpu_kernel_is_said(monkeypatch):
    """Where torch has no CPU kernel for a fused optimizer the host share
    steps unfused, with a warning (before: silently)."""
    class FusedOnlyOnDevice(torch.optim.SGD):
        def __init__(self, params, fused=None, **kw):
            groups = list(params)
            if fused or any(isinstance(g, dict) and g.get("fused") for g in groups):
                raise RuntimeError("fused=True requires all the params to be on a device")
            super().__init__(groups, **kw)
            for g in self.param_groups:
                g.setdefault("fused", fused)
            self.defaults["fused"] = fused
    m = make_model()
    opt = FusedOnlyOnDevice(m.parameters(), lr=0.1)
    for g in opt.param_groups:
        g["fused"] = True
    with pytest.warns(RuntimeWarning, match="no CPU kernel"):
        opt = offload_optimizer(opt, fraction=1.0)
    assert not opt.ferry_offload.host_fused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(m, opt, batches(1))


@pytest.mark.parametrize("before", [True, False])
def test_lr_scheduler_created_before_or_after_wrapping(before):
    """No 'lr_scheduler.step() before optimizer.step()' or 'optimizer.step()
    overridden' warning, and the schedule is the plain run's."""
    def run(offload):
        m = make_model()
        opt = make_opt("adamw", m.parameters())
        sched = None
        if before:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if offload:
            opt = offload_optimizer(opt, fraction=0.5)
        if sched is None:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        lrs = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for x, y in batches(3):
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                opt.step()
                sched.step()
                lrs.append(opt.param_groups[0]["lr"])
        return m, lrs
    (ref, ref_lrs), (m, lrs) = run(False), run(True)
    assert lrs == ref_lrs and same_params(m, ref)
