"""ferry.transformers.ActivationOffloadCallback with a real HF Trainer on a
tiny Llama built from a config (no download): the same weights after a few
steps as the Trainer without it, with tensors really offloaded and reloaded
(skipped only where transformers is not installed: Debian's torch 1.13)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import ferry.torch as ft  # noqa: E402
from conftest import offloads_per_step  # noqa: E402
from ferry.transformers import ActivationOffloadCallback  # noqa: E402

EVERYTHING = """
local R = require "ferry.rules"
return R.policy { name = "everything", R.min_bytes(0), R.exclude_params_and_buffers(),
                  R.max_stash(0), reload = R.on_use() }
"""


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 96, (12, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def fit(tmp_path, callbacks, accumulate):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulate, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   callbacks=callbacks)
    trainer.train()
    return model, trainer


@pytest.mark.parametrize("accumulate", [1, 2])
def test_trainer_with_the_callback_trains_bit_identically(tmp_path, accumulate):
    policy = tmp_path / "everything.lua"
    policy.write_text(EVERYTHING)
    plain, _ = fit(tmp_path, [], accumulate)
    cb = ActivationOffloadCallback(policy=str(policy), backend="host")
    mine, trainer = fit(tmp_path, [cb], accumulate)
    for (name, a), b in zip(plain.state_dict().items(), mine.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after 3 steps"
    s = ft.stats()
    assert s["tensors_offloaded"] > 0 and s["bytes_h2d"] > 0, s
    assert s["live_handles"] == 0
    logged = [h for h in trainer.state.log_history if "ferry/bytes_d2h" in h]
    assert logged and logged[-1]["ferry/tensors_offloaded"] > 0


FORWARD_ONLY = """
local R = require "ferry.rules"
return R.policy { name = "forward_only", R.min_bytes(0), R.exclude_params_and_buffers(),
                  R.forward_only(), recompute = "decide", R.max_stash(0), reload = R.on_use() }
"""


@pytest.mark.parametrize("policy", ["forward_only", "fraction"])
def test_accumulated_micro_batches_offload_alike(tmp_path, policy):
    """gradient_accumulation_steps=4: the Trainer calls on_step_begin once per
    optimizer step, so at f9032b9 one context spanned the four micro-batches
    and 2..4 were packed as recompute: R.forward_only() offloaded
    [n, 0, 0, 0, n, ...], fraction.lua [9, 9, 9, 9, 21, 15, 0, 0, ...]. Now
    every micro-batch offloads the same."""
    if policy == "forward_only":
        path = tmp_path / "fo.lua"
        path.write_text(FORWARD_ONLY)
        policy = str(path)
    trace = str(tmp_path / "t.jsonl")
    cb = ActivationOffloadCallback(policy=policy, backend="host", record_trace=trace)
    plain, _ = fit(tmp_path, [], 4)
    mine, _ = fit(tmp_path, [cb], 4)
    for (name, a), b in zip(plain.state_dict().items(), mine.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs"
    counts = offloads_per_step(trace)
    # 3 optimizer steps of 4 micro-batches (2 in the epoch's last: 6 batches
    # an epoch), each micro-batch an engine step; fraction.lua learns the
    # step's total in its first step, then offloads its share
    learned = counts[1:] if policy == "fraction" else counts
    assert len(counts) == 10 and learned[0] > 0 and len(set(learned)) == 1, counts


class Boom(RuntimeError):
    pass


def test_nothing_left_behind_after_an_exception(tmp_path):
    """The Trainer calls no callback when training_step raises: at f9032b9
    the callback's saved-tensor hooks stayed pushed, and a later, unrelated
    model's forward and backward went through ferry. Now the context is
    left when the model's forward ends, raising or not, and the forward's
    wrapper removes itself at the model's next forward."""
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    calls = {"n": 0}

    def explode(module, args, output):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Boom("an interrupt in the third forward")

    layer = model.model.layers[1].mlp.register_forward_hook(explode)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=2,
        learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True, seed=0)
    cb = ActivationOffloadCallback(policy="default", backend="host")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb])
    with pytest.raises(Boom):
        trainer.train()
    layer.remove()
    assert ft.stats()["tensors_offloaded"] > 0
    packed = ft.stats()["tensors_packed"]
    other = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    other(torch.randn(8, 64)).sum().backward()
    model.train()
    model(input_ids=torch.randint(0, 96, (2, 16)), labels=torch.randint(0, 96, (2, 16))).loss.backward()
    assert ft.stats()["tensors_packed"] == packed
    assert "forward" not in model.__dict__  # the wrapper removed itself


def test_a_deepcopy_of_the_model_during_training_runs_itself(tmp_path):
    """A callback that copies the model while training (an EMA or evaluation
    copy): the copy's forward was the callback's closure, shared by
    deepcopy, so the copy ran the original model. Now the copy runs its own
    weights (here a zeroed head: all logits 0)."""
    import copy

    class Twin(transformers.TrainerCallback):
        logits = None

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if self.logits is None:
                twin = copy.deepcopy(model)
                torch.nn.init.zeros_(twin.lm_head.weight)
                twin.eval()
                with torch.no_grad():
                    self.logits = twin(input_ids=torch.randint(0, 96, (1, 8))).logits

    twin = Twin()
    cb = ActivationOffloadCallback(policy="default", backend="host")
    model, _ = fit(tmp_path, [cb, twin], 1)
    assert twin.logits is not None and torch.count_nonzero(twin.logits) == 0
    assert "forward" not in model.__dict__
