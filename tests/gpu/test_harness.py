#!/usr/bin/env python3
"""Checks of the GPU run's own machinery that need no GPU and no build, run
by tests/gpu/rehearse.sh before the rehearsal:
  python3 tests/gpu/test_harness.py"""
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_common  # noqa: E402


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


class Run(unittest.TestCase):
    def child_of(self, out):
        return int(out.split("child ")[1].split()[0])

    def test_timeout_kills_what_the_command_started(self):
        # compute-sanitizer killed alone would leave its target on the GPU
        rc, out = gpu_common.run(["bash", "-c", "sleep 60 & echo child $!; wait"], timeout=1)
        self.assertEqual(rc, "timeout")
        pid = self.child_of(out)
        time.sleep(0.3)
        self.assertFalse(alive(pid), "the command's child outlived its timeout")

    def test_a_finished_command_leaves_nothing_running(self):
        rc, out = gpu_common.run(["bash", "-c", "sleep 60 & echo child $!; exit 3"], timeout=20)
        self.assertEqual(rc, 3)
        time.sleep(0.3)
        self.assertFalse(alive(self.child_of(out)), "a background child outlived its command")

    def test_the_command_stays_in_this_session(self):
        # the device tool ends the session's processes when its command
        # returns; a new session (setsid) would outlive it on the GPU
        rc, out = gpu_common.run(["cat", "/proc/self/stat"], timeout=20)
        fields = out.rsplit(")", 1)[1].split()
        self.assertEqual(rc, 0)
        self.assertEqual(int(fields[3]), os.getsid(0))
        self.assertNotEqual(int(fields[2]), os.getpgid(0), "not in a group of its own")

    def test_a_term_to_the_check_kills_its_command_too(self):
        # on-device.sh's bound TERMs the check; the command is in a group of its own
        here = os.path.dirname(os.path.abspath(__file__))
        code = ("import sys; sys.path.insert(0, %r); import gpu_common; "
                "gpu_common.run(['bash', '-c', 'sleep 60 & echo child $! >&2; wait'], 60)" % here)
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                             stderr=subprocess.STDOUT)
        deadline = time.time() + 10
        pid = None
        while pid is None and time.time() < deadline:
            time.sleep(0.2)
            kids = [c for c in self.descendants(p.pid) if self.comm(c) == "sleep"]
            pid = kids[0] if kids else None
        self.assertIsNotNone(pid, "the command did not start")
        p.terminate()
        p.wait(10)
        time.sleep(0.3)
        self.assertFalse(alive(pid), "the command outlived a TERM to its check")

    def comm(self, pid):
        try:
            with open(f"/proc/{pid}/comm") as fh:
                return fh.read().strip()
        except FileNotFoundError:
            return ""

    def descendants(self, pid):
        out, todo = [], [pid]
        while todo:
            q = todo.pop()
            try:
                with open(f"/proc/{q}/task/{q}/children") as fh:
                    kids = [int(k) for k in fh.read().split()]
            except FileNotFoundError:
                kids = []
            out += kids
            todo += kids
        return out


class Main(unittest.TestCase):
    def test_a_check_out_of_time_writes_its_figures_so_far(self):
        # a TERM from on-device.sh's bound: env's facts read before it stay
        here = os.path.dirname(os.path.abspath(__file__))
        out = os.path.join(tempfile.mkdtemp(), "env.json")
        code = ("import sys, time; sys.path.insert(0, %r); import gpu_common\n"
                "def body(a, f):\n    f['python'] = '3.x'\n    print('set', flush=True)\n"
                "    time.sleep(60)\n"
                "sys.exit(gpu_common.main('env', '', body))" % here)
        p = subprocess.Popen([sys.executable, "-c", code, "--out", out, "--build", "b", "--work", "w"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.assertEqual(p.stdout.readline().strip(), "set")
        p.terminate()
        p.wait(10)
        p.stdout.close()
        with open(out) as fh:
            frag = json.load(fh)
        self.assertEqual(frag["figures"]["python"], "3.x")
        self.assertEqual(frag["status"], "failed")


if __name__ == "__main__":
    unittest.main()
