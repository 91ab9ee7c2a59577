"""Where ferry.checkpoint fences a snapshot at an optimizer step
(docs/checkpoints.md, "What is fenced").

A step that is given a closure (Lightning's way: optimizer.step(closure))
runs the closure's forward and backward first; they only read the state,
so the fence goes after the closure returns and the copies overlap them.
torch 1.13 has no global optimizer step pre-hook: register_global_step_pre_hook
then wraps the step of every torch.optim.Optimizer subclass (and of those
defined later) once per process."""
from __future__ import annotations

import functools
import gc
import importlib
import itertools
import weakref

import torch


def fence_after_closure(fence, args, kwargs, at=1):
    """For a step pre-hook: the step's (args, kwargs) with its closure
    (kwargs["closure"] or args[at]: torch's hooks get the optimizer as
    args[0]) wrapped to call fence() when it returns, or None after calling
    fence() now when the step has no closure. torch's optimizers call the
    closure before they change anything."""
    closure = kwargs.get("closure") if "closure" in kwargs else (
        args[at] if len(args) > at else None)
    if not callable(closure):
        fence()
        return None

    def fenced_closure(*a, **k):
        try:
            return closure(*a, **k)
        finally:
            fence()

    if "closure" in kwargs:
        return tuple(args), dict(kwargs, closure=fenced_closure)
    return tuple(args[:at]) + (fenced_closure,) + tuple(args[at + 1:]), dict(kwargs)


# ---- torch 1.13: a global step pre-hook of ferry's own -------------------------------
_hooks = {}  # key -> hook(optimizer, args, kwargs) -> None or (args, kwargs)
_keys = itertools.count()
_classes_wrapped = False


class _Handle:
    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key

    def remove(self):
        _hooks.pop(self.key, None)


def _wrap_step(cls):
    step = cls.__dict__.get("step")
    if step is None or getattr(step, "_ferry_fences", False):
        return

    # functools.wraps keeps torch 1.13's "hooked" mark: its profiler wrapper
    # then goes around this one, or is already inside it
    @functools.wraps(step)
    def step_after_hooks(*args, **kwargs):  # args[0]: the optimizer, as torch's hooks get it
        args, kwargs = _run_hooks(args[0], args, kwargs)
        return step(*args, **kwargs)

    step_after_hooks._ferry_fences = True
    cls.step = step_after_hooks


def _run_hooks(optimizer, args, kwargs):
    for hook in list(_hooks.values()):
        result = hook(optimizer, args, kwargs)
        if result is not None:
            args, kwargs = result
    return args, kwargs


def _wrap_instance_step(opt):
    """An optimizer whose step an LR scheduler already wrapped on the
    instance (torch 1.13's with_counter keeps the class's step of that
    time, so the class wrap never runs for it): wrap that step too."""
    step = opt.__dict__.get("step")
    if not callable(step) or getattr(step, "_ferry_fences", False):
        return

    opt_ref = weakref.ref(opt)  # as the scheduler's: no cycle keeps the state alive

    @functools.wraps(step)  # keeps _with_counter: the scheduler does not warn
    def step_after_hooks(*args, **kwargs):
        me = opt_ref()
        args, kwargs = _run_hooks(me, (me,) + tuple(args), kwargs)
        return step(*args[1:], **kwargs)

    step_after_hooks._ferry_fences = True
    opt.step = step_after_hooks


def _wrap_subclasses(cls):
    for sub in cls.__subclasses__():
        _wrap_step(sub)
        _wrap_subclasses(sub)


def _wrap_optimizer_classes():
    global _classes_wrapped
    if _classes_wrapped:
        return
    base = torch.optim.Optimizer
    _wrap_subclasses(base)
    previous = base.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kw):  # optimizers defined from now on
        if previous is not None:
            previous.__func__(cls, **kw)
        else:
            super(base, cls).__init_subclass__(**kw)
        _wrap_step(cls)

    base.__init_subclass__ = classmethod(__init_subclass__)
    for obj in gc.get_objects():  # once: optimizers made before, with a scheduler
        if issubclass(type(obj), base):  # not isinstance: __class__ of proxies warns
            _wrap_instance_step(obj)
    _classes_wrapped = True


def register_global_step_pre_hook(hook):
    """torch's register_optimizer_step_pre_hook where it exists (torch >=
    2.0), else ferry's: hook(optimizer, args, kwargs) before every step of
    every optimizer; returns a handle with remove()."""
    # torch.optim.optimizer is a submodule that torch 2.x does not always
    # bind as an attribute of torch.optim: import it
    optim_mod = importlib.import_module("torch.optim.optimizer")
    register = getattr(optim_mod, "register_optimizer_step_pre_hook", None)
    if register is not None:
        return register(hook)
    _wrap_optimizer_classes()
    key = next(_keys)
    _hooks[key] = hook
    return _Handle(key)
