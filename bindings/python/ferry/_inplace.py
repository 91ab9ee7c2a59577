"""The error torch raises when a tensor saved for backward was modified in
place, raised by ferry's unpack hook: torch skips its own check for tensors
saved through saved_tensors_hooks.

torch's wording changes between versions (the grad_fn's name, the hint), so
it is learned from torch itself: the first time, a known case is run
without hooks and its message becomes the template.
"""
from __future__ import annotations

import re
import warnings

import torch

_templates: dict[bool, tuple[str, bool, str]] = {}
_asked = False
# torch 2.x's wording, for when torch cannot be asked (hooks already active)
_FALLBACK = ("one of the variables needed for gradient computation has been modified by an "
             "inplace operation: ", True, " Hint: enable anomaly detection to find the operation "
             "that failed to compute its gradient, with "
             "torch.autograd.set_detect_anomaly(True, check_nan=False).")


def _probe() -> tuple[str, bool, str] | None:
    """torch's message for a known case, run without hooks; None if torch
    did not raise (saved-tensor hooks of someone else are active)."""
    with torch.enable_grad():
        x = torch.ones(2, requires_grad=True)
        a = x * 1
        node = a.grad_fn.name()
        b = a.sin()
        a.mul_(2)
        try:
            b.sum().backward()
            return None
        except RuntimeError as e:
            msg = str(e)
    found = re.search(r", which is output 0 of (.+?), is at version", msg)
    if "[" not in msg or "instead." not in msg or not found:
        return None
    tail = msg[msg.index("instead.") + len("instead."):]
    return msg[:msg.index("[")], found.group(1) != node, tail


def prepare() -> None:
    """Learn the templates (normal and anomaly mode) while no hooks are
    active: ferry.torch calls it before it installs its own."""
    global _asked
    if _asked:
        return
    _asked = True
    for anomaly in (False, True):
        with warnings.catch_warnings(), torch.autograd.set_detect_anomaly(anomaly):
            warnings.simplefilter("ignore")
            found = _probe()
        if found:
            _templates[anomaly] = found


def _template() -> tuple[str, bool, str]:
    """(prefix, strip "Backward<N>" from grad_fn names, tail after "instead.")
    for the current anomaly mode."""
    return _templates.get(torch.is_anomaly_enabled(), _FALLBACK)


def error(now: torch.Tensor, tensor: torch.Tensor | None, shape: tuple[int, ...] | None,
          current: int, saved: int, module: str | None) -> RuntimeError:
    """torch's RuntimeError for a saved tensor at version `current` that was
    saved at version `saved`, with the module that saved it. `now` shares
    its version counter (the tensor, an alias or its base), `tensor` is the
    tensor itself if still alive, `shape` its shape when `now` is its base."""
    prefix, strip, tail = _template()
    sizes = ", ".join(str(s) for s in (shape if shape is not None else now.shape))
    msg = f"{prefix}[{now.type()} [{sizes}]]"
    fn = tensor.grad_fn if tensor is not None else None
    if fn is not None:
        name = fn.name()
        if strip:
            name = re.sub(r"Backward\d*$", "", name)
        msg += f", which is output {tensor.output_nr} of {name},"
    msg += f" is at version {current}; expected version {saved} instead.{tail}"
    where = f"module '{module}'" if module else "no module"
    return RuntimeError(f"{msg} (ferry: the tensor was saved in {where})")
