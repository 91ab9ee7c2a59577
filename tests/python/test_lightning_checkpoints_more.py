"""ferry's checkpoints under a real Lightning Trainer, the less common
loops (review of issue 37, items 3 and 7): gradient accumulation, manual
optimization, validation every n steps. Every file equals what torch.save
wrote at the moment of its save (the plugin crawls, so an unfenced change
made after the save shows up in the file)."""
import io

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from ferry.lightning import StagedCheckpointCallback  # noqa: E402
from test_lightning_checkpoints import (SLOW, Recording, Wide, assert_same, load,  # noqa: E402
                                        loader, trainer)


class Manual(Wide):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, i):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


@pytest.mark.parametrize("loop", ["accumulate", "manual", "validate_every_2"])
def test_every_checkpoint_equals_the_state_at_its_save(tmp_path, loop):
    torch.manual_seed(0)
    plugin = Recording(**SLOW)
    ck = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2,
                                      save_top_k=-1, filename="{step}", save_last="link")
    kw, model = {}, Wide()
    if loop == "accumulate":
        kw = dict(accumulate_grad_batches=2)
    elif loop == "manual":
        model = Manual()
    else:
        kw = dict(val_check_interval=2, num_sanity_val_steps=0)
    t = trainer(tmp_path, [ck, StagedCheckpointCallback()], [plugin], **kw)
    t.fit(model, loader(), loader(16) if loop == "validate_every_2" else None)
    assert len(plugin.reference) >= 3
    for path, ref in plugin.reference.items():
        assert_same(torch.load(io.BytesIO(ref), weights_only=False), load(path), path)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert load(last)["global_step"] == 6
