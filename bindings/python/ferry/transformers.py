"""ferry.transformers — ferry for the Hugging Face `Trainer` (pip
`transformers`):

    from ferry.transformers import ActivationOffloadCallback
    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[ActivationOffloadCallback(policy="budget")])

Each training forward of the model runs inside ``ferry.torch.offload(model,
...)``: at on_train_begin the callback wraps the model's ``forward`` (an
attribute of the instance, restored at on_train_end), so what the forward
saves goes to pinned host memory and its backward (after the forward, as in
torchtune) brings it back. So every gradient-accumulation micro-batch is an
engine step of its own (the Trainer calls ``on_step_begin`` once per
optimizer step, not per micro-batch), a reentrant checkpoint's
recomputation inside backward is not offloaded, and nothing of ferry's is
active outside the model's forward: after an exception anywhere in the
Trainer (which calls no callback then) no saved-tensor hook stays pushed,
and the wrapper removes itself at the model's next training forward once
the training loop that installed it has ended. A deepcopy of the model
runs its own forward, without ferry. The same works in an accelerate
loop: wrap each forward in ``ferry.torch.offload(model)``
(examples/accelerate_loop.py).
"""
from __future__ import annotations

import copy
import functools
import os
import sys
from typing import Any, Dict, Optional

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ._policy import PolicyLike
from .torch import offload, stats

__all__ = ["ActivationOffloadCallback"]

_HERE = os.path.normcase(os.path.abspath(__file__))


def _loop_frame():
    """(id, code) of the frame that called the callback handler: the
    Trainer's training loop. No reference is kept, so its locals are not
    held alive after training."""
    f = sys._getframe(1)
    while f is not None and (os.path.normcase(os.path.abspath(f.f_code.co_filename)) == _HERE
                             or f.f_code.co_filename.endswith("trainer_callback.py")):
        f = f.f_back
    return (id(f), f.f_code) if f is not None else None


def _on_stack(mark):
    f = sys._getframe(1)
    while f is not None:
        if id(f) == mark[0] and f.f_code is mark[1]:
            return True
        f = f.f_back
    return False


class _OffloadingForward:
    """The model's forward while the callback is installed: each training
    forward inside ferry.torch.offload. An object, not a closure, so that a
    deepcopy of the model (an EMA or evaluation copy made by a callback)
    gets a forward of its own: a closure would be shared by the copy and run
    the original model."""

    def __init__(self, cb, model, inner, loop):
        functools.update_wrapper(self, inner)
        self._cb, self._model, self._inner, self._loop = cb, model, inner, loop

    def __call__(self, *a, **kw):
        cb, model, inner = self._cb, self._model, self._inner
        if cb._inside or not (model.training and torch.is_grad_enabled()):
            return inner(*a, **kw)  # a nested call, or evaluation
        if cb._wrapped is None or self._loop is None or not _on_stack(self._loop):
            cb._remove()  # the training loop ended without on_train_end
            return inner(*a, **kw)
        cb._inside = True
        try:
            with offload(model, policy=cb.policy, backend=cb.backend, **cb.knobs):
                return inner(*a, **kw)
        finally:
            cb._inside = False

    def __deepcopy__(self, memo):
        # the copy's own forward (accelerate's wrapper or the class's,
        # rebound to the copy by deepcopy), without ferry
        return copy.deepcopy(self._inner, memo)


class ActivationOffloadCallback(TrainerCallback):
    """Offload the activations of every training forward of a ``Trainer``.

    ActivationOffloadCallback(policy=None, backend=None, **knobs): policy,
    backend and knobs are ferry.torch.offload's. ``last_stats`` holds
    ferry.torch.stats() as of the last optimizer step's end; at each logging
    step the figures are added to ``trainer.state.log_history`` as
    "ferry/<name>". Forwards in eval mode or without grad (evaluation,
    prediction) run without ferry."""

    _LOGGED = ("tensors_offloaded", "bytes_d2h", "bytes_h2d", "arena_peak")

    def __init__(self, policy: Optional[PolicyLike] = None, backend: Optional[str] = None,
                 **knobs: Any) -> None:
        self.policy = policy
        self.backend = backend
        self.knobs = knobs
        self.last_stats = None
        self._wrapped = None  # (model, our forward, the instance's own forward or None)
        self._inside = False

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Optional[torch.nn.Module] = None, **kwargs: Any) -> None:
        self._remove()
        if model is None:
            return
        loop = _loop_frame()
        inner = model.forward  # the bound method, or a wrapper of accelerate's
        had_own = "forward" in model.__dict__
        forward = _OffloadingForward(self, model, inner, loop)
        model.forward = forward
        self._wrapped = (model, forward, inner if had_own else None)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
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
        self._remove()

    def _remove(self):
        """Restore the model's forward (unless someone wrapped it after us:
        then ours stays, inert)."""
        if self._wrapped is not None:
            model, forward, previous = self._wrapped
            self._wrapped = None
            if model.__dict__.get("forward") is forward:
                if previous is None:
                    del model.forward
                else:
                    model.forward = previous
