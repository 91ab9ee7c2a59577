"""Item 5: a trace recorded from a real model run replays in `ferry sim`
with the same decisions and bytes moved as the run's own stats."""
import json
import os
import subprocess

import pytest
import torch

import ferry
import ferry.torch as ft
from conftest import GPT, gpt_batch, gpt_loss

STEPS = 3


def ferry_cli():
    exe = os.environ.get("FERRY_BIN")
    if not exe:  # <build>/python/ferry/__init__.py -> <build>/bin/ferry
        build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(ferry.__file__))))
        exe = os.path.join(build, "bin", "ferry")
    if not os.access(exe, os.X_OK):
        if os.environ.get("CI") == "true":
            pytest.fail(f"no ferry CLI at {exe} (set FERRY_BIN)")
        pytest.skip(f"no ferry CLI at {exe} (set FERRY_BIN)")
    return exe


@pytest.mark.parametrize("policy", ["default", "layers"])
def test_recorded_trace_replays_with_same_decisions(policy, tmp_path):
    exe = ferry_cli()
    trace = tmp_path / "run.jsonl"
    torch.manual_seed(0)
    model = GPT(layers=4)
    for _ in range(STEPS):
        with ft.offload(model, policy=policy, record_trace=str(trace)):
            loss = gpt_loss(model, gpt_batch())
        loss.backward()
    ft.step()
    run = ft.stats()
    ft.close()
    out = tmp_path / "sim.json"
    r = subprocess.run([exe, "sim", "--policy", ferry.policy_path(policy), "--trace", str(trace),
                        "--steps", str(STEPS), "--json", str(out), "--recorded"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    sims = {p["name"]: p for p in report["policies"]}
    replayed = [p for n, p in sims.items() if n != "no offload"]
    assert len(replayed) == 2  # the policy, and the recorded decisions
    # Steady state: every step makes the same decisions (cached per site),
    # so the simulator's per-step figures are the run's totals / STEPS.
    for sim in replayed:
        for key in ("tensors_packed", "tensors_offloaded", "bytes_d2h"):
            assert sim[key] * STEPS == run[key], (sim["name"], key, sim[key], run[key])
    assert run["tensors_offloaded"] > 0
