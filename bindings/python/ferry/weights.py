"""Weight offload (docs/optimizer-offload.md): chosen layers' parameters live
on the host between uses.

``offload_weights(model, layers, double_buffer=True)``, or
``offload_weights(model, policy="mine.lua")``: the policy's ``resident(r)``
chooses among the model's repeated blocks (``weights = R.host_first_layers(4)``;
docs/optimizer-offload.md), its answers in ``WeightOffload.choices``:

* At the start, and after each forward of a chosen layer, its parameters are
  copied to host buffers (pinned when CUDA is available) and their device
  storage is released (``param.data`` becomes an empty tensor).
* Before a layer's forward, and before its backward (a hook on its output's
  gradient), the parameters are copied back. With ``double_buffer`` the next
  layer (in the order of ``layers``, forward; the previous one in backward)
  starts reloading at the same time, on a side stream with CUDA: at most two
  offloaded layers are on the device at once during forward.
* Autograd saves views of the weights (``weight.t()`` in a Linear), or
  under autocast their low-precision casts, which would keep device memory
  alive: inside a chosen layer's forward (a wrapper around the module's
  forward, so the hooks are popped whatever happens) a
  ``saved_tensors_hooks`` pair replaces a saved view or cast of one of its
  parameters by a marker, and rebuilds it from the reloaded parameter
  when backward needs it. Other saved tensors go to the hooks that were in
  force when the layer's forward began (``ferry.torch.offload``'s, or
  ``torch.utils.checkpoint``'s), as if ours were not there; torch 1.13 cannot
  name those hooks, so there they pass through unchanged.
* After backward the parameters stay on the device for the optimizer step;
  the next training forward of the layer sends them back (not a forward
  inside backward, a checkpoint's recompute, nor an eval forward before the
  step; on torch 2.x a global step pre-hook brings back offloaded layers
  that have gradients).
* ``model.state_dict()`` shows offloaded weights as their host copies;
  ``load_state_dict`` loads them (state-dict hooks on the layers).
* Tied weights (a chosen layer's parameter also held by a module that is not
  chosen, or by another chosen layer) are refused. With
  ``offload_optimizer``, wrap the optimizer first.
"""
from __future__ import annotations

import copy
import functools
import sys
import weakref
from typing import Any, Optional, Sequence, Union

import torch

from . import _resident

__all__ = ["offload_weights", "WeightOffload"]


def _outer_hooks():
    """The saved-tensor hooks in force now ((pack, unpack) or None): torch
    2.x tells; torch 1.13 does not (None)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _storage_ptr(t):
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage().data_ptr()
    return t.storage().data_ptr()


def _in_backward(owner):
    """Whether a backward pass is running (a checkpoint's recompute runs
    forwards inside one): torch 2.x says; on torch 1.13 the owner's flag,
    set by our backward hooks and cleared by a callback at the end of that
    backward."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is not None:
        return task() != -1
    return owner.backward_running


def _mark_backward(owner):
    if getattr(torch._C, "_current_graph_task_id", None) is not None or owner.backward_running:
        return
    owner.backward_running = True

    def done():
        owner.backward_running = False
    torch.autograd.Variable._execution_engine.queue_callback(done)


def _cast_source(t, params):
    """(index, dtype) when t is autocast's cast of one of params (or a view
    of that cast): the cast's grad_fn is a ToCopyBackward whose input is the
    parameter's AccumulateGrad; else None."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or not type(fn).__name__.startswith("ToCopyBackward"):
        return None
    nxt = fn.next_functions
    if len(nxt) != 1 or nxt[0][0] is None:
        return None
    var = getattr(nxt[0][0], "variable", None)
    for i, p in enumerate(params):
        if var is p and base.is_contiguous() and base.dtype != p.dtype:
            return i, base.dtype
    return None


class _Layer:
    def __init__(self, owner, index, module):
        self.owner, self.index, self.module = owner, index, module
        self.params = [p for p in module.parameters(recurse=True)]
        for p in self.params:
            p._ferry_weight_offload = True  # ferry.optim refuses to wrap it afterwards
        self.host = []
        for p in self.params:
            h = torch.empty(p.shape, dtype=p.dtype, device="cpu")
            if torch.cuda.is_available():
                h = h.pin_memory()
            self.host.append(h)
        self.device = [p.device for p in self.params]
        self.on_device = True
        self.kept_for_step = False  # reloaded by backward: stays for the optimizer step
        self.was_on_device = True  # before a load_state_dict
        self.event = None  # a pending reload on the side stream (CUDA)
        self.outer = None  # the hooks our pack hands other tensors to

    def offload(self):
        if not self.on_device:
            return
        self.wait()
        for p, h in zip(self.params, self.host):
            h.copy_(p.detach())  # synchronous: the device storage goes next
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.on_device = False
        self.kept_for_step = False
        self.owner.offloads += 1

    def load(self, asynchronous=False):
        if self.on_device:
            if not asynchronous:
                self.wait()
            return
        stream = self.owner.stream
        if stream is not None:
            # The compute stream, read before the side stream becomes the
            # current one: the reload waits for the work queued there.
            compute = torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                stream.wait_stream(compute)
                for p, h, d in zip(self.params, self.host, self.device):
                    p.data = h.to(d, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
        else:
            for p, h, d in zip(self.params, self.host, self.device):
                p.data = h.to(d, copy=True)
        self.on_device = True
        self.owner.reloads += 1
        if not asynchronous:
            self.wait()

    def wait(self):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            for p in self.params:
                p.data.record_stream(torch.cuda.current_stream())
            self.event = None

    def index_of(self, p):
        """p's index in params, or None (by identity, not id(): a deepcopy
        of the model copies this layer with its parameters)."""
        for i, q in enumerate(self.params):
            if q is p:
                return i
        return None

    # ---- hooks --------------------------------------------------------------
    def pack(self, t):
        ptr = _storage_ptr(t)
        for i, p in enumerate(self.params):
            if p.numel() and ptr == _storage_ptr(p) and t.device == p.device:
                return ("ferry-weight", self, i, tuple(t.shape), tuple(t.stride()),
                        t.storage_offset(), None)
        # autocast's cast of a weight: made again from the reloaded weight in
        # backward rather than kept on the device until then
        cast = _cast_source(t, self.params) if t.grad_fn is not None else None
        if cast is not None:
            return ("ferry-weight", self, cast[0], tuple(t.shape), tuple(t.stride()),
                    t.storage_offset(), cast[1])
        if self.outer is not None:
            pack, unpack = self.outer
            return ("ferry-outer", unpack, pack(t))
        return t

    def forward(self, orig, *args, **kwargs):
        """The module's forward inside our saved-tensor hooks, popped
        whatever happens (an OOM, an interrupt): a forward that raises
        leaves no hooks behind."""
        self.outer = _outer_hooks()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
                return orig(*args, **kwargs)
        finally:
            self.outer = None

    def pre_forward(self, module, args):
        self.load()
        nxt = self.owner.neighbour(self.index, +1)
        if nxt is not None and self.owner.double_buffer:
            nxt.load(asynchronous=True)

    def post_forward(self, module, args, output):
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._before_backward)
        if _in_backward(self.owner):
            return  # a checkpoint's recompute: backward needs the weights now
        if self.kept_for_step and not torch.is_grad_enabled() and not module.training:
            return  # an eval forward between backward and step(): the step needs them
        self.offload()

    def _before_backward(self, grad):
        _mark_backward(self.owner)
        self.load()
        self.kept_for_step = True
        prev = self.owner.neighbour(self.index, -1)
        if prev is not None and self.owner.double_buffer:
            prev.load(asynchronous=True)
        return grad

    # ---- state dict -----------------------------------------------------------
    def state_dict_hook(self, sub, state_dict, prefix, local_metadata):
        """Offloaded weights appear as their host copies (the parameters'
        values; a plain state_dict's are live parameters too)."""
        if self.on_device:
            return
        for pn, p in sub._parameters.items():
            i = self.index_of(p)
            if i is not None and prefix + pn in state_dict:
                state_dict[prefix + pn] = self.host[i]

    def load_pre_hook(self, sub, *args):
        self.was_on_device = self.on_device
        self.load()  # the parameters' own shapes, for torch's size checks and copies

    def load_post_hook(self, sub, incompatible):
        if any(p is not None and self.index_of(p) is None for p in sub._parameters.values()):
            raise RuntimeError("offload_weights: load_state_dict replaced parameters of an "
                               "offloaded layer (assign=True): call remove() first, then "
                               "offload_weights again")
        if not self.was_on_device:
            self.offload()


def _unpack(x):
    if isinstance(x, tuple) and len(x) == 7 and x[0] == "ferry-weight":
        _, layer, i, size, stride, offset, cast = x
        _mark_backward(layer.owner)
        layer.load()
        layer.kept_for_step = True
        w = layer.params[i].detach()
        if cast is not None:
            w = w.to(cast)  # autocast's cast, made again (the same rounding)
        return w.as_strided(size, stride, offset)
    if isinstance(x, tuple) and len(x) == 3 and x[0] == "ferry-outer":
        return x[1](x[2])
    return x


def _reload_for_step(me):
    """Before an optimizer step: offloaded layers whose parameters have
    gradients come back (a no-grad forward after backward sent them away)."""
    w = me()
    if w is None:
        return
    for ly in w.layers:
        if not ly.on_device and any(p.grad is not None for p in ly.params):
            ly.load()
            ly.kept_for_step = True


class _ForwardInHooks:
    """The layer's forward as an instance attribute: an object, not a
    closure, so that copy.deepcopy of the model (swa_utils.AveragedModel,
    an EMA copy) rebinds it to the copy's layer and module; a closure would
    be shared and run the original module on the copy's inputs."""

    def __init__(self, layer, orig):
        self.layer, self.orig = layer, orig
        functools.update_wrapper(self, orig)

    def __call__(self, *args, **kwargs):
        return self.layer.forward(self.orig, *args, **kwargs)


def _forward_in_hooks(layer, orig):
    return _ForwardInHooks(layer, orig)


def _tensors(out):
    if torch.is_tensor(out):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


class WeightOffload:
    """What offload_weights did: ``layers`` (in order), counters ``offloads``
    and ``reloads``, ``choices`` (a policy's answer per block, or None);
    ``remove()`` brings every weight back and drops the hooks."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[Union[torch.nn.Module, str]],
                 double_buffer: bool) -> None:
        mods = []
        named = dict(model.named_modules())
        for ly in layers:
            if isinstance(ly, str):
                if ly not in named:
                    raise KeyError("offload_weights: no module named %r in the model" % ly)
                ly = named[ly]
            if not isinstance(ly, torch.nn.Module):
                raise TypeError("offload_weights: layers are modules or their names, got %r"
                                % type(ly).__name__)
            mods.append(ly)
        if len({id(m) for m in mods}) != len(mods):
            raise ValueError("offload_weights: a layer is listed twice")
        owner_of = {}
        for m, name in zip(mods, [ly if isinstance(ly, str) else type(ly).__name__
                                  for ly in layers]):
            for p in m.parameters():
                if id(p) in owner_of:
                    raise ValueError("offload_weights: a parameter of %s is also in %s (tied "
                                     "weights, or one layer inside another, are not supported)"
                                     % (name, owner_of[id(p)]))
                owner_of[id(p)] = name
        chosen = set(owner_of)
        inside = {id(s) for m in mods for s in m.modules()}
        for name, m in model.named_modules():
            if id(m) in inside:
                continue
            for pn, p in m._parameters.items():
                if p is not None and id(p) in chosen:
                    raise ValueError("offload_weights: parameter %s.%s is shared with a module "
                                     "that is not offloaded (tied weights are not supported)"
                                     % (name, pn))
        self.double_buffer = bool(double_buffer)
        self.choices = None
        self.offloads = self.reloads = 0
        self.backward_running = False  # torch 1.13's stand-in for the graph task id
        self.stream = None
        if any(p.is_cuda for m in mods for p in m.parameters()):
            self.stream = torch.cuda.Stream()
        self.layers = [_Layer(self, i, m) for i, m in enumerate(mods)]
        self._handles = []
        self._forwards = []  # (module, our forward, the instance's own forward or None)
        for ly in self.layers:
            mod = ly.module
            self._handles.append(mod.register_forward_pre_hook(ly.pre_forward))
            self._handles.append(mod.register_forward_hook(ly.post_forward))
            own = mod.__dict__.get("forward")
            fwd = _forward_in_hooks(ly, mod.forward)
            mod.forward = fwd
            self._forwards.append((mod, fwd, own))
            for sub in mod.modules():
                if sub._parameters:
                    self._handles.append(sub._register_state_dict_hook(ly.state_dict_hook))
                    self._handles.append(sub._register_load_state_dict_pre_hook(
                        ly.load_pre_hook, with_module=True))
                    self._handles.append(sub.register_load_state_dict_post_hook(
                        ly.load_post_hook))
            ly.offload()
        reg = getattr(sys.modules.get("torch.optim.optimizer"), "register_optimizer_step_pre_hook",
                      None)
        if reg is not None:  # torch 2.x: any step finds the weights it updates on the device
            me = weakref.ref(self)
            h = reg(lambda opt, args, kwargs: _reload_for_step(me))
            self._handles.append(h)
            weakref.finalize(self, h.remove)  # a global hook: gone with this object

    def __deepcopy__(self, memo):
        """copy.deepcopy of the model copies this too (through its hooks):
        the copy's layers hold copies of the host buffers; a CUDA side
        stream is not copied but made anew."""
        new = WeightOffload.__new__(WeightOffload)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            setattr(new, k, None if k == "stream" else copy.deepcopy(v, memo))
        if self.stream is not None:
            new.stream = torch.cuda.Stream()
        return new

    def neighbour(self, index: int, step: int) -> Optional[_Layer]:
        j = index + step
        return self.layers[j] if 0 <= j < len(self.layers) else None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for mod, fwd, own in self._forwards:
            if mod.__dict__.get("forward") is fwd:
                if own is None:
                    del mod.forward
                else:
                    mod.forward = own
        self._forwards = []
        for ly in self.layers:
            ly.load()
            for p in ly.params:
                p.__dict__.pop("_ferry_weight_offload", None)


def offload_weights(model: torch.nn.Module,
                    layers: Optional[Sequence[Union[torch.nn.Module, str]]] = None,
                    double_buffer: bool = True, policy: Any = None) -> WeightOffload:
    """Keep the parameters of ``layers`` (modules of model, or their names,
    in forward order) on the host between uses; returns a WeightOffload.
    Or ``policy`` (a Lua policy with ``resident(r)``) chooses them among the
    model's repeated blocks."""
    if (layers is None) == (policy is None):
        raise TypeError("offload_weights: give layers or policy (one of them)")
    choices = None
    if policy is not None:
        choices = _resident.choose_layers(policy, model)
        layers = [c.name for c in choices if c.host]
    w = WeightOffload(model, layers, double_buffer)
    w.choices = choices
    return w
