"""Worker processes of test_distributed.py (not a test module itself).

  python dist_worker.py ddp RANK WORLD PORT OUT
  python dist_worker.py capholder NAME CAP NBYTES      reserve, print, sleep
  python dist_worker.py caprank NAME CAP OUT           a local rank training under the node cap
"""
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def ddp(rank, world, port, out):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ferry.torch as ft
    from conftest import GPT, gpt_batch, gpt_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for use_ferry in (False, True):
        torch.manual_seed(0)
        model = DDP(GPT(layers=3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        grads = []
        for step in range(3):
            torch.manual_seed(100 * step + rank)  # each rank its own data
            batch = gpt_batch()
            if use_ferry:
                with ft.offload(model, policy="default"):
                    loss = gpt_loss(model, batch)
            else:
                loss = gpt_loss(model, batch)
            loss.backward()  # DDP all-reduces the gradients here
            grads.append([p.grad.detach().clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        results[use_ferry] = grads
    ft.step()
    s = ft.stats()
    same = all(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
               for ga, gb in zip(results[False], results[True]) for a, b in zip(ga, gb))
    # the all-reduced gradients must also agree across ranks
    flat = torch.cat([g.reshape(-1) for g in results[True][-1]])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    across = all(torch.equal(gathered[0], g) for g in gathered)
    with open(out, "w") as f:
        json.dump({"same": same, "across_ranks": across, "offloaded": s["tensors_offloaded"],
                   "bytes_h2d": s["bytes_h2d"], "live": s["live_handles"]}, f)
    # The last DDP model sits in reference cycles that hold the process
    # group: left to the collector it is freed during interpreter shutdown,
    # where gloo's threads abort the process ("terminate called without an
    # active exception", 3-7 runs in 25 with or without ferry; torch issue
    # 190489). Free it while the interpreter is whole.
    del model, opt
    gc.collect()
    dist.destroy_process_group()


def capholder(name, cap, nbytes):
    import ferry

    nc = ferry.NodeCap(name, cap)
    ok = nc.reserve(nbytes)
    print("reserved" if ok else "refused", flush=True)
    time.sleep(600)  # until killed


def caprank(name, cap, out):
    """Train under a node-wide cap; report the arena's cap and reservation,
    then wait (so the test can kill it mid-step) unless told to exit."""
    import ferry.torch as ft
    from conftest import GPT, gpt_batch, gpt_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(layers=2)
    with ft.offload(model, policy="default", node_host_cap=cap, node_cap_name=name):
        loss = gpt_loss(model, gpt_batch())
        s = ft.stats()
        state = ft._current.node_cap.state()
        with open(out + ".tmp", "w") as f:
            json.dump({"arena_cap": s["arena_cap"], "arena_reserved": s["arena_reserved"],
                       "node_total": state["total"], "node_cap": state["cap"],
                       "offloaded": s["tensors_offloaded"], "pid": os.getpid()}, f)
        os.rename(out + ".tmp", out)
        if os.environ.get("CAPRANK_HOLD"):
            time.sleep(600)  # mid-step: killed here
    loss.backward()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "ddp":
        ddp(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    elif mode == "capholder":
        capholder(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif mode == "caprank":
        caprank(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(f"unknown mode {mode}")
