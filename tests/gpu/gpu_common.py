"""What the checks of tests/gpu share: their arguments, whether there is a GPU,
and the fragment each writes (its status and its figures, keys from
schema.py) for summary.py. Without a GPU each check still runs as far as it
can without one (imports, models built on the CPU, a smoke step where one is
cheap) and writes its keys as null with the reason."""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

import schema


def args(doc, extra=None):
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the fragment (JSON) this check writes")
    ap.add_argument("--build", required=True, help="the build directory (bin/, python/)")
    ap.add_argument("--work", required=True, help="a scratch directory")
    if extra:
        extra(ap)
    return ap.parse_args()


def no_gpu_reason():
    """None when torch sees a CUDA device and on-device.sh found one."""
    why = os.environ.get("FERRY_GPU_NO_GPU")
    if why:
        return why
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


class Fragment:
    """One step's figures: every key of schema.FIGURES[step], null until set."""

    def __init__(self, step, path):
        self.step, self.path = step, path
        self.figures = dict.fromkeys(schema.FIGURES[step])
        self.status, self.reason, self.notes = "ok", None, []
        self.t0 = time.perf_counter()

    def __setitem__(self, key, value):
        if key not in self.figures:
            raise KeyError(f"{self.step}: figure {key!r} is not in tests/gpu/schema.py")
        if hasattr(value, "item"):
            value = value.item()
        self.figures[key] = value

    def no_gpu(self, why):
        self.status, self.reason = "no GPU", why
        print(f"{self.step}: no GPU ({why}): figures null")

    def note(self, text):
        print(f"{self.step}: {text}")
        self.notes.append(text)

    def write(self):
        with open(self.path, "w") as f:
            json.dump({"step": self.step, "status": self.status, "reason": self.reason,
                       "notes": self.notes, "figures": self.figures,
                       "seconds": round(time.perf_counter() - self.t0, 1)}, f, indent=1)
        shown = {k: v for k, v in self.figures.items() if v is not None}
        print(f"{self.step}: {self.status}; {json.dumps(shown)}")


_groups = set()  # process groups of run()'s commands still running


def _kill_groups(signum=None, frame=None):
    for g in list(_groups):
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _groups.discard(g)
    if signum is not None:  # on-device.sh's bound ran out (timeout sends TERM first)
        sys.exit(128 + signum)


def run(cmd, timeout, **kw):
    """A subprocess under its own bound (stretched by FERRY_GPU_TIME_SCALE, as
    on-device.sh stretches the step's); (exit code or 'timeout', output).
    It runs in a process group of its own, killed whole when it ends or times
    out: a command that starts another (compute-sanitizer its target) leaves
    no orphan holding the GPU. A TERM to this check kills that group too.
    The group stays in this session (no setsid): the device tool ends every
    process of the session when its command returns, whatever else fails."""
    timeout *= float(os.environ.get("FERRY_GPU_TIME_SCALE", "1"))
    print("$ " + " ".join(map(str, cmd)), flush=True)
    signal.signal(signal.SIGTERM, _kill_groups)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", process_group=0, **kw)
    _groups.add(p.pid)
    chunks = []
    # read aside: a child left running holds the pipe open past the command's end
    reader = threading.Thread(target=lambda: chunks.extend(p.stdout), daemon=True)
    reader.start()
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    _kill_groups()  # on a timeout, and what a finished command left running
    p.wait()
    reader.join(5)
    p.stdout.close()
    out = "".join(chunks)
    sys.stdout.write(out or "")
    sys.stdout.flush()
    return rc, out or ""


def timed(torch, fn, on_gpu):
    """fn() timed in ms, the device synchronized on both sides."""
    if on_gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    if on_gpu:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, r


def bits_equal(torch, a, b):
    """Bit for bit (NaNs compared by their bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.device != b.device:
        b = b.to(a.device)
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def main(step, doc, body, extra=None):
    """Parses the arguments, runs body(args, fragment), writes the fragment
    (also when body raises: the step then fails with the fragment's nulls)."""
    a = args(doc, extra)
    sys.path.insert(0, os.path.join(a.build, "python"))
    # the checks' own subprocesses (pytest, gpu_train_step.py) import it too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(a.build, "python")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    frag = Fragment(step, a.out)
    # on-device.sh's bound TERMs a check that runs long: its figures so far are
    # written (the step then reads "timeout"), its commands killed
    signal.signal(signal.SIGTERM, _kill_groups)
    try:
        body(a, frag)
    except BaseException as e:
        frag.status, frag.reason = "failed", f"{type(e).__name__}: {e}"
        frag.write()
        raise
    frag.write()
    return 1 if frag.status == "failed" else 0
