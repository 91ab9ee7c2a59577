"""One rank of test_optim.py's DDP test: 5 steps of DDP (gloo) with a plain
AdamW and with offload_optimizer(fraction=0.5), from the same start; writes
both final parameter sets to <dir>/rank<r>.pt."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ferry.optim import offload_optimizer


def run(offload, rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 8))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    if offload:
        opt = offload_optimizer(opt, fraction=0.5)
        assert not opt.ferry_offload.early_grads  # DDP averages at the end of backward
        assert opt.ferry_offload.pairs
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main():
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = {"plain": run(False, rank), "offload": run(True, rank)}
    torch.save(res, os.path.join(out, "rank%d.pt" % rank))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
