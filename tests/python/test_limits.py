"""Promises that hold under hostile input, seen from a Python trainer."""
import os
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
