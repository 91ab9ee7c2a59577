"""Worker of test_fsdp2.py (not a test module itself): one rank of FSDP2
(fully_shard, gloo, CPU) training a small GPT three steps without ferry,
with ferry told the model, with ferry not told it, and with a policy that
offloads everything, the all-gathered weights FSDP2 frees with resize_(0)
included (its copies slowed by the host backend's link model).

  python fsdp2_worker.py RANK WORLD PORT OUT
"""
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Parameters too; a small stash, so most saved tensors are reloaded.
OFFLOAD_ALL = """
local R = require "ferry.rules"
return R.policy { name = "offload-all", R.min_bytes(1024), R.max_stash(2), reload = R.on_use() }
"""


def local_bits(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def main(rank, world, port, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ferry.torch as ft
    from conftest import GPT, gpt_batch, gpt_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    runs, stats = {}, {}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(OFFLOAD_ALL)
    offload_all = dict(policy=f.name, link=(2e8, 1e12, 0.0, 1.0))
    modes = ("model", "no_model", "offload_all")
    for mode in ("plain",) + modes:
        torch.manual_seed(0)
        model = GPT(layers=3)
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        history = []
        for step in range(3):
            torch.manual_seed(100 * step + rank)  # each rank its own data
            batch = gpt_batch()
            if mode == "plain":
                loss = gpt_loss(model, batch)
            else:
                how = offload_all if mode == "offload_all" else dict(policy="default")
                with ft.offload(model if mode == "model" else None, backend="host",
                                min_offload_bytes=1024, **how):
                    loss = gpt_loss(model, batch)
            loss.backward()  # FSDP2 reduce-scatters the gradients here
            history.append([local_bits(loss)] + [local_bits(p.grad) for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        history.append([local_bits(p) for p in model.parameters()])
        runs[mode] = history
        if mode != "plain":
            ft.step()
            s = ft.stats()
            stats[mode] = {k: s[k] for k in ("tensors_offloaded", "live_handles", "bytes_h2d")}
            ft.close()
    same = {mode: all(torch.equal(a, b) for ha, hb in zip(runs["plain"], runs[mode])
                      for a, b in zip(ha, hb))
            for mode in modes}
    os.unlink(f.name)
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"same": same, "stats": stats}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
