"""Fixture lecture: the engine's test bed

Small on purpose: every narration call the engine offers, and fifteen quick demos over world
sizes 1, 2 and 4 (one of them an expected failure), so tests and `make bench` can exercise recording, launching and rendering.
"""
import os

import torch
import torch.distributed as dist

from util import figure, image, note, see, settings, span, spawn, table, timeline

HERE = os.path.dirname(os.path.abspath(__file__))


# --- rank code ---------------------------------------------------------------------------

def sum_of_ranks(rank, world_size):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    note(f"rank {rank}: the sum of all ranks is **{x.item():g}**")
    return x.item()


def seeded_noise(rank, world_size):
    """Every demo starts seeded: this is the same under the pool and under fresh processes."""
    return torch.randn(3).tolist()


def talk(rank, world_size):
    print(f"stdout of rank {rank}")
    table([[rank, rank ** 2, 1 / (rank + 1)]], header=["rank", "rank²", "1/(rank+1)"])


def timed_work(rank, world_size):
    with span("compute"):
        a = torch.randn(64, 64)
        for _ in range(20):
            a = torch.tanh(a @ a)
    with span("all-reduce"):
        dist.all_reduce(a)
    return a.sum().item()


def skip_a_collective(rank, world_size):
    """The last rank skips the all-reduce the others wait in: a hang the timeout turns into an
    error (the fixture's expected failure)."""
    if rank != world_size - 1:
        dist.all_reduce(torch.ones(1))


def draw(rank, world_size):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.bar(range(world_size), [r + 1 for r in range(world_size)])
    ax.set_title(f"drawn on rank {rank}")
    figure(fig, caption=f"a figure made on rank {rank}")


# --- the lecture -------------------------------------------------------------------------

def narration():
    note("""
        ## Narration
        Notes are Markdown with math: the ring sends $2(n-1)/n$ of the data, and
        $$\\mathrm{busbw} = \\mathrm{algbw} \\cdot \\frac{2(n-1)}{n}$$
        Text that looks like HTML is shown as text: <script>alert("x")</script>.
    """)
    table([[1, 2.5, "a"], [1234567, 0.000123, "b"]], header=["int", "float", "str"], caption="numbers")
    see(sum_of_ranks)
    see("https://pytorch.org/docs/stable/distributed.html", title="torch.distributed docs")
    image(os.path.join(HERE, "fixture_image.png"), caption="a local image", width=120)
    image("https://example.invalid/ring.png", caption="a remote image (a link card offline)")


def collectives():
    note("## Collectives on 1, 2 and 4 ranks")
    for world_size in (1, 2, 4):
        run = spawn(sum_of_ranks, world_size, name=f"sum of ranks, {world_size} rank{'s' if world_size > 1 else ''}")
        if run.status == "ok":  # under torchrun, demos for more ranks than exist are skipped
            assert run.returns == [world_size * (world_size - 1) / 2] * world_size
        spawn(seeded_noise, world_size, name=f"seeded noise, {world_size} rank{'s' if world_size > 1 else ''}")
        spawn(talk, world_size, name=f"talk, {world_size} rank{'s' if world_size > 1 else ''}")


def timelines():
    note("## Timelines")
    for world_size in (2, 4):
        run = spawn(timed_work, world_size, name=f"timed work, {world_size} rank{'s' if world_size > 1 else ''}")
        figure(timeline(run.spans, title=f"{world_size} ranks"), caption="measured spans")
    spawn(skip_a_collective, 2, name="a rank skips a collective", expect_error=True, timeout=2)
    for world_size in (1, 2, 4):
        spawn(draw, world_size, name=f"draw, {world_size} rank{'s' if world_size > 1 else ''}")


def main():
    note(f"# Fixture lecture\nQuick mode: {settings.quick}.")
    narration()
    collectives()
    timelines()
