"""The warning a step gives when it ends with saved tensors still live says
why: two context entries before one backward (the forward's backward has not
run yet), or a graph its backward left alive (retain_graph). At f9032b9 both
read "a graph kept alive, e.g. retain_graph=True", which sent users looking
for a retain_graph they never wrote."""
import warnings

import torch

import ferry.torch as ft
from conftest import GPT, gpt_batch, gpt_loss


def step_warnings(run):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run()
        ft.step()
    return [str(w.message) for w in seen if "a step ended with" in str(w.message)]


def test_two_entries_before_one_backward_say_the_backward_has_not_run():
    torch.manual_seed(0)
    model, batch = GPT(), gpt_batch()

    def run():
        with ft.offload(model, policy="default", backend="host"):
            a = gpt_loss(model, batch)
        with ft.offload(model, policy="default", backend="host"):  # ends a's step
            b = gpt_loss(model, batch)
        (a + b).backward()

    msgs = step_warnings(run)
    assert len(msgs) == 1 and "whose backward has not run yet" in msgs[0], msgs
    assert "retain_graph" not in msgs[0]


def test_a_graph_its_backward_left_alive_says_so():
    """One backward ran, but a second head's graph (saved through ferry) is
    still alive at the step's end: kept alive, not "not run yet"."""
    torch.manual_seed(0)
    trunk, head_a, head_b = (torch.nn.Linear(64, 64) for _ in range(3))
    x = torch.randn(64, 64)

    def run():
        with ft.offload(policy="default", backend="host"):
            h = torch.relu(trunk(x))
            a = head_a(h).sum()
            b = torch.sigmoid(head_b(h)).sum()
        a.backward(retain_graph=True)
        run.b = b  # b's graph (its sigmoid output, saved through ferry) stays alive

    msgs = step_warnings(run)
    assert len(msgs) == 1 and "a graph kept alive" in msgs[0], msgs
    assert "has not run" not in msgs[0]
