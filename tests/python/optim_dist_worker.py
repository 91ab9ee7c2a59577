"""One rank of test_optim.py's distributed tests (gloo, CPU):

    optim_dist_worker.py RANK WORLD PORT OUTDIR ddp|fsdp

For AdamW and SGD (momentum), 5 steps of a plain run, then of every CASES
entry (offload_optimizer at that fraction and overlap), each from the same
start on the same per-rank batches. ddp wraps the model in
DistributedDataParallel; fsdp applies FSDP2's fully_shard to each Linear and
to the root (DTensor parameters, each rank holds a shard) and records the
full parameters (full_tensor()). fsdp also checks the offloaded optimizer's
state_dict() against the plain one's and loads a plain FSDP run's state
dict into an offloaded optimizer halfway through a run. Writes
OUTDIR/rank<r>.pt."""
import copy
import gc
import os
import sys

import torch
import torch.distributed as dist

from ferry.optim import offload_optimizer

KINDS = ("adamw", "sgd")
# Overlap matters only where there is a host share.
CASES = [(kind, fraction, overlap) for kind in KINDS
         for fraction, overlap in ((0.0, True), (0.5, True), (0.5, False), (1.0, True),
                                   (1.0, False))]
STEPS = 5


def make_opt(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=False)


def make_model(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 8))
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return model, DDP(model)
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, model


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g))
            for _ in range(STEPS)]


def train(wrapped, opt, data):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()


def params_of(model):
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def run(mode, rank, kind, fraction=None, overlap=True):
    model, wrapped = make_model(mode)
    opt = make_opt(kind, wrapped.parameters())
    if fraction is not None:
        opt = offload_optimizer(opt, fraction=fraction, overlap=overlap)
    train(wrapped, opt, batches(rank))
    return model, opt


def state_differences(sa, sb):
    """Where two state dicts of the FSDP model's optimizers differ: keys,
    kinds of tensor (DTensor with the same placements, or plain), values bit
    for bit on this rank. Empty when they agree."""
    out = []
    if sa["param_groups"] != sb["param_groups"]:
        out.append("param_groups")
    if sorted(sa["state"]) != sorted(sb["state"]):
        return out + ["state keys %s != %s" % (sorted(sa["state"]), sorted(sb["state"]))]
    for i in sa["state"]:
        x, y = sa["state"][i], sb["state"][i]
        if sorted(x) != sorted(y):
            out.append("state[%s] keys %s != %s" % (i, sorted(x), sorted(y)))
            continue
        for k in x:
            if type(x[k]) is not type(y[k]):
                out.append("state[%s][%s]: %s, not %s" % (i, k, type(x[k]).__name__,
                                                          type(y[k]).__name__))
            elif hasattr(x[k], "placements"):
                if x[k].placements != y[k].placements or x[k].shape != y[k].shape:
                    out.append("state[%s][%s]: layout" % (i, k))
                elif not torch.equal(x[k].to_local().cpu(), y[k].to_local().cpu()):
                    out.append("state[%s][%s]: values" % (i, k))
            elif torch.is_tensor(x[k]):
                if not torch.equal(x[k].cpu(), y[k].cpu()):
                    out.append("state[%s][%s]: values" % (i, k))
            elif x[k] != y[k]:
                out.append("state[%s][%s]: %r != %r" % (i, k, x[k], y[k]))
    return out


def fsdp_state_checks(rank, kind):
    """The offloaded optimizer's state_dict() against the plain one's (DTensor
    states) after 5 steps; a plain run's state dict loaded into an offloaded
    optimizer after 3 steps, then 2 more steps of both."""
    data = batches(rank)
    _, popt = run("fsdp", rank, kind)
    _, oopt = run("fsdp", rank, kind, fraction=1.0)
    res = {"state_dict": state_differences(oopt.state_dict(), popt.state_dict())}

    pm, pw = make_model("fsdp")
    popt = make_opt(kind, pw.parameters())
    train(pw, popt, data[:3])
    sd = copy.deepcopy(popt.state_dict())  # state_dict() aliases the live state
    lm, lw = make_model("fsdp")
    with torch.no_grad():
        for q, p in zip(lm.parameters(), pm.parameters()):
            q.to_local().copy_(p.to_local())
    lopt = offload_optimizer(make_opt(kind, lw.parameters()), fraction=0.5)
    lopt.load_state_dict(sd)
    off = lopt.ferry_offload
    # The host share's state: in the host optimizer, plain host tensors
    # (opt.state shows the host optimizer's own dict).
    res["host_state"] = [
        (lopt.state.get(p) is off.host_opt.state.get(hp), hp in off.host_opt.state,
         [type(v).__name__ for v in off.host_opt.state.get(hp, {}).values()])
        for _, p, hp, _ in off.pairs]
    train(pw, popt, data[3:])
    train(lw, lopt, data[3:])
    res["loaded"], res["plain"] = params_of(lm), params_of(pm)
    return res


def main():
    rank, world, port, out, mode = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                    sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = {"plain": {}, "cases": {}, "state": {}}
    for kind in KINDS:
        res["plain"][kind] = params_of(run(mode, rank, kind)[0])
    for kind, fraction, overlap in CASES:
        model, opt = run(mode, rank, kind, fraction, overlap)
        off = opt.ferry_offload
        res["cases"][(kind, fraction, overlap)] = {
            "params": params_of(model), "pairs": len(off.pairs), "host_steps": off.host_steps,
            "n_params": len(list(model.parameters())), "early_grads": off.early_grads}
    if mode == "fsdp":
        for kind in KINDS:
            res["state"][kind] = fsdp_state_checks(rank, kind)
    torch.save(res, os.path.join(out, "rank%d.pt" % rank))
    dist.barrier()
    # free the last wrapped model (in reference cycles that hold the process
    # group) before the interpreter's shutdown: see dist_worker.py
    del model, opt, off
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
