"""The figures of the GPU run (tests/gpu/on-device.sh), one list per step: the
keys summary.json always holds (null where a step measured nothing: no GPU,
or it failed). A check writing a key not listed here fails, so this file is
the schema; docs/hardware.md's "measured" table reads these names."""

FRACTIONS = (0, 0.25, 0.5, 1)


def frac_tag(f):
    """0.25 -> '025': a key-safe name of an optimizer-offload fraction."""
    return str(f).replace(".", "")


DROPIN_MODES = ("none", "torchtune", "ferry_offload_activations", "save_on_cpu",
                "ferry_default", "ferry_budget", "ferry_host_budget")

FIGURES = {
    "env": ["gpu_name", "gpu_count", "compute_cap", "gpu_memory_MiB", "driver", "cuda_toolkit",
            "torch", "torch_cuda", "python", "transformers", "pcie_gen", "pcie_width",
            "cpu_cores", "date"],
    "link": ["link_preset", "link_d2h_GBps_64MB", "link_h2d_GBps_64MB", "link_d2h_GBps_1MB",
             "link_h2d_GBps_1MB", "link_duplex_share", "link_d2h_vs_cudamemcpy",
             "link_h2d_vs_cudamemcpy", "link_latency_us", "link_copy_mismatches",
             "preset_d2h_GBps", "preset_h2d_GBps", "link_d2h_vs_preset", "link_h2d_vs_preset"],
    "suite": [],
    "test_cuda": ["pytest_passed", "pytest_failed", "pytest_skipped"],
    "bench_gpu": ["gpu_none_step_ms", "gpu_save_on_cpu_step_ms", "gpu_ferry_default_step_ms",
                  "gpu_ferry_default_step_vs_save_on_cpu", "gpu_ferry_default_peak_vs_none"],
    "checkpoint": ["ckpt_state_MiB", "ckpt_snapshot_blocked_ms", "ckpt_sync_cpu_ms",
                   "ckpt_clone_gpu_ms", "ckpt_snapshot_blocked_vs_sync_cpu",
                   "ckpt_snapshot_blocked_vs_clone_gpu", "ckpt_peak_snapshot_MiB",
                   "ckpt_peak_sync_cpu_MiB", "ckpt_peak_clone_gpu_MiB", "ckpt_plain_step_ms",
                   "ckpt_step_during_drain_ms", "ckpt_step_slowdown_during_drain",
                   "ckpt_snapshot_bit_identical"],
    "optim": (["optim_plain_step_ms", "optim_plain_peak_MiB", "optim_sim_mfu",
               "optim_sim_plain_vs_measured"]
              + [f"optim_f{frac_tag(f)}_{k}" for f in FRACTIONS
                 for k in ("step_ms", "peak_MiB", "step_vs_plain", "params_bit_identical",
                           "sim_step_ms", "sim_vs_measured")]
              + ["weights_none_step_ms", "weights_none_peak_MiB"]
              + [f"weights_{db}_{k}" for db in ("double_buffer", "single_buffer")
                 for k in ("step_ms", "peak_MiB", "params_bit_identical", "sim_step_ms",
                           "sim_vs_measured")]),
    "dropins": (["dropins_model", "torchtune_version"]
                + [f"dropin_{m}_{k}" for m in DROPIN_MODES
                   for k in ("step_ms", "peak_MiB", "bit_identical")]),
    "sanitizer": [f"{tool}_{what}_{k}" for tool in ("racecheck", "memcheck")
                  for what in ("suite", "train") for k in ("errors", "status")]
                 + ["stress_reuse_rounds", "stress_reuse_mismatches"],
}

# Steps of on-device.sh that run no check of their own (their status only).
BUILD_STEPS = ("unpack", "configure", "build")
STEPS = BUILD_STEPS + tuple(FIGURES)
# "skipped": left out by FERRY_GPU_ONLY (a rerun of some checks)
STATUSES = ("ok", "no GPU", "failed", "timeout", "not run", "skipped")
