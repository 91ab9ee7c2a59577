"""Promises that hold under hostile input, seen from a Python trainer."""
import os
import re
import signal
import subprocess
import sys
import time

TRAINER = r"""
import sys, torch, ferry.torch as ft
torch.manual_seed(0)
m = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
x = torch.randn(512, 512)
print("ready", flush=True)
try:
    while True:
        with ft.offload(m, policy=sys.argv[1], backend="host"):
            m(x).sum().backward()
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
    sys.exit(3)
"""


def test_ctrl_c_reaches_the_trainer_while_the_policy_is_stuck(tmp_path):
    """Every decision spins on os.clock (a call the instruction budget would
    let run ~0.5 s); the wall-clock budget ends each one, so Python's own
    SIGINT handling raises KeyboardInterrupt in the trainer within a second."""
    policy = tmp_path / "stuck.lua"
    policy.write_text("return { api = 1, decide = function(t)\n"
                      "  local t0 = os.clock() while os.clock() - t0 < 60 do end\n"
                      "  return ferry.OFFLOAD\n"
                      "end }\n")
    env = dict(os.environ, FERRY_POLICY_DECISION_MS="150", FERRY_POLICY_ERROR_BUDGET="1000000")
    p = subprocess.Popen([sys.executable, "-c", TRAINER, str(policy)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # inside the decisions by now
        assert p.poll() is None
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
        took = time.monotonic() - t0
    finally:
        p.kill()
    assert p.returncode == 3, (out, err[-2000:])
    assert "KeyboardInterrupt" in out
    assert "interrupted after 150 ms, the wall-clock budget of a decision" in err, err[-2000:]
    print(f"KeyboardInterrupt {took * 1000:.0f} ms after SIGINT")


# ---- torch's in-place check ------------------------------------------------
import pytest  # noqa: E402
import torch  # noqa: E402

import ferry.torch as ft  # noqa: E402
from conftest import SHIPPED_POLICIES  # noqa: E402

OFFLOAD_ALL = ('local R = require "ferry.rules"\n'
               'return R.policy { name = "offload-all", R.min_bytes(0), R.max_stash(0),\n'
               '                  reload = R.on_use() }\n')
KEEP_ALL = 'return { api = 1, decide = function() return ferry.KEEP end }\n'


class Body(torch.nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case

    def forward(self, x):
        """Returns (the value backward starts from, the tensor to change)."""
        if self.case == "input":   # sin saves its input, a non-leaf
            a = x * 1
            return a.sin(), a
        if self.case == "output":  # exp saves its output
            a = (x * 1).exp()
            return a * 1, a
        if self.case == "leaf":    # a matmul saves the leaf weight
            return x @ self.w, self.w
        if self.case == "view":    # the saved tensor is a view at an offset
            a = x * 1
            return a[1:].sin(), a
        raise ValueError(self.case)


class Model(torch.nn.Module):
    def __init__(self, case):
        super().__init__()
        self.body = Body(case)
        self.body.w = torch.nn.Parameter(torch.randn(512, 512))


def _error(case, policy):
    """str() of the RuntimeError backward raises after the saved tensor was
    changed in place, under ferry with `policy` or (None) plain torch."""
    torch.manual_seed(0)
    m = Model(case)
    x = torch.randn(512, 512, requires_grad=True)
    if policy is None:
        out, changed = m.body(x)
    else:
        with ft.offload(m, policy=policy, backend="host"):
            out, changed = m.body(x)
    with torch.no_grad():
        changed.add_(1)
    with pytest.raises(RuntimeError) as e:
        if policy is None:
            out.sum().backward()
        else:
            with ft.offload(m, policy=policy, backend="host"):
                out.sum().backward()
    return str(e.value)


@pytest.mark.parametrize("case", ["input", "output", "leaf", "view"])
@pytest.mark.parametrize("policy", ["keep-all", "offload-all"] + SHIPPED_POLICIES)
def test_inplace_change_after_save_raises_torchs_error(case, policy, tmp_path):
    """torch's own text (learned from torch: its wording differs between
    versions) plus the module that saved the tensor, whether the tensor was
    kept or offloaded. Two differences (docs/security.md): for a saved output
    torch names the node that saved it, ferry the tensor's grad_fn now (the
    in-place op's); for a view whose Python object is gone (its base was
    changed), ferry cannot name a grad_fn and leaves that clause out."""
    if policy in ("keep-all", "offload-all"):
        path = tmp_path / f"{policy}.lua"
        path.write_text(KEEP_ALL if policy == "keep-all" else OFFLOAD_ALL)
        policy = str(path)
    torch_msg = _error(case, None)
    ferry_msg = _error(case, policy)
    # raised in a hook, the error reaches the caller through torch's engine,
    # which may prefix the type and append the hook's traceback ("At:")
    got = ferry_msg.split("\n\nAt:\n")[0].removeprefix("RuntimeError: ")
    suffix = " (ferry: the tensor was saved in module 'body')"
    assert got.endswith(suffix), ferry_msg
    got = got[:-len(suffix)]
    if case == "output":
        node = r"output 0 of \w+,"
        got, torch_msg = (re.sub(node, "output 0 of NODE,", m) for m in (got, torch_msg))
    if case == "view" and ", which is output" not in got:
        torch_msg = re.sub(r", which is output 0 of \w+,", "", torch_msg)
    assert got == torch_msg


def test_unchanged_saved_tensors_pass_the_check_on_every_path(tmp_path):
    """No false alarm: tensors changed in place before they are saved, saved
    twice, reloaded after a stash hit, under retain_graph."""
    path = tmp_path / "offload-all.lua"
    path.write_text(OFFLOAD_ALL)
    torch.manual_seed(0)
    m = Model("input")
    x = torch.randn(512, 512, requires_grad=True)
    with ft.offload(m, policy=str(path), backend="host"):
        a = x * 1
        a.add_(1)              # before the save: fine for torch too
        b = a.sin() * a.cos()  # a saved twice
        b.sum().backward(retain_graph=True)
        b.sum().backward()
    want = 2 * ((x + 1).cos() ** 2 - (x + 1).sin() ** 2)
    torch.testing.assert_close(x.grad, want)


# ---- one number parser --------------------------------------------------------
@pytest.mark.parametrize("value", ["0.4", "nan", "inf", "-1", "0", "12 parsecs", "1e300", "16Q",
                                   "0x10", "5 G"])
def test_python_keywords_read_numbers_as_the_cli_does(value, tmp_path):
    """host_cap= goes through the engine's parser: the same refusal, word
    for word, as `ferry sim --host-cap`."""
    from test_trace_replay import ferry_cli
    trace = tmp_path / "t.jsonl"
    subprocess.run([ferry_cli(), "trace", "synth", "--preset", "tiny", "-o", str(trace)],
                   check=True, capture_output=True)
    r = subprocess.run([ferry_cli(), "sim", "--trace", str(trace), "--host-cap", value],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    cli = r.stderr.splitlines()[0]
    assert cli.startswith(f"ferry sim: --host-cap {value}: "), cli
    with pytest.raises(ValueError) as e:
        ft.offload(torch.nn.Linear(2, 2), host_cap=value)
    assert str(e.value) == f"ferry: host_cap {value}: " + cli.split(f"--host-cap {value}: ", 1)[1]


@pytest.mark.parametrize("knob,value,message", [
    ("max_fwd_stash", -1, "ferry: max_fwd_stash -1: must be between 0 and 1048576"),
    ("max_fwd_stash", 2.5, "ferry: max_fwd_stash 2.5: must be a whole number"),
    ("prefetch_distance", 5000, "ferry: prefetch_distance 5000: must be between 0 and 4096"),
    ("min_offload_bytes", float("nan"), "ferry: min_offload_bytes nan: not a number"),
    ("min_offload_bytes", "1M ish", "ferry: min_offload_bytes 1M ish: unexpected"),
    ("max_fwd_stash_bytes", float("inf"), "ferry: max_fwd_stash_bytes inf: not a number"),
    ("max_fwd_stash_bytes", 0.5, "ferry: max_fwd_stash_bytes 0.5: must be a whole number of bytes"),
])
def test_numeric_knobs_are_strict_and_named(knob, value, message):
    with pytest.raises(ValueError) as e:
        ft.offload(torch.nn.Linear(2, 2), **{knob: value})
    assert str(e.value).startswith(message), str(e.value)


def test_size_knobs_take_size_strings():
    with pytest.warns(UserWarning, match="overrule"):
        c = ft.offload(torch.nn.Linear(2, 2), min_offload_bytes="1M", max_fwd_stash_bytes="64MiB")
    with c:
        knobs = c.engine.knobs()
    assert knobs["min_offload_bytes"] == 1 << 20 and knobs["max_fwd_stash_bytes"] == 64 << 20
