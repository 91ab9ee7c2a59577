"""Optimizer-state offload (docs/optimizer-offload.md).

``offload_optimizer(opt, fraction=0.5, overlap=True, policy=None)`` keeps the
optimizer state of a share of the parameters on the host and steps that share
there with torch's own CPU kernels, as Megatron's ``HybridDeviceOptimizer``
(``optimizer_offload_fraction``) and DeepSpeed's ZeRO-Offload do:

* The host share is chosen by bytes, largest parameters first (ties in
  parameter order), each taken while the share stays within
  ``fraction * total bytes``: deterministic, the same on every rank.
* Each host-share parameter gets a host master copy (pinned when CUDA is
  available) and a host gradient buffer; a second optimizer of the same class
  and hyperparameters owns their state (``exp_avg`` ... live on the host).
* Gradients reach the host buffers as soon as they are accumulated
  (``register_post_accumulate_grad_hook``, torch >= 2.1) or at step time
  (torch 1.13, and always under ``torch.distributed``, where DDP writes the
  averaged gradient only at the end of backward). A gradient replaced or
  changed in place after the hook (``clip_grad_norm_``, unscaling: seen by
  its identity and version counter) is copied again at step time.
* ``step()``: the device share steps with the wrapped optimizer while the
  host share steps on a worker thread (``overlap=True``) or after it; then
  the host share's parameters are copied back.
* The wrapped optimizer is patched in place and returned, so an LR scheduler,
  ``state_dict()``/``load_state_dict()`` (the wrapped optimizer's own format,
  with every parameter's state) and ``torch.save`` work unchanged.
* Sharded parameters (FSDP2 ``fully_shard``: DTensors): the host copies are
  plain tensors of this rank's local shard, and the host optimizer steps
  them (elementwise optimizers only: Adam, AdamW, SGD ... step a shard as
  they would the whole); ``state_dict()`` gives their state back as DTensors
  laid out like the parameter, as the plain optimizer's.

``policy`` may instead be a Lua policy (a name, a path, a ``ferry.Policy``)
whose ``resident(r)`` chooses the host share (``optimizer = R.host_fraction(0.5)``
and the other selectors of the rules library; docs/optimizer-offload.md):
``opt.ferry_offload.choices`` then says, per parameter, which rule placed it.
"""
from __future__ import annotations

import inspect
import sys
import threading
import types
from typing import Any, Callable, Dict, Optional

import torch

from . import _resident

__all__ = ["offload_optimizer", "OptimizerOffload"]

_HOST_GROUP_OFF = {"fused": None, "capturable": False}


def _pin(t):
    if torch.cuda.is_available():
        return t.pin_memory()
    return t


def _dtensor_class():
    """DTensor's class once torch.distributed.tensor is imported (no DTensor
    exists before that; torch 1.13 has none), else None."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        cls = getattr(sys.modules.get(name), "DTensor", None)
        if cls is not None:
            return cls
    return None


def _local(t):
    """The plain tensor holding this rank's share of t: a DTensor's local
    shard (its storage: copies into it change the parameter), else t."""
    cls = _dtensor_class()
    if cls is not None and isinstance(t, cls):
        return t._local_tensor
    return t


def _like_param(key, v, p, hp):
    """A host state tensor as the plain optimizer would hold it: for a
    DTensor parameter, a parameter-shaped state (exp_avg ..., not step)
    becomes a DTensor with the parameter's mesh and placements."""
    cls = _dtensor_class()
    if (cls is None or not isinstance(p, cls) or not torch.is_tensor(v) or key == "step"
            or v.shape != hp.shape):
        return v
    return cls.from_local(v, p.device_mesh, p.placements, run_check=False,
                          shape=p.shape, stride=p.stride())


def _choose(params, fraction, policy, model):
    """Indices (into params) of the host share, and the Lua policy's
    answers (None without one)."""
    if _resident.is_policy(policy):
        choices = _resident.choose_params(policy, params, model)
        return [i for i, c in enumerate(choices) if c.host], choices
    if policy is not None:
        return [i for i, p in enumerate(params) if policy(p)], None
    sizes = [p.numel() * p.element_size() for p in params]
    total = sum(sizes)
    if fraction >= 1.0:
        return list(range(len(params))), None
    budget = fraction * total
    chosen, used = [], 0
    for i in sorted(range(len(params)), key=lambda i: (-sizes[i], i)):
        if used + sizes[i] <= budget:
            chosen.append(i)
            used += sizes[i]
    return sorted(chosen), None


class OptimizerOffload:
    """The offload state attached to a patched optimizer as
    ``opt.ferry_offload``: which parameters are on the host and how many
    bytes of parameters they are."""

    def __init__(self, opt: torch.optim.Optimizer, fraction: float, overlap: bool,
                 policy: Any, early_grads: Optional[bool],
                 model: Optional[torch.nn.Module] = None) -> None:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError("offload_optimizer: expected a torch.optim.Optimizer, got %s"
                            % type(opt).__name__)
        if not (0.0 <= float(fraction) <= 1.0):
            raise ValueError("offload_optimizer: fraction must be in [0, 1], got %r" % (fraction,))
        if getattr(opt, "ferry_offload", None) is not None:
            raise RuntimeError("offload_optimizer: this optimizer is already offloaded")
        self.opt = opt
        self.fraction = float(fraction)
        self.overlap = bool(overlap)
        params = [p for g in opt.param_groups for p in g["params"]]
        if any(getattr(p, "_ferry_weight_offload", False) for p in params):
            raise RuntimeError("offload_optimizer: some parameters are already under "
                               "offload_weights (their sizes are not known while they are on "
                               "the host); call offload_optimizer first, then offload_weights")
        chosen, self.choices = _choose(params, self.fraction, policy, model)
        idx = set(chosen)
        self.total_bytes = sum(p.numel() * p.element_size() for p in params)
        # Host share, per group: (group index, [(device param, host param)]).
        self.pairs = []  # (group index, device param, host param, host grad)
        host_groups, self._group_map = [], []
        k = 0
        for gi, g in enumerate(opt.param_groups):
            hps = []
            for p in g["params"]:
                if k in idx:
                    hp = _pin(_local(p.detach()).to("cpu", copy=True))
                    hg = _pin(torch.zeros_like(hp))
                    self.pairs.append((gi, p, hp, hg))
                    hps.append(hp)
                k += 1
            if hps:
                hg_opts = {key: v for key, v in g.items() if key != "params"}
                for key, v in _HOST_GROUP_OFF.items():
                    if key in hg_opts:
                        hg_opts[key] = v
                host_groups.append(dict(hg_opts, params=hps))
                self._group_map.append(gi)
        self.host_bytes = sum(p.numel() * p.element_size() for _, p, _, _ in self.pairs)
        self.host_opt = None
        if host_groups:
            defaults = dict(opt.defaults)
            for key, v in _HOST_GROUP_OFF.items():
                if key in defaults:
                    defaults[key] = v
            # Only the keywords the constructor takes (torch 2.x AdamW's defaults
            # hold decoupled_weight_decay, which it does not); every group key,
            # the rest included, is in the host groups themselves.
            sig = inspect.signature(type(opt).__init__).parameters
            kw = {k: v for k, v in defaults.items() if k in sig}
            self.host_opt = type(opt)(host_groups, **kw)
            self.host_opt.defaults = defaults
        self._host_set = {id(p) for _, p, _, _ in self.pairs}
        self._fresh = {}
        self._hooks = []
        if early_grads is None:
            early_grads = not (torch.distributed.is_available()
                               and torch.distributed.is_initialized()
                               and torch.distributed.get_world_size() > 1)
        self.early_grads = bool(early_grads) and hasattr(torch.Tensor,
                                                         "register_post_accumulate_grad_hook")
        if self.early_grads:
            for n, (_, p, _, hg) in enumerate(self.pairs):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(n, hg)))
        self._orig_step = opt.step
        self._orig_state_dict = opt.state_dict
        self._orig_load_state_dict = opt.load_state_dict
        self.host_steps = 0

    def _grad_hook(self, n, hg):
        def hook(p):
            hg.copy_(_local(p.grad), non_blocking=True)
            # Which gradient, at which version: clip_grad_norm_, an unscale or
            # DDP may change it in place before step(), which then copies again.
            self._fresh[n] = (p.grad, p.grad._version)
        return hook

    # ---- step -------------------------------------------------------------
    def _sync_hyperparams(self):
        for hgi, gi in enumerate(self._group_map):
            src, dst = self.opt.param_groups[gi], self.host_opt.param_groups[hgi]
            for key, v in src.items():
                if key != "params" and key not in _HOST_GROUP_OFF:
                    dst[key] = v

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.host_opt is None:
            self._orig_step()
            return loss
        self._sync_hyperparams()
        saved = []
        try:
            for n, (_, p, hp, hg) in enumerate(self.pairs):
                saved.append(p.grad)
                if p.grad is None:
                    hp.grad = None
                    continue
                fresh = self._fresh.get(n)
                if fresh is None or fresh[0] is not p.grad or fresh[1] != p.grad._version:
                    hg.copy_(_local(p.grad), non_blocking=True)
                hp.grad = hg
                hp.detach().copy_(_local(p.detach()), non_blocking=True)  # the model is the truth
                p.grad = None  # the device step skips the host share
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()  # host buffers are filled
            if self.overlap:
                err = []

                def run():
                    try:
                        self.host_opt.step()
                    except BaseException as ex:  # noqa: BLE001 - re-raised below
                        err.append(ex)
                t = threading.Thread(target=run, name="ferry-host-optim")
                t.start()
                try:
                    self._orig_step()
                finally:
                    t.join()
                if err:
                    raise err[0]
            else:
                self.host_opt.step()
                self._orig_step()
            for _, p, hp, _ in self.pairs:
                if hp.grad is not None:
                    _local(p.detach()).copy_(hp, non_blocking=True)
            self.host_steps += 1
        finally:
            for (_, p, hp, _), g in zip(self.pairs, saved):
                p.grad = g
                hp.grad = None
            self._fresh.clear()
        return loss

    # ---- state dict: the wrapped optimizer's format -------------------------
    def state_dict(self) -> Dict[str, Any]:
        if self.host_opt is None:
            return self._orig_state_dict()
        self._sync_hyperparams()
        st = self.opt.state
        put = []
        for _, p, hp, _ in self.pairs:
            if hp in self.host_opt.state:
                st[p] = {k: _like_param(k, v, p, hp) for k, v in self.host_opt.state[hp].items()}
                put.append(p)
        try:
            return self._orig_state_dict()
        finally:
            for p in put:
                st.pop(p, None)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._orig_load_state_dict(state_dict)
        if self.host_opt is None:
            return
        self._sync_hyperparams()
        for _, p, hp, _ in self.pairs:
            s = self.opt.state.pop(p, None)
            self.host_opt.state.pop(hp, None)
            if s is not None:
                self.host_opt.state[hp] = {
                    k: (_pin(_local(v.detach()).to("cpu", copy=True)) if torch.is_tensor(v) else v)
                    for k, v in s.items()}

    def remove(self) -> None:
        """Undo the patch: the host share's state moves back into the wrapped
        optimizer (on each parameter's device)."""
        sd = self.state_dict()
        for h in self._hooks:
            h.remove()
        for name in ("step", "state_dict", "load_state_dict"):
            self.opt.__dict__.pop(name, None)
        self.opt.ferry_offload = None
        self.opt.load_state_dict(sd)


def offload_optimizer(opt: torch.optim.Optimizer, fraction: float = 0.5, overlap: bool = True,
                      policy: Any = None, early_grads: Optional[bool] = None,
                      model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
    """Keep the optimizer state of a ``fraction`` (by bytes) of opt's
    parameters on the host and step it there; returns opt, patched in place
    (its ``ferry_offload`` attribute is the :class:`OptimizerOffload`).

    ``policy``: instead of ``fraction``, a Lua policy (name, path or
    ``ferry.Policy``) whose ``resident(r)`` chooses the host share (its
    answers and reasons in ``opt.ferry_offload.choices``), or a Python
    ``policy(param) -> bool``. ``model``: names the parameters and their
    layers for a Lua policy (without it they are ``param.<i>``, no layer).
    ``early_grads``: copy gradients to the host as they are accumulated
    (default: on torch >= 2.1 outside torch.distributed).
    """
    off = OptimizerOffload(opt, fraction, overlap, policy, early_grads, model)
    opt.step = types.MethodType(lambda self, closure=None: off.step(closure), opt)
    opt.state_dict = types.MethodType(lambda self: off.state_dict(), opt)
    opt.load_state_dict = types.MethodType(lambda self, sd: off.load_state_dict(sd), opt)
    opt.ferry_offload = off
    return opt
