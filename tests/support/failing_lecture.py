"""Failing lecture: a demo raises on one rank

Used by the tests: the build must fail promptly, exit 1, and still write a page showing why.
"""
import torch
import torch.distributed as dist

from util import note, spawn


def fails_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one cannot go on")
    dist.all_reduce(torch.ones(1))  # the other ranks wait here until the demo is stopped


def main():
    note("## Before the failure\nThis part is recorded.")
    spawn(fails_on_rank_one, 2)
    note("## After the failure\nNever reached.")
