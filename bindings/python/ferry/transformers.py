"""ferry.transformers — ferry for the Hugging Face `Trainer` (pip
`transformers`):

    from ferry.transformers import ActivationOffloadCallback
    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[ActivationOffloadCallback(policy="budget")])

The Trainer calls on_step_begin before the forward passes of an optimizer
step (every gradient-accumulation micro-batch) and on_step_end after the
optimizer step; the callback keeps ``ferry.torch.offload(model, ...)`` open
between the two, so what those forwards save goes to pinned host memory
and their backwards bring it back. The same works in an accelerate loop:
wrap each step in ``ferry.torch.offload(model)`` (examples/accelerate_loop.py).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ._policy import PolicyLike
from .torch import offload, stats

__all__ = ["ActivationOffloadCallback"]


class ActivationOffloadCallback(TrainerCallback):
    """Offload the activations of every training step of a ``Trainer``.

    ActivationOffloadCallback(policy=None, backend=None, **knobs): policy,
    backend and knobs are ferry.torch.offload's. ``last_stats`` holds
    ferry.torch.stats() as of the last step's end; at each logging step the
    figures are added to ``trainer.state.log_history`` as "ferry/<name>"."""

    _LOGGED = ("tensors_offloaded", "bytes_d2h", "bytes_h2d", "arena_peak")

    def __init__(self, policy: Optional[PolicyLike] = None, backend: Optional[str] = None,
                 **knobs: Any) -> None:
        self.policy = policy
        self.backend = backend
        self.knobs = knobs
        self.last_stats = None
        self._ctx = None

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      model: Optional[torch.nn.Module] = None, **kwargs: Any) -> None:
        self._leave()
        self._ctx = offload(model, policy=self.policy, backend=self.backend, **self.knobs)
        self._ctx.__enter__()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._leave()
        self.last_stats = stats()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: Optional[Dict[str, float]] = None, **kwargs: Any) -> None:
        # The Trainer has already copied logs into state.log_history: add the
        # figures to that entry (report_to integrations, called before user
        # callbacks, do not see them; read last_stats there).
        if self.last_stats is not None and state.log_history and "loss" in state.log_history[-1]:
            state.log_history[-1].update({f"ferry/{k}": self.last_stats[k] for k in self._LOGGED})

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._leave()

    def _leave(self):
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)
