"""ferry._session — the engines ferry.torch and ferry.checkpoint share.

One engine per configuration (backend, caps, knobs, node cap), kept and
reused across steps; `current` is the session of the offload context entered
last. Below ferry.torch and ferry.checkpoint, which both import it.
"""
import atexit
import os
import warnings
import weakref

from . import _ferry
from ._ferry import FerryError

ENGINE_KNOBS = {"min_offload_bytes", "max_fwd_stash", "max_fwd_stash_bytes", "prefetch_distance",
                "link", "arena", "policy_trusted", "fast_keep", "release_when_copied",
                "prefetch_at_backward_begin"}
# The on/off knobs of the engine's config that `ferry run` can set too: the
# environment variable each takes its default from (docs/pytorch.md).
SWITCH_KNOBS = {"release_when_copied": "FERRY_RELEASE_COPIED",
                "prefetch_at_backward_begin": "FERRY_PREFETCH_AT_BACKWARD"}
_SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True,
                 "0": False, "false": False, "no": False, "off": False}
# The knobs a policy can set too (ferry_knobs): given as keywords they win
# over the policy's (config.knobs_fixed), with one warning on a conflict.
POLICY_KNOB_BITS = {"max_fwd_stash": 0x1, "prefetch_distance": 0x2, "min_offload_bytes": 0x4,
                    "max_fwd_stash_bytes": 0x8}


def fixed_knobs(knobs):
    """config.knobs_fixed for the policy knobs given explicitly."""
    mask = 0
    for k in knobs:
        mask |= POLICY_KNOB_BITS.get(k, 0)
    return mask

sessions = {}  # configuration key -> Session
current = None  # Session of the offload context entered last


@atexit.register
def _finish_chrome_traces():
    """At exit, close the engines that write a Chrome trace, so the events
    after the last step end reach the file (it is valid JSON at every step
    end already). Their saved tensors are of no use any more. A forked child
    leaves its parent's engines alone (their copy threads are not its own)."""
    for s in list(sessions.values()):
        if s.cfg.get("chrome_trace_path") and not s.engine.closed and s.pid == os.getpid():
            s.engine.close()


# ---- configuration --------------------------------------------------------
def parse_cap(value, what):
    """bytes (int), "16G", "512MiB" or "40%" -> (bytes, pct)."""
    if value is None:
        return 0, 0.0
    if isinstance(value, bool):
        raise TypeError(f"ferry: {what} must be bytes or a string like '16G' or '40%'")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"ferry: {what} must be > 0 bytes, got {value}")
        return value, 0.0
    if isinstance(value, float):
        raise TypeError(f"ferry: {what}={value!r}: give whole bytes (int) or a string like '40%'")
    s = str(value).strip()
    if s.endswith("%"):  # the engine's own parser, as for --host-cap and FERRY_HOST_CAP
        return 0, _ferry.parse_number(what, s, _ferry.NUMBER_PERCENT, 0, 100, True)
    return int(_ferry.parse_number(what, s, _ferry.NUMBER_BYTES, 1, 2.0 ** 53)), 0.0


# The numeric knobs of offload(**knobs): (kind, min, max). Sizes also take
# "512K"-style strings; every value goes through the engine's parser, so a
# bad one is refused as the CLI refuses it, naming the keyword.
NUMERIC_KNOBS = {
    "max_fwd_stash": (_ferry.NUMBER_COUNT, 0, 1 << 20),
    "prefetch_distance": (_ferry.NUMBER_COUNT, 0, 4096),
    "min_offload_bytes": (_ferry.NUMBER_BYTES, 0, 2.0 ** 50),
    "max_fwd_stash_bytes": (_ferry.NUMBER_BYTES, 0, 2.0 ** 53),
}


def switch_from_env(name):
    """The default of an on/off knob from its environment variable (set by
    `ferry run`): None when unset or empty; a bad value raises, naming it."""
    var = SWITCH_KNOBS[name]
    text = os.environ.get(var, "").strip()
    if not text:
        return None
    value = _SWITCH_WORDS.get(text.lower())
    if value is None:
        raise ValueError(f"ferry: {var}={text!r} is not 1 or 0 (also true/false, yes/no, on/off); "
                         f"it sets {name}")
    return value


def parse_knobs(knobs):
    """knobs with the numeric ones checked and made ints, the on/off ones
    checked (True/False, or 1/0) and made bools, and those of the latter not
    given taken from their environment variable."""
    out = dict(knobs)
    for name in SWITCH_KNOBS:
        value = out.get(name)
        if value is None:
            value = switch_from_env(name)
            if value is None:
                out.pop(name, None)
                continue
        elif isinstance(value, bool) or (type(value) is int and value in (0, 1)):
            value = bool(value)
        else:
            raise TypeError(f"ferry: {name} must be True or False, got {value!r}")
        out[name] = value
    for name, (kind, lo, hi) in NUMERIC_KNOBS.items():
        value = out.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError(f"ferry: {name} must be a number, got {type(value).__name__}")
        text = value.strip() if isinstance(value, str) else repr(value)
        out[name] = int(_ferry.parse_number(name, text, kind, lo, hi))
    return out


# ---- sessions ----------------------------------------------------------------
class Session:
    def __init__(self, cfg, policy_path, node_cap):
        self.cfg = cfg
        self.node_cap = node_cap  # keeps the shared-memory slot for this process
        self.engine = _ferry.Engine(policy_path=policy_path, **cfg)
        self.pid = os.getpid()
        self.policy_path = policy_path
        self.models = weakref.WeakKeyDictionary()
        self.param_ranges = []  # the engine's, as the active offload contexts set them
        self.policy_errors_seen = 0
        self.warned_policy = False
        self.warned_live = set()  # the kinds of step-end warnings given
        self.backwards_seen = 0  # the engine's backwards at the last step end
        self.warned_knobs = set()
        # while recording a trace: the FLOP counter (ferry/_flops.py) and the
        # resident memory declared last, {what: bytes}
        self.recording = bool(cfg.get("trace_path"))
        self.flops = None
        self.declared = {}
        # while recording on a GPU (set by ferry.torch): (reset, read) of the
        # allocator's peak statistic, reset as each step begins and read as
        # it ends into the trace's device_peak
        self.device_peak = None
        self.check_knobs()

    def set_policy(self, policy_path):
        if policy_path == self.policy_path:
            return
        if self.engine.in_step:
            self.end_step()
        self.engine.set_policy(path=policy_path)  # FerryError with file:line on failure
        self.policy_path = policy_path
        self.check_knobs()

    def check_knobs(self):
        """One warning per policy and knob where a keyword argument overrules
        the policy's own value."""
        k = self.engine.knobs()
        new = [n for n in k["overruled"] if (self.policy_path, n) not in self.warned_knobs]
        if new:
            self.warned_knobs.update((self.policy_path, n) for n in new)
            warnings.warn("ferry: keyword argument(s) " + ", ".join(f"{n}={k[n]}" for n in new) +
                          f" overrule policy {self.policy_path}'s own value (keyword arguments "
                          "win over a policy's knobs)", UserWarning, stacklevel=4)

    def begin_step(self, resident=None):
        """End the step in progress and begin one; resident: {what: bytes}
        of device memory to declare in the trace between the two (only what
        changed since the last declaration is written)."""
        if self.engine.in_step:
            self.end_step()
        if resident and self.recording:
            for what, nbytes in resident.items():
                if self.declared.get(what) != nbytes:
                    self.engine.trace_resident(what, nbytes)
                    self.declared[what] = nbytes
        self.engine.step_begin()
        if self.device_peak is not None:
            self.device_peak[0]()

    def end_step(self):
        if not self.engine.in_step:
            return 0
        if self.flops is not None:
            self.flops.flush()  # the last backward's FLOPs, before backward_end
        live = self.engine.step_end()
        if self.device_peak is not None:
            self.engine.trace_device_peak(self.device_peak[1]())
        self.check_policy()
        # the attribute, not stats()["backwards"]: the dict of every counter
        # cost 15-80 us a step, a third of a keep-all step's overhead
        backwards = self.engine.backwards
        no_backward, self.backwards_seen = backwards == self.backwards_seen, backwards
        if live and no_backward and "unrun" not in self.warned_live:
            # no backward at all in the step: its forward's backward is still
            # to come (two context entries before one backward)
            self.warned_live.add("unrun")
            warnings.warn(f"ferry: a step ended with {live} saved tensor(s) whose backward has not "
                          "run yet: the context was entered again (or ferry.torch.step() called) "
                          "before the backward of the forward it wrapped. They stay valid and "
                          "their backward works; for several forwards before one backward, put one "
                          "context around them, or pass steps=\"manual\" and call "
                          "ferry.torch.step() after the backward", RuntimeWarning, stacklevel=3)
        elif live and not no_backward and "kept" not in self.warned_live:
            self.warned_live.add("kept")
            warnings.warn(f"ferry: a step ended with {live} saved tensor(s) neither used nor freed "
                          "by its backward (a graph kept alive, e.g. retain_graph=True, or a "
                          "second backward still to come); they stay valid",
                          RuntimeWarning, stacklevel=3)
        return live

    def check_policy(self):
        errors = self.engine.policy_errors()
        if errors > self.policy_errors_seen:
            self.policy_errors_seen = errors
            if not self.warned_policy:
                self.warned_policy = True
                warnings.warn(f"ferry: policy {self.policy_path} failed at run time: "
                              f"{self.engine.policy_error()}; the tensors concerned were kept on "
                              "device and training goes on (further faults are counted in "
                              "ferry.torch.stats()['policy_errors'])", RuntimeWarning, stacklevel=3)

    def hooks_for(self, model, make):
        """The model's site hooks in this engine, made by make(engine, model) once."""
        h = self.models.get(model)
        if h is None:
            h = self.models[model] = make(self.engine, model)
        return h


def session_key(cfg, node_cap_spec):
    return tuple(sorted((k, v) for k, v in cfg.items())) + (node_cap_spec,)


def session_for(policy_path, cfg, node_cap_spec, key=None):
    if key is None:
        key = session_key(cfg, node_cap_spec)
    s = sessions.get(key)
    if s is None or s.engine.closed:
        node_cap = None
        if node_cap_spec is not None:
            name, cap = node_cap_spec
            node_cap = _ferry.NodeCap(name, cap)
            if _ferry.HAVE_NODE_CAP_HOOK:
                cfg = dict(cfg, node_cap=node_cap)
            else:
                # Without the engine's reserve hook the node cap is split
                # statically: each local rank reserves cap/LOCAL_WORLD_SIZE in
                # the shared segment up front and caps its own arena there.
                local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
                share = cap // local
                if not node_cap.reserve(share):
                    st = node_cap.state()
                    raise FerryError(f"ferry: node host cap {name}: cannot reserve this rank's share "
                                     f"of {share} bytes ({st['total']} of {st['cap']} held by "
                                     f"{len(st['slots']) - 1} other process(es))", "FERRY_ECAP")
                own = cfg.get("host_cap_bytes") or share
                cfg = dict(cfg, host_cap_bytes=min(own, share))
        s = Session(cfg, policy_path, node_cap)
        sessions[key] = s
    return s
