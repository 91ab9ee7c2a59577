"""ferry's checkpoints under a real Lightning Trainer (issue 37): a
last.ckpt link (ModelCheckpoint(save_last="link")) is replaced, never
written through; EMAWeightAveraging's in-place copies after a save are
fenced; the optimizer step's fence comes after the closure's forward.

The plugin crawls (a 1 MiB cap over an emulated 200 MB/s link), so a copy
made after an unfenced change holds the changed values."""
import io
import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import ferry.checkpoint  # noqa: E402
from ferry.lightning import StagedCheckpointIO, StagedCheckpointCallback  # noqa: E402
from conftest import assert_same_saved as assert_same, load_saved as load  # noqa: E402

SLOW = dict(host_cap=1 << 20, link=(200e6, 200e6, 0, 1))


class Wide(pl.LightningModule):
    """1 MiB of weights (3 MiB with AdamW's moments), no buffers."""

    def __init__(self, events=None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(),
                                       torch.nn.Linear(512, 1))
        self.events = events

    def training_step(self, batch, i):
        if self.events is not None:
            pending = ferry.checkpoint.pending()
            self.events.append(("forward", [h.fenced for h in pending]))
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def loader(n=48):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 512, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]),
                                       batch_size=8)


class Recording(StagedCheckpointIO):
    """What torch.save would write for each path, at the moment of the save."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.reference = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        self.reference[os.fspath(path)] = buf.getvalue()
        super().save_checkpoint(checkpoint, path, storage_options)


def trainer(tmp_path, callbacks, plugins=(), **kw):
    kw.setdefault("max_steps", 6)
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path),
                      callbacks=list(callbacks), plugins=list(plugins), **kw)


def test_save_last_link_is_replaced_not_written_through(tmp_path):
    ckdir = tmp_path / "ckpt"
    torch.manual_seed(0)
    first = pl.callbacks.ModelCheckpoint(dirpath=str(ckdir), every_n_train_steps=2,
                                         save_top_k=1, filename="{step}", save_last="link")
    trainer(tmp_path, [first], [StagedCheckpointIO()], max_steps=4).fit(Wide(), loader())
    last = ckdir / "last.ckpt"
    assert os.path.islink(last) and os.readlink(last) == "step=4.ckpt"
    best_bytes = (ckdir / "step=4.ckpt").read_bytes()
    # a later run saves last.ckpt itself (save_last=True): the link goes,
    # the checkpoint it named stays as it was
    second = pl.callbacks.ModelCheckpoint(dirpath=str(ckdir), every_n_train_steps=2,
                                          save_top_k=0, save_last=True,
                                          enable_version_counter=False)
    torch.manual_seed(1)
    trainer(tmp_path, [second], [StagedCheckpointIO()], max_steps=2).fit(Wide(), loader())
    assert not os.path.islink(last) and load(last)["global_step"] == 2
    assert (ckdir / "step=4.ckpt").read_bytes() == best_bytes
    assert load(ckdir / "step=4.ckpt")["global_step"] == 4


def test_ema_weight_averaging_copies_after_a_save_are_fenced(tmp_path):
    """EMAWeightAveraging swaps the averaged and the live weights with copy_
    at validation and copies the average into the module at the end of
    training, both after the save of that step started."""
    ema = pytest.importorskip("lightning.pytorch.callbacks").EMAWeightAveraging
    torch.manual_seed(0)
    plugin = Recording(**SLOW)
    ck = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3,
                                      save_top_k=-1, filename="{step}")
    t = trainer(tmp_path, [ema(), ck, StagedCheckpointCallback()], [plugin],
                val_check_interval=3, num_sanity_val_steps=0)
    t.fit(Wide(), loader(), loader(16))
    assert len(plugin.reference) == 2
    for path, ref in plugin.reference.items():
        got = load(path)
        assert "current_model_state" in got  # EMA's layout: average and live weights
        assert_same(torch.load(io.BytesIO(ref), weights_only=False), got, path)


def test_under_lightning_the_fence_comes_after_the_closures_forward(tmp_path):
    """Lightning steps as optimizer.step(closure): the forward and backward
    in the closure overlap the snapshot's copies; the fence comes after."""
    torch.manual_seed(0)
    events = []
    plugin = Recording(**SLOW)
    ck = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2,
                                      save_top_k=-1, filename="{step}")
    trainer(tmp_path, [ck, StagedCheckpointCallback()], [plugin]).fit(Wide(events), loader())
    # the forward of the step after each save (at steps 2 and 4 of 6) ran
    # with that save unfenced; later ones see it fenced, maybe still writing
    # (on a loaded machine the first save may still be pending at step 4)
    unfenced = [any(not f for f in fenced) for what, fenced in events]
    assert unfenced == [False, False, True, False, True, False], events
    for path, ref in plugin.reference.items():
        assert_same(torch.load(io.BytesIO(ref), weights_only=False), load(path), path)
