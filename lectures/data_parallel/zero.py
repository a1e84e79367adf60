"""ZeRO stages 1, 2 and 3 from scratch: the building blocks of lecture 03, in their own module.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(https://arxiv.org/abs/1910.02054). Each class takes a model and a `comm` object with the
collectives `broadcast`, `all_reduce`, `reduce_scatter(out, full)`, `all_gather(full, shard)` and
a world size `n` (lecture 03's `Collectives`, which also counts the bytes), and is checked
against single-process AdamW in tests/test_lecture_03.py: plain, with gradient accumulation, with
a no_grad forward between backward and step, at 2 and 4 ranks and awkward sizes.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# =========================================================================================
# 4. ZeRO: shard the optimizer state, then the gradients, then the parameters
# =========================================================================================
# Every tensor is flattened, padded to a multiple of N, and cut into N equal pieces; rank r owns
# piece r of every tensor. That is neither FSDP1 (which flattens *all* of a unit's tensors into
# one FlatParameter and shards that) nor FSDP2 (which shards each parameter along dim 0 as a
# DTensor, Shard(0), rows not elements); flattening per tensor keeps shards equal in size for
# any shape, and one tensor at a time keeps ZeRO-3's layer-by-layer gathering simple.

def shard_size(numel, world_size):
    """Elements of each rank's piece: numel / world_size, rounded up."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1; got numel={numel}, world_size={world_size}")
    return -(-numel // world_size)


def take_shard(t, rank, world_size):
    """A copy of this rank's piece of `t` (padded with zeros at the end of the last piece)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1} of {world_size} ranks")
    s = shard_size(t.numel(), world_size)
    flat = torch.zeros(s * world_size, dtype=t.dtype, device=t.device)
    flat[:t.numel()] = t.detach().reshape(-1)
    return flat[rank * s:(rank + 1) * s].clone()


def padded(t, world_size):
    s = shard_size(t.numel(), world_size)
    if t.numel() == s * world_size:
        return t.reshape(-1)
    flat = torch.zeros(s * world_size, dtype=t.dtype, device=t.device)
    flat[:t.numel()] = t.reshape(-1)
    return flat


def adamw_update(p, g, m, v, step, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8):
    """AdamW on one (sharded) tensor, in the same order of operations as torch.optim.AdamW, so
    the sharded run matches the reference to rounding."""
    b1, b2 = betas
    p.mul_(1 - lr * weight_decay)                     # decoupled weight decay
    m.lerp_(g, 1 - b1)                                # first moment
    v.mul_(b2).addcmul_(g, g, value=1 - b2)           # second moment
    denom = (v.sqrt() / math.sqrt(1 - b2 ** step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1 ** step))


class ShardedAdamW:
    """Adam's two moments for this rank's shards only: kΨ/N bytes instead of kΨ."""

    def __init__(self, shards, lr, weight_decay):
        self.shards, self.lr, self.wd, self.t = shards, lr, weight_decay, 0
        self.m = [torch.zeros_like(s) for s in shards]
        self.v = [torch.zeros_like(s) for s in shards]

    def step(self, grads):
        self.t += 1
        for p, g, m, v in zip(self.shards, grads, self.m, self.v):
            adamw_update(p, g, m, v, self.t, self.lr, self.wd)

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.m + self.v)


class Zero1:
    """ZeRO stage 1: replicated parameters and gradients, sharded optimizer state.
    Step: reduce-scatter each gradient (each rank receives the averaged gradient of its shard),
    update its shard, all-gather the updated shards into the full parameters."""

    clip = None    # clip(grad_shards): a hook before the update (lecture 08's global-norm clipping)

    def __init__(self, model, comm, task):
        self.model, self.comm = model, comm
        self.params = list(model.parameters())
        # The shard index is the rank inside the data-parallel group (the whole world unless
        # `comm` runs on a group, as on lecture 07's mesh).
        r, n = dist.get_rank(getattr(comm, "group", None)), comm.n
        self.shards = [take_shard(p, r, n) for p in self.params]
        self.opt = ShardedAdamW(self.shards, task.lr, task.weight_decay)

    def step(self):
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if missing:
            raise RuntimeError(f"ZeRO-1: parameters {missing} got no gradient; every rank must "
                               "reduce-scatter every gradient (give them one, or freeze them "
                               "before wrapping)")
        grads = []
        for p, s in zip(self.params, self.shards):
            g = torch.empty_like(s)
            self.comm.reduce_scatter(g, padded(p.grad, self.comm.n))
            grads.append(g.div_(self.comm.n))
        self.held = self.measure(grads)
        if self.clip is not None:
            self.clip(grads)
        self.opt.step(grads)
        for p, s in zip(self.params, self.shards):
            full = torch.empty(s.numel() * self.comm.n, dtype=s.dtype, device=s.device)
            self.comm.all_gather(full, s)
            p.data.copy_(full[:p.numel()].view_as(p))
            p.grad = None

    def measure(self, grad_shards):
        nbytes = lambda t: t.numel() * t.element_size()
        return {"params": sum(map(nbytes, self.params)),
                "grads": sum(nbytes(p.grad) for p in self.params),
                "optimizer": self.opt.nbytes(), "transient": 0}


class Zero2(Zero1):
    """ZeRO stage 2: also shard the gradients. Each gradient is reduce-scattered as soon as
    backward produces it and the full gradient is dropped, so a rank never holds more than a
    couple of full gradients at once; the optimizer sees only its gradient shards.

    With gradient accumulation every micro-batch's backward reduce-scatters, and the shards
    *add up* until `step()` (as DeepSpeed's stage 2 does): the full gradient cannot wait
    locally for the next micro-batch, since holding it is what stage 2 saves. That costs one
    reduce-scatter per micro-batch instead of one per step."""

    def __init__(self, model, comm, task, in_flight=1):
        super().__init__(model, comm, task)
        self.in_flight, self.pending, self.grad_shards = in_flight, [], {}
        self.index = {p: i for i, p in enumerate(self.params)}
        self.live_full, self.peak_full = 0, 0       # bytes of full gradients alive right now / at most
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        i = self.index[p]
        full = padded(p.grad, self.comm.n)
        g = torch.empty_like(self.shards[i])
        work = self.comm.reduce_scatter(g, full, async_op=True, label="reduce-scatter (async)")
        self.live_full += full.numel() * full.element_size()
        self.peak_full = max(self.peak_full, self.live_full)
        p.grad = None                                 # autograd's copy is gone; `full` lives until sent
        self.pending.append((work, full, i, g))
        while len(self.pending) > self.in_flight:     # bound the memory of gradients in flight
            self._retire()

    def _retire(self):
        work, full, i, g = self.pending.pop(0)
        work.wait()
        self.live_full -= full.numel() * full.element_size()
        g.div_(self.comm.n)
        previous = self.grad_shards.get(i)       # accumulation: add to earlier micro-batches
        self.grad_shards[i] = g if previous is None else previous.add_(g)

    def step(self):
        while self.pending:
            self._retire()
        missing = [i for i in range(len(self.params)) if i not in self.grad_shards]
        if missing:
            raise RuntimeError(f"ZeRO-2: parameters {missing} got no gradient since the last step")
        grads = [self.grad_shards.pop(i) for i in range(len(self.params))]
        nbytes = lambda t: t.numel() * t.element_size()
        self.held = {"params": sum(map(nbytes, self.params)), "grads": sum(map(nbytes, grads)),
                     "optimizer": self.opt.nbytes(), "transient": self.peak_full}
        self.peak_full = 0
        if self.clip is not None:
            self.clip(grads)
        self.opt.step(grads)
        for p, s in zip(self.params, self.shards):
            full = torch.empty(s.numel() * self.comm.n, dtype=s.dtype, device=s.device)
            self.comm.all_gather(full, s)
            p.data.copy_(full[:p.numel()].view_as(p))


class Zero3Layer:
    """One Linear layer under ZeRO-3: only this rank's shards of its weight and bias live here.
    `gather()` starts (or finishes) the all-gather of the full tensors; `free()` drops them."""

    def __init__(self, linear, index, owner):
        r, n = owner.rank, owner.comm.n
        self.index, self.owner = index, owner
        self.shapes = [linear.weight.shape, linear.bias.shape]
        self.shards = [nn.Parameter(take_shard(t, r, n)) for t in (linear.weight, linear.bias)]
        self.full, self.work = None, []

    def prefetch(self):
        """Launch the all-gathers without waiting: the next layer's weights travel while this
        layer computes."""
        if self.full is None:
            comm = self.owner.comm
            self.full = [torch.empty(s.numel() * comm.n, dtype=s.dtype, device=s.device)
                         for s in self.shards]
            self.work = [comm.all_gather(f, s.detach(), async_op=True, label="all-gather (async)")
                         for f, s in zip(self.full, self.shards)]
            self.owner.track(+sum(f.numel() * f.element_size() for f in self.full))

    def gather(self):
        self.prefetch()
        for w in self.work:
            w.wait()
        self.work = []
        return [f[:math.prod(shape)].view(shape) for f, shape in zip(self.full, self.shapes)]

    def free(self):
        if self.full is None:
            return
        for w in self.work:            # a prefetch still in flight must land before we drop it
            w.wait()
        self.work = []
        self.owner.track(-sum(f.numel() * f.element_size() for f in self.full))
        self.full = None


class Zero3LinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b where W and b exist in full only inside this function: gathered before the
    forward, freed after it, gathered again for the backward, freed again. The gradients of W
    and b are reduce-scattered straight into this rank's shards. Because the shards are inputs
    of this function, autograd calls its backward for every layer, the first one included."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, layer, backward_follows):
        w, b = layer.gather()
        layer.owner.prefetch(layer.index + 1)
        y = F.linear(x, w, b)
        # The last layer's backward comes right after its forward: keep it gathered, but only
        # if a backward can follow at all (not under torch.no_grad(), e.g. logging a loss).
        if not (backward_follows and layer.owner.is_last(layer)):
            layer.free()
        ctx.save_for_backward(x)
        ctx.layer = layer
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        layer = ctx.layer
        w, _ = layer.gather()
        layer.owner.prefetch(layer.index - 1)
        grad_x = grad_y @ w if ctx.needs_input_grad[0] else None
        grad_w, grad_b = grad_y.t() @ x, grad_y.sum(0)
        layer.free()
        layer.owner.reduce_scatter_grads(layer, [grad_w, grad_b])
        return grad_x, None, None, None, None


class Zero3(nn.Module):
    """ZeRO stage 3 (the idea behind FSDP): parameters, gradients and optimizer state all sharded.
    Built from a full model (then dropped), it runs the same Sequential layer by layer.

    Each layer's full gradients are reduce-scattered asynchronously in its backward; at most
    `in_flight` of them travel at once (the next layer's backward waits for the oldest, as
    FSDP2 does). A gloo Work holds a full-size copy of its input until it is dropped, so
    leaving them all pending until `step()` would keep every layer's full gradient alive. The
    shard index is the rank inside `comm`'s group (the whole world unless `comm.group` says).

    It knows how to shard `nn.Linear` (with bias) only. Any other module that owns parameters
    (a LayerNorm, an Embedding) is refused at construction: left alone it would be neither
    synchronised nor stepped, and train wrongly in silence. Modules without parameters (tanh,
    GELU, dropout) run as they are."""

    def __init__(self, model, comm, task, in_flight=2, prefetch=True):
        super().__init__()
        if not isinstance(model, nn.Sequential):
            raise TypeError(f"Zero3 runs an nn.Sequential layer by layer; got {type(model).__name__}")
        group = getattr(comm, "group", None)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"Zero3: global rank {dist.get_rank()} is not in the group of the "
                             "collectives it was given (comm.group): pass this rank's data-parallel group")
        if comm.n != dist.get_world_size(group):
            raise ValueError(f"Zero3: comm.n = {comm.n} but its group has {dist.get_world_size(group)} ranks")
        if in_flight < 1:
            raise ValueError(f"Zero3: in_flight must be at least 1, got {in_flight}")
        self.comm, self.in_flight, self.prefetching = comm, in_flight, prefetch
        self.steps = []                   # Zero3Layer or a parameter-free module, in order
        self.layers = []
        for name, m in model.named_children():
            if isinstance(m, nn.Linear) and m.bias is not None and not list(m.children()):
                self.layers.append(Zero3Layer(m, len(self.layers), self))
                self.steps.append(self.layers[-1])
            elif any(True for _ in m.parameters()):
                raise TypeError(f"Zero3 shards nn.Linear (with bias) only, but module {name!r} "
                                f"({type(m).__name__}) has parameters "
                                f"{[n for n, _ in m.named_parameters()]}: it would be neither "
                                "synchronised nor stepped. Use FSDP2 (fully_shard), or replace it.")
            else:
                self.steps.append(m)
        self.shards = [s for layer in self.layers for s in layer.shards]
        self.opt = ShardedAdamW([s.data for s in self.shards], task.lr, task.weight_decay)
        self.pending, self.live_full, self.peak_full = [], 0, 0

    def is_last(self, layer):
        return layer.index == len(self.layers) - 1

    def prefetch(self, index):
        """Start gathering layer `index` (the next one) now; off (`prefetch=False`), each layer
        gathers only when it runs: a measurement's control."""
        if self.prefetching and 0 <= index < len(self.layers):
            self.layers[index].prefetch()

    def track(self, nbytes):
        self.live_full += nbytes
        self.peak_full = max(self.peak_full, self.live_full)

    def forward(self, x):
        backward_follows = torch.is_grad_enabled()
        for step in self.steps:
            if isinstance(step, Zero3Layer):
                x = Zero3LinearFunction.apply(x, *step.shards, step, backward_follows)
            else:
                x = step(x)
        return x

    def reduce_scatter_grads(self, layer, grads):
        for shard, g in zip(layer.shards, grads):
            out, full = torch.empty_like(shard), padded(g, self.comm.n)
            work = self.comm.reduce_scatter(out, full, async_op=True, label="reduce-scatter (async)")
            nbytes = full.numel() * full.element_size()
            self.track(+nbytes)          # a full gradient lives until its reduce-scatter is retired
            self.pending.append((work, shard, out, nbytes))
        while len(self.pending) > self.in_flight:
            self._retire()

    def _retire(self):
        """Wait for the oldest reduce-scatter, add its result to the shard's gradient, and drop
        the Work (and with it the full gradient it holds)."""
        work, shard, out, nbytes = self.pending.pop(0)
        work.wait()
        del work
        self.track(-nbytes)
        out.div_(self.comm.n)           # accumulation: micro-batches' shards add up
        shard.grad = out if shard.grad is None else shard.grad.add_(out)

    def step(self):
        while self.pending:
            self._retire()
        for layer in self.layers:       # a forward without backward may have left one gathered:
            layer.free()                # after the update that copy would be stale
        missing = [i for i, s in enumerate(self.shards) if s.grad is None]
        if missing:
            raise RuntimeError(f"ZeRO-3: shards {missing} got no gradient since the last step")
        nbytes = lambda t: t.numel() * t.element_size()
        self.held = {"params": sum(nbytes(s) for s in self.shards),
                     "grads": sum(nbytes(s.grad) for s in self.shards),
                     "optimizer": self.opt.nbytes(), "transient": self.peak_full}
        self.peak_full = self.live_full
        self.opt.step([s.grad for s in self.shards])
        for s in self.shards:
            s.grad = None

    def full_parameters(self):
        """Gather everything once, e.g. to compare with the reference (not used in training)."""
        out = []
        for layer in self.layers:
            out += [t.detach().cpu().clone() for t in layer.gather()]
            layer.free()
        return out
