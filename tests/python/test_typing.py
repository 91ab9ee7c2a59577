"""The package ships py.typed: every public function and method carries
annotations that resolve (typing.get_type_hints), and the C extension has a
stub, so a type checker sees the same API the docs describe."""
import importlib
import inspect
import os
import typing

import pytest

import ferry

MODULES = ["ferry", "ferry.torch", "ferry.checkpoint", "ferry.optim", "ferry.weights",
           "ferry.lightning", "ferry.transformers"]


def public_callables(mod):
    for name in getattr(mod, "__all__", []):
        obj = getattr(mod, name)
        if inspect.isfunction(obj) and obj.__module__.startswith("ferry"):
            yield f"{mod.__name__}.{name}", obj
        elif inspect.isclass(obj) and obj.__module__.startswith("ferry") and \
                not obj.__module__.startswith("ferry._ferry"):
            for attr, fn in vars(obj).items():
                if isinstance(fn, property):
                    fn = fn.fget
                if inspect.isfunction(fn) and (attr == "__init__" or not attr.startswith("_")):
                    yield f"{mod.__name__}.{name}.{attr}", fn


@pytest.mark.parametrize("modname", MODULES)
def test_public_api_is_annotated(modname):
    try:
        mod = importlib.import_module(modname)
    except ImportError as e:  # lightning/transformers absent with Debian's torch
        pytest.skip(f"{modname}: {e}")
    missing = []
    for qual, fn in public_callables(mod):
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
        bare = [p.name for p in params if p.annotation is inspect.Parameter.empty]
        if bare or sig.return_annotation is inspect.Signature.empty:
            missing.append(f"{qual}({', '.join(bare)}){'' if sig.return_annotation is not inspect.Signature.empty else ' -> ?'}")
            continue
        typing.get_type_hints(fn)  # the names resolve
    assert not missing, "unannotated: " + "; ".join(missing)


def test_extension_stub_and_marker_ship_with_the_package():
    pkg = os.path.dirname(ferry.__file__)
    assert os.path.exists(os.path.join(pkg, "py.typed"))
    stub = os.path.join(pkg, "_ferry.pyi")
    assert os.path.exists(stub)
    text = open(stub).read()
    for name in ("class Engine", "class FerryError", "class NodeCap", "class Resident",
                 "def resident(", "def snapshot(", "def info("):
        assert name in text, name


def test_extension_stub_names_every_attribute():
    """Each C attribute (getset/member) of the extension's classes is in the
    stub: Engine.backwards, read at every step's end, was missing."""
    import types
    from ferry import _ferry
    text = open(os.path.join(os.path.dirname(ferry.__file__), "_ferry.pyi")).read()
    descriptors = (types.GetSetDescriptorType, types.MemberDescriptorType)
    missing = []
    for cname, cls in vars(_ferry).items():
        if not isinstance(cls, type) or f"class {cname}" not in text:
            continue
        body = text.split(f"class {cname}", 1)[1].split("\nclass ", 1)[0]
        missing += [f"{cname}.{a}" for a, d in vars(cls).items()
                    if isinstance(d, descriptors) and not a.startswith("_")
                    and f"\n    {a}:" not in body]
    assert not missing, "not in _ferry.pyi: " + ", ".join(missing)
