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
* Gradients are copied to the host buffers when ``step()`` runs, so what
  the host share steps on is the gradient as it is then: clipped, unscaled
  by a ``GradScaler`` (whose unscale kernel bumps no version counter),
  changed through ``.data`` or numpy. ``early_grads=True`` copies them as
  they are accumulated instead (``register_post_accumulate_grad_hook``,
  torch >= 2.1, never under ``torch.distributed``): it trusts that the
  gradient is not changed afterwards except by ordinary in-place ops (seen
  by identity and version counter, then copied again).
* A fused optimizer under ``GradScaler`` gets ``grad_scale``/``found_inf``
  from the scaler: the host share honours them (a fused host optimizer
  where torch has a CPU kernel, else an unscale and a skipped step).
* State the optimizer already has (a resumed run, or steps taken before
  wrapping) moves to the host at wrap; ``opt.state`` keeps showing every
  parameter's state (the host share's as the host optimizer's own dicts), so
  code that reads it (DCP's ``get_optimizer_state_dict``) sees the truth.
* Step pre- and post-hooks (torch 2.x) run around the whole step: before
  either share moves, after the parameters are back.
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
import warnings
import weakref
from typing import Any, Callable, Dict, Optional

import torch

from . import _resident

__all__ = ["offload_optimizer", "OptimizerOffload"]

_HOST_GROUP_OFF = {"capturable": False}  # fused: kept where torch has a CPU kernel


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


def _needs_closure(opt):
    """Whether opt's step must be given a closure (LBFGS re-evaluates it
    inside the step, over every parameter at once)."""
    try:
        closure = inspect.signature(_raw_step(opt)).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _raw_step(opt):
    """The class's step without torch 2.x's hook wrapper (profile_hook_step,
    marked ``hooked``): OptimizerOffload.step runs the hooks itself, around
    both shares."""
    fn = type(opt).step
    if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return types.MethodType(fn, opt)


def _to_host(v, key, hp, fused):
    """A state value as the host optimizer keeps it: a copy on the host
    (a DTensor's local shard), floating states in the parameter's dtype,
    ``step`` as it is unless the host optimizer is fused (float32, as
    torch's load_state_dict does)."""
    if not torch.is_tensor(v):
        return v
    v = _local(v.detach())
    if key == "step":
        return v.to("cpu", dtype=torch.float32 if fused else v.dtype, copy=True)
    dtype = hp.dtype if hp.is_floating_point() else v.dtype
    return _pin(v.to("cpu", dtype=dtype, copy=True))


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
        if _needs_closure(opt):
            raise TypeError("offload_optimizer: %s.step needs a closure it evaluates again "
                            "over all parameters together (a line search): its state cannot be "
                            "split between two shares; offload an elementwise optimizer (Adam, "
                            "AdamW, SGD ...)" % type(opt).__name__)
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
        self.host_fused = False
        if host_groups:
            self.host_opt = self._make_host_opt(opt, host_groups)
            # an internal optimizer: global step hooks are for the user's
            self._host_step = _raw_step(self.host_opt)
        self._host_set = {id(p) for _, p, _, _ in self.pairs}
        self._fresh = {}
        self._hooks = []
        if early_grads is None:
            early_grads = False  # copied at step(): the gradient as it is then
        if early_grads and (torch.distributed.is_available()
                            and torch.distributed.is_initialized()
                            and torch.distributed.get_world_size() > 1):
            early_grads = False  # DDP writes the averaged gradient at the end of backward
        self.early_grads = bool(early_grads) and hasattr(torch.Tensor,
                                                         "register_post_accumulate_grad_hook")
        if self.early_grads:
            me = weakref.ref(self)  # the hook lives in torch's C++ storage: no cycle through it
            for n, (_, p, _, hg) in enumerate(self.pairs):
                if p.requires_grad:  # frozen parameters take no hook (and get no gradient)
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        _grad_hook(me, n, hg)))
        self._orig_step = opt.step
        self._device_step = _raw_step(opt)
        self._orig_state_dict = opt.state_dict
        self._orig_load_state_dict = opt.load_state_dict
        self._orig_add_param_group = opt.add_param_group
        self.host_steps = 0
        self._adopt_state()

    def _make_host_opt(self, opt, host_groups):
        defaults = dict(opt.defaults)
        for key, v in _HOST_GROUP_OFF.items():
            if key in defaults:
                defaults[key] = v
        # Only the keywords the constructor takes (torch 2.x AdamW's defaults
        # hold decoupled_weight_decay, which it does not); every group key,
        # the rest included, is in the host groups themselves.
        sig = inspect.signature(type(opt).__init__).parameters
        kw = {k: v for k, v in defaults.items() if k in sig}
        fused = any(g.get("fused") for g in host_groups)
        if fused:
            try:  # torch's CPU kernel where it has one (torch >= 2.4: Adam, AdamW, SGD ...)
                host = type(opt)(host_groups, **kw)
                host.defaults = defaults
                self.host_fused = True
                return host
            except (RuntimeError, ValueError) as e:
                warnings.warn("offload_optimizer: %s(fused=True) has no CPU kernel in this torch "
                              "(%s): the host share steps unfused (the same math, not the same "
                              "rounding)" % (type(opt).__name__, e), RuntimeWarning, stacklevel=4)
            for g in host_groups:
                g["fused"] = None
            if "fused" in kw:
                kw["fused"] = None
            defaults["fused"] = None
        host = type(opt)(host_groups, **kw)
        host.defaults = defaults
        return host

    def _adopt_state(self):
        """State the optimizer already holds for the host share (load then
        wrap, or steps before wrapping) moves to the host optimizer."""
        if self.host_opt is None:
            return
        st = self.opt.state
        for _, p, hp, _ in self.pairs:
            s = st.pop(p) if p in st else None
            if s:
                self.host_opt.state[hp] = {k: _to_host(v, k, hp, self.host_fused)
                                           for k, v in s.items()}
        self._publish()

    def _publish(self):
        """opt.state[p] is the host optimizer's own dict for each host-share
        parameter that has state: readers of opt.state see every state."""
        st = self.opt.state
        for _, p, hp, _ in self.pairs:
            s = self.host_opt.state.get(hp) if hp in self.host_opt.state else None
            if s:
                st[p] = s
            elif p in st:
                del st[p]

    # ---- step -------------------------------------------------------------
    def _sync_hyperparams(self):
        for hgi, gi in enumerate(self._group_map):
            src, dst = self.opt.param_groups[gi], self.host_opt.param_groups[hgi]
            for key, v in src.items():
                if key != "params" and key not in _HOST_GROUP_OFF and key != "fused":
                    dst[key] = v

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        opt = self.opt
        args, kwargs = (opt,), ({} if closure is None else {"closure": closure})
        mod = sys.modules.get("torch.optim.optimizer")
        pre = list(getattr(mod, "_global_optimizer_pre_hooks", {}).values())
        pre += list(getattr(opt, "_optimizer_step_pre_hooks", {}).values())
        for hook in pre:  # before either share moves (a snapshot's fence, DCP ...)
            res = hook(opt, args, kwargs)
            if res is not None:
                if not (isinstance(res, tuple) and len(res) == 2):
                    raise RuntimeError("offload_optimizer: a step pre-hook must return None or "
                                       "(args, kwargs), got %r" % (res,))
                args, kwargs = res
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        out = self._step(closure)
        if hasattr(opt, "_optimizer_step_code"):
            opt._optimizer_step_code()
        opt._opt_called = True  # an LR scheduler's check, as its own step wrapper sets it
        post = list(getattr(opt, "_optimizer_step_post_hooks", {}).values())
        post += list(getattr(mod, "_global_optimizer_post_hooks", {}).values())
        for hook in post:  # after the parameters are back
            hook(opt, args, kwargs)
        return out

    def _amp(self):
        """(grad_scale, found_inf) a GradScaler handed a fused optimizer for
        this step (attributes it sets on opt around step()), or Nones."""
        return getattr(self.opt, "grad_scale", None), getattr(self.opt, "found_inf", None)

    def _step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.host_opt is None:
            self._device_step()
            return loss
        self._sync_hyperparams()
        grad_scale, found_inf = self._amp()
        host_runs = True
        if found_inf is not None or grad_scale is not None:
            if self.host_fused:  # the CPU kernel unscales and skips as the device one does
                self.host_opt.grad_scale = (None if grad_scale is None
                                            else grad_scale.detach().to("cpu", copy=True))
                self.host_opt.found_inf = (None if found_inf is None
                                           else found_inf.detach().to("cpu", copy=True))
            elif found_inf is not None and float(found_inf) != 0.0:
                host_runs = False  # an inf/NaN step: skipped, as the fused device share skips it
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
            if host_runs and grad_scale is not None and not self.host_fused:
                inv = grad_scale.double().reciprocal().float().item()
                for _, _, hp, _ in self.pairs:
                    if hp.grad is not None:
                        hp.grad.mul_(inv)
            if not host_runs:
                for _, _, hp, _ in self.pairs:
                    hp.grad = None
            if self.overlap:
                err = []

                def run():
                    try:
                        self._host_step()
                    except BaseException as ex:  # noqa: BLE001 - re-raised below
                        err.append(ex)
                t = threading.Thread(target=run, name="ferry-host-optim")
                t.start()
                try:
                    self._device_step()
                finally:
                    t.join()
                if err:
                    raise err[0]
            else:
                self._host_step()
                self._device_step()
            for _, p, hp, _ in self.pairs:
                if hp.grad is not None:
                    _local(p.detach()).copy_(hp, non_blocking=True)
            self.host_steps += 1
        finally:
            for (_, p, hp, _), g in zip(self.pairs, saved):
                p.grad = g
                hp.grad = None
            self._fresh.clear()
            self.host_opt.__dict__.pop("grad_scale", None)
            self.host_opt.__dict__.pop("found_inf", None)
            self._publish()
        return loss

    # ---- state dict: the wrapped optimizer's format -------------------------
    def state_dict(self) -> Dict[str, Any]:
        if self.host_opt is None:
            return self._orig_state_dict()
        self._sync_hyperparams()
        st = self.opt.state
        for _, p, hp, _ in self.pairs:  # FSDP2: parameter-shaped states as DTensors
            if hp in self.host_opt.state and self.host_opt.state[hp]:
                st[p] = {k: _like_param(k, v, p, hp) for k, v in self.host_opt.state[hp].items()}
        try:
            return self._orig_state_dict()
        finally:
            self._publish()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if self.host_opt is None:
            return self._orig_load_state_dict(state_dict)
        # The host share's states go straight to the host: torch's
        # load_state_dict would first put them on each parameter's device.
        saved_ids = [i for g in state_dict.get("param_groups", ()) for i in g.get("params", ())]
        params = [p for g in self.opt.param_groups for p in g["params"]]
        host_ids = {}
        if len(saved_ids) == len(params):  # else torch's own check says what is wrong
            where = {id(p): i for i, p in zip(saved_ids, params)}
            host_ids = {id(p): where[id(p)] for _, p, _, _ in self.pairs}
        states = state_dict.get("state", {})
        rest = dict(state_dict)
        rest["state"] = {k: v for k, v in states.items() if k not in set(host_ids.values())}
        self._orig_load_state_dict(rest)
        self._sync_hyperparams()
        for _, p, hp, _ in self.pairs:
            self.opt.state.pop(p, None)
            self.host_opt.state.pop(hp, None)
            s = states.get(host_ids.get(id(p)))
            if s:
                self.host_opt.state[hp] = {k: _to_host(v, k, hp, self.host_fused)
                                           for k, v in s.items()}
        self._publish()

    def add_param_group(self, group: Dict[str, Any]) -> None:
        self._orig_add_param_group(group)
        warnings.warn("offload_optimizer: a parameter group added after wrapping keeps its "
                      "optimizer state on the device (the host share is chosen at wrap; wrap "
                      "again after remove() to include it)", RuntimeWarning, stacklevel=3)

    def remove(self) -> None:
        """Undo the patch: the host share's state moves back into the wrapped
        optimizer (on each parameter's device)."""
        sd = self.state_dict()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for name in ("step", "state_dict", "load_state_dict", "add_param_group"):
            self.opt.__dict__.pop(name, None)
        if "step" not in self.opt.__dict__ and self._orig_step is not None and \
                getattr(self._orig_step, "__self__", None) is not self.opt:
            self.opt.step = self._orig_step  # someone's own wrapper (an LR scheduler's)
        for _, p, _, _ in self.pairs:
            self.opt.state.pop(p, None)
        self.opt.ferry_offload = None
        self.opt.load_state_dict(sd)


def _grad_hook(me, n, hg):
    """The early copy of parameter n's gradient; me is a weak reference to
    the OptimizerOffload (a strong one would keep it, its optimizer and
    parameters alive from torch's C++ hook storage, which gc cannot see)."""
    def hook(p):
        off = me()
        if off is None:
            return
        hg.copy_(_local(p.grad), non_blocking=True)
        # Which gradient, at which version: an ordinary in-place change
        # (clip_grad_norm_) before step() makes step() copy again.
        off._fresh[n] = (p.grad, p.grad._version)
    return hook


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
    (torch >= 2.1, ignored under torch.distributed; default off: they are
    copied at step(), where clipping, a GradScaler's unscale and writes
    through ``.data`` have been done).
    """
    off = OptimizerOffload(opt, fraction, overlap, policy, early_grads, model)
    prev = opt.__dict__.get("step")

    counted = getattr(prev, "_with_counter", False)

    def step(self, closure=None):
        if counted:  # torch 1.13's LR scheduler counts steps through its wrapper
            self._step_count = getattr(self, "_step_count", 0) + 1
        return off.step(closure)
    # An LR scheduler made before wrapping marked the step it wrapped: ours
    # carries the mark (and does the bookkeeping) so it does not warn.
    for mark in ("_wrapped_by_lr_sched", "_with_counter"):
        if getattr(prev, mark, False):
            setattr(step, mark, True)
    opt.step = types.MethodType(step, opt)  # bound: LR schedulers rewrap step.__func__
    # torch's own parameter names: callers pass them by keyword (DCP's
    # set_optimizer_state_dict calls load_state_dict(state_dict=...))
    def state_dict(self):
        return off.state_dict()

    def load_state_dict(self, state_dict):
        return off.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        return off.add_param_group(param_group)
    opt.state_dict = types.MethodType(state_dict, opt)
    opt.load_state_dict = types.MethodType(load_state_dict, opt)
    opt.add_param_group = types.MethodType(add_param_group, opt)
    opt.ferry_offload = off
    return opt
