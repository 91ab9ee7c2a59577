"""The Hugging Face Trainer with ferry: a tiny Llama (built from a config, no
download) trained a few steps with its activations offloaded.

    python examples/hf_trainer.py [--steps 3]"""
import argparse
import tempfile

import torch
import transformers

from ferry.transformers import ActivationOffloadCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16):
        self.ids = torch.randint(0, 128, (n, 32), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    steps = ap.parse_args().steps
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, max_steps=steps,
                                              per_device_train_batch_size=4, logging_steps=1,
                                              save_strategy="no", report_to=[], use_cpu=True)
        callback = ActivationOffloadCallback(policy="default", backend="host")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                       callbacks=[callback])
        trainer.train()
    s = callback.last_stats
    print(f"{trainer.state.global_step} steps, {s['tensors_offloaded']} tensors offloaded, "
          f"{s['bytes_h2d']} bytes reloaded")
    assert s["tensors_offloaded"] > 0


if __name__ == "__main__":
    main()
