"""ferry._model — what ferry sees of a model: its modules as the hooks see
them (a torch.compile'd module is one site) and its repeated blocks (the
layers policies count). Below ferry.torch, ferry.optim and ferry.weights,
which all describe a model's parts to a policy."""
import torch


def _is_compiled(m):
    """A torch.compile'd module (dynamo's OptimizedModule wrapper)."""
    return type(m).__name__ == "OptimizedModule" and isinstance(getattr(m, "_orig_mod", None), torch.nn.Module)


def _compiled_in_place(m):
    """A module compiled by its own .compile() (torchtune's way)."""
    return getattr(m, "_compiled_call_impl", None) is not None


def _uncompiled(m):
    """The module a torch.compile'd module wraps (m itself otherwise)."""
    while _is_compiled(m):
        m = m._orig_mod
    return m


def _named_sites(model):
    """model.named_modules() as the hooks can see them: a compiled module is
    one site, under its own path, with its wrapped module's class; the
    modules inside it are left out, because a Python hook inside a compiled
    region breaks the graph, and the tensors its graph saves reach the
    saved-tensor hooks together at the end of its forward anyway."""
    inside = []
    for path, m in model.named_modules():
        if any(path.startswith(p) for p in inside):
            continue
        if _is_compiled(m) or _compiled_in_place(m):
            inside.append(path + "." if path else "")
            yield path, m, type(_uncompiled(m)).__name__
        else:
            yield path, m, type(m).__name__


def _find_blocks(model):
    """The model's repeated blocks: the ModuleList/Sequential whose children
    all have one class, with the most parameters (ties: most children).
    Returns (container path, {child name: index}) or (None, {})."""
    best = None
    for path, m, _ in _named_sites(model):
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        kids = list(m.named_children())
        if len(kids) < 2:
            continue
        cls = type(_uncompiled(kids[0][1]))
        if cls in (torch.nn.ModuleList, torch.nn.Sequential) or \
                any(type(_uncompiled(k)) is not cls for _, k in kids):
            continue
        nparams = sum(p.numel() for p in m.parameters())
        score = (nparams, len(kids))
        if best is None or score > best[0]:
            best = (score, path, {name: i for i, (name, _) in enumerate(kids)})
    if best is None:
        return None, {}
    return best[1], best[2]
