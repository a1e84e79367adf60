"""Pipeline-parallel execution: the GPT cut into stages by layers, and one executor that runs any
schedule of lectures/schedules.py on real ranks.

- `GPTStage`, `split_gpt`: contiguous slices of the course's GPT (lectures/gpt.py) that share the
  full model's modules, so gradients land on the full model's parameters.
- `PipelineExecutor`: one rank's action list, with non-blocking sends posted together with the
  next receive (`batch_isend_irecv`), the split backward of zero-bubble schedules (B: input and
  module-output gradients only, W: the weight gradients later; Qi et al. 2023, "Zero Bubble
  Pipeline Parallelism", https://arxiv.org/abs/2401.10241), optional activation checkpointing
  (GPipe, Huang et al. 2019, https://arxiv.org/abs/1811.06965), and the activation memory autograd
  really holds (`lectures.memory.SavedBytes`).
- `build_rank`: a rank's executor and stages for a schedule; `gradients_by_name`: gradients by
  full-model name, to compare with one process.

Lecture 05 runs every schedule with it and checks loss, gradients and parameters against one
process (tests/test_lecture_05.py); lecture 07 runs it on the pipeline axis of a mesh.
"""
import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from lectures.gpt import GPT, loss_fn
from lectures.memory import SavedBytes
from lectures.schedule_sim import check_schedule, message_order
from lectures.schedules import Schedule, make_schedule
from util import device, span_at


class GPTStage(nn.Module):
    """A contiguous slice of the course's GPT (lectures/gpt.py): the embeddings if it is the
    first stage, some blocks, the final LayerNorm and LM head if it is the last. It shares (does
    not copy) the full model's modules, so gradients land on the full model's parameters."""

    def __init__(self, model, stage, n_stages):
        super().__init__()
        L = len(model.blocks)
        bounds = [k * L // n_stages for k in range(n_stages + 1)]   # sizes differ by at most one
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.block_ids = list(range(bounds[stage], bounds[stage + 1]))
        if self.first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleList(model.blocks[j] for j in self.block_ids)
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x

    def global_name(self, local):
        """'blocks.1.attn.q_proj.weight' here -> the full model's 'blocks.5.attn.q_proj.weight'."""
        if local.startswith("blocks."):
            _, j, rest = local.split(".", 2)
            return f"blocks.{self.block_ids[int(j)]}.{rest}"
        return local


def split_gpt(cfg, layout):
    """{stage: GPTStage} for the stages of every rank, by layers, from one seeded full model."""
    if cfg.tie_embeddings and layout.stages > 1:
        raise ValueError("tied embeddings put one parameter on the first and the last stage; "
                         "untie them (GPTConfig(tie_embeddings=False)) for pipelining")
    model = GPT(cfg).to(device())
    return model, {s: GPTStage(model, s, layout.stages) for s in range(layout.stages)}


def param_leaves(module):
    """The modules that own parameters directly (Linear, LayerNorm, Embedding, ...)."""
    return [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]


class PipelineExecutor:
    """Runs one rank's action list. Plug in `modules` ({chunk: nn.Module}: the stage each
    chunk holds; the first takes the micro-batch's inputs, the last's output goes to
    `loss_fn(output, target)`), the `layout`, this rank's index in `group` and the shape and
    dtype of what crosses a stage boundary.

    Sends never block: each is an `isend` posted in one `batch_isend_irecv` together with the
    receive the next action needs, and waited for at the end of the step. The only waits are
    for inputs, so any schedule the simulator can finish runs without deadlock. gloo matches
    messages by tag (kind, stage, micro-batch); NCCL ignores tags and matches each pair of ranks
    in posting order. So receives are posted in the order the sender sends
    (`schedule_sim.message_order`): to receive a message, a rank first posts the receives of every
    message that peer sends before it. In interleaved 1F1B with m not a multiple of p, and in
    DualPipeV at p >= 3, a rank needs a peer's messages in another order than the peer sends
    them; posting receives in the order needed would swap same-shaped tensors on NCCL.

    `delay` ({"F": s, "B": s, "W": s}) adds a fixed sleep to each action (an unsplit B sleeps
    B + W): sleep mode, for more ranks than cores. `checkpoint` keeps only each micro-batch's
    stage input after F (the forward runs without a graph) and re-runs the forward inside B
    (GPipe's re-materialisation). `track_memory` counts the bytes
    autograd saves for backward (`SavedBytes`, a Python hook per saved tensor: turn it off when
    timing against another implementation)."""

    def __init__(self, schedule, modules, rank, boundary_shape, *, group=None, loss_fn=loss_fn,
                 dtype=torch.float32, delay=None, checkpoint=False, layout=None, track_memory=True):
        self.actions = schedule[rank]
        self.layout = layout or schedule.layout
        self.split = any(a.kind == "W" for acts in schedule for a in acts)
        self.modules, self.rank, self.group = modules, rank, group
        self.shape, self.dtype, self.loss_fn = tuple(boundary_shape), dtype, loss_fn
        self.delay, self.checkpoint, self.track_memory = delay or {}, checkpoint, track_memory
        if self.split and checkpoint:
            raise ValueError("checkpointing with a split backward is not supported here")
        self.leaves = {c: param_leaves(mod) for c, mod in modules.items()}
        # What each peer sends this rank, in the peer's order: receives are posted in that order.
        self.sent_to_me = {src: keys for (src, dst), keys in message_order(schedule, self.layout).items()
                           if dst == rank}
        self.messages = 0

    # --- one step: for each action, receive its input, compute, send what it produced --------

    def step(self, inputs, targets, record=False):
        with torch.enable_grad():         # a step trains, even if called under torch.no_grad()
            return self._step(inputs, targets, record)

    def _step(self, inputs, targets, record):
        """Run the action list once on micro-batches `inputs[i]`, `targets[i]`. Gradients
        accumulate into the modules' parameters (each micro-batch's loss is divided by m, so
        they are those of the mean loss). Returns the mean loss on the last stage's rank (else
        None), the measured (action, start, end) list, and the peak bytes saved for backward."""
        self.inputs, self.targets, self.m = inputs, targets, len(inputs)
        self.local, self.inbox, self.sending, self.state = {}, {}, [], {}
        self.expected = {src: list(reversed(keys)) for src, keys in self.sent_to_me.items()}  # pop() = next
        self.posted = []            # (peer, "send" or "recv", key) in posting order, for tests
        # One meter per step, entered around every forward: its `live` is what autograd still
        # holds for backward (released as each backward uses it), its `peak` the most at once.
        self.meter = SavedBytes(exclude=[p for mod in self.modules.values() for p in mod.parameters()])
        self.loss_sum, self.messages, events = None, 0, []
        self.kept = self.peak_kept = 0      # checkpointing: bytes of kept inputs; the most held
        if self.actions:
            ops = []
            self._post_recv(self.actions[0], ops)
            self._launch(ops)
        for n, a in enumerate(self.actions):
            # Wait for this action's input first: the span below is compute only, so idle time
            # (the bubble) shows as a gap in the timeline.
            received = self._receive(a)
            t0 = time.perf_counter()
            produced = self._compute(a, received)
            pause = self.delay.get(a.kind, 0) + (self.delay.get("W", 0) if a.kind == "B" and not self.split else 0)
            if pause:
                time.sleep(pause)
            t1 = time.perf_counter()
            events.append((a, t0, t1))
            if record:
                span_at(a.kind, t0, t1)
            self._send_and_prefetch(n, a, produced)
        for work, _ in self.sending:
            work.wait()
        return {"loss": None if self.loss_sum is None else self.loss_sum / self.m, "events": events,
                "peak_saved_bytes": self.peak_kept if self.checkpoint else self.meter.peak,
                "messages": self.messages}

    def _receive(self, a):
        """The input of action `a`: F's activation (the micro-batch itself on the first stage),
        B's output gradient (none on the last stage, where the loss starts the backward). W needs
        nothing from another stage: it only uses what its B kept."""
        s = self.layout.stage(self.rank, a.chunk)
        key_in = self._incoming(a)
        if a.kind == "F":
            if s == 0:
                return self.inputs[a.microbatch].to(device())
            return self._take(key_in[0] if key_in else ("act", s, a.microbatch)).requires_grad_()
        if a.kind == "B" and s < self.layout.stages - 1:
            return self._take(key_in[0] if key_in else ("grad", s, a.microbatch))
        return None

    def _compute(self, a, received):
        """Run `a`; returns what goes to the neighbouring stage (F's output, B's input gradient)."""
        if a.kind == "F":
            return self._run_forward(a, received)
        if a.kind == "B":
            return self._run_backward(a, received)
        self._run_weight(a)
        return None

    def _run_forward(self, a, x):
        """F: the stage's forward with the meter on (the last stage's loss is computed outside
        it: it is not part of the stage). The micro-batch's input, output and kept module
        outputs stay in `state` until its backward (split: its W) has used them."""
        with self.meter if self.track_memory else contextlib.nullcontext():
            ys = self._forward(a.chunk, x)
        out = ys.pop("out")
        produced = out.detach()
        if self.checkpoint:                       # GPipe keeps only the stage's input
            self.kept += x.untyped_storage().nbytes()
            self.peak_kept = max(self.peak_kept, self.kept)
        if self.layout.stage(self.rank, a.chunk) == self.layout.stages - 1:
            loss = self.loss_fn(out, self.targets[a.microbatch].to(device()))
            self.loss_sum = (self.loss_sum or 0.0) + loss.item()
            out = loss / self.m                   # the backward starts from the mean loss
        self.state[a.microbatch, a.chunk] = {"x": x, "out": out, "leaves": ys}
        return produced

    def _run_backward(self, a, g):
        """B: the whole backward, or (split) only its input half. Unsplit, autograd has now
        released the micro-batch's saved tensors, and we drop the graph's ends; split, they
        stay until W."""
        if self.checkpoint:
            return self._recompute_backward(a, self.state.pop((a.microbatch, a.chunk)), g)
        dx = self._backward(self.state[a.microbatch, a.chunk], g)
        if not self.split:
            del self.state[a.microbatch, a.chunk]
        return dx

    def _run_weight(self, a):
        """W: the weight gradients B skipped, one parameter-owning module at a time; then the
        micro-batch's graph is dropped and autograd releases what it saved for it."""
        st = self.state.pop((a.microbatch, a.chunk))
        for module, y, dy in st["weight_work"]:
            torch.autograd.backward(y, dy, inputs=list(module.parameters(recurse=False)))

    def _send_and_prefetch(self, n, a, produced):
        """Post, in one batch, the send of what action n produced and the receive the next
        action needs: posting both together is what keeps two neighbours from deadlocking."""
        s = self.layout.stage(self.rank, a.chunk)
        ops = []
        if a.kind == "F" and s < self.layout.stages - 1:
            self._send("act", s + 1, a.microbatch, produced, ops)
        elif a.kind == "B" and s > 0:
            self._send("grad", s - 1, a.microbatch, produced, ops)
        if n + 1 < len(self.actions):
            self._post_recv(self.actions[n + 1], ops)
        self._launch(ops)

    # --- the computations -------------------------------------------------------------------

    def _forward(self, chunk, x):
        """The stage's forward; in split mode the outputs of every parameter-owning module are
        kept, so that W can later turn their gradients into weight gradients."""
        module = self.modules[chunk]
        if self.checkpoint:                       # no graph now: B re-runs this forward
            with torch.no_grad():
                return {"out": module(x)}
        if not self.split:
            return {"out": module(x)}
        seen = []

        def keep(mod, inp, y):
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"a split backward needs every module that owns parameters to return "
                                f"one tensor; {type(mod).__name__} returned {type(y).__name__}")
            seen.append((mod, y))
        handles = [leaf.register_forward_hook(keep) for leaf in self.leaves[chunk]]
        try:
            out = module(x)
        finally:
            for h in handles:
                h.remove()
        return {"out": out, "seen": seen}

    def _recompute_backward(self, a, st, g):
        """B under checkpointing: re-run the stage's forward with autograd on, then its backward.
        The re-run saves one micro-batch's activations again, on top of every input still kept:
        a meter of its own (the kept input left out, it is counted already) measures that, and
        `peak_kept` is the most the rank held at once."""
        x = st["x"]
        params = [p for p in self.modules[a.chunk].parameters()]
        meter = SavedBytes(exclude=params + [x]) if self.track_memory else contextlib.nullcontext()
        with torch.enable_grad():
            with meter:                           # the stage's activations (the loss is not part of it)
                out = self.modules[a.chunk](x)
            if self.layout.stage(self.rank, a.chunk) == self.layout.stages - 1:
                out = self.loss_fn(out, self.targets[a.microbatch].to(device())) / self.m
            torch.autograd.backward(out, g)
        if self.track_memory:
            self.peak_kept = max(self.peak_kept, self.kept + meter.peak)
        self.kept -= x.untyped_storage().nbytes()
        return x.grad if x.requires_grad else None

    def _backward(self, st, g):
        """B. Unsplit: the whole backward; the input's gradient is x.grad. Split (zero bubble):
        ask autograd only for the gradients of the input and of every parameter-owning module's
        output — the weight-gradient products are not computed — and keep the latter for W,
        which multiplies them into weight gradients one module at a time."""
        x, out = st["x"], st["out"]
        if not self.split:
            torch.autograd.backward(out, g)
            return x.grad if x.requires_grad else None
        seen = st["leaves"]["seen"]
        wrt = ([x] if x.requires_grad else []) + [y for _, y in seen]
        grads = torch.autograd.grad(out, wrt, g, retain_graph=True, allow_unused=True)
        dx = grads[0] if x.requires_grad else None
        dys = grads[1:] if x.requires_grad else grads
        st["weight_work"] = [(mod, y, dy) for (mod, y), dy in zip(seen, dys) if dy is not None]
        return dx

    # --- messages: who, which tag, posting and taking -------------------------------------

    def _peer(self, stage):
        return self._global(self.layout.place(stage)[0])

    def _global(self, r):
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _tag(self, kind, stage, mb):
        return (0 if kind == "act" else 1) + 2 * (stage + self.layout.stages * mb)

    def _incoming(self, a):
        """(key, source stage) of the message action `a` needs, or None (none, or local)."""
        s = self.layout.stage(self.rank, a.chunk)
        if a.kind == "F" and s > 0 and self.layout.place(s - 1)[0] != self.rank:
            return ("act", s, a.microbatch), s - 1
        if a.kind == "B" and s < self.layout.stages - 1 and self.layout.place(s + 1)[0] != self.rank:
            return ("grad", s, a.microbatch), s + 1
        return None

    def _post_recv(self, a, ops):
        """Post the receive action `a` needs, after those of every message its sender sends
        earlier (posting order is what NCCL matches by)."""
        need = self._incoming(a)
        if not need or need[0] in self.inbox:
            return
        src = self.layout.place(need[1])[0]
        queue = self.expected[src]
        while True:
            key = queue.pop()
            buf = torch.empty(self.shape, dtype=self.dtype, device=device())
            self.inbox[key] = [buf, None]
            self.posted.append((src, "recv", key))
            ops.append((dist.P2POp(dist.irecv, buf, self._global(src), self.group, self._tag(*key)), key))
            if key == need[0]:
                return

    def _take(self, key):
        """The tensor for `key`: local hand-over, or the posted receive, waited for."""
        if key in self.local:
            return self.local.pop(key)
        buf, work = self.inbox.pop(key)
        if work is not None:
            work.wait()
        return buf

    def _launch(self, ops):
        if ops:
            works = dist.batch_isend_irecv([op for op, _ in ops])
            for (op, key), work in zip(ops, works):
                if key is None:
                    self.sending.append((work, op.tensor))
                else:
                    self.inbox[key][1] = work

    def _send(self, kind, stage, mb, tensor, ops):
        dest = self.layout.place(stage)[0]
        if dest == self.rank:                                # the V's turn: a local hand-over
            self.local[(kind, stage, mb)] = tensor.detach()
            return
        self.messages += 1
        self.posted.append((dest, "send", (kind, stage, mb)))
        ops.append((dist.P2POp(dist.isend, tensor.contiguous(), self._peer(stage), self.group,
                               self._tag(kind, stage, mb)), None))


def gradients_by_name(stage_modules):
    """{full-model parameter name: gradient} over the given {stage: GPTStage}."""
    out = {}
    for module in stage_modules.values():
        for local, p in module.named_parameters():
            if p.grad is not None:
                out[module.global_name(local)] = p.grad.detach().cpu().clone()
    return out


def build_rank(rank, world_size, cfg, schedule, m, mb_size, chunks=1, delay=None, checkpoint=False, group=None,
               track_memory=True):
    """This rank's executor and stages for schedule `schedule` (a name or a Schedule)."""
    sched = schedule if isinstance(schedule, Schedule) else make_schedule(schedule, world_size, m, chunks)
    check_schedule(sched)
    _, stages = split_gpt(cfg, sched.layout)
    mine = {c: stages[sched.layout.stage(rank, c)] for c in range(sched.layout.chunks)}
    if delay:   # sleep mode: an action of a chunk holding 1/v of the rank's layers waits 1/v as long
        delay = {k: d / sched.layout.chunks for k, d in delay.items()}
    executor = PipelineExecutor(sched, mine, rank, (mb_size, cfg.seq_len, cfg.d_model), group=group,
                                dtype=cfg.torch_dtype, delay=delay, checkpoint=checkpoint,
                                track_memory=track_memory)
    return executor, {sched.layout.stage(rank, c): mod for c, mod in mine.items()}
