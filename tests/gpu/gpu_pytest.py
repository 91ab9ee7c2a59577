#!/usr/bin/env python3
"""tests/python/test_cuda.py on the GPU: ferry.torch under torch's CUDA tensors,
streams and caching allocator, bit-identical to plain autograd (issue 36's
stream and device items among them). Without a GPU the module skips itself;
it is still collected here, so its imports are checked."""
import os
import re
import sys

from gpu_common import main, no_gpu_reason, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def body(a, f):
    why = os.environ.get("FERRY_GPU_NO_GPU")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(a.build, "python"), os.path.join(ROOT, "tests", "python")]))
    args = ["-q", "-p", "no:cacheprovider", "-rfEs", os.path.join(ROOT, "tests", "python", "test_cuda.py")]
    # an image without pytest gets the carried wheels' (tests/gpu/gather.sh),
    # behind its own packages: appended to sys.path, not on PYTHONPATH
    site = os.environ.get("FERRY_GPU_SITE", "")
    launch = ("import sys; sys.path.append(sys.argv.pop(1)); import pytest; "
              "print('pytest', pytest.__version__, 'from', pytest.__file__, flush=True); "
              "sys.exit(pytest.main(sys.argv[1:]))")
    rc, out = run([sys.executable, "-c", launch, site] + args, timeout=35, env=env,
                  cwd=os.path.join(ROOT, "tests", "python"))
    last = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", last)}
    why = why or no_gpu_reason()
    if why:
        # 5: pytest's "no tests ran", as a module skipped whole ends
        if rc not in (0, 5) or not counts.get("skipped") or counts.get("passed") \
                or counts.get("failed"):
            raise RuntimeError(f"test_cuda.py without a GPU: exit {rc}, {last!r} (it must skip)")
        f.no_gpu(why)
        return
    f["pytest_passed"] = counts.get("passed", 0)
    f["pytest_failed"] = counts.get("failed", 0) + counts.get("error", 0)
    f["pytest_skipped"] = counts.get("skipped", 0)
    if rc != 0:
        f.status, f.reason = "failed", f"pytest: {last}"


if __name__ == "__main__":
    sys.exit(main("test_cuda", __doc__, body))
