"""ferry.torch.OffloadActivations / NoOffload: torchtune's context managers
on ferry's engine — the same losses and gradients as plain torch, real
reloads, NoOffload keeping a region on device, composition with
torch.utils.checkpoint, and torchtune's arguments meaning what they mean."""
import pytest
import torch

import ferry.torch as ft
from conftest import GPT, assert_same_training, gpt_batch, gpt_loss, train


def test_one_import_switches_a_recipe():
    base = train(GPT, gpt_batch, gpt_loss, steps=3)
    mine = train(GPT, gpt_batch, gpt_loss, steps=3,
                 offload=lambda m: ft.OffloadActivations(max_fwd_stash_size=1,
                                                         min_offload_size=1024))
    assert_same_training(base, mine)
    s = ft.stats()
    assert s["tensors_offloaded"] > 0 and s["bytes_h2d"] > 0, s


def test_arguments_mean_what_they_mean():
    torch.manual_seed(0)
    model = GPT()
    batch = gpt_batch()
    # every activation is below 1 GiB: nothing offloaded
    with ft.OffloadActivations(min_offload_size=1 << 30):
        gpt_loss(model, batch).backward()
    assert ft.stats()["tensors_offloaded"] == 0
    ft.close()
    # a large stash holds everything: offloaded, but no reload (stash hits)
    with ft.OffloadActivations(max_fwd_stash_size=100000, min_offload_size=0):
        gpt_loss(model, batch).backward()
    s = ft.stats()
    assert s["tensors_offloaded"] > 0 and s["stash_hits"] >= s["tensors_offloaded"], s  # aliases hit too
    assert s["bytes_h2d"] == 0, s
    with pytest.raises(ValueError, match="max_fwd_stash_size=-1"):
        ft.OffloadActivations(max_fwd_stash_size=-1)
    with pytest.raises(ValueError, match="min_offload_size=1.5"):
        ft.OffloadActivations(min_offload_size=1.5)


def test_no_offload_keeps_its_region():
    torch.manual_seed(0)
    model = GPT()
    batch = gpt_batch()
    with ft.OffloadActivations(max_fwd_stash_size=0, min_offload_size=0):
        with ft.NoOffload():
            loss = gpt_loss(model, batch)
    loss.backward()
    assert ft.stats()["tensors_packed"] == 0  # the engine never saw them
    ft.close()
    # a region inside: the head kept, the rest offloaded
    idx = batch[:, :-1]
    with ft.OffloadActivations(max_fwd_stash_size=0, min_offload_size=0):
        x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
        for block in model.h:
            x = block(x)
        packed_before_head = ft.stats()["tensors_packed"]
        with ft.NoOffload():
            logits = model.lm_head(model.ln_f(x))
        assert ft.stats()["tensors_packed"] == packed_before_head  # the head's: not seen
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
    loss.backward()
    assert ft.stats()["tensors_offloaded"] > 0


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_composes_with_checkpointing(mode):
    make = lambda: GPT(checkpoint=mode)  # noqa: E731
    base = train(make, gpt_batch, gpt_loss, steps=2)
    mine = train(make, gpt_batch, gpt_loss, steps=2,
                 offload=lambda m: ft.OffloadActivations(max_fwd_stash_size=0,
                                                         min_offload_size=0))
    assert_same_training(base, mine)
    assert ft.stats()["bytes_h2d"] > 0
