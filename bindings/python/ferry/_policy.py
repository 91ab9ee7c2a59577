"""ferry.policy(...) and ferry.Policy: policies written from Python.

A Policy is Lua source, rendered from keyword arguments onto the rules
library (policies/lib/ferry/rules.lua) or given inline, and kept in a file so
that `ferry check`, `ferry sim` and recorded traces name it like any other
policy. Loading it in the engine's sandbox when it is made turns a mistake
into an error at the call, with the file and line."""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from typing import Optional, Sequence, Union

from . import _ferry
from ._ferry import FerryError

_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def _bytes(what, v):
    """An int, or "64M"/"2GiB" -> bytes; ValueError naming the argument."""
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise TypeError(f"ferry.policy: {what} must be bytes (int) or a string like '64M', "
                        f"not {type(v).__name__}")
    if isinstance(v, str):
        s = v.strip()
        num = s.rstrip("KkMmGgTtIiBb")
        unit = s[len(num):].lower()
        if not num.isdigit() or unit not in _UNITS:
            raise ValueError(f"ferry.policy: {what}={v!r}: expected bytes like 1048576, '64M' or '2GiB'")
        v = int(num) * _UNITS[unit]
    if v < 0:
        raise ValueError(f"ferry.policy: {what}={v} must be >= 0")
    return v


def _count(what, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"ferry.policy: {what}={v!r} must be a whole number >= 0")
    return v


def _lua_string(s):
    """A Lua string literal for s (every byte outside printable ASCII escaped)."""
    out = []
    for b in str(s).encode():
        c = chr(b)
        out.append("\\" + c if c in '"\\' else c if 32 <= b < 127 else "\\%03d" % b)
    return '"' + "".join(out) + '"'


def _patterns(what, v):
    if isinstance(v, str):
        v = [v]
    v = list(v)
    if not v or not all(isinstance(p, str) and p for p in v):
        raise ValueError(f"ferry.policy: {what} must be module path patterns (non-empty strings)")
    return ", ".join(_lua_string(p) for p in v)


_private_tmp = None  # this process's own directory, when the home cache cannot be written


def _private_dir(d):
    """d if it is a real directory (not a link) of this user, made writable
    by this user alone (chmod 0700 if it was not), so that no other user can
    plant a file there; else None."""
    try:
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
        if st.st_mode & 0o022:
            os.chmod(d, 0o700)
    except OSError:
        return None
    return d


def _ancestors_private(d):
    """Whether no other user can rename or replace anything on d's real
    path: every directory above it is this user's or root's, and writable by
    others only with the sticky bit (/tmp). Else a directory d of ours in,
    say, a world-writable XDG_CACHE_HOME could be swapped for another
    user's after it was checked."""
    real = os.path.realpath(d)
    parent = os.path.dirname(real)
    while True:
        try:
            st = os.stat(parent)
        except OSError:
            return False
        if st.st_uid not in (0, os.getuid()):
            return False
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return False
        up = os.path.dirname(parent)
        if up == parent:
            return True
        parent = up


def _cache_dir():
    """~/.cache/ferry/policies (XDG_CACHE_HOME), or where the home cannot be
    written a directory of this process's own made by mkdtemp (mode 0700,
    removed at exit). Never a predictable name in a shared directory: another
    user could create it first and plant a policy there."""
    global _private_tmp
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    d = os.path.join(base, "ferry", "policies")
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        if _private_dir(d) and os.access(d, os.W_OK) and _ancestors_private(d):
            return d
    except OSError:
        pass
    if _private_tmp is None or not _private_dir(_private_tmp):
        import atexit
        import shutil
        _private_tmp = tempfile.mkdtemp(prefix="ferry-policies-")
        atexit.register(shutil.rmtree, _private_tmp, True)
    return _private_tmp


def _holds(path, source):
    """Whether path is a regular file (not a link) holding exactly source."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        return f.read(len(source.encode()) + 1) == source.encode()


class Policy:
    """A policy's Lua source and the file it lives in (content-addressed under
    ~/.cache/ferry/policies, so the same source is the same file).

    Pass it wherever a policy name or path goes: ferry.torch.offload(policy=p),
    set_policy(p), the trainers' callbacks; `str(p.path)` for the CLI."""

    def __init__(self, source: str, name: str = "inline") -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError("ferry.Policy: source must be non-empty Lua text")
        self.source = source
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40] or "inline"
        self.path = os.path.join(_cache_dir(), f"{safe}-{digest}.lua")
        if not _holds(self.path, source):  # absent, or not this source: written anew
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".lua")
            with os.fdopen(fd, "w") as f:
                f.write(source)
            os.replace(tmp, self.path)
        try:  # load it once in the sandbox: errors now, with file:line
            _ferry.Engine(backend="host", policy_path=self.path).close()
        except FerryError as e:
            raise ValueError(f"ferry.Policy: {e.args[0]}") from None

    @classmethod
    def from_source(cls, source: str, name: str = "inline") -> Policy:
        """A policy from Lua text (a script returning a policy, as a file would)."""
        return cls(source, name)

    def save(self, path: Union[str, "os.PathLike[str]"]) -> str:
        """Write the source to path (for `ferry check`, `ferry sim`, a repo)."""
        with open(path, "w") as f:
            f.write(self.source)
        return path

    def __fspath__(self):
        return self.path

    def __str__(self):
        return self.source

    def __repr__(self):
        return f"<ferry.Policy {self.path}>"


# What every `policy=` argument takes: a shipped policy's name ("default"),
# a path to a Lua file, or a Policy.
PolicyLike = Union[str, "os.PathLike[str]", Policy]


def policy(*, min_bytes: Optional[Union[int, str]] = None, exclude: Optional[Sequence[str]] = None,
           only: Optional[Sequence[str]] = None, activations_only: bool = False,
           first_layers: Optional[int] = None, keep_last: Optional[int] = None,
           fraction: Optional[float] = None, host_budget: Optional[Union[int, str]] = None,
           max_stash: Optional[int] = None, max_stash_bytes: Optional[Union[int, str]] = None,
           prefetch: Optional[int] = None, prefetch_layers: Optional[int] = None,
           prefetch_bytes: Optional[Union[int, str]] = None, name: str = "python") -> Policy:
    """A Policy built from the rules library's selectors, in Python.

    min_bytes: keep smaller tensors (bytes or "1M").   R.min_bytes
    exclude / only: module path patterns to keep / to offload only.
                                  R.exclude_modules / R.only_modules
    activations_only: keep parameters and buffers.   R.activations_only
    first_layers=n: offload only layers 0..n-1.     R.first_layers
    keep_last=k: keep the last k layers.            R.keep_last_layers
    fraction=f: offload this share of bytes.        R.fraction
    host_budget: offload the largest tensors up to this many host bytes per
        step (with keep_last).                      R.host_budget
    max_stash / max_stash_bytes: the forward stash.  R.max_stash(_bytes)
    prefetch=d tensors ahead, prefetch_layers=k, prefetch_bytes=n; none:
        reload on use.                              R.prefetch*, R.on_use

    Returns a Policy (its Lua source in .source, its file in .path)."""
    rules = []
    if min_bytes is not None:
        rules.append(f"R.min_bytes({_bytes('min_bytes', min_bytes)})")
    if activations_only:
        rules.append("R.activations_only()")
    if exclude is not None:
        rules.append(f"R.exclude_modules({_patterns('exclude', exclude)})")
    if only is not None:
        rules.append(f"R.only_modules({_patterns('only', only)})")
    if first_layers is not None:
        rules.append(f"R.first_layers({_count('first_layers', first_layers)})")
    if host_budget is not None:
        keep = _count("keep_last", keep_last) if keep_last is not None else 0
        rules.append(f"R.host_budget {{ bytes = {_bytes('host_budget', host_budget)}, keep_last = {keep} }}")
    elif keep_last is not None:
        rules.append(f"R.keep_last_layers({_count('keep_last', keep_last)})")
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"ferry.policy: fraction={fraction!r} must be within [0, 1]")
        rules.append(f"R.fraction({float(fraction)!r})")
    if max_stash is not None:
        rules.append(f"R.max_stash({_count('max_stash', max_stash)})")
    if max_stash_bytes is not None:
        rules.append(f"R.max_stash_bytes({_bytes('max_stash_bytes', max_stash_bytes)})")
    reloads = [(k, v) for k, v in (("prefetch", prefetch), ("prefetch_layers", prefetch_layers),
                                   ("prefetch_bytes", prefetch_bytes)) if v is not None]
    if len(reloads) > 1:
        raise ValueError("ferry.policy: give one of prefetch, prefetch_layers, prefetch_bytes")
    reload = "R.on_use()"
    if reloads:
        k, v = reloads[0]
        n = _bytes(k, v) if k == "prefetch_bytes" else _count(k, v)
        reload = f"R.{k}({n})"
    body = "".join(f"  {r},\n" for r in rules)
    source = ("-- Rendered by ferry.policy() from Python.\n"
              'local R = require "ferry.rules"\n'
              f"return R.policy {{\n  name = {_lua_string(name)},\n{body}  reload = {reload},\n}}\n")
    return Policy(source, name)
