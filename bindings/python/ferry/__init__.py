"""ferry: policy-driven offloading of tensors saved for backward.

`import ferry` needs no torch. The PyTorch integration is `ferry.torch`
(imported on first use):

    import ferry.torch
    with ferry.torch.offload(model, policy="default"):
        loss = model(batch).loss
    loss.backward()

See docs/pytorch.md.
"""
from __future__ import annotations

import os as _os
from typing import Any, Dict, List, Union

try:
    from . import _ferry
except ImportError as _e:  # the extension, or a library it needs (LuaJIT)
    raise ImportError(
        f"ferry: the C extension ferry._ferry does not load: {_e}. It is built with the package "
        "(pip install ., or cmake --build <build> for PYTHONPATH=<build>/python) and needs "
        "LuaJIT's shared library at run time (Debian: apt-get install libluajit-5.1-2)") from _e
from ._ferry import Engine, FerryError, NodeCap

__version__ = _ferry.__version__
__all__ = ["info", "policy_path", "policy_dirs", "policy", "Policy", "Engine", "FerryError", "NodeCap",
           "torch"]

_JEMALLOC_NAMES = ("libjemalloc.so", "libjemalloc.so.2")


def _jemalloc_preloaded():
    pre = _os.environ.get("LD_PRELOAD", "")
    return any(_os.path.basename(p).startswith("libjemalloc") for p in pre.replace(":", " ").split())


def info() -> Dict[str, Any]:
    """What this ferry is and can do here.

    Keys: version; arena ("jemalloc" when jemalloc is the process's allocator,
    i.e. preloaded with LD_PRELOAD or `ferry run`, else "pool"); backends
    {host, cuda, sim: {available, error?}}; jemalloc_preloaded; policy_dirs;
    node_cap_hook (whether a node-wide host cap can be shared dynamically).
    """
    d = _ferry.info()
    d["jemalloc_preloaded"] = _jemalloc_preloaded()
    d["policy_dirs"] = policy_dirs()
    d["extension"] = _ferry.__file__
    return d


def policy_dirs() -> List[str]:
    """Directories searched for policies given by name, in order:
    $FERRY_POLICY_DIR (colon-separated), the policies installed with this
    package, the source tree's policies/ (build-tree package)."""
    dirs = [d for d in _os.environ.get("FERRY_POLICY_DIR", "").split(":") if d]
    here = _os.path.dirname(_os.path.abspath(__file__))
    installed = _os.path.join(here, "policies")
    if _os.path.isdir(installed):
        dirs.append(installed)
    try:
        from . import _paths

        if _paths.SOURCE_POLICY_DIR:
            dirs.append(_paths.SOURCE_POLICY_DIR)
    except ImportError:
        pass
    return dirs


def policy_path(policy: Union[str, "_os.PathLike[str]", Policy]) -> str:
    """Resolve a policy name ("default", "layers") or a path to a Lua file.

    A name is looked up as <dir>/<name>.lua in policy_dirs(); a Policy
    (ferry.policy(...), ferry.Policy.from_source(...)) is its file. Raises
    FileNotFoundError naming what was tried, or ValueError for a bad name."""
    if not isinstance(policy, (str, _os.PathLike)):
        raise TypeError(f"ferry: policy must be a name, a path or a ferry.Policy, "
                        f"not {type(policy).__name__}")
    policy = _os.fspath(policy)
    if not policy:
        raise ValueError("ferry: empty policy name")
    looks_like_path = _os.sep in policy or policy.endswith(".lua")
    if looks_like_path:
        if _os.path.isfile(policy):
            return _os.path.abspath(policy)
        raise FileNotFoundError(f"ferry: policy file {policy!r} does not exist")
    tried = []
    for d in policy_dirs():
        p = _os.path.join(d, policy + ".lua")
        tried.append(p)
        if _os.path.isfile(p):
            return p
    names = sorted({f[:-4] for d in policy_dirs() if _os.path.isdir(d)
                    for f in _os.listdir(d) if f.endswith(".lua")})
    raise FileNotFoundError(
        f"ferry: unknown policy {policy!r}; shipped policies: {', '.join(names) or '(none found)'}; "
        f"tried {', '.join(tried) or 'no directory (set FERRY_POLICY_DIR)'}")


def _policy_libdir():
    """The Lua library dir (require "ferry.rules") next to the policies in use."""
    for d in policy_dirs():
        lib = _os.path.join(d, "lib")
        if _os.path.isdir(lib):
            return lib
    return None


# An installed package carries its own policies/lib, the build-tree package
# names the source tree's in _paths.py (libferry has no build path compiled
# in); point the policy host at it unless the user chose one.
if "FERRY_POLICY_LIBDIR" not in _os.environ:
    _here = _os.path.dirname(_os.path.abspath(__file__))
    _libs = [_os.path.join(_here, "policies", "lib")]
    try:
        from . import _paths

        if _paths.SOURCE_POLICY_DIR:
            _libs.append(_os.path.join(_paths.SOURCE_POLICY_DIR, "lib"))
    except ImportError:
        pass
    for _lib in _libs:
        if _os.path.isdir(_lib):
            _os.environ["FERRY_POLICY_LIBDIR"] = _lib
            break


from ._policy import Policy, policy  # noqa: E402


def __getattr__(name):
    # `ferry.torch` imports torch: only on first use.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'ferry' has no attribute {name!r}")
