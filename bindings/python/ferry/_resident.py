"""ferry._resident — a policy's resident(r) answers for ferry.optim and
ferry.weights: which parameters' optimizer states, and which layers'
weights, live on the host (docs/optimizer-offload.md, "Choosing with a
policy"). The policy is asked once, when an optimizer or a model is wrapped,
largest candidate first (ties in model order), through its own instance
(_ferry.PolicyInstance), never the offload engine's."""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _ferry
from ._model import _find_blocks


class Choice(NamedTuple):
    """One candidate's answer: its name, whether it is on the host, and the
    rule that said so with the file:line it is written at."""
    name: str
    host: bool
    rule: str
    where: str


def is_policy(policy: Any) -> bool:
    """A Lua policy (a name, a path, a ferry.Policy), not a Python callable."""
    return isinstance(policy, (str, os.PathLike))


def _load(policy) -> "_ferry.PolicyInstance":
    import ferry
    path = ferry.policy_path(policy)
    inst = _ferry.PolicyInstance(path=path)
    if not inst.has_resident:
        raise ValueError(f"ferry: policy {path} has no resident(r) function: give it one, or "
                         "R.policy { optimizer = R.host_fraction(0.5), weights = ... } "
                         "(docs/optimizer-offload.md)")
    return inst


def model_layers(model: Optional[torch.nn.Module]) -> Tuple[Dict[str, int], int, str]:
    """The model's repeated blocks: ({block module path: index}, count,
    container path), as ferry.torch describes saved tensors."""
    if model is None:
        return {}, 0, ""
    cpath, blocks = _find_blocks(model)
    prefix = (cpath + ".") if cpath else ""
    return {prefix + name: i for name, i in blocks.items()}, len(blocks), cpath or ""


def _layer_of(module: str, blocks: Dict[str, int]) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        i = blocks.get(".".join(parts[:n]))
        if i is not None:
            return i
    return -1


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _ask(policy, kind: str, items: Sequence[Tuple[str, str, int, int, int, str]]) -> List[Choice]:
    """items in model order -> answers in model order (asked largest first)."""
    inst = _load(policy)
    order = sorted(range(len(items)), key=lambda i: (-items[i][4], i))
    answers = inst.resident(kind, [items[i] for i in order])
    if inst.errors:
        warnings.warn(f"ferry: policy {inst.name}: resident(r) failed: {inst.last_error()}; "
                      "those stay on the device", RuntimeWarning, stacklevel=4)
    out: List[Optional[Choice]] = [None] * len(items)
    for i, (host, rule, where) in zip(order, answers):
        out[i] = Choice(items[i][0], host, rule, where)
    return out  # type: ignore[return-value]


def choose_params(policy, params: Sequence[torch.nn.Parameter],
                  model: Optional[torch.nn.Module]) -> List[Choice]:
    """The policy's answer for each parameter's optimizer state, in order.
    With model, parameters are named and placed in layers as in the model;
    without, they are "param.<i>" outside any layer."""
    names: Dict[int, str] = {}
    if model is not None:
        for n, p in model.named_parameters():
            names.setdefault(id(p), n)
    blocks, count, _ = model_layers(model)
    items = []
    for i, p in enumerate(params):
        name = names.get(id(p), f"param.{i}")
        module = name.rsplit(".", 1)[0] if "." in name else ""
        items.append((name, module, _layer_of(module, blocks), count,
                      p.numel() * p.element_size(), _dtype_name(p)))
    return _ask(policy, "optimizer", items)


def choose_layers(policy, model: torch.nn.Module) -> List[Choice]:
    """The policy's answer for each repeated block's weights, in order."""
    blocks, count, cpath = model_layers(model)
    if not blocks:
        raise ValueError("ferry: the model has no repeated blocks (a ModuleList or Sequential of "
                         "one class) whose weights a policy could place; name the layers instead")
    named = dict(model.named_modules())
    items = []
    for path, i in sorted(blocks.items(), key=lambda kv: kv[1]):
        ps = list(named[path].parameters())
        dtype = _dtype_name(ps[0]) if ps else "float32"
        items.append((path, path, i, count, sum(p.numel() * p.element_size() for p in ps), dtype))
    return _ask(policy, "weights", items)
