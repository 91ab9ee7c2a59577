"""The writer thread of a snapshot that fits in the arena runs at normal
scheduling with a nice value, not at SCHED_IDLE, which starves it while
every core is busy (issue 37, item 8). Linux only (/proc, per-thread nice)."""
import os
import sys

import pytest
import torch

import ferry.torch as ft

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux threads")


def threads_named(name):
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    out.append(int(tid))
        except OSError:
            pass
    return out


def test_background_writer_is_niced_not_sched_idle(tmp_path):
    base_nice = os.getpriority(os.PRIO_PROCESS, 0)
    before = set(threads_named("ferry-snapshot"))
    ft.snapshot({"w": torch.randn(1 << 16)}, tmp_path / "ck.pt").wait()
    writers = [t for t in threads_named("ferry-snapshot") if t not in before] or \
        threads_named("ferry-snapshot")
    assert writers, "no ferry-snapshot thread found"
    backgrounded = [t for t in writers if os.getpriority(os.PRIO_PROCESS, t) > base_nice]
    assert backgrounded, "the writer kept the process's nice value"
    for t in backgrounded:
        assert os.sched_getscheduler(t) == os.SCHED_OTHER, "not normal scheduling"
        assert os.getpriority(os.PRIO_PROCESS, t) == min(base_nice + 10, 19)
