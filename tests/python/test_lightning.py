"""ferry.lightning with a real lightning Trainer on CPU (venv with pip's
lightning; skipped where lightning is not installed): the plugin's files
equal what torch.save would have written at that moment, training resumes
from them exactly as from torch.save's, and the callback replaces
CPUOffloadCallback (offload_keys, skipped-object report, strategy checks)."""
import io
import logging
import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from ferry.checkpoint import CheckpointIOError, describe  # noqa: E402
from ferry.lightning import StagedCheckpointIO, StagedCheckpointCallback, strategy_support  # noqa: E402


def load(path):
    return torch.load(path, weights_only=False)


def assert_same(a, b, where="ckpt"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8),
                           b.contiguous().view(-1).view(torch.uint8)), f"{where}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


class Tag:
    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, Tag) and other.name == self.name


class Net(pl.LightningModule):
    def __init__(self, tag=False):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.tag = tag

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]

    def on_save_checkpoint(self, checkpoint):
        if self.tag:  # a custom object inside an offloaded key
            checkpoint["optimizer_states"][0]["ferry_test_tag"] = Tag("note")


def loader():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, 32, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)


class TorchSaveAtSaveTime(pl.Callback):
    """What torch.save would write at the moment Lightning saves."""

    def __init__(self):
        self.reference = {}

    def on_save_checkpoint(self, trainer, module, checkpoint):
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        self.reference[trainer.global_step] = buf.getvalue()


def trainer(tmp_path, max_steps, callbacks=(), plugins=(), **kw):
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), callbacks=list(callbacks),
                      plugins=list(plugins), **kw)


def ckpt_callback(tmp_path):
    return pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3,
                                        save_top_k=-1, filename="{step}")


def test_plugin_checkpoints_equal_torch_save_and_resume(tmp_path):
    torch.manual_seed(0)
    ref = TorchSaveAtSaveTime()
    plugin = StagedCheckpointIO()
    t = trainer(tmp_path, 6, [ckpt_callback(tmp_path), ref], [plugin])
    t.fit(Net(), loader())
    assert plugin.saves == 2 and not plugin._pending  # teardown waited for both
    for step in (3, 6):
        path = tmp_path / "ckpt" / f"step={step}.ckpt"
        ours = load(path)
        theirs = torch.load(io.BytesIO(ref.reference[step]), weights_only=False)
        assert ours["global_step"] == step
        assert_same(theirs, ours, f"step {step}")
    assert plugin.last_stats["staged"] > 0 and plugin.last_stats["copied"] == 0

    # resume from ferry's file and from torch.save's: the same training
    (tmp_path / "ref.ckpt").write_bytes(ref.reference[3])
    finals = []
    for src in (tmp_path / "ckpt" / "step=3.ckpt", tmp_path / "ref.ckpt"):
        torch.manual_seed(1)
        m = Net()
        t2 = trainer(tmp_path / "resume", 9, plugins=[StagedCheckpointIO()])
        t2.fit(m, loader(), ckpt_path=str(src))
        assert t2.global_step == 9
        finals.append({k: v.clone() for k, v in m.state_dict().items()})
    assert_same(finals[1], finals[0], "resumed")


def test_callback_replaces_cpu_offload_callback(tmp_path, caplog):
    torch.manual_seed(0)
    cb = StagedCheckpointCallback()
    t = trainer(tmp_path, 3, [cb, ckpt_callback(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="ferry.lightning"):
        t.fit(Net(tag=True), loader())
    assert cb.enabled and isinstance(t.strategy.checkpoint_io, StagedCheckpointIO)
    assert cb.checkpoints == 1
    rep = cb.last_report
    assert rep["tensors"] > 0 and rep["skipped"] == [
        f"optimizer_states.0.ferry_test_tag: {__name__}.Tag"]
    assert "1 object(s)" in caplog.text and "ferry_test_tag" in caplog.text
    assert "loops" in rep["other_keys"]
    stats = cb.plugin.last_stats
    got = load(tmp_path / "ckpt" / "step=3.ckpt")
    # offload_keys: their tensors are staged; tensors under other keys (the
    # loops' and callbacks' state) are copied when the save starts
    others = [k for k in got if k not in cb.offload_keys]
    assert stats["staged_bytes"] == describe(got, keys=cb.offload_keys)["tensor_bytes"] > 0
    assert stats["copied_bytes"] == describe(got, keys=others)["tensor_bytes"]
    assert got["optimizer_states"][0]["ferry_test_tag"] == Tag("note")

    # offload_keys narrowed: the optimizer state is copied at save time instead
    cb2 = StagedCheckpointCallback(offload_keys=["state_dict"])
    trainer(tmp_path / "b", 3, [cb2, ckpt_callback(tmp_path / "b")]).fit(Net(), loader())
    got = load(tmp_path / "b" / "ckpt" / "step=3.ckpt")
    assert cb2.plugin.last_stats["staged_bytes"] == describe(got, keys=["state_dict"])["tensor_bytes"]
    assert cb2.plugin.last_stats["copied_bytes"] >= describe(got, keys=["optimizer_states"])["tensor_bytes"] > 0


def test_strategy_checks():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    assert strategy_support(SingleDeviceStrategy(device=torch.device("cpu")))[0]
    assert strategy_support(DDPStrategy())[0]
    ok, reason = strategy_support(FSDPStrategy())
    assert not ok and "FSDP" in reason


class TrainerOnGPUStandIn:
    """Lightning refuses FSDP without a GPU, so a Trainer with it cannot
    exist here: this stand-in carries the real FSDPStrategy object."""

    def __init__(self, strategy):
        self.strategy = strategy


def test_fsdp_strategy_left_alone():
    from lightning.pytorch.strategies import FSDPStrategy

    cb = StagedCheckpointCallback()
    t = TrainerOnGPUStandIn(FSDPStrategy())
    io_before = t.strategy.checkpoint_io
    with pytest.warns(UserWarning, match="StagedCheckpointCallback is disabled.*FSDP"):
        cb.setup(t, Net(), "fit")
    assert not cb.enabled and t.strategy.checkpoint_io is io_before
    assert not isinstance(io_before, StagedCheckpointIO)


def test_failed_write_raises_at_teardown(tmp_path):
    plugin = StagedCheckpointIO()
    bad = tmp_path / "ro"
    bad.mkdir()
    os.chmod(bad, 0o500)
    if os.access(bad, os.W_OK):  # root ignores permissions: use a path under a file
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "ck.ckpt"
    else:
        target = bad / "ck.ckpt"
    plugin._pending[str(target)] = __import__("ferry.torch").torch.snapshot(
        {"w": torch.ones(3)}, target, distributed="all")
    with pytest.raises(CheckpointIOError, match=str(target)):
        plugin.teardown()


# ---- ActivationOffload: activations offloaded in every training step ---------
from conftest import GPT, gpt_batch, gpt_loss  # noqa: E402
from ferry.lightning import ActivationOffload  # noqa: E402

EVERYTHING = """
local R = require "ferry.rules"
return R.policy { name = "everything", R.min_bytes(0), R.exclude_params_and_buffers(),
                  R.max_stash(0), reload = R.on_use() }
"""


class GPTModule(pl.LightningModule):
    def __init__(self, manual=False):
        super().__init__()
        self.gpt = GPT()
        self.automatic_optimization = not manual
        self.grads = []

    def training_step(self, batch, i):
        loss = gpt_loss(self.gpt, batch)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.grads.append([p.grad.clone() for p in self.gpt.parameters()])
        opt.step()

    def on_before_optimizer_step(self, optimizer):
        if self.automatic_optimization:
            self.grads.append([p.grad.clone() for p in self.gpt.parameters()])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def gpt_loader():
    torch.manual_seed(3)
    data = [gpt_batch() for _ in range(5)]
    return torch.utils.data.DataLoader(data, batch_size=None)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_activation_offload_callback_trains_bit_identically(tmp_path, manual):
    import ferry.torch as ft
    policy = tmp_path / "everything.lua"
    policy.write_text(EVERYTHING)
    runs = []
    for cb in (None, ActivationOffload(policy=str(policy), backend="host")):
        torch.manual_seed(0)
        m = GPTModule(manual)
        logger = pl.loggers.CSVLogger(str(tmp_path / "logs"), name="with" if cb else "without")
        t = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=logger,
                       log_every_n_steps=1, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False,
                       default_root_dir=str(tmp_path), callbacks=[cb] if cb else [])
        t.fit(m, gpt_loader())
        runs.append((m, logger))
    (plain, _), (mine, logger) = runs
    assert len(plain.grads) == len(mine.grads) == 4
    for step, (ga, gb) in enumerate(zip(plain.grads, mine.grads)):
        for i, (x, y) in enumerate(zip(ga, gb)):
            assert_same(x, y, f"step {step} grad {i}")
    assert_same(plain.state_dict(), mine.state_dict(), "final weights")
    s = ft.stats()
    assert s["tensors_offloaded"] > 0 and s["bytes_h2d"] > 0, s
    metrics = open(os.path.join(logger.log_dir, "metrics.csv")).read()
    assert "ferry/bytes_d2h" in metrics.splitlines()[0] and "ferry/arena_peak" in metrics


def test_old_names_still_work_with_a_warning():
    import ferry.lightning as fl
    with pytest.warns(DeprecationWarning, match="FerryCheckpointIO is now StagedCheckpointIO"):
        assert fl.FerryCheckpointIO is fl.StagedCheckpointIO
    with pytest.warns(DeprecationWarning, match="StagedCheckpointCallback"):
        assert fl.FerryOffloadCallback is fl.StagedCheckpointCallback
