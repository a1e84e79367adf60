"""Fixture lecture: a demo whose last rank never finishes (an endless Python loop, no
collective to time out), given a short deadline, and a demo after it that must still run."""
from util import note, spawn


def loop_forever_on_the_last_rank(rank, world_size):
    while rank == world_size - 1:
        pass
    return rank


def sum_of_ranks(rank, world_size):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def main():
    note("A rank that loops forever is stopped at the demo's deadline.")
    spawn(loop_forever_on_the_last_rank, 2, expect_error=True, deadline=3)
    spawn(sum_of_ranks, 2)
