"""Pipeline-parallel execution: the GPT cut into stages by layers, and one executor that runs any
schedule of lectures/pipeline/schedules.py on real ranks.

- `GPTStage`, `split_gpt`: contiguous slices of the course's GPT (lectures/model/gpt.py) that share the
  full model's modules, so gradients land on the full model's parameters.
- `PipelineExecutor`: one rank's action list, with non-blocking sends posted together with the
  next receive (`batch_isend_irecv`), the split backward of zero-bubble schedules (B: input and
  module-output gradients only, W: the weight gradients later; Qi et al. 2024, "Zero Bubble
  Pipeline Parallelism", https://arxiv.org/abs/2401.10241), optional activation checkpointing
  (GPipe, Huang et al. 2019, https://arxiv.org/abs/1811.06965), and the activation memory autograd
  really holds (`lectures.model.memory.SavedBytes`).
- Tied embeddings (Megatron-LM's embedding group, Narayanan et al. 2021,
  https://arxiv.org/abs/2104.04473): the first stage's embedding and the last stage's LM head are
  two copies of one weight, made equal at the first step; after each step's backward the executor sums their
  gradients across the two ranks (`tie_peer`), or autograd already has where one rank holds both.
- `build_rank`: a rank's executor and stages for a schedule; `gradients_by_name`: gradients by
  full-model name, to compare with one process; `stage_parameters`: a rank's parameters, once.

Lecture 05 runs every schedule with it and checks loss, gradients and parameters against one
process (tests/test_lecture_05.py); lecture 07 runs it on the pipeline axis of a mesh.
"""
import collections
import contextlib
import hashlib
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from lectures.model.gpt import GPT, loss_fn
from lectures.model.memory import SavedBytes
from lectures.pipeline.simulate import check_schedule, message_slots, plan_clock, simulate
from lectures.pipeline.schedules import Schedule, make_schedule
from util import device, span_at


class GPTStage(nn.Module):
    """A contiguous slice of the course's GPT (lectures/model/gpt.py): the embeddings if it is the
    first stage, some blocks, the final LayerNorm and LM head if it is the last. It shares (does
    not copy) the full model's modules, so gradients land on the full model's parameters.
    `tied`: the parameters this stage shares with the other end of the pipeline (a tied
    embedding, on the first and the last stage; empty elsewhere)."""

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
        head = list(model.lm_head.parameters())
        shared = [p for p in model.tok_emb.parameters() if any(p is q for q in head)]
        self.ties_embedding = bool(shared)        # every stage knows, so every rank's signature says it
        self.tied = shared if self.first or self.last else []

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
    """{stage: GPTStage} for the stages of every rank, by layers, from one seeded full model
    (the same on every rank: so a tied embedding's two copies, on the first and the last stage's
    ranks, start equal)."""
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

    Messages follow `communication_plan`: each goes out in a `batch_isend_irecv` (one per
    neighbour and slot) that both its ends post at the same slot of one clock timed with the
    run's costs (`simulate.message_slots`), every rank posting its batches in slot order, and a rank waits for a message only when an action needs it,
    waiting for every Work of its batch. That holds under NCCL's rules as well as gloo's: NCCL
    returns one Work for a whole batch (a receive's data is there only once it is waited for),
    runs a rank's batches one after another on one stream, matches a pair's sends and receives
    in posting order whatever the tags, and completes a send only when its receive runs.
    `simulate.p2p_deadlock` runs the plans under those rules; the tests run the executor
    under a stand-in that has them.

    `delay` ({"F": s, "B": s, "W": s}) adds a fixed sleep to each action (an unsplit B sleeps
    B + W): sleep mode, for more ranks than cores. `cost` ({"F", "B", "W"} per action: the times
    the run will have, given or measured; default `delay`, else unit costs) times the plan's
    slots; `plan_for` re-times them, and every rank must use the same (the signature says them).
    `checkpoint` keeps only each micro-batch's stage input after F (the forward runs without a
    graph) and re-runs the forward inside B (GPipe's re-materialisation). `track_memory` counts the bytes
    autograd saves for backward (`SavedBytes`, a Python hook per saved tensor: turn it off when
    timing against another implementation).

    A parameter that `modules` mark as `tied` (GPTStage: a tied embedding) lives on the first and
    the last stage; after the step's backward its two copies' gradients are summed across the
    two ranks (`tie_peer`), so both copies take the same optimizer step."""

    def __init__(self, schedule, modules, rank, boundary_shape, *, group=None, loss_fn=loss_fn,
                 dtype=torch.float32, delay=None, checkpoint=False, layout=None, track_memory=True, cost=None):
        self.actions = schedule[rank]
        self.layout = layout or schedule.layout
        self.split = any(a.kind == "W" for acts in schedule for a in acts)
        self.modules, self.rank, self.group = modules, rank, group
        self.shape, self.dtype, self.loss_fn = tuple(boundary_shape), dtype, loss_fn
        self.delay, self.checkpoint, self.track_memory = delay or {}, checkpoint, track_memory
        if self.split and checkpoint:
            raise ValueError("checkpointing with a split backward is not supported here")
        self.leaves = {c: param_leaves(mod) for c, mod in modules.items()}
        self.microbatches, self.schedule_name = schedule.microbatches, schedule.name
        self.schedule = schedule
        self.plan_for(cost or self.delay or None)
        self.messages = 0
        self.tied = list({id(p): p for mod in modules.values() for p in getattr(mod, "tied", [])}.values())
        self.tie_peer = tie_peer(self.layout, rank) if self.tied else None
        self.ties_embedding = any(getattr(mod, "ties_embedding", False) for mod in modules.values())
        self.tie_synced = False      # the two copies are made equal at the first step (`_sync_tied`)

    def plan_for(self, cost):
        """Time the communication plan with `cost` (None: unit costs): the slots follow the run
        only if the costs are the run's. Every rank of the pipeline must plan with the same."""
        self.plan_cost = cost
        self.plan = communication_plan(self.schedule, self.rank, self.layout, cost)

    # --- one step: for each action, receive its input, compute, send what it produced --------

    def step(self, inputs, targets, record=False):
        with torch.enable_grad():         # a step trains, even if called under torch.no_grad()
            return self._step(inputs, targets, record)

    def _step(self, inputs, targets, record):
        """Run the action list once on micro-batches `inputs[i]`, `targets[i]`. Gradients
        accumulate into the modules' parameters (each micro-batch's loss is divided by m, so
        they are those of the mean loss). Returns the mean loss on the last stage's rank (else
        None), the measured (action, start, end) list, and the peak bytes saved for backward."""
        self._agree(inputs, targets)
        self._check_tied()
        if len(inputs) != self.microbatches or len(targets) != self.microbatches:
            raise ValueError(f"this schedule runs {self.microbatches} micro-batches; got {len(inputs)} "
                             f"inputs and {len(targets)} targets (make a schedule for that many)")
        before = self._take_tied_grads()
        self._sync_tied()
        self.inputs, self.targets, self.m = inputs, targets, len(inputs)
        self.local, self.outbox, self.inbox, self.state = {}, {}, {}, {}
        self.batch_of, self.batches = {}, []     # key -> the Works of its batch; batches not waited for
        self.posted = []            # (peer, "send" or "recv", key) in posting order, for tests
        # One meter per step, entered around every forward: its `live` is what autograd still
        # holds for backward (released as each backward uses it), its `peak` the most at once.
        self.meter = SavedBytes(exclude=[p for mod in self.modules.values() for p in mod.parameters()])
        self.loss_sum, self.messages, events = None, 0, []
        self.kept = self.peak_kept = 0      # checkpointing: bytes of kept inputs; the most held
        # split backward: {(microbatch, chunk): {"inputs": bytes, "grads": bytes}} kept from B to W,
        # the output gradients held now, and how many of the peak's bytes were output gradients
        self.held_for_w, self.grads_live, self.peak_grads, seen_peak = {}, 0, 0, 0
        for what, arg in self.plan:
            if what == "post":
                self._post(arg)
            elif what == "wait":
                self._wait(arg)
            else:
                events.append(self._run(self.actions[arg], record))
                if self.meter.peak > seen_peak:   # a new peak, set during this action: its output gradients
                    seen_peak, self.peak_grads = self.meter.peak, self.grads_live
        for works in self.batches:          # the batches not waited for yet: sends in flight
            for work in works:
                work.wait()
        self._sum_tied(before)
        return {"loss": None if self.loss_sum is None else self.loss_sum / self.m, "events": events,
                "peak_saved_bytes": self.peak_kept if self.checkpoint else self.meter.peak,
                "peak_held_grads": self.peak_grads, "messages": self.messages}

    def _take_tied_grads(self):
        """The tied copies' gradients from earlier steps (accumulation), set aside so that only
        this step's part is exchanged: the sum adds them back. None where there is no peer."""
        if self.tie_peer is None:
            return None
        before = [p.grad for p in self.tied]
        for p in self.tied:
            p.grad = None
        return before

    def _sync_tied(self):
        """At the first step, the last stage's copy of a tied weight takes the first stage's
        values (Megatron-LM makes them equal at the start, too): ranks seeded differently still
        train one weight. One message pair, posted before any of the pipeline's."""
        if self.tie_peer is None or self.tie_synced:
            return
        holds_first = self.layout.place(0)[0] == self.rank
        peer = self._global(self.tie_peer)
        ops = [dist.P2POp(dist.isend if holds_first else dist.irecv, p.data, peer, self.group,
                          2 * self.layout.stages * self.microbatches + len(self.tied) + k)
               for k, p in enumerate(self.tied)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.tie_synced = True

    def _sum_tied(self, before):
        """The tied embedding's gradient: the first stage's copy holds the embedding's part, the
        last stage's the LM head's. An all-reduce of the two ranks, written as one exchange (each
        sends this step's part and adds the other's: a + b = b + a bit for bit, so both copies
        take the same optimizer step), posted after every pipeline message is done, so under NCCL
        it is the next message of the pair at both ends; what earlier steps accumulated
        (`before`, equal on both ends) is added back. Where one rank holds both ends (the V's
        rank 0), the copies are one Parameter and autograd has summed them already."""
        if self.tie_peer is None:
            return
        ops, theirs, peer = [], [], self._global(self.tie_peer)
        for k, p in enumerate(self.tied):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            theirs.append(torch.empty_like(p.grad))
            tag = 2 * self.layout.stages * self.m + k          # after every activation's and gradient's
            ops += [dist.P2POp(dist.isend, p.grad, peer, self.group, tag),
                    dist.P2POp(dist.irecv, theirs[-1], peer, self.group, tag)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for p, g, old in zip(self.tied, theirs, before):
            total = p.grad + g
            p.grad = total if old is None else old + total

    def _check_tied(self):
        """A gradient hook on a tied weight (the course's overlapped all-reduce, Zero2) would
        start an asynchronous reduction, or keep only a shard, of a gradient the pipeline has
        not summed yet. Both ends raise; middle ranks learn of it from `_agree` (the signature
        names the hook), so no rank waits for a message that will not come."""
        if self.tie_peer is not None and self._tied_hooked():
            raise ValueError("a tied embedding's gradient is summed across the first and the last stage after "
                             "the pipeline's backward; a gradient hook on it would reduce (or shard) it before "
                             "that sum, or while it runs: reduce it after executor.step, or untie the embedding")

    def _tied_hooked(self):
        return any(getattr(p, "_post_accumulate_grad_hooks", None) for p in self.tied)

    def signature(self, inputs, targets):
        """What every rank of the pipeline must agree on for a step to be exchangeable: the
        schedule and its size, the micro-batches' shapes and dtypes, the shape and dtype of
        what crosses a stage boundary (the receive buffers), and whether the embedding is tied
        (the two ends exchange its gradient) and hooked (refused)."""
        def kinds(tensors):
            return sorted({f"{tuple(t.shape)} {t.dtype}" for t in tensors})
        lay = self.layout
        tie = ("embedding tied" + (" (a gradient hook on the tied weight: refused)"
                                   if self.tie_peer is not None and self._tied_hooked() else "")
               if self.ties_embedding else "embedding untied")
        return (f"schedule {self.schedule_name} on {lay.ranks} ranks × {lay.chunks} chunks ({lay.style}), "
                f"{len(inputs)} micro-batches, inputs {kinds(inputs)}, targets {kinds(targets)}, "
                f"boundary {self.shape} {self.dtype}, {tie}, plan timed at {plan_clock(self.plan_cost)}")

    def _agree(self, inputs, targets):
        """Before any message moves, the ranks compare a 20-byte digest of their `signature`
        (one small all_gather): ranks that disagree (another dtype, shape, schedule or number of
        micro-batches) would otherwise make gloo abort on a size mismatch, wait for ever, or
        (NCCL) copy bytes into a buffer of another type. Only when the digests differ do they
        gather the signatures themselves, and every rank raises the same error."""
        if self.layout.ranks == 1:
            return
        mine = self.signature(inputs, targets).encode()
        if len(set(self._gather_bytes(hashlib.sha1(mine).digest(), 20))) == 1:
            return
        seen = self._gather_bytes(mine[:400], 400)
        groups = collections.defaultdict(list)
        for r, sig in enumerate(seen):
            groups[sig.rstrip(b"\0").decode(errors="replace")].append(r)
        said = "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: {sig}"
                         for sig, rs in groups.items())
        raise ValueError(f"the pipeline's ranks disagree on the step they run, so their messages "
                         f"would not match: {said}")

    def _gather_bytes(self, data, size):
        """Every rank's `data` (at most `size` bytes), by one all_gather on the pipeline's group."""
        buf = torch.zeros(size, dtype=torch.uint8, device=device())
        buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        out = [torch.empty_like(buf) for _ in range(self.layout.ranks)]
        dist.all_gather(out, buf, group=self.group)
        return [bytes(t.cpu().tolist()) for t in out]

    def _run(self, a, record):
        """One action: its input (waited for already), the compute, and what it produced put
        where the plan will send it (or handed over, when the next stage is this rank's too)."""
        received = self._receive(a)
        t0 = time.perf_counter()
        produced = self._compute(a, received)
        pause = self.delay.get(a.kind, 0) + (self.delay.get("W", 0) if a.kind == "B" and not self.split else 0)
        if pause:
            time.sleep(pause)
        t1 = time.perf_counter()
        if record:
            span_at(a.kind, t0, t1)
        s = self.layout.stage(self.rank, a.chunk)
        key = (("act", s + 1, a.microbatch) if a.kind == "F" and s < self.layout.stages - 1 else
               ("grad", s - 1, a.microbatch) if a.kind == "B" and s > 0 else None)
        if key:
            if self.layout.place(key[1])[0] == self.rank:     # the V's turn: a local hand-over
                self.local[key] = produced.detach()
            else:
                self.outbox[key] = produced
        return a, t0, t1

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
        """B: the whole backward, or (split) only its input half. Either way autograd has now
        released the micro-batch's saved tensors and its graph is dropped; split, what W needs
        stays until W: each parameter-owning module's input and output gradient (the meter
        counts them: `held_for_w`)."""
        st = self.state.pop((a.microbatch, a.chunk))
        if self.checkpoint:
            return self._recompute_backward(a, st, g)
        if not self.split:
            return self._backward(st, g)
        dx, work = self._backward_input(st, g)
        del st                                    # the graph goes: autograd frees what only B needed
        held = {"inputs": 0, "grads": 0}
        if self.track_memory:
            held["inputs"] = self.meter.hold([t for _, inputs, _ in work for t in inputs if isinstance(t, torch.Tensor)])
            held["grads"] = self.meter.hold([dy for _, _, dy in work])
            self.grads_live += held["grads"]
        self.state[a.microbatch, a.chunk] = {"weight_work": work, "held": held}
        self.held_for_w[a.microbatch, a.chunk] = held
        return dx

    def _run_weight(self, a):
        """W: the weight gradients B skipped, one parameter-owning module at a time, from the
        module's input and output gradient alone (`weight_gradients`); then they are let go."""
        st = self.state.pop((a.microbatch, a.chunk))
        for module, inputs, dy in st["weight_work"]:
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            grads = weight_gradients(module, inputs, dy)
            # backward from the parameters themselves: autograd accumulates into .grad and runs
            # any gradient hook (an overlapped all-reduce), as it would in one backward
            if params:
                torch.autograd.backward(params, [grads[id(p)] for p in params])
        if self.track_memory:
            self.meter.let_go(st["held"]["inputs"] + st["held"]["grads"])
            self.grads_live -= st["held"]["grads"]

    # --- the computations -------------------------------------------------------------------

    def _forward(self, chunk, x):
        """The stage's forward; in split mode the input and output of every parameter-owning
        module are noted, so that B can ask for the outputs' gradients and W can turn them
        into weight gradients."""
        module = self.modules[chunk]
        if self.checkpoint:                       # no graph now: B re-runs this forward
            with torch.no_grad():
                return {"out": module(x)}
        if not self.split:
            return {"out": module(x)}
        seen = []

        def keep(mod, args, kwargs, y):
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"a split backward needs every module that owns parameters to return "
                                f"one tensor; {type(mod).__name__} returned {type(y).__name__}")
            if kwargs:
                raise TypeError(f"a split backward keeps each parameter-owning module's positional "
                                f"inputs for W; {type(mod).__name__} was called with keywords {sorted(kwargs)}")
            seen.append((mod, tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args), y))
        handles = [leaf.register_forward_hook(keep, with_kwargs=True) for leaf in self.leaves[chunk]]
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
        """B unsplit: the whole backward; the input's gradient is x.grad."""
        x, out = st["x"], st["out"]
        torch.autograd.backward(out, g)
        return x.grad if x.requires_grad else None

    def _backward_input(self, st, g):
        """B split (zero bubble): ask autograd only for the gradients of the input and of every
        parameter-owning module's output — the weight-gradient products are not computed — and
        free the graph (no retain_graph: softmax's, GELU's and the other saves only B needs go
        now). Returns the input's gradient and W's work: (module, its inputs, its output's
        gradient), all W needs (Qi et al.'s implementation and Megatron-LM's WeightGradStore
        keep the same)."""
        x, out = st["x"], st["out"]
        seen = st["leaves"]["seen"]
        wrt = ([x] if x.requires_grad else []) + [y for _, _, y in seen]
        grads = torch.autograd.grad(out, wrt, g, allow_unused=True)
        dx = grads[0] if x.requires_grad else None
        dys = grads[1:] if x.requires_grad else grads
        work = [(mod, inputs, dy) for (mod, inputs, _), dy in zip(seen, dys) if dy is not None]
        st.clear()                                # drop the graph's ends (the outputs) here
        return dx, work

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

    def _post(self, batch):
        """One batch_isend_irecv of the plan: sends of what earlier actions produced, receives
        into fresh buffers."""
        ops, recvs = [], []
        for op, peer, key in batch:
            self.posted.append((peer, op, key))
            if op == "send":
                self.messages += 1
                tensor = self.outbox.pop(key).contiguous()
                ops.append(dist.P2POp(dist.isend, tensor, self._global(peer), self.group, self._tag(*key)))
            else:
                buf = torch.empty(self.shape, dtype=self.dtype, device=device())
                self.inbox[key] = buf
                recvs.append(key)
                ops.append(dist.P2POp(dist.irecv, buf, self._global(peer), self.group, self._tag(*key)))
        works = dist.batch_isend_irecv(ops)
        self.batches.append(works)
        for key in recvs:
            self.batch_of[key] = works

    def _wait(self, key):
        """Wait for every Work of the batch that receives `key` (NCCL returns one for the whole
        batch, gloo one per op: either way the buffer is complete only after all are waited),
        once: a batch with two receives is not waited for again."""
        works = self.batch_of.pop(key)
        if any(w is works for w in self.batches):
            self.batches = [w for w in self.batches if w is not works]
            for work in works:
                work.wait()

    def _take(self, key):
        """The tensor for `key`: a local hand-over, or a receive the plan has waited for."""
        if key in self.local:
            return self.local.pop(key)
        return self.inbox.pop(key)


def weight_gradients(module, inputs, dy):
    """{id(parameter): gradient} of `module`'s own parameters from its inputs and its output's
    gradient `dy`: W's work, without the graph of the forward. Linear: dy^T x (and the sum of
    dy); LayerNorm: the sums of dy times the normalised input, and of dy; Embedding: dy's rows
    added at the looked-up indices. Any other module runs its forward again on the kept inputs
    and backpropagates dy into its parameters only (exact for any module whose forward is
    deterministic; it costs one more forward)."""
    x = inputs[0] if inputs else None
    if type(module) is nn.Linear:
        d2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        out = {id(module.weight): d2.t() @ x2}
        if module.bias is not None:
            out[id(module.bias)] = d2.sum(0)
        return out
    if type(module) is nn.LayerNorm and module.weight is not None:
        shape = tuple(module.normalized_shape)
        xhat = torch.nn.functional.layer_norm(x, shape, eps=module.eps)
        out = {id(module.weight): (dy * xhat).reshape(-1, *shape).sum(0)}
        if module.bias is not None:
            out[id(module.bias)] = dy.reshape(-1, *shape).sum(0)
        return out
    if (type(module) is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq
            and not module.sparse):
        g = torch.zeros_like(module.weight).index_add_(0, x.reshape(-1), dy.reshape(-1, dy.shape[-1]))
        if module.padding_idx is not None:
            g[module.padding_idx] = 0
        return {id(module.weight): g}
    params = [p for p in module.parameters(recurse=False) if p.requires_grad]
    with torch.enable_grad():
        y = module(*inputs)
    return {id(p): g for p, g in zip(params, torch.autograd.grad(y, params, dy))}


def measured_cost(events, group=None):
    """The run's costs from one step's measured (action, start, end) spans: each kind's median
    length on this rank, averaged over the pipeline's ranks (one all_reduce: every rank must
    time its plan with the same costs). An unsplit list has no W; its B is the whole backward."""
    lengths = [statistics.median([t1 - t0 for a, t0, t1 in events if a.kind == k] or [0.0]) for k in "FBW"]
    total = torch.tensor(lengths, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
        total /= dist.get_world_size(group)
    return dict(zip("FBW", total.tolist()))


def tie_peer(layout, rank):
    """The rank holding the other end of the pipeline (first stage <-> last stage), with which a
    tied embedding's gradient is summed; None where this rank holds both ends (p = 1, or the V
    layouts' rank 0) or neither."""
    ends = {layout.place(0)[0], layout.place(layout.stages - 1)[0]}
    return (ends - {rank}).pop() if rank in ends and len(ends) == 2 else None


def communication_plan(schedule, rank, layout=None, cost=None):
    """What rank `rank` does, in order: ("post", batch) posts one batch_isend_irecv, a batch being
    [(op, peer, key)] with op "send" or "recv"; ("wait", key) waits for the batch that receives
    `key`; ("run", n) runs action n of the rank's list.

    Both ends of a message post it in their batch of the same slot (`message_slots`: the time
    its data is ready when the actions take `cost`, the costs the run will have; unit costs if
    None), a rank posts each slot's batch before it starts an action at or after that slot, and
    waits for an input just before the action that needs it. Batches of one slot therefore
    meet across all ranks once every earlier slot is done, so no cycle of waits can form, even
    where batches run one after another and a send completes only when its receive runs
    (NCCL), whatever the costs; inside a batch, ops are sorted by key, so a pair posts its
    messages in the same order at both ends. The costs decide only how well the slots follow
    the run: timed at costs the run does not have, a message ready early waits behind a batch
    whose partner is still computing."""
    layout = layout or schedule.layout
    return _rank_plan(schedule, rank, layout, *_timed_slots(schedule, layout, cost))


def communication_plans(schedule, layout=None, cost=None):
    """Every rank's `communication_plan`, from one simulation: the slots are the same for all
    ranks, so a caller that wants them all (a deadlock check) need not simulate p times."""
    layout = layout or schedule.layout
    timed = _timed_slots(schedule, layout, cost)
    return [_rank_plan(schedule, rank, layout, *timed) for rank in range(len(schedule))]


def _timed_slots(schedule, layout, cost):
    clocked = simulate(schedule, plan_clock(cost), layout)    # slots and starts from one simulation
    return clocked, message_slots(schedule, layout, sim=clocked)


def _rank_plan(schedule, rank, layout, clocked, slots):
    batches = collections.defaultdict(list)
    for key, slot in slots.items():
        kind, stage, _ = key
        src = layout.place(stage - 1 if kind == "act" else stage + 1)[0]
        dst = layout.place(stage)[0]
        if src == rank:
            batches[slot].append(("send", dst, key))
        elif dst == rank:
            batches[slot].append(("recv", src, key))
    order = sorted(batches)
    starts = [start for _, start, _ in clocked.timeline[rank]]
    plan, i = [], 0
    for n, (a, start) in enumerate(zip(schedule[rank], starts)):
        while i < len(order) and order[i] <= start:
            plan += _posts(batches[order[i]], rank)
            i += 1
        s = layout.stage(rank, a.chunk)
        need = (("act", s, a.microbatch) if a.kind == "F" and s > 0 else
                ("grad", s, a.microbatch) if a.kind == "B" and s < layout.stages - 1 else None)
        if need in slots:
            plan.append(("wait", need))
        plan.append(("run", n))
    for slot in order[i:]:
        plan += _posts(batches[slot], rank)
    return plan


def _posts(ops, rank):
    """One slot's messages as one batch per peer, in the order of the pair (lower rank, higher
    rank): every rank orders the pairs alike, so under NCCL's one stream the pair first in that
    order always has its batch at the head of both ends' streams (no cycle), and a rank that
    needs one neighbour's message does not wait for another neighbour's batch of the same
    slot. Inside a batch, ops are sorted by key, the same order at both ends."""
    by_peer = collections.defaultdict(list)
    for op in ops:
        by_peer[op[1]].append(op)
    return [("post", sorted(by_peer[peer], key=lambda op: op[2]))
            for peer in sorted(by_peer, key=lambda q: (min(q, rank), max(q, rank)))]


def gradients_by_name(stage_modules):
    """{full-model parameter name: gradient} over the given {stage: GPTStage}."""
    out = {}
    for module in stage_modules.values():
        for local, p in module.named_parameters():
            if p.grad is not None:
                out[module.global_name(local)] = p.grad.detach().cpu().clone()
    return out


def stage_parameters(stage_modules):
    """Every parameter of a rank's {stage: GPTStage}, once: a tied embedding sits in two stages
    on the V's rank 0, and an optimizer given it twice would step it twice."""
    return list({id(p): p for module in stage_modules.values() for p in module.parameters()}.values())


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
