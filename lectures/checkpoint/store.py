"""Checkpoints of lecture 07's `LayoutTrainer` that load under any other layout: `save`, `load`,
`export`, written with `torch.distributed.checkpoint` (DCP).

Every rank writes the boxes of the global tensors it holds (`lectures.layout.shards`), each with
its offset in the global tensor; DCP's planner keeps one copy of a box that several ranks hold
(replicas), checks that the boxes of every tensor cover it exactly once, and writes one file
per rank plus a `.metadata` file that maps every box to its file. Loading, each rank asks for
the boxes of its *new* layout, and DCP reads the overlapping parts of whatever boxes were saved:
nothing is gathered on one rank, in either direction.

A checkpoint is a folder `step-000002/` under the run's directory. It is written as
`step-000002.partial/` and renamed when every rank has finished: a crash during a save leaves the
previous checkpoint as the latest, never a half-written one. `load` reads into fresh tensors and
copies into the trainer only when everything was read and checked: a bad checkpoint changes
nothing.
"""
import dataclasses
import hashlib
import os
import re
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan, create_default_local_save_plan
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lectures.data_parallel.zero import take_shard
from lectures.layout.shards import flat_boxes, global_shapes, local_pieces
from util import new_group

STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this trainer: missing, incomplete, corrupt, or
    another model's. Raised on every rank; the trainer is left as it was."""


# =========================================================================================
# Boxes: one global tensor's pieces on this rank, and the DCP planners that read and write them
# =========================================================================================

class Boxes:
    """A state-dict value: the boxes this rank holds of one global tensor of `size`,
    {offset: tensor of the box's shape} (a view of the trainer's tensor, or a fresh buffer)."""

    def __init__(self, size, dtype):
        self.size, self.dtype, self.boxes = torch.Size(size), dtype, {}

    def add(self, offset, tensor):
        offset = tuple(offset)
        if offset in self.boxes:
            raise ValueError(f"two boxes at {offset}")
        self.boxes[offset] = tensor

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.boxes.values())


class BoxSavePlanner(DefaultSavePlanner):
    """DCP's default planner (replicas written once, coverage checked), told this rank's boxes."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self):
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, Boxes)}
        items = list(create_default_local_save_plan(plain, True).items)   # every rank: its own keys
        for fqn, b in self.state_dict.items():
            if not isinstance(b, Boxes):
                continue
            for offset, t in b.boxes.items():
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offset)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=t.shape),
                        properties=TensorProperties.create_from_tensor(t), size=b.size)))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index):
        value = self.state_dict[index.fqn]
        return value.boxes[tuple(index.offset)] if isinstance(value, Boxes) else value


class BoxLoadPlanner(DefaultLoadPlanner):
    """Each rank reads the parts of the saved boxes that overlap the boxes it asks for."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        # DefaultLoadPlanner's own set-up replaces every value it does not know (Boxes) by None
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self):
        saved = self.metadata.state_dict_metadata
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, Boxes)}
        missing = sorted(k for k in self.state_dict if k not in saved)
        if missing:
            raise CheckpointError(f"the checkpoint has no {', '.join(missing[:4])}"
                                  + (f" (and {len(missing) - 4} more)" if len(missing) > 4 else ""))
        items = list(create_default_local_load_plan(plain, self.metadata, strict=True).items)
        for fqn, b in self.state_dict.items():
            if not isinstance(b, Boxes):
                continue
            md = saved[fqn]
            if not isinstance(md, TensorStorageMetadata) or md.size != b.size:
                got = md.size if isinstance(md, TensorStorageMetadata) else "not a tensor"
                raise CheckpointError(f"{fqn}: the checkpoint holds {tuple(got)}, this model {tuple(b.size)}")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in b.boxes.items()]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index):
        value = self.state_dict[index.fqn]
        return value.boxes[tuple(index.offset)] if isinstance(value, Boxes) else super().lookup_tensor(index)


# =========================================================================================
# What a trainer's checkpoint holds
# =========================================================================================

def _boxes_of(pieces, tensor, shapes, fresh):
    """{global name: Boxes} of a local tensor cut into its pieces (views, or zero buffers)."""
    out = {}
    for piece in pieces:
        part = tensor[piece.rows[0]:piece.rows[1]]
        b = out.setdefault(piece.name, Boxes(shapes[piece.name], tensor.dtype))
        b.add(piece.offset, torch.zeros_like(part) if fresh else part.detach())
    return out


def _zero_boxes(pieces, flat, local, rank, shapes, fresh):
    """{global name: Boxes} of a ZeRO shard: elements [rank·s, (rank+1)·s) of the flattened
    local tensor, cut into at most three boxes per piece it crosses."""
    s, cols = flat.numel(), local[0].numel() if local.dim() > 1 else 1
    out = {}
    for piece in pieces:
        f0, f1 = piece.rows[0] * cols, piece.rows[1] * cols
        a, b = max(f0, rank * s), min(f1, (rank + 1) * s)
        if a >= b:
            continue
        boxes = out.setdefault(piece.name, Boxes(shapes[piece.name], flat.dtype))
        for offset, shape, start, stop in flat_boxes(piece, a - f0, b - f0):
            part = flat[f0 + start - rank * s:f0 + stop - rank * s].view(shape)
            boxes.add(offset, torch.zeros_like(part) if fresh else part.detach())
    return out


def _merge(state, prefix, boxes):
    for name, b in boxes.items():
        key = f"{prefix}/{name}"
        if key in state:
            for offset, t in b.boxes.items():
                state[key].add(offset, t)
        else:
            state[key] = b


def model_fingerprint(run):
    """What must agree for a checkpoint to continue this run: the model and the data it reads.
    With experts, their number and top-k (the same tensors with another top-k are another model)."""
    out = {"config": dataclasses.asdict(run.cfg), "global_batch": run.global_batch}
    if run.experts:
        out["experts"] = {"experts": run.experts, "top_k": run.top_k}
    return out


def trainer_state(trainer, fresh=False):
    """The state dict of one rank: "model/<name>", "optim/exp_avg/<name>", "optim/exp_avg_sq/<name>"
    as Boxes (views of the trainer's tensors, or zero buffers of the same boxes with `fresh`),
    and "optim/step", "run" and "rng/<rank>" as plain objects."""
    cfg_shapes = global_shapes(trainer.run.cfg, trainer.run.experts, trainer.run.top_k)
    pieces = local_pieces(trainer)
    state = {}
    zero = trainer.zero
    for i, (p, ps) in enumerate(pieces):
        _merge(state, "model", _boxes_of(ps, p, cfg_shapes, fresh))
        if zero is None:
            st = trainer.opt.state.get(p, {})
            for k in ("exp_avg", "exp_avg_sq"):
                _merge(state, f"optim/{k}", _boxes_of(ps, st.get(k, torch.zeros_like(p)), cfg_shapes, fresh))
        else:
            r = dist.get_rank(zero.comm.group)
            for k, flat in (("exp_avg", zero.opt.m[i]), ("exp_avg_sq", zero.opt.v[i])):
                _merge(state, f"optim/{k}", _zero_boxes(ps, flat, p, r, cfg_shapes, fresh))
    state["optim/step"] = optimizer_steps(trainer)
    state["run"] = model_fingerprint(trainer.run)
    state[f"rng/{dist.get_rank()}"] = torch.get_rng_state()
    return state


def optimizer_steps(trainer):
    """How many updates AdamW has made (its bias correction depends on it)."""
    if trainer.zero is not None:
        return trainer.zero.opt.t
    steps = {int(s["step"]) for s in trainer.opt.state.values() if "step" in s}
    return steps.pop() if steps else 0


def _install(trainer, loaded):
    """Copy a loaded state (fresh Boxes) into the trainer's tensors."""
    current = trainer_state(trainer)
    t = loaded["optim/step"]
    zero = trainer.zero
    with torch.no_grad():
        for key, b in current.items():
            if key.startswith("model/") or (key.startswith("optim/exp_") and zero is not None):
                for offset, view in b.boxes.items():
                    view.copy_(loaded[key].boxes[offset])
        if zero is not None:
            r, n = dist.get_rank(zero.comm.group), zero.comm.n
            for i, p in enumerate(zero.params):
                zero.shards[i].copy_(take_shard(p, r, n))       # ZeRO's fp32 copy of its shard
            zero.opt.t = t
        else:
            trainer.opt.state.clear()
            if t > 0:       # AdamW's state, created as its first step would create it
                for p in trainer.params:
                    trainer.opt.state[p] = {"step": torch.tensor(float(t)),
                                            "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                fresh = trainer_state(trainer)
                for key, b in fresh.items():
                    if key.startswith("optim/exp_"):
                        for offset, view in b.boxes.items():
                            view.copy_(loaded[key].boxes[offset])


# =========================================================================================
# save, load, export
# =========================================================================================

def checkpoint_path(directory, step):
    return os.path.join(directory, f"step-{step:06d}")


def saved_steps(directory):
    """The steps of the complete checkpoints in `directory`, ascending."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(directory)) if m
                  and os.path.isfile(os.path.join(directory, m.group(0), ".metadata")))


def save(trainer, directory, step, async_save=False):
    """Write the trainer's state after `step` steps as `directory/step-<step>/` (collective: every
    rank calls it). With `async_save`, returns as soon as this rank's tensors are copied: the
    files are written in the background and `finish(pending)` completes (and renames) them.
    Returns the path, or the pending save."""
    final = checkpoint_path(directory, step)
    partial = final + ".partial"
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)       # an earlier attempt that died mid-save
    dist.barrier()
    state = trainer_state(trainer)
    # the data position: batch k of the run is a function of k (lecture 01's task), so the step
    # is the position; a real loader saves its own state (its shard, its offset) here
    state["data"] = {"step": step, "samples_seen": step * trainer.run.global_batch}
    if async_save:
        staged = _stage(state)           # our copy: the only time the step waits for the tensors
        future = dcp.async_save(staged, checkpoint_id=partial, planner=BoxSavePlanner(),
                                process_group=_background_group(), async_stager=_AlreadyStaged())
        return {"future": future, "partial": partial, "final": final}
    dcp.save(state, checkpoint_id=partial, planner=BoxSavePlanner())
    return _commit(partial, final)


class _AlreadyStaged:
    """dcp.async_save's stager for a state dict `_stage` has already copied (its default stager
    would copy it again)."""
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self):
        pass

    def close(self):
        pass


_GROUPS = {}


def _background_group():
    """A process group of all ranks for the background writer's collectives (planning, the final
    metadata): on the training's own group, they could interleave with the step's collectives.
    Made once per default group (collective: every rank makes it at its first asynchronous save)."""
    world = dist.distributed_c10d._get_default_group()
    if _GROUPS.get("world") is not world:
        _GROUPS.update(world=world, group=new_group(backend="gloo"))
    return _GROUPS["group"]


def _stage(state):
    """A copy of every tensor of `state` (what an asynchronous save must own: training goes on
    changing the originals)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, Boxes):
            b = Boxes(v.size, v.dtype)
            for offset, t in v.boxes.items():
                b.add(offset, t.clone())
            out[k] = b
        else:
            out[k] = v.clone() if torch.is_tensor(v) else v
    return out


def finish(pending):
    """Wait for an asynchronous save and make it the latest checkpoint (collective)."""
    pending["future"].result()
    return _commit(pending["partial"], pending["final"])


def _commit(partial, final):
    dist.barrier()                         # every rank's file is written
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)          # atomic on one file system: complete, or not there
    dist.barrier()
    return final


def load(trainer, directory, step=None):
    """Load the latest complete checkpoint in `directory` (or the one of `step`) into `trainer`,
    whatever layout wrote it; returns the step to continue from (0 when there is none and no
    `step` was asked for). Raises CheckpointError on every rank, with the trainer untouched, for
    a missing, corrupt or foreign checkpoint."""
    steps = saved_steps(directory)
    if step is None:
        if not steps:
            return 0
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"{checkpoint_path(directory, step)}: no complete checkpoint of step {step} "
                              f"(complete ones: {steps or 'none'})")
    path = checkpoint_path(directory, step)
    loaded = trainer_state(trainer, fresh=True)
    for k in list(loaded):
        if k.startswith("rng/"):
            del loaded[k]           # a rank of another layout has no RNG state of its own here
    loaded["data"] = None
    try:
        described = {"run": None}       # first what the checkpoint is of: a clear refusal, before any tensor
        dcp.load(described, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
        expected = model_fingerprint(trainer.run)
        if described["run"] != expected:
            raise CheckpointError(f"{path} was written by another run: {_difference(described['run'], expected)}")
        dcp.load(loaded, checkpoint_id=path, planner=BoxLoadPlanner())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:   # DCP raises it on every rank: a BaseException
        inner = _inner(e)
        if isinstance(inner, CheckpointError):
            raise CheckpointError(f"{path}: {inner}") from e
        raise CheckpointError(f"{path}: cannot be read ({_first_line(inner)})") from e
    if loaded["data"]["samples_seen"] != step * trainer.run.global_batch:
        raise CheckpointError(f"{path}: its data position {loaded['data']} is not step {step}'s")
    _install(trainer, loaded)
    _restore_rng(path, step)
    return loaded["data"]["step"]


def _restore_rng(path, step):
    """Restore this rank's RNG state from the checkpoint, when the saving layout had a rank of this
    number (collective: every rank reads). A rank it did not have (a run resumed on more ranks)
    is seeded from (step, rank) alone (`new_rank_seed`): the same whatever the process did before
    loading, and not a copy of another rank's stream (ranks that draw the same numbers would drop
    out the same units, say)."""
    rank = dist.get_rank()
    key = f"rng/{rank}"
    saved = key in FileSystemReader(path).read_metadata().state_dict_metadata
    state = {key: torch.get_rng_state()}
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    if saved:
        torch.set_rng_state(state[key])
    else:
        torch.manual_seed(new_rank_seed(step, rank))


def new_rank_seed(step, rank):
    """The seed of a rank that resumes at `step` without a saved RNG state: 64 bits of a hash of
    (step, rank), so distinct ranks and steps get unrelated streams."""
    digest = hashlib.sha256(f"rng/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _inner(e):
    """What a rank raised inside DCP (CheckpointException holds {rank: (exception, traceback)})."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))
        e = e[0] if isinstance(e, tuple) else e
    return e


def _first_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1].split('. ')[0][:200]}" if text else type(e).__name__


def _difference(saved, expected):
    if not isinstance(saved, dict):
        return f"its description is {saved!r}"
    diffs = []
    for part in sorted(set(saved) | set(expected)):
        a, b = saved.get(part), expected.get(part)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"{k}={a.get(k)!r} there, {b[k]!r} here" for k in b if a.get(k) != b[k]]
        elif a != b:
            diffs.append(f"{part}={a!r} there, {b!r} here")
    return "; ".join(diffs)


def export(directory, path, step=None):
    """One file for inference: {name: full tensor} of the model (no optimizer), read from the
    checkpoint in one process without any process group; written atomically."""
    steps = saved_steps(directory)
    if not steps or (step is not None and step not in steps):
        raise CheckpointError(f"{directory}: no complete checkpoint" + (f" of step {step}" if step is not None else ""))
    source = checkpoint_path(directory, steps[-1] if step is None else step)
    meta = FileSystemReader(source).read_metadata().state_dict_metadata
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in meta.items()
             if k.startswith("model/") and isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():      # "torch.distributed is disabled ...": one process is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=source, no_dist=True)
    tmp = path + ".partial"
    torch.save({k[len("model/"):]: v for k, v in state.items()}, tmp)
    os.replace(tmp, path)
    return path


# =========================================================================================
# A run that resumes
# =========================================================================================

def train_resumable(rank, world_size, run, layout, directory, until, save_every=None):
    """Train `run` under `layout` from the latest checkpoint in `directory` (or from the start) up
    to step `until`, saving every `save_every` steps; returns the step it started from, the global
    losses of the steps it ran and this rank's full parameters (by name)."""
    from lectures.layout.mesh import make_mesh
    from lectures.layout.trainer import LayoutTrainer, global_loss
    trainer = LayoutTrainer(run, layout, make_mesh(layout.dp, layout.pp, layout.cp, layout.tp, ep=layout.ep),
                            track_memory=False)
    start = load(trainer, directory)
    losses = []
    for step in range(start, until):
        loss, _, _ = trainer.train_step(step)
        losses.append(global_loss(trainer, loss))
        if save_every and (step + 1) % save_every == 0:
            save(trainer, directory, step + 1)
    return {"start": start, "losses": losses, "params": trainer.full_parameters()}
