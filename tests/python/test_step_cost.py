"""What an offload context's step costs beyond its saved tensors (issue 38,
hook_keep_vs_noop_pair): the step's end read stats()["backwards"], a dict of
every counter built each step (15-80 us on the 2-core VM, about 300 ns per
saved tensor of bench_torch's 256-tensor step). It reads Engine.backwards
now; the warnings that count backwards still tell their two cases apart
(test_step_warnings.py)."""
import torch

import ferry.torch as ft


class CountingEngine:
    """The session's engine with its stats() calls counted."""

    def __init__(self, engine):
        self._engine = engine
        self.stats_calls = 0

    def stats(self):
        self.stats_calls += 1
        return self._engine.stats()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def run_step(w):
    x = torch.randn(64, 64)
    (x @ w).relu().sum().backward()


def test_backwards_attribute_is_the_stats_count():
    w = torch.randn(64, 64, requires_grad=True)
    ctx = ft.offload(policy="default", backend="host")
    for i in range(3):
        with ctx:
            run_step(w)
        eng = ctx.engine
        assert eng.backwards == eng.stats()["backwards"]
    with ctx:  # a step without backward: the count stays
        (torch.randn(64, 64) @ w).sum()
    assert ctx.engine.backwards == ctx.engine.stats()["backwards"]
    ft.step()


def test_steps_do_not_build_the_stats_dict():
    w = torch.randn(64, 64, requires_grad=True)
    ctx = ft.offload(policy="default", backend="host")
    with ctx:
        run_step(w)
    session = ctx.session
    counting = CountingEngine(session.engine)
    session.engine = counting
    try:
        for _ in range(4):
            with ctx:  # each entry ends the previous step
                run_step(w)
        ft.step()
    finally:
        session.engine = counting._engine
    assert counting.stats_calls == 0
