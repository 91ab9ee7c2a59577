"""ferry.lightning — ferry for PyTorch Lightning (pip `lightning`).

    from ferry.lightning import ActivationOffload, StagedCheckpointIO, StagedCheckpointCallback
    trainer = Trainer(callbacks=[ActivationOffload(policy="budget")])  # activations
    trainer = Trainer(plugins=[StagedCheckpointIO()])                  # checkpoints
    trainer = Trainer(callbacks=[StagedCheckpointCallback(), ModelCheckpoint(...)])

ActivationOffload offloads what every training step saves for backward
(ferry.torch.offload around the batch: forward, backward and the optimizer
step, automatic and manual optimization alike) and logs ferry's figures of
each step through the Trainer's loggers under "ferry/".

StagedCheckpointIO saves with ferry.torch.snapshot: the checkpoint's tensors
are staged through ferry's pinned arena while training goes on and written
by a writer thread, in place of AsyncCheckpointIO's clone of every tensor
on the device (no device memory is added) and of a synchronous torch.save.
The file is the one torch.save writes; loading is TorchCheckpointIO's.

StagedCheckpointCallback replaces CPUOffloadCallback: the same offload_keys
(the checkpoint's top-level keys whose tensors are staged; the others are
copied when the save starts), rank 0 only under DDP, a report of the
objects that are not tensors, and strategy checks: FSDP, DeepSpeed, XLA and
other sharded strategies keep their own checkpointing (the callback
disables itself with a message naming the strategy).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ._policy import PolicyLike
from .checkpoint import CheckpointError, describe, snapshot
from .torch import offload, stats

__all__ = ["ActivationOffload", "StagedCheckpointIO", "StagedCheckpointCallback",
           "strategy_support"]

log = logging.getLogger("ferry.lightning")

DEFAULT_OFFLOAD_KEYS = ("state_dict", "optimizer_states", "lr_schedulers")


class StagedCheckpointIO(TorchCheckpointIO):
    """A CheckpointIO that stages checkpoints through ferry.

    StagedCheckpointIO(policy=None, keys=None, host_cap=None, backend=None,
                      **knobs)

    policy: the policy file whose snapshot(e) decides per tensor (default
        $FERRY_POLICY or "default"); keys: top-level keys whose tensors may
        be staged (None: all); host_cap, backend, knobs (trim= among them):
        as for ferry.torch.snapshot.

    save_checkpoint returns at once. The snapshot is fenced before the next
    optimizer step and before the next training forward of a module that
    owns buffers (the optimizers and the LightningModule given by
    StagedCheckpointCallback, else torch's global hooks). A failed write raises
    CheckpointError at the next save, load, remove or teardown. Saving to a
    path still being written waits for it first.
    """

    def __init__(self, policy: Optional[PolicyLike] = None, keys: Optional[Iterable[str]] = None,
                 host_cap: Optional[Union[int, str]] = None, backend: Optional[str] = None,
                 **knobs: Any) -> None:
        super().__init__()
        self.policy = policy
        self.keys = None if keys is None else list(keys)
        self.host_cap = host_cap
        self.backend = backend
        self.knobs = knobs
        self.optimizers = []  # set by StagedCheckpointCallback
        self.modules = []
        self.reporter = None  # StagedCheckpointCallback's report, on the final checkpoint dict
        self._pending = {}  # path -> Snapshot
        self.last_stats = None
        self.saves = 0

    def _check_failures(self):
        for path, h in list(self._pending.items()):
            try:
                if h.done():
                    del self._pending[path]
            except CheckpointError:
                del self._pending[path]
                raise

    def _wait_for(self, path):
        h = self._pending.pop(os.fspath(path), None)
        if h is not None:
            h.wait()

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Union[str, "os.PathLike[str]"],
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("StagedCheckpointIO.save_checkpoint does not take storage_options "
                            f"(got {storage_options!r})")
        self._check_failures()
        path = os.fspath(path)
        self._wait_for(path)
        if self.reporter is not None:
            self.reporter(checkpoint)
        fs = get_filesystem(path)
        fs.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        h = snapshot(checkpoint, path, optimizer=self.optimizers or None,
                     module=self.modules or None, policy=self.policy, keys=self.keys,
                     backend=self.backend, host_cap=self.host_cap, distributed="all",
                     **self.knobs)
        self._pending[path] = h
        self.last_stats = h.stats
        self.saves += 1

    def load_checkpoint(self, path: Union[str, "os.PathLike[str]"], *args: Any,
                        **kwargs: Any) -> Dict[str, Any]:
        self._wait_for(path)
        return super().load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path: Union[str, "os.PathLike[str]"]) -> None:
        self._wait_for(path)
        super().remove_checkpoint(path)

    def wait(self) -> None:
        """Wait for every checkpoint this plugin started; raises the first
        failure."""
        first = None
        for path in list(self._pending):
            try:
                self._wait_for(path)
            except CheckpointError as e:
                first = first or e
        if first is not None:
            raise first

    def fence(self) -> None:
        """Fence every checkpoint this plugin started: after it the state
        may be changed in place (ferry.checkpoint.Snapshot.fence)."""
        for h in list(self._pending.values()):
            h.fence()

    def teardown(self) -> None:
        self.wait()


# ---- strategies ------------------------------------------------------------------
_SHARDED = {
    "FSDPStrategy": "FSDP saves sharded state dicts through its own checkpointing",
    "DeepSpeedStrategy": "DeepSpeed writes its own checkpoint format",
    "XLAStrategy": "XLA tensors are not host or CUDA memory",
    "XLAFSDPStrategy": "XLA FSDP saves sharded state through its own checkpointing",
    "ModelParallelStrategy": "model-parallel (DTensor) state goes through torch.distributed.checkpoint",
}
_SUPPORTED = ("SingleDeviceStrategy", "DDPStrategy", "DataParallelStrategy")


def strategy_support(strategy: Any) -> Tuple[bool, str]:
    """(supported, reason) for a Lightning strategy object: single device
    and DDP are; FSDP, DeepSpeed, XLA and model parallel are left to their
    own checkpointing; unknown strategies are not touched."""
    for cls in type(strategy).__mro__:
        if cls.__name__ in _SHARDED:
            return False, _SHARDED[cls.__name__]
    for cls in type(strategy).__mro__:
        if cls.__name__ in _SUPPORTED:
            return True, cls.__name__
    return False, (f"{type(strategy).__name__} is not a strategy ferry knows (supported: "
                   f"{', '.join(_SUPPORTED)})")


class StagedCheckpointCallback(Callback):
    """Stage Lightning checkpoints through ferry (replaces CPUOffloadCallback).

    StagedCheckpointCallback(offload_keys=("state_dict", "optimizer_states",
                         "lr_schedulers"), log_skipped=False, policy=None,
                         host_cap=None, **knobs)

    At setup it checks the strategy and, when supported, puts a
    StagedCheckpointIO on it (unless one is there), staging the tensors under
    offload_keys; tensors under other keys are copied when the save starts.
    Each save (global rank 0) counts the tensors and reports the objects
    that are not tensors or plain values (first and last 10, or all with
    log_skipped=True). Only global rank 0 saves under DDP (Lightning calls
    the plugin there); other ranks do nothing.
    """

    def __init__(self, offload_keys: Optional[Iterable[str]] = None, log_skipped: bool = False,
                 policy: Optional[PolicyLike] = None, host_cap: Optional[Union[int, str]] = None,
                 **knobs: Any) -> None:
        super().__init__()
        self.offload_keys = list(offload_keys if offload_keys is not None
                                 else DEFAULT_OFFLOAD_KEYS)
        self.log_skipped = log_skipped
        self.policy = policy
        self.host_cap = host_cap
        self.knobs = knobs
        self.enabled = False
        self.disabled_reason = None
        self.plugin = None
        self.checkpoints = 0
        self.last_report = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        ok, reason = strategy_support(trainer.strategy)
        self.enabled = ok
        if not ok:
            self.disabled_reason = reason
            rank_zero_warn(f"StagedCheckpointCallback is disabled for this run: {reason}; "
                           "checkpoints are saved by the strategy's own checkpointing.")
            return
        io = trainer.strategy.checkpoint_io
        if isinstance(io, StagedCheckpointIO):
            self.plugin = io
        elif type(io) is TorchCheckpointIO:
            self.plugin = StagedCheckpointIO(policy=self.policy, keys=self.offload_keys,
                                            host_cap=self.host_cap, **self.knobs)
            trainer.strategy.checkpoint_io = self.plugin
        else:
            self.enabled = False
            self.disabled_reason = (f"the strategy already has the checkpoint plugin "
                                    f"{type(io).__name__}")
            rank_zero_warn(f"StagedCheckpointCallback is disabled: {self.disabled_reason}; pass "
                           "ferry.lightning.StagedCheckpointIO as the plugin instead.")
            return
        if self.plugin.keys is None:
            self.plugin.keys = self.offload_keys
        self.plugin.reporter = self._report

        # first among the callbacks, so that the hooks below fence before
        # another callback's same hook changes the state (Lightning calls
        # them in this order; moving the one being called is safe)
        callbacks = trainer.callbacks
        if callbacks and callbacks[0] is not self and self in callbacks:
            callbacks.remove(self)
            callbacks.insert(0, self)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.enabled:
            # fence before these optimizers step and before a training
            # forward of the module's buffer owners
            self.plugin.optimizers = list(trainer.optimizers)
            self.plugin.modules = [pl_module]

    # Hooks where callbacks change the state in place outside an optimizer
    # step: EMAWeightAveraging / StochasticWeightAveraging swap or copy the
    # averaged weights into the module at validation and at the end of
    # training, and update the average at an epoch's end.
    def _fence(self, *args: Any) -> None:
        if self.enabled and self.plugin is not None:
            self.plugin.fence()

    on_train_epoch_end = on_validation_epoch_start = on_validation_epoch_end = _fence
    on_validation_start = on_validation_end = on_train_end = on_fit_end = _fence
    on_test_start = on_predict_start = on_exception = _fence

    def _report(self, checkpoint):
        # Called by the plugin with the final dict (the LightningModule's
        # on_save_checkpoint runs after the callbacks'), on the saving rank.
        self.checkpoints += 1
        t0 = time.perf_counter()
        d = describe(checkpoint, keys=self.offload_keys)
        skipped = d["skipped"]
        step = checkpoint.get("global_step", -1)
        self.last_report = {"step": step, "tensors": d["tensors"],
                            "tensor_bytes": d["tensor_bytes"], "primitives": d["primitives"],
                            "skipped": skipped,
                            "other_keys": sorted(str(k) for k in checkpoint
                                                 if k not in self.offload_keys)}
        if skipped:
            shown = skipped if self.log_skipped or len(skipped) <= 20 else \
                skipped[:10] + [f"... ({len(skipped) - 20} more) ..."] + skipped[-10:]
            log.warning("ferry: checkpoint at step %d: %d object(s) under %s are not tensors and "
                        "are saved as they are:\n  %s", step, len(skipped),
                        ", ".join(self.offload_keys), "\n  ".join(shown))
        log.info("ferry: checkpoint at step %d: %d tensor(s), %.1f MiB to stage (%.2f ms to "
                 "describe)", step, d["tensors"], d["tensor_bytes"] / 2**20,
                 (time.perf_counter() - t0) * 1e3)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.enabled and self.plugin is not None:
            self.plugin.wait()


# figures logged per step: counters as the step's increase, levels as they are
_STEP_COUNTERS = ("tensors_offloaded", "tensors_kept", "bytes_d2h", "bytes_h2d", "stash_hits",
                  "cap_fallbacks", "policy_errors")
_LEVELS = ("arena_in_use", "arena_peak")


class ActivationOffload(Callback):
    """Offload the activations of every training step through ferry.

    ActivationOffload(policy=None, backend=None, log_stats=True, **knobs)

    policy, backend and knobs are ferry.torch.offload's. Each training batch
    runs inside ``ferry.torch.offload(pl_module, ...)``, from
    on_train_batch_start to on_train_batch_end, so what the forward saves is
    offloaded and backward (Lightning's, or ``manual_backward`` in a
    training_step) brings it back. With log_stats, the step's figures are
    logged as "ferry/<name>" (offloaded and kept tensors, bytes each way,
    stash hits, cap fallbacks, policy errors, arena in use and peak): the
    counters as their increase since the last optimizer step, so under
    gradient accumulation the logged step covers all its micro-batches."""

    def __init__(self, policy: Optional[PolicyLike] = None, backend: Optional[str] = None,
                 log_stats: bool = True, **knobs: Any) -> None:
        super().__init__()
        self.policy = policy
        self.backend = backend
        self.log_stats = log_stats
        self.knobs = knobs
        self._ctx = None
        self._base = None  # the counters at the last optimizer step
        self._base_step = None  # trainer.global_step then

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._base, self._base_step = None, trainer.global_step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._leave()
        self._ctx = offload(pl_module, policy=self.policy, backend=self.backend, **self.knobs)
        self._ctx.__enter__()
        if self.log_stats and self._base is None:
            # the engine's counters run on across fits in one process: the
            # first step's increase is from here, not from the engine's start
            s = stats()
            self._base = {k: s[k] for k in _STEP_COUNTERS}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._leave()
        if self.log_stats:
            # Lightning writes a step's logs once per optimizer step, with
            # the values of its last micro-batch: log what the whole step did.
            s = stats()
            logged = {f"ferry/{k}": float(s[k] - self._base[k]) for k in _STEP_COUNTERS}
            logged.update({f"ferry/{k}": float(s[k]) for k in _LEVELS})
            if trainer.global_step != self._base_step:  # this batch stepped
                self._base = {k: s[k] for k in _STEP_COUNTERS}
                self._base_step = trainer.global_step
            pl_module.log_dict(logged, on_step=True, on_epoch=False)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A module whose on_train_batch_start returns -1 ends the epoch
        # after our on_train_batch_start, with no on_train_batch_end.
        self._leave()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule,
                     exception: BaseException) -> None:
        self._leave()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._leave()

    def _leave(self):
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)


_RENAMED = {"FerryCheckpointIO": "StagedCheckpointIO",
            "FerryOffloadCallback": "StagedCheckpointCallback"}


def __getattr__(name):
    """The old names, deprecated: they staged checkpoints only."""
    if name in _RENAMED:
        import warnings
        warnings.warn(f"ferry.lightning.{name} is now {_RENAMED[name]}", DeprecationWarning,
                      stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
