"""Hooks lecture: demos whose process group outlives them in PyTorch's own objects

Used by the torchrun tests. Several demos in a row train a small model with PyTorch's DDP and
its `powerSGD_hook`, whose callbacks run on the process group's own worker threads and hold
the group; under torchrun each demo has a process group of its own, destroyed when it ends.
Before the launcher let a demo's objects die on the main thread, the last reference to a
destroyed group was sometimes dropped on one of that group's worker threads, which then
joined itself ("Resource deadlock avoided") and aborted the rank.
"""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from util import note, settings, spawn


def ddp_train(rank, world_size, hook="powersgd", steps=12):
    """A tiny MLP under DDP, with no hook, the all-reduce hook or the PowerSGD hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    net = DistributedDataParallel(model)
    if hook == "allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        net.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as p
        state = p.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                start_powerSGD_iter=2, min_compression_rate=2,
                                use_error_feedback=True, warm_start=True, random_seed=0)
        net.register_comm_hook(state, p.powerSGD_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return sum(p.sum().item() for p in model.parameters())


def main():
    note("# Hooks lecture\nDDP with communication hooks, one process group per demo.")
    rounds = 2 if settings.quick else 6
    for i in range(rounds):
        for world_size in (4, 2):
            for hook in ("none", "powersgd", "allreduce"):
                run = spawn(ddp_train, world_size, hook=hook,
                            name=f"DDP, {hook} hook, {world_size} ranks, round {i + 1}")
                if run.status == "ok":  # DDP keeps the replicas identical
                    assert len(set(run.returns)) == 1, run.returns
