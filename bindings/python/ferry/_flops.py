"""ferry._flops — what a recording ``ferry.torch.offload`` context adds to
the trace so that ``ferry sim`` replays it honestly on another machine
(docs/pytorch.md, "Recording a trace for the simulator"):

* the **FLOPs** of the matrix products the trainer runs, counted per call
  by a ``torch.overrides.TorchFunctionMode`` that is pushed only while a
  recording context is entered (nothing is installed otherwise), and, for
  backward, by a hook on each counted output's gradient;
* the **device memory held for the whole step** (parameters, gradients,
  optimizer states, buffers), declared between steps.

Counted (multiply-adds as 2 FLOPs, the convention of
``torch.utils.flop_counter``): ``F.linear`` (so ``nn.Linear``),
``torch.matmul``/``@``/``mm``/``bmm``/``addmm``/``baddbmm``,
``F.conv1d/2d/3d`` and ``F.conv_transpose1d/2d/3d``,
``F.scaled_dot_product_attention`` (full L x S, a causal mask included) and
``F.multi_head_attention_forward`` (``nn.MultiheadAttention``: input and
output projections and both attention products). Backward: for a linear,
matmul or convolution the forward's FLOPs once per operand that requires a
gradient (the input's gradient, the weight's); for attention twice the
forward (the four products of its gradients; torch.utils.flop_counter counts
2.5x, the fused kernels' recompute of the scores included). Not counted: elementwise ops, norms, softmax, losses, the
optimizer, bias gradients, ``einsum``, and what runs outside the context
(activation-checkpointing recomputes in backward). Only calls made at the
top level are seen: a counted function's own inner calls are not counted
again.

Attribution: a forward call's FLOPs go to the next traced event (the call's
compute lies between its saved tensors and that event). A backward's FLOPs
are held until the next counted output's gradient is ready (the previous
backward's compute is done by then) and go to the event after that; the
last ones go with the step's end (backward_end)."""
from __future__ import annotations

import inspect
import math
import threading
from typing import Any, Dict, Optional

import torch
from torch.overrides import TorchFunctionMode

from ._ferry import FerryError

_COUNTED_MODULES = (torch.nn.Linear, torch.nn.modules.conv._ConvNd, torch.nn.MultiheadAttention)


def has_counted_modules(model: Optional[torch.nn.Module]) -> bool:
    """Whether model holds a module whose compute ferry counts."""
    return model is not None and any(isinstance(m, _COUNTED_MODULES) for m in model.modules())


def _rg(t):
    return isinstance(t, torch.Tensor) and t.requires_grad


def _product(a, b, out):
    """a @ b (any batch): 2 * out elements * contraction length."""
    k = a.shape[-1] if a.dim() else 1
    fwd = 2.0 * out.numel() * k
    return fwd, fwd * (_rg(a) + _rg(b)), out


def _matmul(args, kwargs, out):
    return _product(args[0], args[1], out)


def _rmatmul(args, kwargs, out):  # other @ self
    return _product(args[1], args[0], out)


def _addmm(args, kwargs, out):  # (input, a, b)
    a = args[1] if len(args) > 1 else kwargs["mat1" if "mat1" in kwargs else "batch1"]
    b = args[2] if len(args) > 2 else kwargs["mat2" if "mat2" in kwargs else "batch2"]
    return _product(a, b, out)


def _linear(args, kwargs, out):
    x = args[0] if args else kwargs["input"]
    w = args[1] if len(args) > 1 else kwargs["weight"]
    fwd = 2.0 * out.numel() * w.shape[-1]
    return fwd, fwd * (_rg(x) + _rg(w)), out


def _conv(args, kwargs, out):
    x = args[0] if args else kwargs["input"]
    w = args[1] if len(args) > 1 else kwargs["weight"]
    fwd = 2.0 * out.numel() * w[0].numel()  # per output: in/groups * kernel
    return fwd, fwd * (_rg(x) + _rg(w)), out


def _conv_transpose(args, kwargs, out):
    x = args[0] if args else kwargs["input"]
    w = args[1] if len(args) > 1 else kwargs["weight"]
    fwd = 2.0 * x.numel() * w[0].numel()  # per input: out/groups * kernel
    return fwd, fwd * (_rg(x) + _rg(w)), out


def _sdpa(args, kwargs, out):
    q = args[0] if args else kwargs["query"]
    k = args[1] if len(args) > 1 else kwargs["key"]
    v = args[2] if len(args) > 2 else kwargs["value"]
    rows = out.numel() // out.shape[-1]  # batch * heads * L
    fwd = 2.0 * rows * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return fwd, 2 * fwd, out


_MHA_SIG = None


def _mha(args, kwargs, out):
    global _MHA_SIG
    if _MHA_SIG is None:
        _MHA_SIG = inspect.signature(torch.nn.functional.multi_head_attention_forward)
    a = _MHA_SIG.bind(*args, **kwargs).arguments
    q, k, v = a["query"], a["key"], a["value"]
    e = int(a["embed_dim_to_check"])
    n = q.shape[1] if q.dim() == 3 else 1
    lq, sk = q.shape[0], k.shape[0]
    s = sk + (a.get("bias_k") is not None) + bool(a.get("add_zero_attn"))
    proj = 2.0 * n * (lq * e * e + sk * k.shape[-1] * e + sk * v.shape[-1] * e + lq * e * e)
    attn = 2.0 * 2 * n * lq * s * e
    res = out[0] if isinstance(out, (tuple, list)) else out
    return proj + attn, 2 * (proj + attn), res


_RULES = {
    "linear": _linear,
    "matmul": _matmul, "__matmul__": _matmul, "mm": _matmul, "bmm": _matmul,
    "__rmatmul__": _rmatmul,
    "addmm": _addmm, "baddbmm": _addmm,
    "conv1d": _conv, "conv2d": _conv, "conv3d": _conv,
    "conv_transpose1d": _conv_transpose, "conv_transpose2d": _conv_transpose,
    "conv_transpose3d": _conv_transpose,
    "scaled_dot_product_attention": _sdpa,
    "multi_head_attention_forward": _mha,
}


def count(func, args, kwargs, out):
    """(forward FLOPs, backward FLOPs, the output whose gradient starts the
    backward) of one call, or None where ferry does not count it."""
    rule = _RULES.get(getattr(func, "__name__", None))
    if rule is None:
        return None
    try:
        fwd, bwd, res = rule(args, kwargs or {}, out)
    except (LookupError, AttributeError, TypeError, IndexError):
        return None  # a signature of another torch: not counted
    if not (fwd >= 0 and math.isfinite(fwd)):
        return None
    return fwd, bwd, res


class Counter:
    """The FLOP bookkeeping of one recording engine: the total counted (for
    tests and stats) and the backward FLOPs waiting to be attributed."""

    def __init__(self, engine):
        self.engine = engine
        self.pending = 0.0
        self.forward = 0.0
        self.backward = 0.0
        self.all_on = False
        self.lock = threading.Lock()  # backward may run on autograd's device threads

    def count_all(self):
        """From now on every traced event carries flops (ferry_trace_flops_all)."""
        if not self.all_on and not self.engine.closed:
            self.engine.trace_flops_all(True)
            self.all_on = True

    def add(self, flops):
        if flops > 0 and not self.engine.closed:
            try:
                self.engine.trace_flops(flops)
            except FerryError:
                pass  # the engine closed meanwhile: nothing to record into

    def op(self, fwd, bwd, res):
        self.count_all()
        self.forward += fwd
        self.add(fwd)
        if bwd > 0 and isinstance(res, torch.Tensor) and res.requires_grad and torch.is_grad_enabled():
            try:
                res.register_hook(self._hook(bwd))
            except RuntimeError:
                pass  # a tensor that takes no hooks: its backward is not counted

    def _hook(self, flops):
        def hook(grad):
            # The backward before this one is done: its FLOPs go to the next event.
            with self.lock:
                done, self.pending = self.pending, flops
                self.backward += flops
            self.add(done)
        return hook

    def flush(self):
        """At the step's end: the last backward's FLOPs."""
        with self.lock:
            done, self.pending = self.pending, 0.0
        self.add(done)


_active = threading.local()


class FlopMode(TorchFunctionMode):
    """Counts the calls of _RULES into a Counter. One at a time per thread:
    a second recording context entered inside the first counts nothing more."""

    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self.counter = counter
        self.pushed = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        c = count(func, args, kwargs, out)
        if c is not None:
            self.counter.op(*c)
        return out

    def __enter__(self):
        if getattr(_active, "mode", None) is not None:
            return self
        _active.mode = self
        self.pushed = True
        return super().__enter__()

    def __exit__(self, *exc):
        if not self.pushed:
            return False
        self.pushed = False
        _active.mode = None
        return super().__exit__(*exc)


# ---- resident memory -----------------------------------------------------------------
def _nbytes(t):
    return t.numel() * t.element_size()


def _state_tensors(opt, seen):
    total = 0
    for st in opt.state.values():
        if not isinstance(st, dict):
            continue
        for v in st.values():
            # 0-dim counters (Adam's step) are bookkeeping, not state memory
            if isinstance(v, torch.Tensor) and v.dim() > 0 and id(v) not in seen:
                seen.add(id(v))
                total += _nbytes(v)
    return total


def resident(model: Optional[torch.nn.Module], optimizer: Any) -> Dict[str, int]:
    """{what: bytes} of device memory held for the whole step: "parameters"
    (as they are now), "gradients" (each parameter that requires one: its
    .grad's size, or the parameter's before the first backward), "buffers"
    (when there are some) and, with an optimizer, "optimizer states": every
    tensor of at least one dimension in its state (AdamW: exp_avg and
    exp_avg_sq), the host share of offload_optimizer included (replay with
    ferry sim --optimizer-fraction to move it)."""
    out = {}
    if model is not None:
        params = list(model.parameters())
        out["parameters"] = sum(_nbytes(p) for p in params)
        out["gradients"] = sum(_nbytes(p.grad if p.grad is not None else p)
                               for p in params if p.requires_grad)
        nbuf = sum(_nbytes(b) for b in model.buffers())
        if nbuf:
            out["buffers"] = nbuf
    if optimizer is not None:
        seen = set()
        total = _state_tensors(optimizer, seen)
        off = getattr(optimizer, "ferry_offload", None)
        if off is not None and getattr(off, "host_opt", None) is not None:
            total += _state_tensors(off.host_opt, seen)
        out["optimizer states"] = total
    return out
