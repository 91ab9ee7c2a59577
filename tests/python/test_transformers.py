"""ferry.transformers.ActivationOffloadCallback with a real HF Trainer on a
tiny Llama built from a config (no download): the same weights after a few
steps as the Trainer without it, with tensors really offloaded and reloaded
(skipped only where transformers is not installed: Debian's torch 1.13)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import ferry.torch as ft  # noqa: E402
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
