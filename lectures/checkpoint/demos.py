"""What lecture 08's demos run on each rank, and the analysis of what they return."""
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist

from lectures.checkpoint.restart import read_events, torchrun_command
from lectures.checkpoint.store import Boxes, checkpoint_path, finish, save, trainer_state
from lectures.layout.estimator import Layout
from lectures.layout.mesh import make_mesh
from lectures.layout.shards import global_grad_norm
from lectures.layout.trainer import LayoutTrainer, Run
from lectures.model.gpt import GPTConfig
from util.measure import Timing, measure

SMALL = Run(cfg=GPTConfig(vocab_size=32, seq_len=12, d_model=24, n_layers=3, n_heads=4, dtype="float64"),
            global_batch=8, steps=4)
# h = 20 over 3 ZeRO replicas: a third of a matrix is not whole rows (the boxes figure)
ODD = Run(cfg=GPTConfig(vocab_size=32, seq_len=12, d_model=20, n_layers=2, n_heads=4), global_batch=8, steps=1)
# Big enough that writing takes longer than DCP's planning: 4 layers, h = 256 (3.4M parameters)
COST = Run(cfg=GPTConfig(vocab_size=512, seq_len=64, d_model=256, n_layers=4, n_heads=8), global_batch=8, steps=1)


def workdir(name, fresh=True):
    """A folder for one demo's checkpoints, emptied first (a checkpoint left by an earlier build
    would be resumed from). Its path is the same in every build: the notebook and the torchrun
    build must make the same calls as the page to be compared with it."""
    path = os.path.join(tempfile.gettempdir(), f"course-lecture-08-{os.getuid()}", name)
    if fresh:
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def _trainer(run, layout):
    return LayoutTrainer(run, layout, make_mesh(layout.dp, layout.pp, layout.cp, layout.tp, ep=layout.ep),
                         track_memory=False)


def boxes_of(rank, world_size, run, layout, keys, steps=1):
    """The boxes (offset, shape) this rank writes of each of `keys` (after `steps` steps, so the
    optimizer state exists)."""
    trainer = _trainer(run, layout)
    for step in range(steps):
        trainer.train_step(step)
    state = trainer_state(trainer)
    return {"coords": trainer.mesh.coords,
            "boxes": {k: [(o, tuple(t.shape)) for o, t in state[k].boxes.items()] for k in keys if k in state}}


def checkpoint_costs(rank, world_size, run, layout, directory, repeats=5):
    """Bytes this rank writes, the time of a synchronous save, and of an asynchronous one: how
    long the step is blocked (copying the tensors, planning) and how long until it is on disk,
    while the next training step runs."""
    trainer = _trainer(run, layout)
    trainer.train_step(0)                     # AdamW's moments exist from the first step
    step_time = measure(lambda: trainer.train_step(0), warmup=1, repeats=repeats)
    sync = measure(lambda: save(trainer, directory, 1), warmup=1, repeats=repeats)
    files = {f: os.path.getsize(os.path.join(checkpoint_path(directory, 1), f))
             for f in os.listdir(checkpoint_path(directory, 1))}
    blocked, total, overlapped = [], [], []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        pending = save(trainer, directory, 2, async_save=True)
        t1 = time.perf_counter()
        trainer.train_step(0)                 # training goes on while the files are written
        t2 = time.perf_counter()
        finish(pending)
        t3 = time.perf_counter()
        if i:                                 # the first is a warm-up
            blocked.append(t1 - t0)
            overlapped.append(t2 - t1)
            total.append(t3 - t0)
    return {"mine": files.get(f"__{rank}_0.distcp", 0), "metadata": files.get(".metadata", 0),
            "held": sum(b.nbytes() for b in trainer_state(trainer).values() if isinstance(b, Boxes)),
            "step": step_time.samples, "sync": sync.samples, "blocked": blocked, "total": total,
            "overlapped_step": overlapped}


def timings(returns, key):
    """The slowest rank's time of each repeat, as a Timing."""
    return Timing([max(r[key][i] for r in returns) for i in range(len(returns[0][key]))])


def clip_norms(rank, world_size, run, layout):
    """The first step's global gradient norm counted once, and counted the naive way (every rank
    counts all it holds), then the clipped run's parameters."""
    trainer = _trainer(dataclasses.replace(run, max_grad_norm=None), layout)
    if trainer.zero is not None:     # the gradient exists only as ZeRO's shards, inside its step
        seen = {}
        trainer.zero.clip = lambda shards: seen.update(once=global_grad_norm(trainer, shards),
                                                       naive=global_grad_norm(trainer, shards, count_once=False))
        trainer.train_step(0)
        once, naive = seen["once"], seen["naive"]
    else:
        trainer.forward_backward(0)
        if trainer.comm is not None:
            for p in trainer.params:
                trainer.comm.all_reduce(p.grad)
                p.grad.div_(trainer.comm.n)
        once, naive = global_grad_norm(trainer), global_grad_norm(trainer, count_once=False)
    clipped = _trainer(run, layout)
    for step in range(run.steps):
        clipped.train_step(step)
    return {"once": once, "naive": naive, "params": clipped.full_parameters()}


def reference_norm(run):
    """clip_grad_norm_'s total norm of the first step, in one process."""
    from lectures.model.gpt import GPT, batch, loss_fn
    model = GPT(run.cfg)
    tokens, targets = batch(run.cfg, run.global_batch, 0)
    loss_fn(model(tokens), targets).backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()


def restart_job(directory, ranks=2, steps=4, save_every=2, die_at=3, timeout=240):
    """Run the torchrun job that loses a rank (lectures/checkpoint/restart.py) and return its
    exit status, wall time, events and the tail of its log."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    t0 = time.time()
    proc = subprocess.run(torchrun_command(directory, ranks=ranks, max_restarts=1, steps=steps,
                                           save_every=save_every, die_at=die_at),
                          capture_output=True, text=True, timeout=timeout, env=_own_job_env())
    return {"rc": proc.returncode, "seconds": time.time() - t0, "events": read_events(directory),
            "log": proc.stderr[-2000:]}


def _own_job_env():
    """This process's environment without the variables of a torchrun job it may itself be a
    rank of (the lecture under torchrun): the job below is a job of its own."""
    inherited = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in inherited and not k.startswith("TORCHELASTIC_")
            and not k.startswith("TORCH_ELASTIC")} | {"OMP_NUM_THREADS": "1"}


def lost_work(events):
    """From the job's events: the step the rank died in, the checkpoint it resumed from, the
    seconds attempt 1 spent redoing the steps after that checkpoint up to the one that died, and
    the seconds from the death to the resumed job (restart)."""
    died = next(e for e in events if e["event"] == "died")
    resumed = next(e for e in events if e["event"] == "resumed" and e["attempt"] == 1)
    redone = [e for e in events if e["event"] == "step" and e["attempt"] == 1 and e["step"] <= died["step"]]
    first = next(e for e in events if e["event"] == "step" and e["attempt"] == 1)
    return {"died_in": died["step"], "resumed_from": resumed["step"],
            "recompute": redone[-1]["t"] - resumed["t"] if redone else 0.0,
            "restart": resumed["t"] - died["t"], "load": resumed["load_seconds"],
            "first_step_after": first["t"] - died["t"]}


def metadata_rows(path, key):
    """The boxes DCP recorded for one tensor: (offset, size, file)."""
    from torch.distributed.checkpoint import FileSystemReader
    reader = FileSystemReader(path)
    md = reader.read_metadata()
    rows = []
    for index, info in md.storage_data.items():
        if index.fqn == key:
            chunk = next(c for c in md.state_dict_metadata[key].chunks if tuple(c.offsets) == tuple(index.offset))
            rows.append((tuple(index.offset), tuple(chunk.sizes), info.relative_path))
    return sorted(rows)


def json_safe(x):
    return json.loads(json.dumps(x, default=str))
