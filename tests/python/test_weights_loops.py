"""ferry.torch.offload_weights in real training loops (issue 39): state_dict
and load_state_dict at every point of a step, an eval forward between
backward and step, non-reentrant checkpointing with early stop off,
autocast, an exception inside an offloaded layer, tied weights between two
offloaded layers; and the side stream's wait on the compute stream (issue
36 item 8) through a test double for torch.cuda's stream functions."""
import gc
import io
import warnings

import pytest
import torch
import torch.utils.checkpoint as cp

from ferry.weights import offload_weights

HAVE_OUTER_HOOKS = hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks")


class Net(torch.nn.Module):
    def __init__(self, ckpt=None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.Tanh()) for _ in range(4))
        self.head = torch.nn.Linear(24, 3)
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            x = b(x) if self.ckpt is None else cp.checkpoint(b, x, use_reentrant=self.ckpt)
        return self.head(x)


OFFLOADED = ["blocks.0", "blocks.2", "head"]


def data(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 24, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def values(sd):
    return {k: v.detach().clone() for k, v in sd.items()}


def same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---- 5: state_dict at every point of a step ------------------------------------------

def test_state_dict_at_every_point_of_a_step(tmp_path):
    """model.state_dict() holds every weight right after wrapping, after a
    forward, after backward, after an eval forward, after step (before: the
    offloaded layers' entries were (0,) tensors, torch.save lost them and
    load_state_dict failed on size)."""
    ref, m = Net(), Net()
    w = offload_weights(m, OFFLOADED)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    assert same(values(m.state_dict()), values(ref.state_dict()))  # right after wrapping
    for i, (x, y) in enumerate(data(3)):
        points = []
        for model, o in ((ref, ropt), (m, opt)):
            got = []
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            got.append(values(model.state_dict()))  # after forward
            loss.backward()
            got.append(values(model.state_dict()))  # after backward
            model.eval()
            with torch.no_grad():
                model(x)  # validation between backward and step
            model.train()
            got.append(values(model.state_dict()))  # after the eval forward
            o.step()
            got.append(values(model.state_dict()))  # after step
            points.append(got)
        for a, b in zip(*points):
            assert same(a, b), i
    assert w.offloads > 0
    # torch.save / torch.load / load_state_dict into an offloaded model
    m(data(1)[0][0])  # offloaded again
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)
    assert same(saved, values(ref.state_dict()))
    m2 = Net()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    w2 = offload_weights(m2, OFFLOADED)
    m2.load_state_dict(saved)
    assert all(p.numel() == 0 for p in m2.head.parameters())  # loaded, still offloaded
    assert same(values(m2.state_dict()), saved)
    w2.remove()
    assert same(values(m2.state_dict()), saved)


def test_load_state_dict_keeps_a_layer_on_the_device_where_it_was():
    m = Net()
    w = offload_weights(m, OFFLOADED)
    x, y = data(1)[0]
    torch.nn.functional.mse_loss(m(x), y).backward()  # backward leaves them on the device
    assert all(p.numel() for p in m.head.parameters())
    sd = values(Net().state_dict())
    m.load_state_dict(sd)
    assert all(p.numel() for p in m.head.parameters())
    assert same(values(m.state_dict()), sd)
    w.remove()


@pytest.mark.parametrize("no_grad_only", [False, True])
def test_eval_forward_between_backward_and_step(no_grad_only):
    """An eval forward between backward and step() used to send the weights
    to the host and make the step raise (a gradient without its weight)."""
    if no_grad_only and not hasattr(torch.optim.Optimizer, "register_step_pre_hook"):
        pytest.skip("a no-grad forward in training mode: brought back by a global step "
                    "pre-hook, torch 2.x")

    def run(offload):
        m = Net()
        if offload:
            offload_weights(m, OFFLOADED)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for x, y in data(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            if not no_grad_only:
                m.eval()
            with torch.no_grad():
                m(x)
            m.train()
            opt.step()
        return m
    ref, m = run(False), run(True)
    assert same(values(m.state_dict()), values(ref.state_dict()))


# ---- 6: checkpoint recompute, autocast ----------------------------------------------

class FirstLayerNet(torch.nn.Module):
    """The offloaded first layer's input needs no gradient, so backward saves
    none of its weights: nothing reloads it but the backward hook."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(24, 24)
        self.rest = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(24, 3))

    def forward(self, x):
        return self.rest(cp.checkpoint(self.first, x, use_reentrant=False))


class RecomputeAfterBackwardNet(torch.nn.Module):
    """The region's tanh saves its output through the checkpoint, so its
    recompute (the whole region, the offloaded layer's forward too) runs
    after the offloaded layer's backward: on torch 1.13 as well."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(24, 24)
        self.out = torch.nn.Linear(24, 3)

    def region(self, x):
        return self.inner(torch.tanh(x)) + 1.0  # add saves nothing

    def forward(self, x):
        return self.out(cp.checkpoint(self.region, x, use_reentrant=False))


@pytest.mark.parametrize("net,layer,grad_input", [(FirstLayerNet, "first", False),
                                                  (RecomputeAfterBackwardNet, "inner", True)])
@pytest.mark.parametrize("early_stop", [True, False])
def test_non_reentrant_checkpoint_recompute_leaves_weights_on_device(early_stop, net, layer,
                                                                     grad_input):
    """With early stop off (torch 2.x's set_checkpoint_early_stop(False);
    torch 1.13 always recomputes the whole function) the recompute ran the
    layer's forward hook inside backward and sent its weights to the host for
    good: the step then raised or was wrong."""
    ctx = getattr(cp, "set_checkpoint_early_stop", None)
    if ctx is None and early_stop:
        pytest.skip("torch 1.13 has no early stop")

    def run(offload):
        m = net()
        if offload:
            offload_weights(m, [layer])
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in data(3):
            x.requires_grad_(grad_input)
            opt.zero_grad()
            if ctx is not None:
                with ctx(early_stop):  # read when checkpoint() is called
                    loss = torch.nn.functional.mse_loss(m(x), y)
            else:
                loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            assert all(p.numel() == p.grad.numel() for p in m.parameters())
            opt.step()
        return m
    ref, m = run(False), run(True)
    assert same(values(m.state_dict()), values(ref.state_dict()))


def live_casts(shape, dtype):
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if torch.is_tensor(o) and o.dtype == dtype
                and tuple(o.shape) in (shape, shape[::-1])]


def test_autocast_casts_of_offloaded_weights_are_not_kept():
    """Under autocast a Linear saves its weight's low-precision cast, not a
    view of the weight: it was kept for backward (a device copy of each
    offloaded weight); now it is made again from the reloaded weight."""
    torch.manual_seed(0)
    dt = torch.bfloat16

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(40, 56), torch.nn.Tanh(),
                                   torch.nn.Linear(56, 3))

    def step(m, opt, x, y, check=None):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dt):
            out = m(x)
        if check:
            check()
        torch.nn.functional.mse_loss(out.float(), y).backward()
        opt.step()
        return [p.clone() for p in m.parameters()]

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 40, generator=g, requires_grad=True), torch.randn(8, 3, generator=g))
               for _ in range(3)]
    ref = make()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = [step(ref, ropt, x, y) for x, y in batches]
    m = make()
    offload_weights(m, ["0", "2"])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    counts = []
    got = [step(m, opt, x, y, check=lambda: counts.append(len(live_casts((56, 40), dt))))
           for x, y in batches]
    assert counts == [0, 0, 0]
    assert all(torch.equal(a, b) for ga, gb in zip(got, want) for a, b in zip(ga, gb))


# ---- 9: an exception inside an offloaded layer's forward ------------------------------

class Flaky(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(24, 24)
        self.fail = None

    def forward(self, x):
        y = self.fc(x)
        if self.fail is not None:
            raise self.fail
        return y


@pytest.mark.parametrize("exc", [RuntimeError("CUDA out of memory (a stand-in)"),
                                 KeyboardInterrupt()])
def test_exception_inside_an_offloaded_forward_leaves_no_hooks(exc):
    """An OOM or an interrupt inside the layer's forward left our saved-tensor
    hooks pushed: the next forward hit RecursionError, or an outer context's
    exit popped ours instead of its own."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(Flaky(), torch.nn.Tanh(), torch.nn.Linear(24, 3))

    def train(m, fail_first):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i, (x, y) in enumerate(data(3)):
            if fail_first and i == 0:
                m[0].fail = exc
                with pytest.raises(type(exc)):
                    m(x)
                m[0].fail = None
                if HAVE_OUTER_HOOKS:
                    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        return m
    ref = train(build(), False)
    m = build()
    offload_weights(m, ["0"])
    train(m, True)
    assert same(values(m.state_dict()), values(ref.state_dict()))
    # an outer saved-tensor hooks context is exited cleanly around a failure
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t, lambda t: t):
        m[0].fail = RuntimeError("again")
        with pytest.raises(RuntimeError):
            m(torch.randn(2, 24, requires_grad=True))
        m[0].fail = None
    x = torch.randn(2, 24, requires_grad=True)
    n = len(seen)
    m(x).sum().backward()
    assert len(seen) == n  # the outer hooks were popped by their own exit, not ours


# ---- 11: tied weights between two offloaded layers ------------------------------------

def test_tied_weights_between_two_offloaded_layers_are_refused():
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.weight = a.weight
    m = torch.nn.Sequential(a, b)
    with pytest.raises(ValueError, match="tied"):
        offload_weights(m, ["0", "1"])
    outer = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="inside another"):
        offload_weights(outer, ["0", "0.0"])


def test_load_state_dict_with_assign_is_refused():
    if "assign" not in torch.nn.Module.load_state_dict.__code__.co_varnames:
        pytest.skip("load_state_dict(assign=True): torch 2.1+")
    m = Net()
    offload_weights(m, OFFLOADED)
    with pytest.raises(RuntimeError, match="assign=True"):
        m.load_state_dict(values(Net().state_dict()), assign=True)


# ---- issue 36 item 8: the side stream waits on the compute stream --------------------

class FakeStream:
    """Test double for torch.cuda's streams: records what it waited on."""

    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_stream(self, other):
        self.waited.append(other)

    def wait_event(self, event):
        self.waited.append(event)


class FakeEvent:
    def record(self, stream=None):
        self.stream = stream


def test_side_stream_waits_on_the_compute_stream(monkeypatch):
    """Test double for torch.cuda's stream functions (no GPU here):
    current_stream(), stream(s) and Event behave as torch's, the tensors stay
    on the CPU. Inside `with torch.cuda.stream(side)` the current stream is
    the side stream itself, so waiting on it ordered nothing."""
    compute, side = FakeStream("compute"), FakeStream("side")
    current = [compute]

    class StreamContext:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            self.prev = current[0]
            current[0] = self.s

        def __exit__(self, *a):
            current[0] = self.prev
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    m = Net()
    w = offload_weights(m, OFFLOADED)
    w.stream = side
    w.layers[1].load(asynchronous=True)
    assert side.waited == [compute]
    assert w.layers[1].event.stream is side
    w.layers[1].event = None  # record_stream needs a real CUDA tensor


def test_deleted_weight_offload_is_freed():
    """A trained, offloaded model dropped without remove() is collected with
    its host buffers (the global step pre-hook holds it weakly)."""
    import weakref
    m = Net()
    w = offload_weights(m, OFFLOADED)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x, y in data(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    refs = [weakref.ref(o) for o in (m, w, opt)] + [weakref.ref(h) for ly in w.layers
                                                     for h in ly.host]
    del m, w, opt, x, y
    gc.collect()
    assert not [r for r in refs if r() is not None]
