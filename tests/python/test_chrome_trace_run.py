"""A real CPU training run's Chrome trace (ferry.torch.offload(...,
chrome_trace=FILE), docs/pytorch.md#perfetto-traces) against the schema
`ferry sim --chrome-trace` is checked with (tests/cli/test_chrome_trace.py,
real=True), and against the run itself: the copies in the trace are the
engine's (count and bytes each way), their times are the link's (a
throttled link makes each copy last at least its bytes over the bandwidth),
and the file is valid JSON at every step end."""
import importlib.util
import json
import os

import pytest
import torch

import ferry.torch as ft
from conftest import GPT, REPO, gpt_batch, gpt_loss

_spec = importlib.util.spec_from_file_location(
    "chrome_schema", os.path.join(REPO, "tests", "cli", "test_chrome_trace.py"))
schema = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(schema)

STEPS = 3
LINK_BPS = 200e6  # a throttled host link: an 8 KiB copy takes >= 41 us


def events_of(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def train(path, policy, steps=STEPS, **knobs):
    torch.manual_seed(0)
    model = GPT(layers=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    whole_at_step_end = []
    for _ in range(steps):
        with ft.offload(model, policy=policy, chrome_trace=str(path), **knobs):
            loss = gpt_loss(model, gpt_batch())
        loss.backward()
        opt.step()
        opt.zero_grad()
        ft.step()
        whole_at_step_end.append(len(events_of(path)))  # loads: valid JSON
    return ft.stats(), whole_at_step_end


@pytest.mark.parametrize("policy", ["default", "layers"])
def test_real_run_trace_holds_the_schema(policy, tmp_path):
    path = tmp_path / "run.json"
    run, sizes = train(path, policy)
    ft.close()
    events = events_of(path)
    problems, nflows = schema.check(events, real=True)
    assert not problems, "\n".join(problems[:20])
    assert sizes == sorted(sizes) and sizes[0] > 0 and len(events) >= sizes[-1]
    copies = {c: [e for e in events if e["ph"] == "X" and e.get("cat") == c]
              for c in ("offload", "reload")}
    # the trace's copies are the engine's, one slice each
    assert run["tensors_offloaded"] > 0
    assert len(copies["offload"]) == run["tensors_offloaded"]
    assert sum(e["args"]["bytes"] for e in copies["offload"]) == run["bytes_d2h"]
    assert sum(e["args"]["bytes"] for e in copies["reload"]) == run["bytes_h2d"]
    packs = [e for e in events if e["ph"] == "X" and e["name"] == "pack"]
    assert len(packs) == run["tensors_packed"]
    assert sum(e["args"]["decision"] == "offload" and "alias_of" not in e["args"]
               for e in packs) == run["tensors_offloaded"]
    # every reload of this run follows an offload of the same tensor
    assert nflows == len(copies["reload"]) > 0
    steps = sorted(e["args"]["step"] for e in events if e["ph"] == "i" and e["name"] == "step end")
    assert steps == list(range(1, STEPS + 1))
    # after the last step nothing is held
    last = {}
    for e in events:
        if e["ph"] == "C":
            last[e["name"]] = list(e["args"].values())[0]
    assert last["device bytes held (saved tensors)"] == 0 and last["forward stash depth"] == 0


def test_copy_times_are_the_links(tmp_path):
    """On a host link throttled to 200 MB/s each copy's slice lasts at least
    its bytes at that rate: the times are those of the copies themselves,
    not of the calls that issued them."""
    path = tmp_path / "slow.json"
    train(path, "default", steps=2, link=(LINK_BPS, LINK_BPS, 0.0, 1.0))
    ft.close()
    events = events_of(path)
    problems, _ = schema.check(events, real=True)
    assert not problems, "\n".join(problems[:20])
    copies = [e for e in events if e["ph"] == "X" and e.get("cat") in ("offload", "reload")]
    assert copies
    for e in copies:
        assert e["dur"] >= e["args"]["bytes"] / LINK_BPS * 1e6 * 0.95, e


def test_no_trace_no_file(tmp_path, monkeypatch):
    """Without chrome_trace (and $FERRY_CHROME_TRACE) nothing is written."""
    monkeypatch.delenv("FERRY_CHROME_TRACE", raising=False)
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = GPT(layers=2)
    with ft.offload(model, policy="default"):
        loss = gpt_loss(model, gpt_batch())
    loss.backward()
    ft.step()
    ft.close()
    assert os.listdir(tmp_path) == []


def test_environment_names_the_file_per_process(tmp_path, monkeypatch):
    """$FERRY_CHROME_TRACE (what `ferry run --trace-out` sets), %p = pid."""
    monkeypatch.setenv("FERRY_CHROME_TRACE", str(tmp_path / "t-%p.json"))
    torch.manual_seed(0)
    model = GPT(layers=2)
    with ft.offload(model, policy="default"):
        loss = gpt_loss(model, gpt_batch())
    loss.backward()
    ft.step()
    ft.close()
    path = tmp_path / f"t-{os.getpid()}.json"
    problems, _ = schema.check(events_of(path), real=True)
    assert not problems, "\n".join(problems[:20])


def test_profiler_ranges_name_the_engine_calls():
    """Under torch.profiler each engine call is a record_function range named
    as the Chrome trace's call slices ("ferry pack: <module>", "ferry unpack:
    <module>"); without the profiler the hooks are told not to make any."""
    torch.manual_seed(0)
    model = GPT(layers=2)
    with torch.profiler.profile() as prof:
        with ft.offload(model, policy="default"):
            assert ft.engine().profile_ranges
            loss = gpt_loss(model, gpt_batch())
        loss.backward()
        ft.step()
    packed = ft.stats()["tensors_packed"]
    names = [e.name for e in prof.events() if e.name.startswith("ferry ")]
    paths = {p for p, *_ in [(s[1],) for s in ft.model_sites(model)]}
    assert packed > 0 and len(names) == 2 * packed, (len(names), packed)
    for n in names:
        what, _, path = n.partition(": ")
        assert what in ("ferry pack", "ferry unpack") and path in paths, n
    with ft.offload(model, policy="default"):
        assert not ft.engine().profile_ranges  # profiler off: no range is made
        loss = gpt_loss(model, gpt_batch())
    loss.backward()
