"""Item 3: losses and gradients bit-identical with and without ferry over
several optimizer steps, on real autograd (CPU torch, host backend)."""
import pytest
import torch

import ferry.torch as ft
from conftest import GPT, assert_same_training, gpt_batch, gpt_loss, train


def offload_default(**kw):
    return lambda model: ft.offload(model, policy="default", backend="host", **kw)


def check_offloaded(reloads=True):
    s = ft.stats()
    assert s["tensors_offloaded"] > 0, s
    if reloads:  # real copies back, not only stash hits
        assert s["bytes_h2d"] > 0, s
    assert s["live_handles"] == 0, s
    return s


def test_transformer_encoder():
    def make():
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        return torch.nn.TransformerEncoder(layer, 3)

    def loss(m, x):
        return m(x).pow(2).mean()

    batch = lambda: torch.randn(4, 16, 32)
    base = train(make, batch, loss)
    mine = train(make, batch, loss, offload=offload_default())
    assert_same_training(base, mine)
    check_offloaded()
    sites = {p: (l, n) for _, p, _, l, n in ft.model_sites(mine[1])}
    assert sites["layers.2.linear1"] == (2, 3)


def test_gpt_with_lm_head():
    base = train(GPT, gpt_batch, gpt_loss, steps=4)
    mine = train(GPT, gpt_batch, gpt_loss, steps=4, offload=offload_default())
    assert_same_training(base, mine)
    s = check_offloaded()
    assert s["tensors_kept"] > 0  # params, head


def test_gpt_prefetching_policy_and_tiny_stash():
    """layers.lua prefetches; max stash 1 through a policy source forces
    every offloaded tensor out of device memory before backward."""
    src = """
local R = require "ferry.rules"
return R.policy { name = "tiny-stash", R.min_bytes(1024), R.exclude_params_and_buffers(),
                  R.max_stash(1), reload = R.prefetch(3) }
"""
    import tempfile, os
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(src)
    try:
        base = train(GPT, gpt_batch, gpt_loss)
        mine = train(GPT, gpt_batch, gpt_loss, offload=lambda m: ft.offload(m, policy=f.name))
        assert_same_training(base, mine)
        s = check_offloaded()
        assert s["prefetches"] > 0, s
        assert s["stash_hits"] < s["tensors_offloaded"], s
    finally:
        os.unlink(f.name)


def test_torchvision_cnn():
    tv = pytest.importorskip("torchvision")

    def make():
        return tv.models.resnet18(weights=None, num_classes=10) if "weights" in \
            tv.models.resnet18.__code__.co_varnames or True else None

    def loss(m, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(m(x), y)

    batch = lambda: (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))
    base = train(make, batch, loss, steps=2)
    mine = train(make, batch, loss, steps=2, offload=offload_default())
    assert_same_training(base, mine)
    check_offloaded()


def _hf_train(make, vocab):
    def loss(m, ids):
        return m(input_ids=ids, labels=ids).loss

    batch = lambda: torch.randint(0, vocab, (2, 12))
    base = train(make, batch, loss)
    mine = train(make, batch, loss, offload=offload_default())
    assert_same_training(base, mine)
    check_offloaded()
    return mine[1]


def test_hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = _hf_train(lambda: transformers.LlamaForCausalLM(cfg), 96)
    sites = {p: (l, n) for _, p, _, l, n in ft.model_sites(model)}
    assert sites["model.layers.1.mlp.up_proj"] == (1, 3)
    assert sites["lm_head"] == (-1, 3)


def test_hf_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = _hf_train(lambda: transformers.GPT2LMHeadModel(cfg), 96)
    sites = {p: (l, n) for _, p, _, l, n in ft.model_sites(model)}
    assert sites["transformer.h.2.attn.c_proj"] == (2, 3)


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_checkpoint(mode):
    make = lambda: GPT(checkpoint=mode)
    base = train(make, gpt_batch, gpt_loss)
    mine = train(make, gpt_batch, gpt_loss, offload=offload_default())
    assert_same_training(base, mine)
    # the non-checkpointed part (embeddings, head inputs) still goes through ferry
    assert ft.stats()["tensors_packed"] > 0


def test_checkpoint_reentrant_backward_inside_context_is_recompute():
    """Backward inside the context: the reentrant checkpoint's recomputation
    saves tensors through ferry, described with phase=recompute."""
    torch.manual_seed(0)
    model = GPT(checkpoint="reentrant")
    ref = GPT(checkpoint="reentrant")
    ref.load_state_dict(model.state_dict())
    batch = gpt_batch()
    gpt_loss(ref, batch).backward()
    with ft.offload(model, policy="default"):
        gpt_loss(model, batch).backward()
    assert ft.stats()["recompute_packs"] > 0
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n


class Tricky(torch.nn.Module):
    """Views, in-place ops, a tensor saved twice, non-dense views."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(48, 48)
        self.lin2 = torch.nn.Linear(48, 48)

    def forward(self, x):
        y = self.lin(x)
        y.relu_()                      # in place on a fresh output; relu_ saves its result
        z = y.t()                      # a transposed view (dense, not contiguous)
        a = z.sin()                    # saves z
        b = a * a                      # a saved twice: stored once (alias)
        c = b[:, 1:]                   # gapped view: kept (non-dense)
        d = c.exp() + c.sin()          # exp saves its output, sin its gapped input
        e = y.unsqueeze(0).expand(3, -1, -1)  # stride-0 view: kept
        f = (e * e.sum()).sum(0)
        g = d.t().contiguous()
        h = self.lin2(torch.nn.functional.pad(g, (0, 0, 0, 1))[: x.shape[0]])
        h2 = h.clone()
        h2.mul_(2.0)                   # in-place on a tensor not saved
        return (h2 * y).mean() + f.mean() + (a[0] * b[1]).sum()


def test_views_inplace_saved_twice():
    batch = lambda: torch.randn(48, 48)
    loss = lambda m, x: m(x)
    base = train(Tricky, batch, loss, steps=3)
    mine = train(Tricky, batch, loss, steps=3,
                 offload=lambda m: ft.offload(m, policy="default", fast_keep=True))
    assert_same_training(base, mine)
    s = ft.stats()
    assert s["tensors_offloaded"] > 0
    assert s["tensors_aliased"] > 0, s
    assert s["kept_non_dense"] > 0, s


def test_backward_twice_with_retain_graph():
    torch.manual_seed(0)
    m = GPT(layers=2)
    batch = gpt_batch()
    with ft.offload(m, policy="default"):
        loss = gpt_loss(m, batch)
    loss.backward(retain_graph=True)
    g1 = [p.grad.clone() for p in m.parameters()]
    loss.backward()
    for p, g in zip(m.parameters(), g1):
        assert torch.equal(p.grad, 2 * g)
    assert ft.stats()["unpacks_repeated"] > 0
    del loss
    assert ft.step() == 0
    s = ft.stats()
    assert s["live_handles"] == 0 and s["device_bytes_held"] == 0 and s["arena_in_use"] == 0


def test_dtypes_roundtrip_bit_identical():
    """Every dtype comes back with the same bits, through real reloads."""
    src = """
return { api = 1, name = "all", knobs = { max_fwd_stash = 1, min_offload_bytes = 1 },
  decide = function(t, ctx) return ferry.OFFLOAD, ferry.ON_USE, nil, true end }
"""
    import tempfile, os
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(src)
    try:
        dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64]
        for dt in dtypes:
            x = torch.randn(7, 5, dtype=dt, requires_grad=True)
            ref = x.detach().clone()
            with ft.offload(None, policy=f.name):
                y = (x * x.t().t()).sum() if not dt.is_complex else (x * x).abs().sum()
            y.backward()
            expect = 2 * ref if not dt.is_complex else None
            if expect is not None:
                assert torch.equal(x.grad, expect), dt
        assert ft.stats()["bytes_h2d"] > 0
    finally:
        os.unlink(f.name)
