"""Lecture 01's GPT trained under any (dp, pp, cp, tp) layout, and the one-process run it must equal.

The pieces come from the earlier lectures, applied to the GPT in a fixed order, torchtitan's
(`torchtitan/models/llama3/parallelize.py`): tensor parallelism (lecture 04's `parallelize_gpt` on
the mesh's tp group; Shoeybi et al. 2019, Megatron-LM) → context parallelism (ring attention on
the cp group over zig-zag token shards; Liu et al. 2023, Llama Team 2024) → pipeline stages
(lecture 05's `GPTStage` and executor on the pp group) → the gradient average over the weight
replicas (dp × cp) and the optimizer, plain AdamW or ZeRO-1/2 (Rajbhandari et al. 2020, lecture
03). tests/test_lecture_07.py trains eleven layouts and checks every parameter against
`reference_run`, and the bytes each rank holds against `lectures.layout.estimator`.

- `GroupCollectives`: lecture 03's byte-counting collectives on one group of the mesh.
- `Run`, `reference_run`, `max_param_diff`: the run every layout must reproduce.
- `LayoutTrainer`, `train_layout`, `global_loss`: one rank's share of the training step.
- `held_bytes`: bytes of parameters, gradients and optimizer state a rank holds.
"""
import dataclasses

import torch
import torch.distributed as dist

from lectures.data_parallel.ddp import Collectives
from lectures.model.gpt import GPT, GPTConfig, batch, loss_fn
from lectures.model.memory import SavedBytes
from lectures.layout.mesh import make_mesh
from lectures.layout.shards import clip_grads_, first_expert, global_expert_name
from lectures.pipeline.executor import GPTStage, PipelineExecutor
from lectures.context_parallel.ring import ring_attention
from lectures.context_parallel.moe import ExpertParallelMoE, moe_gpt
from lectures.pipeline.schedules import make_schedule
from lectures.context_parallel.sharding import sequence_positions, zigzag_shard
from lectures.tensor_parallel.gpt import full_parameters, parallelize_gpt
from lectures.tensor_parallel.ops import shard_checks
from lectures.tensor_parallel.vocab import vocab_parallel_cross_entropy
from lectures.data_parallel.zero import Zero1, Zero2
from util import device
from util.measure import bytes_sent


class GroupCollectives(Collectives):
    """Adapter: lecture 03's byte-counting collectives run on the whole world; on a mesh they
    must run on one axis' group. Same counting, explicit `group` (lecture 03's ZeRO takes its
    shard index from it)."""

    def __init__(self, group):
        super().__init__(dist.get_world_size(group))
        self.group = group

    def all_reduce(self, t, async_op=False, label="all-reduce"):
        self.sent += 2 * (self.n - 1) * t.numel() * t.element_size() // self.n
        return self._async(dist.all_reduce(t, group=self.group, async_op=async_op), label, 0)

    def reduce_scatter(self, out, full, async_op=False, label="reduce-scatter"):
        self.sent += (self.n - 1) * full.numel() * full.element_size() // self.n
        return self._async(dist.reduce_scatter_single(out, full, group=self.group, async_op=async_op), label, 0)

    def all_gather(self, full, shard, async_op=False, label="all-gather"):
        self.sent += (self.n - 1) * full.numel() * full.element_size() // self.n
        return self._async(dist.all_gather_single(full, shard, group=self.group, async_op=async_op), label, 0)


# =========================================================================================
# The run, and the one process every layout must equal
# =========================================================================================

@dataclasses.dataclass(frozen=True)
class Run:
    """A small training run: the model, the global batch, steps and learning rate."""
    cfg: GPTConfig = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=4)
    global_batch: int = 8
    steps: int = 4
    lr: float = 3e-3
    weight_decay: float = 0.01     # AdamW's default, spelled out: ZeRO's optimizer needs it
    experts: int = 0               # > 0: every MLP a dropless mixture of experts (lecture 06's MoE)
    top_k: int = 1
    max_grad_norm: float = None    # clip the global gradient norm to this (lecture 08); None: no clipping


def build_model(run):
    """Lecture 01's GPT, or with `run.experts` lecture 06's MoE GPT, dropless (no capacity: which
    tokens an expert takes cannot depend on how the batch is split, so every layout can equal
    one process)."""
    if run.experts:
        return moe_gpt(run.cfg, run.experts, run.top_k, capacity_factor=None)
    return GPT(run.cfg)


def reference_run(run):
    """One process, the whole global batch, torch.optim.AdamW: what every layout must equal."""
    model = build_model(run).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=run.weight_decay)
    losses = []
    for step in range(run.steps):
        tokens, targets = (t.to(device()) for t in batch(run.cfg, run.global_batch, step))
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        if run.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: p.detach().cpu().clone() for k, p in model.named_parameters()}}


def max_param_diff(returns, reference):
    """The largest difference between any parameter the ranks returned (their "params", merged)
    and the reference's; every parameter must be there exactly once."""
    params = {}
    for r in returns:
        params.update(r["params"])
    if set(params) != set(reference):
        raise AssertionError(f"parameters missing or extra: {set(params) ^ set(reference)}")
    return max((params[k] - v).abs().max().item() for k, v in reference.items())


def held_bytes(params, optimizer_state=()):
    """Bytes of parameters, their gradients and optimizer state tensors (scalars like Adam's
    step counter left out) that this rank holds."""
    nbytes = lambda t: t.numel() * t.element_size()
    params = list(params)
    return {"weights": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(nbytes(t) for t in optimizer_state if t.dim() > 0)}


# =========================================================================================
# One rank's share of the step
# =========================================================================================

class _RingAttend:
    """CausalSelfAttention.attend on zig-zag sequence shards: lecture 06's ring attention."""

    def __init__(self, group):
        self.group = group

    def __call__(self, q, k, v):
        return ring_attention(q, k, v, causal=True, group=self.group, layout="zigzag")


class LayoutTrainer:
    """Lecture 01's GPT trained under `layout` on this rank's place in `mesh`. The constructor
    applies the parallelisms in order: split the model (tp, then cp), cut it into a pipeline
    stage (pp), then set up the gradient sync and optimizer over the weight replicas."""

    def __init__(self, run, layout, mesh, track_memory=True):
        """`track_memory=False` leaves out the saved-activation meter (a Python hook per saved
        tensor, +15–20% on a step of this small model): what timing runs want."""
        self.run, self.layout, self.mesh = run, layout, mesh
        self.track_memory = track_memory
        if layout.global_batch != run.global_batch:
            raise ValueError(f"layout {layout.label()} makes a global batch of {layout.global_batch}, "
                             f"the run wants {run.global_batch}")
        if layout.virtual_stages > 1 or layout.recompute != "none":
            # the estimator and the step-time model cover these; this trainer does not run them
            raise ValueError(f"layout {layout.label()}: this trainer runs one pipeline chunk per rank "
                             "and no recomputation (virtual_stages=1, recompute='none')")
        if layout.cp > 1 and layout.cp_algorithm != "ring":
            raise ValueError(f"layout {layout.label()}: this trainer runs ring attention (cp_algorithm='ring'); "
                             "lecture 06 builds the all-gather variant")
        if layout.ep > 1 and not run.experts:
            raise ValueError(f"layout {layout.label()}: ep > 1 needs a model with experts (Run.experts)")
        if run.experts and (layout.world != layout.dp or layout.zero):
            # the expert layers are wired for data and expert parallelism only
            raise ValueError(f"layout {layout.label()}: this trainer runs experts under dp and ep only "
                             "(no tp, pp, cp or ZeRO with experts)")
        self.tp_group = mesh.group["tp"]
        self.model = self._split_model(build_model(run).to(device()))   # the same seeded weights on every rank
        self.stage, self.executor, self.module = self._pipeline_stage()
        self.params = list(self.module.parameters())
        self.comm, self.zero, self.opt = self._optimizer()
        self.grad_norm = None        # the global gradient norm of the last step, when clipping
        if self.zero is not None and run.max_grad_norm is not None:
            self.zero.clip = self._clip
        # What autograd saves for backward, weights left out (they are counted as weights).
        self.meter = SavedBytes(exclude=self.params) if track_memory else None

    def _split_model(self, model):
        """Tensor parallelism on the tp group, then ring attention on the cp group."""
        if self.layout.tp > 1:
            model = parallelize_gpt(model, self.tp_group, sequence_parallel=self.layout.sp)
        if self.layout.cp > 1:
            attend = _RingAttend(self.mesh.group["cp"])
            for block in model.blocks:
                block.attn.attend = attend
        if self.layout.ep > 1:   # each rank keeps E/ep experts; tokens reach them by all-to-all
            for block in model.blocks:
                block.mlp = ExpertParallelMoE.from_full(block.mlp, self.mesh.group["ep"])
        return model

    def _expert_params(self):
        """The parameters of the routed experts this rank holds (replicated over dp/ep ranks only)."""
        if self.layout.ep == 1:     # experts on every rank: synced like every other parameter
            return set()
        return {id(p) for block in self.model.blocks for p in block.mlp.experts.parameters()}

    def _pipeline_stage(self):
        """(stage, executor, the module this rank trains): this rank's layers and the schedule
        that drives them on the pp group, or the whole (split) model without a pipeline."""
        lay, cfg = self.layout, self.run.cfg
        if lay.pp == 1:
            return None, None, self.model
        if lay.cp > 1 or lay.sp:
            raise ValueError("pipeline stages with context or sequence parallelism are not wired up here")
        index = self.mesh.index("pp")
        stage = GPTStage(self.model, index, lay.pp)
        executor = PipelineExecutor(
            make_schedule(lay.schedule, lay.pp, lay.micro_batches), {0: stage}, index,
            (lay.micro_batch, cfg.seq_len, cfg.d_model), group=self.mesh.group["pp"],
            loss_fn=self._loss, dtype=cfg.torch_dtype, track_memory=self.track_memory)
        return stage, executor, stage

    def _optimizer(self):
        """(collectives on the replica group, ZeRO or None, AdamW or None)."""
        lay, run = self.layout, self.run
        replica = self.mesh.group["replica"]
        comm = GroupCollectives(replica) if replica is not None else None
        if not lay.zero:
            return comm, None, torch.optim.AdamW(self.params, lr=run.lr, weight_decay=run.weight_decay)
        if lay.zero not in (1, 2) or replica is None:
            raise ValueError(f"ZeRO-{lay.zero}: this trainer implements ZeRO-1 and ZeRO-2 on a "
                             "data-parallel axis of 2 or more ranks (lecture 03 builds ZeRO-3)")
        # Lecture 03's ZeRO on the replica group; ZeRO-2's hooks reduce-scatter each
        # gradient as backward (a pipeline's, too) produces it, micro-batch by micro-batch.
        return comm, (Zero1 if lay.zero == 1 else Zero2)(self.module, comm, run), None

    def _loss(self, logits, targets):
        if self.layout.tp > 1:
            return vocab_parallel_cross_entropy(logits, targets, self.tp_group)
        return loss_fn(logits, targets)

    def local_batch(self, step):
        """This rank's rows (its dp slice) and tokens (its zig-zag cp slice) of the global batch,
        cut into m micro-batches, and the global positions of its tokens."""
        lay, mesh, cfg = self.layout, self.mesh, self.run.cfg
        tokens, targets = batch(cfg, self.run.global_batch, step)
        rows = self.run.global_batch // lay.dp
        d = mesh.index("dp")
        tokens, targets = tokens[d * rows:(d + 1) * rows], targets[d * rows:(d + 1) * rows]
        positions = None
        if lay.cp > 1:
            c = mesh.index("cp")
            tokens, targets = (zigzag_shard(t, c, lay.cp, dim=1) for t in (tokens, targets))
            positions = sequence_positions(cfg.seq_len, c, lay.cp, "zigzag").to(device())
        return (list(tokens.to(device()).chunk(lay.micro_batches)),
                list(targets.to(device()).chunk(lay.micro_batches)), positions)

    def forward_backward(self, step):
        """Gradients of the mean loss over this rank's share; returns (local mean loss or None,
        peak bytes of saved activations)."""
        tokens, targets, positions = self.local_batch(step)
        m = self.layout.micro_batches
        if self.meter is None:
            return self._forward_backward_untracked(tokens, targets, positions)
        self.meter.reset_peak()
        if self.executor is not None:
            with self.meter:        # the executor counts the stages' saves, the meter the loss's
                out = self.executor.step(tokens, targets)
            return out["loss"], out["peak_saved_bytes"] + self.meter.peak - self.meter.live
        total = 0.0
        for x, y in zip(tokens, targets):
            with self.meter:
                model = self.model
                h = model.embed(x, positions)
                for block in model.blocks:
                    h = block(h)
                loss = self._loss(model.head(h), y) / m
            loss.backward()
            total += loss.item()
        return total, self.meter.peak

    def _forward_backward_untracked(self, tokens, targets, positions):
        """forward_backward without the meter (peak saved bytes reported as 0)."""
        if self.executor is not None:
            return self.executor.step(tokens, targets)["loss"], 0
        total, m = 0.0, self.layout.micro_batches
        for x, y in zip(tokens, targets):
            h = self.model.embed(x, positions)
            for block in self.model.blocks:
                h = block(h)
            loss = self._loss(self.model.head(h), y) / m
            loss.backward()
            total += loss.item()
        return total, 0

    def sync_and_step(self):
        """Average the gradients over the weight replicas, then the optimizer."""
        if self.zero is not None:
            self.zero.step()                      # reduce-scatter, sharded AdamW, all-gather
            return
        if self.comm is not None:
            experts = self._expert_params()
            # an expert's gradient already sums its ep group's tokens (the all-to-all brought them
            # home): add the other ep groups' (its replicas) and divide by all dp·cp replicas
            ep_comm = self.mesh.group.get("expert_replica")
            ep_comm = GroupCollectives(ep_comm) if ep_comm is not None else None
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if id(p) in experts:
                    if ep_comm is not None:
                        ep_comm.all_reduce(p.grad)
                        self.comm.sent += ep_comm.sent
                        ep_comm.sent = 0
                else:
                    self.comm.all_reduce(p.grad)
                p.grad.div_(self.comm.n)
        if self.run.max_grad_norm is not None:
            self._clip()
        self.opt.step()
        self.opt.zero_grad()

    def _clip(self, zero_grads=None):
        """Clip by the norm of the whole model's gradient, each element counted once over every
        axis (lecture 08's `clip_grads_`): replicas and tensor-parallel copies are one tensor."""
        self.grad_norm = clip_grads_(self, self.run.max_grad_norm, zero_grads)

    def held(self):
        """Bytes of weights, gradients and optimizer state this rank holds at the step."""
        if self.zero is not None:   # ZeRO counts them itself: under ZeRO-2 the gradients are shards
            h = self.zero.held
            return {"weights": h["params"], "grads": h["grads"], "optimizer": h["optimizer"]}
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return held_bytes(self.params, state)

    def train_step(self, step):
        loss, act = self.forward_backward(step)
        if self.zero is None:
            held = self.held()
            self.sync_and_step()
        else:                       # ZeRO measures what it holds during its step
            self.sync_and_step()
            held = self.held()
        return loss, act, held

    def full_parameters(self):
        """{name of the unsplit GPT's parameter: full tensor} for the parameters this rank's
        stage holds (tensor-parallel slices gathered; every rank calls it)."""
        module = self.module
        named = full_parameters(module) if self.layout.tp > 1 else {
            k: p.detach().clone() for k, p in module.named_parameters()}
        if self.stage is not None:
            named = {self.stage.global_name(k): v for k, v in named.items()}
        if self.layout.ep > 1:   # local expert j of this rank is expert first + j of the model
            first = first_expert(self)
            named = {global_expert_name(k, first): v for k, v in named.items()}
        return {k: v.cpu() for k, v in named.items()}


def global_loss(trainer, loss):
    """The step's loss over the whole global batch, on every rank: the replicas' local means
    averaged (equal token counts), taken from one tensor-parallel rank of the last stage."""
    lay, mesh = trainer.layout, trainer.mesh
    counts = loss is not None and mesh.index("tp") == 0 and mesh.index("pp") == lay.pp - 1
    t = torch.tensor([loss if counts else 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / (lay.dp * lay.cp)


def train_layout(rank, world_size, run, layout):
    """Train `run` under `layout`; returns the loss of every step, this rank's coordinates and
    full parameters (by name), its measured memory (bytes held, peak saved activations) and the
    bytes it wrote to its sockets during the last step (`/proc/self/io`; None off Linux)."""
    mesh = make_mesh(layout.dp, layout.pp, layout.cp, layout.tp, ep=layout.ep)
    trainer = LayoutTrainer(run, layout, mesh)
    losses, act, held, sent = [], 0, None, None
    for step in range(run.steps):
        # every step has the same shapes on every rank: the tensor-parallel layers' cross-rank
        # shape check (a small all-gather per call) runs in the first step only, so the last
        # step's bytes are the layout's own collectives
        with bytes_sent() as wire, shard_checks(step == 0):
            loss, a, held = trainer.train_step(step)
        sent = wire.bytes                # the last step's (AdamW's state exists by then)
        act = max(act, a)
        losses.append(global_loss(trainer, loss))
    return {"losses": losses, "coords": mesh.coords, "params": trainer.full_parameters(),
            "memory": {**held, "activations": act}, "bytes_sent": sent,
            "tensor_sizes": [p.numel() for p in trainer.params]}
