"""A job that survives a failure: torchrun restarts it, and it resumes from its last checkpoint.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m lectures.checkpoint.restart \\
        --directory DIR [--steps 4] [--save-every 2] [--die-at 3] [--victim 1] [--dp 2 --tp 1 ...]

On its first attempt, rank `victim` dies in the middle of step `die_at` (counted from 1: after
its backward, before the gradient all-reduce its peers are already waiting in). torchrun's agent
sees the worker exit, stops the others and starts every worker again (attempt 1), which loads
the latest complete checkpoint and trains to the end. Rank 0 appends what happened, with times,
to DIR/events.jsonl.

On torch 2.13 with gloo a restarted worker must not rendezvous under the previous attempt's keys
(the agent's store still holds them: "Gloo connectFullMesh failed"; ../shared/PYTORCH_ON_CPU.md):
`init_group` prefixes them with the attempt number.

`young_daly` and `expected_waste` are the checkpoint interval that loses the least work and the
fraction lost at an interval (Young 1974; Daly 2006).
"""
import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from lectures.checkpoint.store import load, save
from lectures.layout.estimator import Layout
from lectures.layout.mesh import make_mesh
from lectures.layout.trainer import LayoutTrainer, Run, global_loss
from lectures.model.gpt import GPTConfig

RESTART_RUN = Run(cfg=GPTConfig(vocab_size=32, seq_len=12, d_model=24, n_layers=3, n_heads=4, dtype="float64"),
                  global_batch=8, steps=4)

# Llama 3 405B's pre-training (Llama Team 2024, "The Llama 3 Herd of Models", §3.3.4 and Table 5,
# https://arxiv.org/abs/2407.21783): 16,384 H100s for 54 days, 466 job interruptions (47 planned,
# 419 unexpected, about 78% of those hardware), more than 90% effective training time; storage
# (§3.3.1): Tectonic, 2 TB/s sustained and 7 TB/s peak; checkpoints of 1 MB to 4 GB per GPU.
LLAMA3_DAYS, LLAMA3_INTERRUPTIONS, LLAMA3_UNEXPECTED, LLAMA3_GPUS = 54, 466, 419, 16384
TECTONIC_SUSTAINED = 2e12      # bytes/s
LLAMA3_405B_PARAMS = 405e9


# =========================================================================================
# How often to save: Young/Daly
# =========================================================================================

def young_daly(write_seconds, mtbf_seconds):
    """The checkpoint interval that loses the least work, √(2·δ·M) (Young 1974; Daly 2006's
    first-order term), for a write of δ seconds and a mean time between failures M."""
    if write_seconds < 0 or mtbf_seconds <= 0:
        raise ValueError("need a write time >= 0 and a mean time between failures > 0")
    return math.sqrt(2 * write_seconds * mtbf_seconds)


def expected_waste(interval, write_seconds, mtbf_seconds, restart_seconds=0.0):
    """The fraction of time lost at a checkpoint interval τ (first order): δ/τ writing
    (a blocking save), τ/(2M) recomputing the half interval lost on average per failure, and R/M
    restarting."""
    return write_seconds / interval + interval / (2 * mtbf_seconds) + restart_seconds / mtbf_seconds


# =========================================================================================
# The job
# =========================================================================================

def attempt():
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_group(timeout_s=60):
    """The process group of this attempt, on the agent's store under a prefix of its own."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt()}/", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def log_event(directory, **event):
    """Rank 0 (or a rank about to die) appends one line to DIR/events.jsonl."""
    with open(os.path.join(directory, "events.jsonl"), "a") as f:
        f.write(json.dumps({"attempt": attempt(), "rank": dist.get_rank(), "t": time.time(), **event}) + "\n")


def read_events(directory):
    path = os.path.join(directory, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def job_layout(dp=1, pp=1, cp=1, tp=1, zero=0, global_batch=8):
    micro_batches = 2 * pp if pp > 1 else 1
    return Layout(dp=dp, pp=pp, cp=cp, tp=tp, zero=zero, micro_batch=global_batch // (dp * micro_batches),
                  micro_batches=micro_batches)


def run_job(directory, steps, save_every, die_at, victim, layout, run=RESTART_RUN):
    """One attempt: resume from the latest checkpoint, train to `steps`, saving every
    `save_every`; on attempt 0, rank `victim` dies mid-step `die_at` (counted from 1)."""
    trainer = LayoutTrainer(run, layout, make_mesh(layout.dp, layout.pp, layout.cp, layout.tp, ep=layout.ep),
                        track_memory=False)
    t0 = time.time()
    start = load(trainer, directory)
    if dist.get_rank() == 0:
        log_event(directory, event="resumed", step=start, load_seconds=time.time() - t0)
    for step in range(start, steps):
        if attempt() == 0 and step + 1 == die_at and dist.get_rank() == victim:
            trainer.forward_backward(step)          # its peers are already in the all-reduce
            log_event(directory, event="died", step=step + 1)
            os._exit(17)
        loss, _, _ = trainer.train_step(step)
        loss = global_loss(trainer, loss)
        if dist.get_rank() == 0:
            log_event(directory, event="step", step=step + 1, loss=loss)
        if (step + 1) % save_every == 0:
            t = time.time()
            save(trainer, directory, step + 1)
            if dist.get_rank() == 0:
                log_event(directory, event="saved", step=step + 1, seconds=time.time() - t)


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m lectures.checkpoint.restart",
                                description="One rank dies mid-step; torchrun restarts the job from its checkpoint.")
    p.add_argument("--directory", required=True)
    for name, default in (("steps", 4), ("save-every", 2), ("die-at", 3), ("victim", 1),
                          ("dp", None), ("pp", 1), ("cp", 1), ("tp", 1), ("zero", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args(argv)
    if args.steps < 1 or args.save_every < 1:
        p.error("--steps and --save-every must be at least 1")
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    init_group()
    world = dist.get_world_size()
    dp = args.dp or world // (args.pp * args.cp * args.tp)
    layout = job_layout(dp, args.pp, args.cp, args.tp, args.zero, RESTART_RUN.global_batch)
    if dist.get_rank() == 0:
        os.makedirs(args.directory, exist_ok=True)
        log_event(args.directory, event="started", world=world, layout=layout.label())
    run_job(args.directory, args.steps, args.save_every, args.die_at, args.victim, layout)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without running C++'s static destructors: on torch 2.13 a restarted attempt's
    # process sometimes aborts there ("terminate called without an active exception": a
    # thread of the previous attempt's store or gloo pair still joinable), after its work is
    # done and saved, and torchrun would count the finished job as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrun_command(directory, ranks=2, max_restarts=1, **options):
    """The command line of the job (torchrun from this Python's environment)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    return [torchrun, "--standalone", f"--nproc-per-node={ranks}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2", "-m", "lectures.checkpoint.restart", f"--directory={directory}", *flags]


if __name__ == "__main__":
    main()
