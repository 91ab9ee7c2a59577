"""ferry.torch — offload a PyTorch model's saved activations through ferry.

    import ferry.torch
    for batch in data:
        with ferry.torch.offload(model, policy="default"):
            loss = model(batch)
        loss.backward()          # may run after the with block
        opt.step(); opt.zero_grad()
    ferry.torch.step()           # end the last step (stats back to zero)

How it works: the context installs torch.autograd.graph.saved_tensors_hooks
whose pack/unpack hooks are C callables of the extension (no Python frame
per saved tensor), and module forward pre/post hooks (also C) that keep the
stack of modules, so each saved tensor is described to the policy with its
module path and class, the index of the repeated block it belongs to and
the block count, and whether it is (a view of) a parameter or buffer.

Engines are kept per configuration (backend, trace, caps, knobs) and reused
across steps; the policy can change between steps (hot swap). Each entry
of the context starts a step (steps="auto"), ending the previous one.

Defaults come from the environment `ferry run` sets: FERRY_POLICY,
FERRY_TRACE, FERRY_CHROME_TRACE, FERRY_HOST_CAP, FERRY_BACKEND,
FERRY_RELEASE_COPIED, FERRY_PREFETCH_AT_BACKWARD (arguments win).

While recording a trace (record_trace=), and only then, the context also
writes what the simulator needs to replay the run on another machine: the
FLOPs of the matrix products (ferry/_flops.py) and the device memory held
for the whole step (parameters, gradients, optimizer states).
"""
from __future__ import annotations

import importlib
import os
import threading
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import _flops
from . import _inplace
from ._model import _compiled_in_place, _find_blocks, _is_compiled, _named_sites, _uncompiled  # noqa: F401
from ._policy import PolicyLike
import ferry as _pkg
from . import _session as _sessmod
from ._ferry import FerryError
from ._ferry import getenv_many as _getenv_many
from ._session import ENGINE_KNOBS as _ENGINE_KNOBS
from ._session import Session as _Session  # noqa: F401 (old name)
from ._session import parse_cap as _parse_cap
from ._session import session_for as _session_for
from ._session import sessions as _sessions
# Checkpoint staging (ferry/checkpoint.py, docs/checkpoints.md).
from .checkpoint import CheckpointError, Snapshot, snapshot

__all__ = ["offload", "step", "set_policy", "stats", "close", "engine", "model_sites", "snapshot",
           "Snapshot", "CheckpointError", "offload_optimizer", "OptimizerOffload",
           "offload_weights", "WeightOffload", "OffloadActivations", "NoOffload"]

def _load_tensor_facts():
    """The hooks' one-call tensor reader, when ferry was built against this
    very torch (ext/torch_facts.h): the module _torchfacts_<torch version>,
    else torch's getters. $FERRY_TORCH_FACTS=0 keeps the getters."""
    if os.environ.get("FERRY_TORCH_FACTS", "1") == "0":
        return None
    name = "_torchfacts_" + "".join(c if c.isalnum() else "_" for c in torch.__version__)
    try:
        mod = importlib.import_module("." + name, __package__)
    except ImportError:
        return None
    if mod.torch_version != torch.__version__:
        return None
    _pkg._ferry.set_tensor_facts(mod.api)
    return mod


_tensor_facts = _load_tensor_facts()


def _profiler_enabled():
    """Whether torch's profiler is recording (checked once per offload
    entry: the hooks then wrap engine calls in record_function ranges)."""
    try:
        return bool(torch._C._autograd._profiler_enabled())
    except AttributeError:  # a torch without it: no ranges
        return False


# ---- configuration --------------------------------------------------------
def _resolve_backend(backend, model):
    if backend is None:
        backend = os.environ.get("FERRY_BACKEND") or "auto"
    if backend not in ("auto", "host", "cuda"):
        raise ValueError(f"ferry: backend {backend!r} is not one of 'auto', 'host', 'cuda'")
    on_cuda = False
    device = -1
    if model is not None:
        for p in model.parameters():
            on_cuda = p.is_cuda
            device = p.get_device() if on_cuda else -1
            break
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() and (model is None or on_cuda) else "host"
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise FerryError("ferry: backend='cuda' but this torch sees no GPU "
                             f"(torch {torch.__version__}); use backend='host' or 'auto'",
                             "FERRY_ENODEV")
        if device < 0:
            device = torch.cuda.current_device()
    return backend, device


def _default_node_cap_name():
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        tag = run
    else:
        tag = "%s_%s" % (os.environ.get("MASTER_ADDR", "local"), os.environ.get("MASTER_PORT", "0"))
    return "ferry-cap-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in tag)[:80]


# ---- model description -----------------------------------------------------
def model_sites(model: torch.nn.Module) -> List[Tuple[str, str, int]]:
    """[(module, path, class, layer, layer_count)] for every module of model,
    as the policy will see them. Inside a torch.compile'd module there are
    no sites (see _named_sites): its tensors carry its own path and layer."""
    cpath, blocks = _find_blocks(model)
    count = len(blocks)
    prefix = (cpath + ".") if cpath else ""
    out = []
    for path, m, cls in _named_sites(model):
        layer = -1
        if cpath is not None and path.startswith(prefix) and len(path) > len(prefix):
            layer = blocks.get(path[len(prefix):].split(".", 1)[0], -1)
        out.append((m, path, cls, layer, count if cpath is not None else 0))
    return out


def _local(t):
    """A DTensor's (FSDP2's sharded parameter's) local shard, t otherwise:
    a DTensor has no storage of its own to read."""
    to_local = getattr(t, "to_local", None)
    plain = type(t) in (torch.Tensor, torch.nn.Parameter)
    return t if plain or to_local is None else to_local()


def _storage_range(t):
    try:
        st = t.untyped_storage()
    except AttributeError:  # torch < 2.0
        st = t.storage()
    return st.data_ptr(), st.nbytes()


def _param_ranges(model):
    out, seen = [], set()
    for is_buffer, tensors in ((False, model.parameters()), (True, model.buffers())):
        for t in tensors:
            try:
                ptr, n = _storage_range(_local(t))
            except RuntimeError:  # a tensor subclass without storage: known by its type
                continue
            if ptr and (ptr, n) not in seen:
                seen.add((ptr, n))
                out.append((ptr, n, is_buffer))
    return out


class _ModelHooks:
    """The C site hooks of one model in one engine."""

    def __init__(self, engine, model):
        sites = model_sites(model)
        first = engine.add_sites([s[1:] for s in sites])
        self.pairs = [(weakref.ref(s[0]),) + tuple(engine.site_hooks(first + i))
                      for i, s in enumerate(sites)]

    def install(self):
        handles = []
        for ref, pre, post in self.pairs:
            m = ref()
            if m is not None:
                handles.append(m.register_forward_pre_hook(pre))
                handles.append(m.register_forward_hook(post))
        return handles


# The environment variables offload() derives its configuration from
# (directly, or through the policy search path, the on/off knobs and the
# node cap's name and share).
_ENV_READ = ("FERRY_POLICY", "FERRY_POLICY_DIR", "FERRY_TRACE", "FERRY_CHROME_TRACE",
             "FERRY_HOST_CAP", "FERRY_NODE_HOST_CAP", "FERRY_NODE_CAP_NAME",
             "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
             *_sessmod.SWITCH_KNOBS.values())
# (arguments, those variables) -> _derive's result
_derived: Dict[Any, Any] = {}


def _derive(policy, backend, device, record_trace, chrome_trace, reasons, host_cap, node_host_cap,
            node_cap_name, knobs):
    """offload()'s policy path, the policy a new session starts with, the
    engine configuration, the node cap and the session's key:
    (policy_path, initial, cfg, node_spec, session key)."""
    # No policy named: the session's (ferry.torch.set_policy's) stays in
    # force; a new session starts with $FERRY_POLICY or "default".
    policy_path = _pkg.policy_path(policy) if policy else None
    initial = policy_path or _pkg.policy_path(os.environ.get("FERRY_POLICY") or "default")
    if record_trace is None:
        record_trace = os.environ.get("FERRY_TRACE") or None
    if chrome_trace is None:
        chrome_trace = os.environ.get("FERRY_CHROME_TRACE") or None
    cap_bytes, cap_pct = _parse_cap(host_cap if host_cap is not None
                                    else os.environ.get("FERRY_HOST_CAP") or None, "host_cap")
    cfg = dict(_sessmod.parse_knobs(knobs), backend=backend, device=device,
               host_cap_bytes=cap_bytes, host_cap_pct=cap_pct)
    if _sessmod.fixed_knobs(knobs):
        cfg["knobs_fixed"] = _sessmod.fixed_knobs(knobs)
    if record_trace:
        cfg["trace_path"] = os.path.abspath(os.fspath(record_trace))
    if chrome_trace:
        cfg["chrome_trace_path"] = os.path.abspath(os.fspath(chrome_trace))
    if reasons:
        cfg["count_reasons"] = True
    if "link" in cfg and cfg["link"] is not None:
        cfg["link"] = tuple(float(x) for x in cfg["link"])
    node_spec = None
    if node_host_cap is not None or os.environ.get("FERRY_NODE_HOST_CAP"):
        nb, npct = _parse_cap(node_host_cap if node_host_cap is not None
                              else os.environ["FERRY_NODE_HOST_CAP"], "node_host_cap")
        if npct:
            with open("/proc/meminfo") as f:
                total = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemTotal:"))
            nb = int(total * npct / 100)
        node_spec = (node_cap_name or os.environ.get("FERRY_NODE_CAP_NAME")
                     or _default_node_cap_name(), nb)
    return policy_path, initial, cfg, node_spec, _sessmod.session_key(cfg, node_spec)


class offload:
    """Context manager offloading what `model` saves for backward.

    offload(model, policy=None, backend=None, *, record_trace=None,
            chrome_trace=None, reasons=False, host_cap=None,
            node_host_cap=None, node_cap_name=None, steps="auto", **knobs)

    policy: a shipped policy name ("default", "layers", "fraction", "ramcap",
        "budget") or a path to a Lua file; default $FERRY_POLICY or "default".
        An unknown name or a missing file raises before anything runs.
    backend: "auto" (cuda when the model is on a GPU, else host), "host",
        "cuda"; default $FERRY_BACKEND or "auto".
    record_trace: write the engine's JSONL trace there (docs/trace-format.md);
        default $FERRY_TRACE. While tracing, every saved tensor reaches the
        engine (the small-tensor fast path is off) so the trace is complete,
        the FLOPs of linear layers, matmuls, convolutions and attention are
        counted (a TorchFunctionMode inside the context, gradient hooks on
        their outputs) so that `ferry sim` times compute at the simulated
        GPU's rate, and the device memory held for the whole step is
        declared at each step's beginning: the model's parameters,
        gradients and buffers, and the optimizer's states.
    optimizer: the model's torch optimizer (also one patched by
        offload_optimizer), whose states the trace declares; used only while
        recording a trace.
    chrome_trace: write a Chrome trace (Perfetto, chrome://tracing) of the
        run there: a lane per calling thread and per copy stream, each copy
        with its observed start and end, offload -> reload arrows, counters
        (docs/pytorch.md#perfetto-traces); default $FERRY_CHROME_TRACE. Valid
        JSON after every step end; complete once the engine is closed
        (ferry.torch.close(), or at exit).
    reasons: count every saved tensor by the rule that decided it and by
        layer, for ferry.torch.stats(by="rule") and stats(by="layer"). Each
        decision then goes through the policy's explain (slower than
        decide) and every saved tensor reaches the engine (no small-tensor
        fast path): for looking at a policy, not for production steps.
    host_cap: pinned host memory cap, bytes or "16G"/"40%"; default
        $FERRY_HOST_CAP.
    node_host_cap: a cap shared by the processes of this node (DDP local
        ranks) through shared memory named node_cap_name.
    steps: "auto" — each entry ends the previous step and starts one;
        "manual" — call ferry.torch.step() yourself.
    knobs: min_offload_bytes, max_fwd_stash, prefetch_distance,
        link=(d2h_B_per_s, h2d_B_per_s, latency_us, duplex), arena
        ("auto"/"jemalloc"/"pool"), policy_trusted, fast_keep,
        release_when_copied (True: a forward-stash buffer is released at the
        first pack after its copy to the host completed; default
        $FERRY_RELEASE_COPIED, else False), prefetch_at_backward_begin
        (True: the policy's first reloads start when backward begins;
        default $FERRY_PREFETCH_AT_BACKWARD, else False).
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 policy: Optional[PolicyLike] = None, backend: Optional[str] = None, *,
                 record_trace: Optional[str] = None, chrome_trace: Optional[str] = None,
                 reasons: bool = False, host_cap: Optional[Union[int, str]] = None,
                 node_host_cap: Optional[Union[int, str]] = None,
                 node_cap_name: Optional[str] = None, steps: Union[str, bool] = "auto",
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 **knobs: Any) -> None:
        unknown = set(knobs) - _ENGINE_KNOBS
        if unknown:
            raise TypeError(f"ferry.torch.offload: unknown knob(s) {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(sorted(_ENGINE_KNOBS))}")
        if steps not in ("auto", "manual"):
            raise ValueError(f"ferry.torch.offload: steps={steps!r} is not 'auto' or 'manual'")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"ferry.torch.offload: model must be a torch.nn.Module, not {type(model).__name__}")
        if _is_compiled(model) and _find_blocks(_uncompiled(model))[0] is not None:
            warnings.warn(
                "ferry.torch.offload: the model is torch.compile'd as a whole, so its saved tensors "
                "reach ferry without a module path or layer (layer -1) and layer rules cannot apply; "
                "compile each block instead (for block in model.layers: block.compile()), as "
                "torchtitan does, to keep per-layer decisions", stacklevel=2)
        if isinstance(optimizer, OptimizerOffload):
            optimizer = optimizer.opt
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("ferry.torch.offload: optimizer must be a torch.optim.Optimizer, not "
                            f"{type(optimizer).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.steps = steps
        backend, device = _resolve_backend(backend, model)
        args = (policy, backend, device, record_trace, chrome_trace, reasons, host_cap,
                node_host_cap, node_cap_name, tuple(sorted(knobs.items())))
        try:  # a training loop makes the same context every step: derive it once
            key = (args, _getenv_many(_ENV_READ), os.getcwd())  # relative paths
            derived = _derived.get(key)
        except TypeError:  # an unhashable argument (a list): derived every time
            key = derived = None
        if derived is None:
            derived = _derive(*args[:-1], knobs)  # args[-1]: the knobs as a key
            if key is not None:
                if len(_derived) >= 64:
                    _derived.clear()
                _derived[key] = derived
        self.policy_path, initial, cfg, node_spec, skey = derived
        self.session = _session_for(initial, cfg, node_spec, skey)
        self._ctx = None
        self._handles = ()
        self._flop_mode = None
        self._outer_ranges = None

    @property
    def engine(self) -> _pkg.Engine:
        return self.session.engine

    def __enter__(self):
        s = self.session
        # Nested in a context of the same engine: this one joins its step
        # (no step ends mid-forward) and adds its model's ranges to the
        # outer ones until it exits; the policy cannot change within a step.
        active = _active()
        outer = next((c for c in reversed(active) if c.session is s), None)
        if outer is not None:
            if self.policy_path and self.policy_path != s.policy_path:
                raise FerryError(
                    f"ferry.torch.offload(policy={self.policy_path!r}) nested inside a context "
                    f"of the same engine with policy {s.policy_path!r}: a policy cannot change "
                    "within a step; name the same policy, or none, in the inner context",
                    "FERRY_ESTATE")
        elif self.policy_path:
            s.set_policy(self.policy_path)
        resident = None
        count_flops = False
        if s.recording:
            if s.flops is None:
                s.flops = _flops.Counter(s.engine)
                # each backward's FLOPs go before its end in the trace
                s.engine.on_backward_end = s.flops.flush
            if s.device_peak is None and s.cfg.get("backend") == "cuda":
                # each step's own peak goes into the trace: a replay learns
                # from it what it cannot see of device memory (the allocator's
                # peak is reset as each recorded step begins; docs/pytorch.md)
                dev = s.cfg["device"]
                s.device_peak = (lambda: torch.cuda.reset_peak_memory_stats(dev),
                                 lambda: torch.cuda.max_memory_allocated(dev))
            # A Python mode inside compiled code would break its graphs: a
            # compiled model's trace keeps the recorded compute times.
            count_flops = self.model is None or not any(
                _is_compiled(m) or _compiled_in_place(m) for m in self.model.modules())
            if count_flops and _flops.has_counted_modules(self.model):
                s.flops.count_all()  # from this step's beginning (else: at the first count)
            if self.model is not None or self.optimizer is not None:
                resident = _flops.resident(self.model, self.optimizer)
        if outer is None and (self.steps == "auto" or not s.engine.in_step):
            s.begin_step(resident)
        self._outer_ranges = None
        if self.model is not None:
            ranges = _param_ranges(self.model)
            if outer is not None:
                self._outer_ranges = s.param_ranges
                ranges = s.param_ranges + [r for r in ranges if r not in s.param_ranges]
            s.engine.set_param_ranges(ranges)
            s.param_ranges = ranges
            self._handles = s.hooks_for(self.model, _ModelHooks).install()
        _inplace.prepare()  # before any hooks of ours are active
        s.engine.profile_ranges = _profiler_enabled()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(*s.engine.hooks())
        self._ctx.__enter__()
        if count_flops:
            self._flop_mode = _flops.FlopMode(s.flops)
            self._flop_mode.__enter__()
        _sessmod.current = s
        active.append(self)
        return self

    def __exit__(self, *exc):
        try:
            if self._flop_mode is not None:
                mode, self._flop_mode = self._flop_mode, None
                mode.__exit__(*exc)
            self._ctx.__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles = ()
            active = _active()
            if self in active:
                active.remove(self)
            s = self.session
            if self._outer_ranges is not None:  # the outer context's model again
                s.engine.set_param_ranges(self._outer_ranges)
                s.param_ranges, self._outer_ranges = self._outer_ranges, None
            if active:  # ft.step(), ft.stats() mean the enclosing context's engine
                _sessmod.current = active[-1].session
            s.check_policy()
        return False


# The offload contexts this thread entered and has not exited, innermost
# last (per thread, as torch's saved-tensor hooks are).
_contexts = threading.local()


def _active() -> List[offload]:
    stack = getattr(_contexts, "stack", None)
    if stack is None:
        stack = _contexts.stack = []
    return stack


# ---- module-level API -------------------------------------------------------------
def _session():
    s = _sessmod.current
    if s is None:
        raise FerryError("ferry.torch: no offload context has been entered yet", "FERRY_ESTATE")
    return s


def engine() -> _pkg.Engine:
    """The _ferry.Engine of the most recently entered offload context."""
    return _session().engine


def step() -> None:
    """End the current step: waits for outstanding copies, frees their host
    buffers. Returns the number of saved tensors still live (0 unless a
    graph is kept alive). Automatic at each context entry with steps="auto";
    call it after the last step, or every step with steps="manual"."""
    return _session().end_step()


def set_policy(policy: PolicyLike) -> None:
    """Swap the current engine's policy (a name or a path) between steps.
    The previous policy stays in force if the new one fails to load."""
    _session().set_policy(_pkg.policy_path(policy))


_BREAKDOWN_KEYS = {"rule": ("rule", "where"), "layer": ("layer",),
                   "rule,layer": ("rule", "where", "layer")}
_BREAKDOWN_COUNTS = ("tensors_offloaded", "bytes_offloaded", "tensors_kept", "bytes_kept")


def stats(by: Optional[str] = None) -> Any:
    """Engine stats (ferry_stats) plus the binding's counters as a dict:
    kept_small (fast path), kept_subclass, kept_sparse, kept_nested,
    kept_device, kept_non_dense, kept_ndim, kept_pack_error,
    recompute_packs, unpack_rebuilds, pack_errors, unpacks_repeated;
    and policy, backend, arena.

    by="rule", "layer" or "rule,layer": instead, the saved tensors since the
    engine was made, grouped so (needs offload(..., reasons=True)): a list
    of dicts with the group's keys (rule and where: the rule's name and the
    file:line it is written at; layer: -1 outside the repeated blocks) and
    tensors_offloaded, bytes_offloaded, tensors_kept, bytes_kept; largest
    bytes first. Engine-level outcomes have rules of their own:
    "min_offload_bytes", "host cap", "copy failed"."""
    s = _session()
    if by is not None:
        return _breakdown(s.engine, by)
    d = s.engine.stats()
    info = s.engine.info()
    d.update(policy=s.policy_path, backend=info["backend"], arena=info["arena"],
             policy_error=s.engine.policy_error())
    return d


def _breakdown(engine, by):
    keys = _BREAKDOWN_KEYS.get(by)
    if keys is None:
        raise ValueError(f"ferry.torch.stats: by={by!r} is not one of "
                         f"{', '.join(repr(k) for k in _BREAKDOWN_KEYS)}")
    try:
        rows = engine.breakdown()
    except FerryError:
        raise FerryError("ferry.torch.stats(by=...): the engine counts no reasons; enter the "
                         "context with ferry.torch.offload(..., reasons=True)",
                         "FERRY_ESTATE") from None
    groups: Dict[Tuple, Dict[str, Any]] = {}
    for r in rows:
        g = groups.setdefault(tuple(r[k] for k in keys),
                              dict({k: r[k] for k in keys}, **{c: 0 for c in _BREAKDOWN_COUNTS}))
        for c in _BREAKDOWN_COUNTS:
            g[c] += r[c]
    return sorted(groups.values(), key=lambda g: (-(g["bytes_offloaded"] + g["bytes_kept"]),
                                                  tuple(str(g[k]) for k in keys)))


def close() -> None:
    """End every engine's step and destroy the engines (tests, shutdown).
    Saved tensors still held by a graph become unusable."""
    for s in list(_sessions.values()):
        if not s.engine.closed:
            try:
                s.end_step()
            finally:
                s.engine.close()
    _sessions.clear()
    _sessmod.current = None


def __getattr__(name):
    # ferry.torch._current: the session now lives in ferry._session.
    if name == "_current":
        return _sessmod.current
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Optimizer-state offload (ferry/optim.py, docs/optimizer-offload.md).
from .optim import OptimizerOffload, offload_optimizer  # noqa: E402
# Weight offload (ferry/weights.py, docs/optimizer-offload.md).
from .weights import WeightOffload, offload_weights  # noqa: E402


# ---- torchtune's context managers, on ferry's engine ----------------------
# A torchtune or TRL recipe switches to ferry by changing one import:
#     from ferry.torch import OffloadActivations, NoOffload
# The arguments mean what they mean in torchtune (docs/pytorch.md); they are
# rendered into a policy, so they hold whatever a policy file would set.
_POLICY = """-- generated by ferry.torch.OffloadActivations: torchtune's rules
local R = require "ferry.rules"
return R.policy {{
  name = "torchtune",
  R.min_bytes({min_bytes}),
  R.exclude_params_and_buffers(),
  R.max_stash({stash}),
  reload = R.on_use(),
}}
"""


def _policy_file(min_offload_size, max_fwd_stash_size):
    """The policy for these arguments: a ferry.Policy, so its file lives in
    the user's private policy cache (never a shared temporary directory,
    where another user could plant a file of the same name first)."""
    src = _POLICY.format(min_bytes=int(min_offload_size), stash=int(max_fwd_stash_size))
    return _pkg.Policy(src, "torchtune")


class OffloadActivations:
    """torchtune's ``OffloadActivations(use_pin_memory=True, use_streams=True,
    max_fwd_stash_size=5, min_offload_size=1024)``: saved activations of at
    least ``min_offload_size`` bytes (parameters and buffers never) go to
    ferry's pinned host arena, ``max_fwd_stash_size`` of them stay alive on
    device while their copies run, and backward brings them back.

    ``use_pin_memory`` and ``use_streams`` are accepted for compatibility:
    ferry's arena is always pinned and its copies always run on their own
    streams (False for either is honoured by warning that it is not needed).
    ``model`` (optional) lets decisions know module paths and layers;
    ``backend`` as in ``ferry.torch.offload``."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True,
                 max_fwd_stash_size: int = 5, min_offload_size: int = 1024, *,
                 model: Optional[torch.nn.Module] = None, backend: Optional[str] = None) -> None:
        if not isinstance(max_fwd_stash_size, int) or isinstance(max_fwd_stash_size, bool) \
                or max_fwd_stash_size < 1:
            # torchtune refuses 0 too: some activation must stay alive while
            # its copy runs (ferry.policy(max_stash=0) is the engine's own knob)
            raise ValueError(f"OffloadActivations: max_fwd_stash_size={max_fwd_stash_size!r} "
                             "must be a whole number >= 1, as in torchtune")
        if not isinstance(min_offload_size, int) or isinstance(min_offload_size, bool) \
                or min_offload_size < 0:
            raise ValueError(f"OffloadActivations: min_offload_size={min_offload_size!r} "
                             "must be a whole number of bytes >= 0")
        if not use_pin_memory or use_streams is False:
            warnings.warn("ferry: OffloadActivations always uses pinned memory and copy streams; "
                          "use_pin_memory/use_streams=False change nothing", RuntimeWarning,
                          stacklevel=2)
        self.max_fwd_stash_size = max_fwd_stash_size
        self.min_offload_size = min_offload_size
        self._ctx = offload(model, policy=_policy_file(min_offload_size, max_fwd_stash_size),
                            backend=backend)

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


class NoOffload(torch.autograd.graph.saved_tensors_hooks):
    """torchtune's ``NoOpManager``: inside an offloading region, keep what
    this region saves on device (e.g. around the output head, whose
    activations backward needs first). The innermost saved-tensor hooks win,
    so these identity hooks shadow ferry's for the region."""

    def __init__(self) -> None:
        super().__init__(lambda t: t, lambda t: t)
