"""An LR scheduler made before the first snapshot still gets the optimizer
fenced, and torch 1.13's scheduler does not warn that optimizer.step was
overridden (review of issue 37, item 1). Runs in a fresh interpreter:
ferry wraps torch 1.13's optimizer classes once per process."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import warnings, torch
    import ferry.checkpoint as fc
    from ferry._checkpoint_fences import register_global_step_pre_hook
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)  # wraps opt.step first
    calls = []
    handle = register_global_step_pre_hook(lambda o, a, k: calls.append(o))
    m(torch.randn(2, 4)).sum().backward()
    fenced = []
    patch = fc._StepPatch(opt, lambda: fenced.append(1))  # snapshot(optimizer=opt)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        result = opt.step(lambda: torch.tensor(7.0))
        sched.step()
    patch.remove()
    handle.remove()
    assert result.item() == 7.0, result
    assert calls == [opt], ("global hook calls", len(calls))
    assert fenced == [1], fenced
    msgs = [str(x.message) for x in w if "lr_scheduler" in str(x.message)
            or "overridden" in str(x.message)]
    assert not msgs, msgs
    print("ok")
""")


def test_a_scheduler_made_before_the_first_snapshot_keeps_the_fence_and_no_warning():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


HOOK_SCRIPT = textwrap.dedent("""
    import warnings, torch
    import torch.distributed  # its deprecated module attributes warn on __class__
    warnings.simplefilter("error")
    from ferry._checkpoint_fences import register_global_step_pre_hook
    from torch.optim import optimizer as optim_mod
    torch_has_hook = hasattr(optim_mod, "register_optimizer_step_pre_hook")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    calls = []
    handle = register_global_step_pre_hook(lambda o, a, k: calls.append(o))
    opt.step()
    handle.remove()
    wrapped = getattr(torch.optim.SGD.step, "_ferry_fences", False)
    assert calls == [opt], calls
    assert wrapped != torch_has_hook, ("ferry wrapped the classes", wrapped, torch.__version__)
    print("ok")
""")


def test_torch_2_uses_torchs_global_step_hook_and_registering_warns_nothing():
    r = subprocess.run([sys.executable, "-c", HOOK_SCRIPT], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


FREE_SCRIPT = textwrap.dedent("""
    import gc, weakref, torch
    from ferry._checkpoint_fences import register_global_step_pre_hook
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)  # instance step, made first
    register_global_step_pre_hook(lambda o, a, k: None).remove()
    gone = weakref.ref(opt)
    gc.disable()
    del opt, sched
    assert gone() is None, "a reference cycle keeps the optimizer's state alive"
    print("ok")
""")


def test_wrapping_a_schedulers_step_makes_no_reference_cycle():
    r = subprocess.run([sys.executable, "-c", FREE_SCRIPT], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
