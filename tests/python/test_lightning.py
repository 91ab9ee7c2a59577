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
from conftest import assert_same_saved as assert_same, load_saved as load  # noqa: E402


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
from conftest import GPT, gpt_batch, gpt_loss, offloads_per_step  # noqa: E402
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


FORWARD_ONLY = """
local R = require "ferry.rules"
return R.policy { name = "forward_only", R.min_bytes(0), R.exclude_params_and_buffers(),
                  R.forward_only(), recompute = "decide", R.max_stash(0), reload = R.on_use() }
"""


class TwoPairs(pl.LightningModule):
    """Manual optimization with `pairs` forward/backward pairs per step."""

    def __init__(self, pairs):
        super().__init__()
        self.gpt = GPT()
        self.automatic_optimization = False
        self.pairs = pairs

    def training_step(self, batch, i):
        opt = self.optimizers()
        opt.zero_grad()
        for _ in range(self.pairs):
            self.manual_backward(gpt_loss(self.gpt, batch))
        opt.step()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_two_forward_backward_pairs_in_a_manual_step_offload_alike(tmp_path):
    """At f9032b9 the second pair's forward was packed as recompute (backward
    had begun in the step): R.forward_only() offloaded the first pair only."""
    policy = tmp_path / "fo.lua"
    policy.write_text(FORWARD_ONLY)
    counts = {}
    for pairs in (1, 2):
        trace = str(tmp_path / f"t{pairs}.jsonl")
        torch.manual_seed(0)
        t = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False,
                       enable_progress_bar=False, enable_model_summary=False,
                       enable_checkpointing=False, default_root_dir=str(tmp_path),
                       callbacks=[ActivationOffload(policy=str(policy), backend="host",
                                                    record_trace=trace, log_stats=False)])
        t.fit(TwoPairs(pairs), gpt_loader())
        counts[pairs] = offloads_per_step(trace)
    assert len(counts[1]) == 3 and counts[1][0] > 0 and len(set(counts[1])) == 1, counts
    assert counts[2] == [2 * n for n in counts[1]], counts


def test_logged_counters_cover_every_micro_batch_of_a_step(tmp_path):
    """accumulate_grad_batches=2: Lightning writes one row per optimizer step
    with the values logged by its last micro-batch; at f9032b9 those were
    that micro-batch's alone (half the step's offloads)."""
    import csv
    trace = str(tmp_path / "t.jsonl")
    policy = tmp_path / "everything.lua"
    policy.write_text(EVERYTHING)
    torch.manual_seed(0)
    logger = pl.loggers.CSVLogger(str(tmp_path / "logs"), name="acc")
    t = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=logger, log_every_n_steps=1,
                   accumulate_grad_batches=2, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False,
                   default_root_dir=str(tmp_path),
                   callbacks=[ActivationOffload(policy=str(policy), backend="host",
                                                record_trace=trace)])
    t.fit(GPTModule(), gpt_loader())
    per_micro = offloads_per_step(trace)
    assert len(per_micro) == 4 and per_micro[0] > 0, per_micro
    rows = [r for r in csv.DictReader(open(os.path.join(logger.log_dir, "metrics.csv")))
            if r.get("ferry/tensors_offloaded")]
    logged = [int(float(r["ferry/tensors_offloaded"])) for r in rows]
    assert logged == [per_micro[0] + per_micro[1], per_micro[2] + per_micro[3]], (logged, per_micro)


class StopsAtBatch(GPTModule):
    def on_train_batch_start(self, batch, i):
        return -1 if i == 2 else None


class Probe(pl.Callback):
    """At the epoch's end, an unrelated model's forward and backward: packed
    by ferry only if a context of ferry's is still open."""

    def on_train_epoch_end(self, trainer, pl_module):
        import ferry.torch as ft
        before = ft.stats()["tensors_packed"]
        net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
        net(torch.randn(64, 256)).sum().backward()  # 64 KiB activations: over min_bytes
        self.packed = ft.stats()["tensors_packed"] - before


def test_a_batch_start_returning_minus_one_leaves_no_context_open(tmp_path):
    """on_train_batch_start returning -1 skips the rest of the epoch with no
    on_train_batch_end: at f9032b9 ferry's context stayed open through
    on_train_epoch_end and packed whatever ran there."""
    probe = Probe()
    t = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False, default_root_dir=str(tmp_path),
                   callbacks=[ActivationOffload(policy="default", backend="host",
                                                log_stats=False), probe])
    t.fit(StopsAtBatch(), gpt_loader())
    import ferry.torch as ft
    assert ft.stats()["tensors_offloaded"] > 0
    assert probe.packed == 0


def test_a_second_fit_logs_its_own_first_step(tmp_path):
    """The engine's counters run on across fits in one process: the first
    step of a second fit logged the first fit's offloads as well (the
    increase from the engine's start: [135, 45] after [45, 45])."""
    import csv
    logged = []
    for run in range(2):
        logger = pl.loggers.CSVLogger(str(tmp_path / "logs"), name=f"fit{run}")
        t = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=logger,
                       log_every_n_steps=1, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False,
                       default_root_dir=str(tmp_path),
                       callbacks=[ActivationOffload(policy="default", backend="host")])
        torch.manual_seed(0)
        t.fit(GPTModule(), gpt_loader())
        rows = [r for r in csv.DictReader(open(os.path.join(logger.log_dir, "metrics.csv")))
                if r.get("ferry/tensors_offloaded")]
        logged.append([int(float(r["ferry/tensors_offloaded"])) for r in rows])
    assert len(logged[0]) == 2 and logged[0][0] > 0, logged
    assert logged[1] == logged[0], logged
