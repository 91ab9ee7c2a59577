#!/usr/bin/env python3
"""The run's machine: GPU, driver, CUDA toolkit, torch, Python (summary.json's
"run"). Without a GPU the GPU's fields stay null."""
import datetime
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys

from gpu_common import main


def smi(fields):
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                         stdout=subprocess.PIPE, text=True, timeout=5, check=True).stdout
    return [[x.strip() for x in line.split(",")] for line in out.strip().splitlines()]


def body(a, f):
    # what needs no torch first: a bound that runs out during torch's import
    # (cold, on a fresh machine) still leaves the GPU and driver (gpu_common.main)
    f["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    f["python"] = platform.python_version()
    f["cpu_cores"] = os.cpu_count()
    why = os.environ.get("FERRY_GPU_NO_GPU")
    if not why:
        rows = smi("name,driver_version,memory.total,compute_cap,pcie.link.gen.max,pcie.link.width.max")
        name, driver, mem, cap, gen, width = rows[0]
        f["gpu_name"], f["driver"], f["compute_cap"] = name, driver, cap
        f["gpu_count"] = len(rows)
        f["gpu_memory_MiB"] = int(float(mem))
        f["pcie_gen"], f["pcie_width"] = gen, width
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                    if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc:
        m = re.search(r"release ([0-9.]+)", subprocess.run([nvcc, "--version"], stdout=subprocess.PIPE,
                                                           text=True, timeout=5).stdout)
        f["cuda_toolkit"] = m and m.group(1)
    try:  # its version without importing it (seconds)
        f["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    import torch

    f["torch"] = torch.__version__
    f["torch_cuda"] = torch.version.cuda
    if why:
        f.no_gpu(why)
        f.status = "ok"  # the machine's facts were read; the GPU's are null


if __name__ == "__main__":
    sys.exit(main("env", __doc__, body))
