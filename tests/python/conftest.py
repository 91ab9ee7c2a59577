"""Shared helpers of the ferry Python tests (CPU torch, host backend).

tests/python/run.sh runs them against the installed wheel in fresh venvs
(FERRY_EXPECT_INSTALLED names the venv); by hand, PYTHONPATH=<build>/python
runs them against the build tree."""
import contextlib
import importlib
import json
import os

import pytest

# run.sh names the modules an interpreter must have (the torch 2.x venv:
# transformers, lightning, torchvision): missing one fails the session
# instead of silently skipping the tests that need it.
REQUIRED = [m for m in os.environ.get("FERRY_REQUIRE_MODULES", "").split() if m]


def pytest_sessionstart(session):
    missing = []
    for m in REQUIRED:
        try:
            importlib.import_module(m)
        except Exception as e:  # ImportError, or a broken install
            missing.append(f"{m} ({type(e).__name__}: {e})")
    if missing:
        pytest.exit("required test dependencies missing: " + "; ".join(missing), returncode=1)
    expect = os.environ.get("FERRY_EXPECT_INSTALLED")
    if expect:
        import ferry

        where = os.path.realpath(ferry.__file__)
        if not where.startswith(os.path.realpath(expect) + os.sep):
            pytest.exit(f"ferry was imported from {where}, not from the installed package in "
                        f"{expect}", returncode=1)


torch = pytest.importorskip("torch")

import ferry  # noqa: E402
import ferry.torch as ft  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICY_DIR = os.path.join(REPO, "policies")
SHIPPED_POLICIES = sorted(f[:-4] for f in os.listdir(POLICY_DIR) if f.endswith(".lua"))


# One thread from the start, not only from the first test's fixture: a
# module-scoped fixture (a baseline run) is set up before any function-scoped
# one, and torch 2's CPU reductions (LayerNorm's weight gradient) sum in an
# order that depends on the thread count, so a baseline taken with two
# threads differs in the last bit from a run with one.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_engines():
    """Every test starts and ends without ferry engines; one thread keeps CPU
    math deterministic and the 2-core machine usable."""
    torch.set_num_threads(1)
    ft.close()
    yield
    ft.close()


def bits(t):
    """A tensor's bytes, for bit-for-bit comparison (torch.equal treats
    -0.0 == 0.0 and NaN != NaN)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def assert_bit_identical(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ (max abs diff {(a.double() - b.double()).abs().max().item()})"


def load_saved(path):
    """torch.load of a checkpoint, whole objects allowed (torch 1.13 has no
    weights_only)."""
    if "weights_only" in torch.load.__code__.co_varnames:
        return torch.load(path, weights_only=False)
    return torch.load(path)


def assert_same_saved(a, b, where="obj", strict=False):
    """Structure and values equal, tensors bit for bit; strict also compares
    strides and container types (what torch.save itself preserves)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert not strict or a.stride() == b.stride(), f"{where}: strides {a.stride()} vs {b.stride()}"
        assert torch.equal(bits(a), bits(b)), f"{where}: values differ"
    elif isinstance(a, dict):
        assert not strict or type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same_saved(a[k], b[k], f"{where}.{k}", strict)
    elif isinstance(a, (list, tuple)):
        assert not strict or type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_saved(x, y, f"{where}.{i}", strict)
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def train(make_model, make_batch, loss_fn, steps=3, offload=None, after_backward=None):
    """Train `steps` AdamW steps; returns [(loss, [grads])] per step and the model.

    offload: None (plain autograd) or a function model -> context manager.
    The forward runs inside the context, backward after it (as in torchtune)."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    history = []
    for i in range(steps):
        torch.manual_seed(1000 + i)
        batch = make_batch()
        ctx = offload(model) if offload else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model, batch)
        loss.backward()
        if after_backward:
            after_backward(model)
        grads = [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append((loss.detach().clone(), grads))
    return history, model


def assert_same_training(base, other):
    (hist_a, model_a), (hist_b, model_b) = base, other
    assert len(hist_a) == len(hist_b)
    for step, ((la, ga), (lb, gb)) in enumerate(zip(hist_a, hist_b)):
        assert_bit_identical(la, lb, f"step {step} loss")
        names = [n for n, _ in model_a.named_parameters()]
        for n, x, y in zip(names, ga, gb):
            assert (x is None) == (y is None), f"step {step} grad {n}: presence differs"
            if x is not None:
                assert_bit_identical(x, y, f"step {step} grad {n}")
    for (n, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert_bit_identical(p, q, f"final parameter {n}")


def read_trace(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def offloads_per_step(trace):
    """Offloaded packs per engine step of a recorded trace, steps without
    one as 0 (closes the session first: that flushes the trace)."""
    ft.close()
    per = {}
    for e in read_trace(trace):
        if e["ev"] == "pack" and e["decision"] == "offload":
            per[e["step"]] = per.get(e["step"], 0) + 1
    return [per.get(s, 0) for s in range(min(per), max(per) + 1)] if per else []


# ---- models --------------------------------------------------------------------------
class Block(torch.nn.Module):
    """GPT-2-style block with module names the shipped policies know
    (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj, ln_1, ln_2)."""

    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln_2 = torch.nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Attention(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = torch.nn.Linear(d, 3 * d)
        self.c_proj = torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)  # views
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # non-contiguous
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.c_proj(y)


class MLP(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = torch.nn.Linear(d, 4 * d)
        self.act = torch.nn.GELU()
        self.c_proj = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class GPT(torch.nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, layers=4, ctx=16, checkpoint=None):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(ctx, d)
        self.h = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        self.checkpoint = checkpoint  # None, "reentrant", "non_reentrant"

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            if self.checkpoint:
                import torch.utils.checkpoint as cp

                x = cp.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_batch(vocab=64, b=4, t=16):
    return torch.randint(0, vocab, (b, t + 1))


def gpt_loss(model, batch):
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
