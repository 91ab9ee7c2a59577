"""What fences a snapshot (issue 37, items 1, 2, 7): with no optimizer= on
every torch (1.13 has no global optimizer hook of its own), the training
forward's fence still in place when optimizer= is given, a step with a
closure fenced after the closure (its forward and backward overlap the
copies), and an explicit fence().

Each snapshot crawls: a 1 MiB cap over an emulated 200 MB/s link, so its
last copies are issued long after snapshot() returned; a step or forward
that is not fenced puts later values into the file."""
import torch

import ferry.torch as ft

SLOW = dict(host_cap=1 << 20, link=(200e6, 200e6, 0, 1))


def load(path):
    if "weights_only" in torch.load.__code__.co_varnames:
        return torch.load(path, weights_only=False)
    return torch.load(path)


def clone(sd):
    return {k: v.detach().clone() for k, v in sd.items()}


def assert_file_holds(path, expected):
    got = load(path)
    assert list(got) == list(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), f"{k}: the file holds later values"


def test_no_optimizer_given_the_next_step_is_fenced(tmp_path):
    """torch 1.13 has no register_optimizer_step_pre_hook: ferry wraps the
    step of torch's optimizer classes instead."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])  # 1 MiB
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 256)).sum().backward()
    before = clone(model.state_dict())
    h = ft.snapshot(model.state_dict(), tmp_path / "ck.pt", **SLOW)
    assert not h.fenced
    opt.step()  # right after snapshot(): every weight changes in place
    assert h.fenced
    h.wait()
    assert_file_holds(tmp_path / "ck.pt", before)
    assert not torch.equal(model[0].weight, before["0.weight"])


def test_an_optimizer_class_defined_later_is_fenced_too(tmp_path):
    class MySGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(1 << 18))  # 1 MiB
    w.grad = torch.ones_like(w)
    opt = MySGD([w], lr=1.0)
    before = w.detach().clone()
    h = ft.snapshot({"w": w}, tmp_path / "ck.pt", **SLOW)
    opt.step()
    assert h.fenced
    h.wait()
    assert_file_holds(tmp_path / "ck.pt", {"w": before})


def test_optimizer_given_the_training_forward_is_still_fenced(tmp_path):
    """optimizer= names what to fence at the step; a training forward of a
    module with buffers (BatchNorm's running statistics) changes the state
    before that step and must fence too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    big = {"filler": torch.randn(1 << 19)}  # 2 MiB ahead of the buffers in the file
    state = dict(big, **model.state_dict())
    before = clone(state)
    h = ft.snapshot(state, tmp_path / "ck.pt", optimizer=opt, **SLOW)
    model(torch.randn(16, 64))  # updates running_mean, running_var, num_batches_tracked
    assert h.fenced
    h.wait()
    assert_file_holds(tmp_path / "ck.pt", before)
    assert int(model[1].num_batches_tracked) == 1


def test_a_step_with_a_closure_is_fenced_after_the_closure(tmp_path):
    """optimizer.step(closure) (Lightning's way): the closure's forward and
    backward only read the state, so the fence waits until it returns, and
    the step's update is still fenced."""
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)  # 1 MiB, no buffers
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = clone(model.state_dict())
    seen = []

    def closure():
        opt.zero_grad()
        seen.append(h.fenced)  # inside step(), before the update
        loss = model(torch.randn(4, 512)).pow(2).sum()
        loss.backward()
        return loss

    for given in ({"optimizer": opt}, {}):
        h = ft.snapshot(model.state_dict(), tmp_path / "ck.pt", **given, **SLOW)
        opt.step(closure)
        assert h.fenced
        h.wait()
        assert_file_holds(tmp_path / "ck.pt", before)
        before = clone(model.state_dict())
    assert seen == [False, False], "the fence ran before the closure: no overlap"


def test_explicit_fence_before_an_inplace_change_no_hook_covers(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(1 << 19)
    before = w.clone()
    h = ft.snapshot({"w": w}, tmp_path / "ck.pt", fence_hooks="none", **SLOW)
    assert not h.fenced
    h.fence()  # e.g. before an EMA copy_ into the weights
    w.mul_(0)
    h.wait()
    assert_file_holds(tmp_path / "ck.pt", {"w": before})
