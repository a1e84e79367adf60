"""Data parallelism and ZeRO: replicate the model, split the data

Every rank holds the model (or, with ZeRO, a slice of it), reads its own slice of every batch,
and the ranks agree on the update through collectives. Each implementation below is written out
in a few lines, run on real ranks, and checked against single-process training.
"""
import dataclasses
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from util import device, figure, note, quiet, see, settings, span, span_at, spawn, table, timeline

# =========================================================================================
# 1. The task: a small model, learnable synthetic data, and the single-process reference
# =========================================================================================

@dataclasses.dataclass(frozen=True)
class Task:
    """Everything that defines a training run, so every rank (and the reference) builds the same."""
    sizes: tuple = (13, 37, 29, 22, 7)   # awkward widths: parameter counts divisible by nothing
    batch: int = 24                      # global batch; each of N ranks reads batch/N rows
    steps: int = 6
    lr: float = 1e-2
    weight_decay: float = 0.01
    seed: int = 0
    dtype: str = "float32"

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)


def make_model(task, seed):
    """Linear layers with tanh between them; `seed` decides the initial weights."""
    torch.manual_seed(seed)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(task.sizes, task.sizes[1:])):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers).to(device=device(), dtype=task.torch_dtype)


def make_batches(task, steps=None, seed_offset=0):
    """A fixed random 'teacher' network labels Gaussian inputs: learnable, and the same on every
    rank because it depends only on the seed."""
    g = torch.Generator().manual_seed(1000 + task.seed)          # one teacher for all streams
    teacher = [torch.randn(a, b, generator=g) / math.sqrt(a) for a, b in zip(task.sizes, task.sizes[1:])]
    g.manual_seed(2000 + task.seed + seed_offset)                # the rows: one stream per offset
    batches = []
    for _ in range(steps or task.steps):
        x = torch.randn(task.batch, task.sizes[0], generator=g)
        y = x
        for i, w in enumerate(teacher):
            y = y @ w if i == len(teacher) - 1 else torch.tanh(2 * y @ w)
        batches.append((x.to(device(), task.torch_dtype), y.to(device(), task.torch_dtype)))
    return batches


def shard_rows(t, rank, world_size):
    """This rank's distinct, contiguous slice of a global batch (partitioned ahead of time)."""
    assert t.shape[0] % world_size == 0, "the global batch must split evenly over the ranks"
    n = t.shape[0] // world_size
    return t[rank * n:(rank + 1) * n]


def checksum(params):
    """One number per replica: equal checksums every step = replicas that agree."""
    return sum(p.detach().double().sum().item() for p in params)


def param_count(task):
    return sum(a * b + b for a, b in zip(task.sizes, task.sizes[1:]))


def reference_train(task):
    """Single process, whole batch, torch.optim.AdamW: what every parallel version must equal."""
    model = make_model(task, task.seed)
    initial = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=task.weight_decay)
    losses, sums = [], []
    for x, y in make_batches(task):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        sums.append(checksum(model.parameters()))
    return {"losses": losses, "checksums": sums, "initial": [p.cpu() for p in initial],
            "params": [p.detach().cpu().clone() for p in model.parameters()]}


# =========================================================================================
# 2. Collectives that count what they send
# =========================================================================================

class Collectives:
    """The collectives this lecture uses, counting the bytes this rank sends when each runs as
    a ring (NCCL's algorithm for large messages): all-reduce 2(N-1)/N of the tensor, reduce-scatter
    and all-gather (N-1)/N of the full tensor. With `trace`, async operations record when they
    were launched and when they completed, for timelines."""

    def __init__(self, world_size, trace=False):
        self.n, self.sent, self.trace, self.events = world_size, 0, trace, []

    def _async(self, work, label, nbytes):
        if self.trace and work is not None:
            start = time.perf_counter()
            work.get_future().then(lambda _: self.events.append((label, start, time.perf_counter())))
        return work

    def broadcast(self, t, src=0):
        self.sent += t.numel() * t.element_size() if dist.get_rank() == src and self.n > 1 else 0
        dist.broadcast(t, src)

    def all_reduce(self, t, async_op=False, label="all-reduce"):
        nbytes = t.numel() * t.element_size()
        self.sent += 2 * (self.n - 1) * nbytes // self.n
        return self._async(dist.all_reduce(t, async_op=async_op), label, nbytes)

    def reduce_scatter(self, out, full, async_op=False, label="reduce-scatter"):
        nbytes = full.numel() * full.element_size()
        self.sent += (self.n - 1) * nbytes // self.n
        return self._async(dist.reduce_scatter_single(out, full, async_op=async_op), label, nbytes)

    def all_gather(self, full, shard, async_op=False, label="all-gather"):
        nbytes = full.numel() * full.element_size()
        self.sent += (self.n - 1) * nbytes // self.n
        return self._async(dist.all_gather_single(full, shard, async_op=async_op), label, nbytes)

    def record_spans(self):
        """Hand the async operations' measured lifetimes to the page's timeline."""
        for label, start, end in self.events:
            span_at(label, start, end)
        self.events.clear()


# =========================================================================================
# 3. DDP from scratch: broadcast once, all-reduce gradients every step
# =========================================================================================

def broadcast_parameters(model, comm):
    """Replicas must start equal: everyone takes rank 0's initial weights."""
    for p in model.parameters():
        comm.broadcast(p.data, src=0)


class AllReduceAfterBackward:
    """The naive gradient sync: wait for the whole backward, then one all-reduce per parameter."""

    def __init__(self, model, comm):
        self.params, self.comm, self.sync = list(model.parameters()), comm, True

    def finish(self):
        for p in self.params:
            self.comm.all_reduce(p.grad)
            p.grad.div_(self.comm.n)   # sum of per-rank mean gradients / N = mean over the batch


class OverlappedAllReduce:
    """Start each parameter's all-reduce the moment autograd has finished its gradient, while
    backward keeps computing the earlier layers; wait for all of them before the optimizer."""

    def __init__(self, model, comm):
        self.comm, self.sync, self.pending = comm, True, []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        if self.sync:                  # False on the micro-batches where we only accumulate
            p.grad.div_(self.comm.n)
            self.pending.append(self.comm.all_reduce(p.grad, async_op=True, label="all-reduce (async)"))

    def finish(self):
        for work in self.pending:
            work.wait()
        self.pending.clear()


class BucketedAllReduce:
    """Many small all-reduces pay the per-message latency many times. Pack gradients, in the
    order backward produces them (last layer first), into buckets of about `bucket_mb`, and
    all-reduce a bucket as soon as all its gradients are in. Buckets launch in order, so every
    rank issues the same collectives in the same order."""

    def __init__(self, model, comm, bucket_mb=1.0):
        self.comm, self.sync = comm, True
        limit = bucket_mb * 2 ** 20
        self.buckets, current, size = [], [], 0
        for p in reversed(list(model.parameters())):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.where = {}               # parameter -> (bucket index, offset in its flat buffer)
        self.flat = []
        for b, params in enumerate(self.buckets):
            offset = 0
            for p in params:
                self.where[p] = (b, offset)
                offset += p.numel()
            self.flat.append(torch.zeros(offset, dtype=params[0].dtype, device=params[0].device))
        self.ready = [0] * len(self.buckets)
        self.next, self.pending = 0, []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        if not self.sync:
            return
        b, offset = self.where[p]
        self.flat[b][offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        self.ready[b] += 1
        while self.next < len(self.buckets) and self.ready[self.next] == len(self.buckets[self.next]):
            flat = self.flat[self.next].div_(self.comm.n)
            self.pending.append(self.comm.all_reduce(flat, async_op=True, label="bucket all-reduce"))
            self.next += 1

    def finish(self):
        if self.next != len(self.buckets):
            raise RuntimeError("some parameters received no gradient: their bucket never launched")
        for work in self.pending:
            work.wait()
        for params, flat in zip(self.buckets, self.flat):
            offset = 0
            for p in params:      # the averaged bucket *becomes* the gradient: no copy back
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
        self.next = 0


GRAD_SYNCS = {"naive": AllReduceAfterBackward, "overlapped": OverlappedAllReduce,
              "bucketed": BucketedAllReduce}


def make_grad_sync(kind, model, comm, bucket_mb):
    if kind == "bucketed":
        return BucketedAllReduce(model, comm, bucket_mb)
    return GRAD_SYNCS[kind](model, comm)


def data_parallel_step(model, grad_sync, opt, x, y, micro_batches=1):
    """One optimizer step on this rank's rows, split into micro-batches. The gradient sync is
    switched off on all but the last micro-batch (DDP's `no_sync`): gradients just accumulate
    locally, and one all-reduce carries the sum of all of them."""
    assert x.shape[0] % micro_batches == 0, "equal micro-batches, or loss/micro_batches is wrong"
    total = 0.0
    for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        grad_sync.sync = i == micro_batches - 1
        with span("forward"):
            loss = F.mse_loss(model(xm), ym) / micro_batches
        with span("backward"):
            loss.backward()
        total += loss.item()
    with span("wait for gradients"):
        grad_sync.finish()
    with span("optimizer"):
        opt.step()
        opt.zero_grad()
    return total


def global_mean(value):
    """The loss averaged over ranks (for reporting only; not counted as training traffic)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train_data_parallel(rank, world_size, task, grad_sync="naive", bucket_mb=1.0, micro_batches=1,
                        broadcast=True):
    """DDP from scratch. Each rank starts from *different* random weights on purpose (seeded by
    rank): the broadcast is what makes the replicas equal."""
    comm = Collectives(world_size)
    model = make_model(task, seed=task.seed + rank)
    if broadcast:
        broadcast_parameters(model, comm)
    initial = [p.detach().cpu().clone() for p in model.parameters()]
    sync = make_grad_sync(grad_sync, model, comm, bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=task.weight_decay)
    losses, sums = [], []
    comm.sent = 0
    for x, y in make_batches(task):
        loss = data_parallel_step(model, sync, opt, shard_rows(x, rank, world_size),
                                  shard_rows(y, rank, world_size), micro_batches)
        losses.append(global_mean(loss))
        sums.append(checksum(model.parameters()))
    return {"losses": losses, "checksums": sums, "initial": initial,
            "params": [p.detach().cpu().clone() for p in model.parameters()],
            "bytes_per_step": comm.sent / task.steps, "held": held_by_adamw(model, opt)}


def held_by_adamw(model, opt):
    """Bytes of parameters, gradients and optimizer state this rank actually holds (gradients
    as they were before zero_grad: we count their sizes, which zero_grad does not change)."""
    nbytes = lambda t: t.numel() * t.element_size()
    params = list(model.parameters())
    state = sum(nbytes(v) for p in params for v in opt.state[p].values() if v.dim() > 0)
    return {"params": sum(map(nbytes, params)), "grads": sum(map(nbytes, params)), "optimizer": state,
            "transient": 0}


# =========================================================================================
# 4. ZeRO: shard the optimizer state, then the gradients, then the parameters
# =========================================================================================
# Every tensor is flattened, padded to a multiple of N, and cut into N equal pieces; rank r owns
# piece r of every tensor. (Flattening all tensors into one vector works too; per-tensor shards
# are what FSDP2 does and keep ZeRO-3's layer-by-layer gathering simple.)

def shard_size(numel, world_size):
    return -(-numel // world_size)


def take_shard(t, rank, world_size):
    """A copy of this rank's piece of `t` (padded with zeros at the end of the last piece)."""
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

    def __init__(self, model, comm, task):
        self.model, self.comm = model, comm
        self.params = list(model.parameters())
        r, n = dist.get_rank(), comm.n
        self.shards = [take_shard(p, r, n) for p in self.params]
        self.opt = ShardedAdamW(self.shards, task.lr, task.weight_decay)

    def step(self):
        grads = []
        for p, s in zip(self.params, self.shards):
            g = torch.empty_like(s)
            self.comm.reduce_scatter(g, padded(p.grad, self.comm.n))
            grads.append(g.div_(self.comm.n))
        self.held = self.measure(grads)
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
    couple of full gradients at once; the optimizer sees only its gradient shards."""

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
        self.grad_shards[i] = g.div_(self.comm.n)

    def step(self):
        while self.pending:
            self._retire()
        grads = [self.grad_shards.pop(i) for i in range(len(self.params))]
        nbytes = lambda t: t.numel() * t.element_size()
        self.held = {"params": sum(map(nbytes, self.params)), "grads": sum(map(nbytes, grads)),
                     "optimizer": self.opt.nbytes(), "transient": self.peak_full}
        self.peak_full = 0
        self.opt.step(grads)
        for p, s in zip(self.params, self.shards):
            full = torch.empty(s.numel() * self.comm.n, dtype=s.dtype, device=s.device)
            self.comm.all_gather(full, s)
            p.data.copy_(full[:p.numel()].view_as(p))


class Zero3Layer:
    """One Linear layer under ZeRO-3: only this rank's shards of its weight and bias live here.
    `gather()` starts (or finishes) the all-gather of the full tensors; `free()` drops them."""

    def __init__(self, linear, index, owner):
        r, n = dist.get_rank(), owner.comm.n
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
        self.owner.track(-sum(f.numel() * f.element_size() for f in self.full))
        self.full = None


class Zero3LinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b where W and b exist in full only inside this function: gathered before the
    forward, freed after it, gathered again for the backward, freed again. The gradients of W
    and b are reduce-scattered straight into this rank's shards. Because the shards are inputs
    of this function, autograd calls its backward for every layer, the first one included."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, layer):
        w, b = layer.gather()
        layer.owner.prefetch(layer.index + 1)
        y = F.linear(x, w, b)
        if not layer.owner.is_last(layer):           # the last layer is needed again at once
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
        return grad_x, None, None, None


class Zero3(nn.Module):
    """ZeRO stage 3 (the idea behind FSDP): parameters, gradients and optimizer state all sharded.
    Built from a full model (then dropped), it runs the same Sequential layer by layer."""

    def __init__(self, model, comm, task):
        super().__init__()
        self.comm = comm
        self.steps = []                   # ("linear", Zero3Layer) or ("module", activation)
        self.layers = []
        for m in model:
            if isinstance(m, nn.Linear):
                self.layers.append(Zero3Layer(m, len(self.layers), self))
                self.steps.append(self.layers[-1])
            else:
                self.steps.append(m)
        self.shards = [s for layer in self.layers for s in layer.shards]
        self.opt = ShardedAdamW([s.data for s in self.shards], task.lr, task.weight_decay)
        self.pending, self.live_full, self.peak_full = [], 0, 0

    def is_last(self, layer):
        return layer.index == len(self.layers) - 1

    def prefetch(self, index):
        if 0 <= index < len(self.layers):
            self.layers[index].prefetch()

    def track(self, nbytes):
        self.live_full += nbytes
        self.peak_full = max(self.peak_full, self.live_full)

    def forward(self, x):
        for step in self.steps:
            if isinstance(step, Zero3Layer):
                x = Zero3LinearFunction.apply(x, *step.shards, step)
            else:
                x = step(x)
        return x

    def reduce_scatter_grads(self, layer, grads):
        for shard, g in zip(layer.shards, grads):
            out = torch.empty_like(shard)
            work = self.comm.reduce_scatter(out, padded(g, self.comm.n), async_op=True,
                                            label="reduce-scatter (async)")
            self.pending.append((work, shard, out))

    def step(self):
        for work, shard, out in self.pending:
            work.wait()
            shard.grad = out.div_(self.comm.n)
        self.pending.clear()
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


def train_zero(rank, world_size, task, stage=1):
    """ZeRO-1/2/3 with the same data, loss and checks as `train_data_parallel`."""
    comm = Collectives(world_size)
    model = make_model(task, seed=task.seed + rank)
    broadcast_parameters(model, comm)
    initial = [p.detach().cpu().clone() for p in model.parameters()]
    zero = {1: Zero1, 2: Zero2}[stage](model, comm, task) if stage < 3 else Zero3(model, comm, task)
    if stage == 3:
        del model                          # from here on, only shards
    net = zero if stage == 3 else zero.model
    losses, sums = [], []
    comm.sent = 0
    for x, y in make_batches(task):
        loss = F.mse_loss(net(shard_rows(x, rank, world_size)), shard_rows(y, rank, world_size))
        loss.backward()
        zero.step()
        losses.append(global_mean(loss.item()))
        # Under ZeRO-3 no rank holds a replica to checksum; stages 1 and 2 still replicate.
        sums.append(None if stage == 3 else checksum(zero.model.parameters()))
    sent = comm.sent
    final = zero.full_parameters() if stage == 3 else [p.detach().cpu().clone() for p in net.parameters()]
    return {"losses": losses, "checksums": sums, "initial": initial, "params": final,
            "bytes_per_step": sent / task.steps, "held": zero.held}


# =========================================================================================
# 5. PyTorch's own: DistributedDataParallel and FSDP2 (fully_shard)
# =========================================================================================

def device_mesh(world_size):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device().type, (world_size,))


def wrap_pytorch(kind, model, world_size, bucket_mb=25.0):
    """The same model under PyTorch's DDP or FSDP2 (each Linear its own FSDP unit, as ours)."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    from torch.distributed.fsdp import fully_shard
    mesh = device_mesh(world_size)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_pytorch(rank, world_size, task, kind="ddp"):
    model = make_model(task, seed=task.seed)    # FSDP2 does not broadcast: start equal
    model = wrap_pytorch(kind, model, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=task.weight_decay)
    losses = []
    for x, y in make_batches(task):
        loss = F.mse_loss(model(shard_rows(x, rank, world_size)), shard_rows(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss.item()))
    if kind == "fsdp2":
        params = [p.full_tensor().detach().cpu().clone() for p in model.parameters()]
    else:
        params = [p.detach().cpu().clone() for p in model.parameters()]
    return {"losses": losses, "params": params}


# =========================================================================================
# 6. Timing: every variant in one run, interleaved, several repetitions, median
# =========================================================================================

def build_variant(kind, task, rank, world_size, bucket_mb, comm):
    """Returns step(x, y) for one variant of data-parallel training."""
    if kind in ("naive", "overlapped", "bucketed"):
        model = make_model(task, task.seed)
        sync = make_grad_sync(kind, model, comm, bucket_mb)
        opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=task.weight_decay)
        return lambda x, y: data_parallel_step(model, sync, opt, x, y)
    if kind in ("ddp", "fsdp2"):
        model = wrap_pytorch(kind, make_model(task, task.seed), world_size, bucket_mb)
        opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=task.weight_decay)

        def update():
            opt.step()
            opt.zero_grad()
        return spanned_step(model, update)
    stage = int(kind[-1])
    model = make_model(task, task.seed)
    zero = {1: Zero1, 2: Zero2}[stage](model, comm, task) if stage < 3 else Zero3(model, comm, task)
    return spanned_step(zero if stage == 3 else zero.model, zero.step)


def spanned_step(net, update):
    """step(x, y) for a model whose gradients are synchronised by its wrapper (PyTorch's) or
    by its optimizer step (ZeRO): forward, backward, `update()`, each in a span."""
    def step(x, y):
        with span("forward"):
            loss = F.mse_loss(net(x), y)
        with span("backward"):
            loss.backward()
        with span("optimizer"):
            update()
    return step


def time_variants(rank, world_size, task, kinds, bucket_mb=1.0, reps=5, steps=3, warmup=2):
    """Median seconds per step of each variant, measured round-robin in the same processes so
    that background noise hits all of them alike."""
    comm = Collectives(world_size)
    x, y = [shard_rows(t, rank, world_size) for t in make_batches(task, steps=1)[0]]
    steps_of = {k: build_variant(k, task, rank, world_size, bucket_mb, comm) for k in kinds}
    times = {k: [] for k in kinds}
    with quiet():                                    # timing runs leave no spans on the page
        for k in kinds:
            for _ in range(warmup):
                steps_of[k](x, y)
        for rep in range(reps):
            for k in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:   # rotate: no order bias
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    steps_of[k](x, y)
                t = torch.tensor([(time.perf_counter() - start) / steps])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)     # a step ends when the slowest rank ends
                times[k].append(t.item())
    return {k: statistics.median(v) for k, v in times.items()}


def traced_steps(rank, world_size, task, kind, bucket_mb=1.0, steps=2):
    """A few steps with every span recorded, including when each async collective really ran."""
    comm = Collectives(world_size, trace=True)
    x, y = [shard_rows(t, rank, world_size) for t in make_batches(task, steps=1)[0]]
    step = build_variant(kind, task, rank, world_size, bucket_mb, comm)
    with quiet():
        step(x, y)                                     # warm-up, not recorded
    comm.events.clear()
    dist.barrier()
    for _ in range(steps):
        step(x, y)
        time.sleep(0.002)                              # let the last completion callbacks land
        comm.record_spans()


# =========================================================================================
# 7. Local SGD / federated averaging, with compressed updates
# =========================================================================================

def quantize_int8(t, generator):
    """Uniform 8-bit quantization with stochastic rounding (unbiased: E[q] = t)."""
    lo, hi = t.min(), t.max()
    scale = (hi - lo).clamp_min(1e-12) / 255
    q = ((t - lo) / scale + torch.rand(t.shape, generator=generator, dtype=t.dtype)).floor()
    return q.clamp_(0, 255).to(torch.uint8), torch.stack([lo, scale])


def average_update(delta, comm, compress, round_index):
    """Average every rank's update `delta` (a flat vector), sending as few bytes as we dare.
    Returns (the average, what this rank's compressed update amounted to).
    mask: all ranks keep the same random quarter of the coordinates (same seed), so only the
    values travel, not their positions; int8: each rank quantizes its values and all-gathers
    them (with two floats: offset and scale)."""
    n = comm.n
    average, mine = torch.zeros_like(delta), torch.zeros_like(delta)
    keep = slice(None)
    if "mask" in compress:
        g = torch.Generator().manual_seed(round_index)
        keep = torch.randperm(delta.numel(), generator=g)[:delta.numel() // 4]
    values = delta[keep].contiguous()
    if "int8" in compress:
        g = torch.Generator().manual_seed(round_index * 1000 + dist.get_rank())
        q, meta = quantize_int8(values, g)
        all_q = torch.empty(n * q.numel(), dtype=torch.uint8, device=q.device)
        all_meta = torch.empty(n * 2, dtype=meta.dtype, device=q.device)
        comm.all_gather(all_q, q)
        comm.all_gather(all_meta, meta)
        decoded = all_q.view(n, -1).to(delta.dtype) * all_meta.view(n, 2)[:, 1:2] + all_meta.view(n, 2)[:, 0:1]
        mine[keep] = q.to(delta.dtype) * meta[1] + meta[0]
        average[keep] = decoded.mean(0)
    else:
        mine[keep] = values
        summed = values.clone()
        comm.all_reduce(summed)
        average[keep] = summed / n
    return average, mine


def local_sgd(rank, world_size, task, sync_every=1, compress="", steps=120, lr=0.5):
    """Each rank trains alone on its own data stream with SGD; every `sync_every` steps the
    ranks average their progress since the last sync. What compression dropped from a rank's
    update is kept and added to its next one (error feedback): delayed, not lost."""
    comm = Collectives(world_size)
    model = make_model(task, task.seed)
    params = list(model.parameters())
    flat = lambda: torch.nn.utils.parameters_to_vector(params).detach()
    synced, residual = flat(), torch.zeros_like(flat())
    data = make_batches(task, steps=steps, seed_offset=1 + rank)   # each rank its own stream
    x_eval, y_eval = make_batches(task, steps=1, seed_offset=999)[0]
    opt = torch.optim.SGD(params, lr=lr)
    with torch.no_grad():
        curve = [(0, F.mse_loss(model(x_eval), y_eval).item())]
    for t, (x, y) in enumerate(data, 1):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if t % sync_every == 0:
            delta = flat() - synced + residual
            average, mine = average_update(delta, comm, compress, t)
            residual = delta - mine
            synced = synced + average
            # a copy: vector_to_parameters makes the parameters views of the vector it is given
            torch.nn.utils.vector_to_parameters(synced.clone(), params)
            with torch.no_grad():
                curve.append((comm.sent, F.mse_loss(model(x_eval), y_eval).item()))
    return {"curve": curve, "checksum": checksum(params)}


# =========================================================================================
# 8. Rank functions for the measurements
# =========================================================================================

def measure_stages(rank, world_size, task):
    """Train a few steps under DP and each ZeRO stage; what each rank held and sent."""
    out = {}
    for name, run in [("DP", lambda: train_data_parallel(rank, world_size, task)),
                      ("ZeRO-1", lambda: train_zero(rank, world_size, task, stage=1)),
                      ("ZeRO-2", lambda: train_zero(rank, world_size, task, stage=2)),
                      ("ZeRO-3", lambda: train_zero(rank, world_size, task, stage=3))]:
        if device().type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        result = run()
        out[name] = {"held": result["held"], "bytes_per_step": result["bytes_per_step"],
                     "peak_allocated": torch.cuda.max_memory_allocated() if device().type == "cuda" else None}
    return out


def local_sgd_sweep(rank, world_size, task, variants, steps):
    return {f"H={h} {c or 'fp32'}": local_sgd(rank, world_size, task, h, c, steps) for h, c in variants}


# =========================================================================================
# The lecture
# =========================================================================================

def small_task():
    return Task(steps=4 if settings.quick else 6)


def timing_task():
    if settings.quick:
        return Task(sizes=(32, 256, 256, 256, 10), batch=64)
    return Task(sizes=(64, 1024, 1024, 1024, 1024, 10), batch=128)


def memory_task():
    width, depth = (64, 8) if settings.quick else (192, 16)
    return Task(sizes=(32,) + (width,) * depth + (10,), batch=16, steps=2)


TIMING_RANKS = 2     # this machine has 2 cores: more ranks would time the CPU's time-slicing


def max_diff(params, reference):
    return max((a - b).abs().max().item() for a, b in zip(params, reference))


def intro():
    note("""
        # Data parallelism and ZeRO
        Data parallelism is the first thing to reach for when one device is too slow: every
        rank keeps the whole model, reads a different slice of each batch, and the ranks average
        their gradients so that every replica takes exactly the step that one process would
        have taken on the whole batch. ZeRO (Rajbhandari et al. 2020) then removes the
        redundancy: why should N ranks each hold the same optimizer state, the same gradients,
        the same parameters?

        Everything here runs on this machine's ranks (gloo on CPU, NCCL on GPUs), and every
        version is compared with one process training on the whole batch.
    """)


def the_task():
    task = small_task()
    note(f"""
        ## The model, the data, the reference
        A stack of `Linear` layers with tanh between them, widths {task.sizes}: that is
        Ψ = {param_count(task):,} parameters, a number divisible by neither 2 nor 4, so every
        shard boundary below is awkward on purpose. The data are Gaussian inputs labelled by a
        fixed random "teacher" network, so there is something to learn; everything is
        generated from a seed, identically on every rank. The loss is the mean squared error,
        the optimizer AdamW.

        The reference is one process that sees the whole global batch of {task.batch} rows:
    """)
    see(make_model)
    see(make_batches)
    see(reference_train)
    ref = reference_train(task)
    table([[i + 1, l, c] for i, (l, c) in enumerate(zip(ref["losses"], ref["checksums"]))],
          header=["step", "loss", "parameter checksum"], caption="single process, whole batch")


def ddp_from_scratch():
    task = small_task()
    note("""
        ## DDP from scratch
        Three ingredients. (1) Start equal: every rank initialises its own random weights (we
        seed them by rank to make the point), then takes rank 0's with a broadcast.
        (2) Split the data: rank r reads rows [r·B/N, (r+1)·B/N) of every global batch.
        (3) Average the gradients: each rank's gradient is the mean over its B/N rows; the
        all-reduce sums the N of them and we divide by N, which is exactly the mean over all B
        rows — so the optimizer step is the single-process step, on every rank.
    """)
    see(broadcast_parameters)
    see(shard_rows)
    see(AllReduceAfterBackward)
    see(data_parallel_step)
    ref = reference_train(task)
    rows = []
    for world_size in (1, 2, 4):
        run = spawn(train_data_parallel, world_size, task=task, name=f"DDP from scratch, {world_size} ranks")
        r = run.returns
        for step in range(task.steps):
            rows.append([world_size, step + 1, r[0]["losses"][step]] +
                        [r[k]["checksums"][step] if k < world_size else "" for k in range(4)] +
                        [ref["checksums"][step]])
        diff = max_diff(r[0]["params"], ref["params"])
        spread = max(max_diff(x["params"], r[0]["params"]) for x in r)
        assert spread == 0 and diff < 1e-4, (spread, diff)
        why = ("bit for bit" if diff == 0 else
               "float32 rounding: the same sums, added in a different order")
        note(f"**{world_size} rank(s)**: after {task.steps} steps the replicas differ by at most "
             f"{spread:.1e} (bit-identical), and from the single-process run by {diff:.1e} ({why}).")
    table(rows, header=["ranks", "step", "loss (mean over ranks)", "rank 0 checksum", "rank 1",
                        "rank 2", "rank 3", "single process"],
          caption="per-rank parameter checksums after every step, beside the single-process run")
    run = spawn(train_data_parallel, 2, task=task, broadcast=False, name="DDP without the broadcast")
    a, b = run.returns
    note(f"""
        Leave out the broadcast and the replicas never meet: they apply the *same* averaged
        gradient to *different* weights. Checksums after the last step: rank 0
        {a['checksums'][-1]:.6f}, rank 1 {b['checksums'][-1]:.6f}.
    """)


def overlap_and_buckets():
    task = timing_task()
    note("""
        ## Overlap communication with backward, and bucket it
        The naive version waits for the whole backward pass and only then starts talking. But
        the last layer's gradients are ready first, long before the first layer's: a hook that
        fires when a parameter's gradient is complete
        (`register_post_accumulate_grad_hook`) can start its all-reduce asynchronously while
        autograd keeps working on the earlier layers. The optimizer waits on all the handles.

        Sending one message per parameter pays the per-message latency many times over, so
        DDP packs gradients into buckets (PyTorch's default is 25 MB) and all-reduces a bucket
        once all its gradients are in.
    """)
    see(OverlappedAllReduce)
    see(BucketedAllReduce)
    check = small_task()
    ref = reference_train(check)
    rows = []
    for kind, kw in [("overlapped", {}), ("bucketed", {"bucket_mb": 0.002})]:
        for world_size in (2, 4):
            r = spawn(train_data_parallel, world_size, task=check, grad_sync=kind,
                      name=f"{kind} DDP, {world_size} ranks", **kw).returns
            rows.append([kind, world_size, max_diff(r[0]["params"], ref["params"]),
                         max(max_diff(x["params"], r[0]["params"]) for x in r)])
    table(rows, header=["gradient sync", "ranks", "max |Δ| vs single process", "max |Δ| between replicas"],
          caption="still the same training (bucketed with 2 kB buckets, so the small model has several)")

    psi = param_count(task)
    bucket_mb = 2.0 if not settings.quick else 0.25
    note(f"""
        Timing needs a model where communication matters: widths {task.sizes}, Ψ = {psi:,}
        parameters ({psi * 4 / 2**20:.1f} MB of float32 gradients), global batch {task.batch}, on
        {TIMING_RANKS} ranks (this build's machine is below; with 2 CPU cores, more ranks would
        measure time-slicing). Our buckets are {bucket_mb} MB and PyTorch's DDP gets the same
        `bucket_cap_mb`. Every variant runs in the same processes, round-robin, several
        repetitions; the table gives medians of the slowest rank's time per step.
    """)
    kinds = ["naive", "overlapped", "bucketed", "ddp"]
    times = spawn(time_variants, TIMING_RANKS, task=task, kinds=kinds, bucket_mb=bucket_mb,
                  reps=3 if settings.quick else 5, name="step time: naive vs overlapped vs bucketed vs DDP").returns[0]
    names = {"naive": "all-reduce after backward", "overlapped": "per-parameter async all-reduce",
             "bucketed": f"bucketed ({bucket_mb} MB)", "ddp": "PyTorch DistributedDataParallel"}
    table([[names[k], times[k] * 1e3, times[k] / times["naive"]] for k in kinds],
          header=["gradient sync", "ms per step", "relative to naive"], caption="measured on this machine")
    for kind in ("naive", "overlapped", "bucketed"):
        run = spawn(traced_steps, TIMING_RANKS, task=task, kind=kind, bucket_mb=bucket_mb,
                    name=f"timeline: {kind}")
        figure(timeline(run.spans, title=f"{names[kind]}: two steps"),
               caption=f"{names[kind]}: measured spans per rank. Async collectives are drawn from "
                       "launch to completion (a completion callback on the communication thread).")
    note("""
        In the naive timeline all communication sits after backward; with hooks it starts
        during backward and runs underneath it. On a CPU the communication thread competes
        with the compute for the same cores, so the overlap hides less than on a GPU, where
        NCCL runs on its own stream.
    """)
    if not settings.quick:
        sizes = [0.25, 1.0, 4.0, 25.0]
        rows = []
        for mb in sizes:
            t = spawn(time_variants, TIMING_RANKS, task=task, kinds=["bucketed"], bucket_mb=mb,
                      reps=3, name=f"bucket size {mb} MB").returns[0]["bucketed"]
            rows.append([mb, -(-psi * 4 // int(mb * 2**20)), t * 1e3])
        table(rows, header=["bucket size (MB)", "≈ buckets", "ms per step"],
              caption="bucket size sweep: one huge bucket cannot start before backward ends; tiny ones pay latency")


def gradient_accumulation():
    task = small_task()
    note("""
        ## Gradient accumulation: skip the all-reduce until the last micro-batch
        When the batch that fits in memory is smaller than the batch we want, run several
        micro-batches and let autograd add their gradients up in `.grad` (each loss divided by
        the number of micro-batches). Only the last micro-batch's hooks all-reduce — the
        `no_sync` idea — so accumulation costs no extra communication. The result is the large
        batch, exactly.
    """)
    ref = reference_train(task)
    rows = []
    for world_size, micro in [(2, 3), (4, 3), (2, 6)]:
        for kind in ("overlapped", "bucketed"):
            r = spawn(train_data_parallel, world_size, task=task, grad_sync=kind, micro_batches=micro,
                      bucket_mb=0.002, name=f"accumulation, {world_size} ranks x {micro} micro-batches").returns
            rows.append([world_size, micro, task.batch // world_size // micro, kind,
                         max_diff(r[0]["params"], ref["params"]), r[0]["bytes_per_step"]])
    table(rows, header=["ranks", "micro-batches", "rows per micro-batch", "sync", "max |Δ| vs batch of 24",
                        "bytes sent per step per rank"],
          caption="accumulated micro-batches equal one large batch; the traffic is one all-reduce per step")


def zero_stages():
    task = small_task()
    note("""
        ## ZeRO-1, ZeRO-2, ZeRO-3
        With mixed-precision Adam, each parameter costs 2 bytes (fp16/bf16 weight) + 2
        (gradient) + K = 12 (fp32 master weight, first and second moment), and plain data
        parallelism stores all of it N times. ZeRO (Rajbhandari et al. 2020) shards it:

        * **ZeRO-1** shards the optimizer state. Gradients are *reduce-scattered* (rank r
          receives the averaged gradient of its shard only), each rank runs AdamW on its shard,
          and the updated shards are *all-gathered* back into the full parameters.
          Reduce-scatter + all-gather moves the same bytes as one all-reduce.
        * **ZeRO-2** also shards gradients: a gradient is reduce-scattered as soon as backward
          produces it, and the full gradient is dropped.
        * **ZeRO-3** shards the parameters too. A layer's weights exist in full only while it
          runs: gathered just before its forward (the next layer's gather is launched
          meanwhile: prefetch), freed right after, gathered again for its backward, freed
          again, gradients reduce-scattered into the shards.

        Every tensor is flattened, padded to a multiple of N and cut into N pieces (as FSDP2
        does); the AdamW update is written out and applied to shards.
    """)
    see(adamw_update)
    see(Zero1)
    see(Zero2)
    see(Zero3Layer)
    see(Zero3LinearFunction)
    note("""
        A common bug in public ZeRO-3 sketches: hooking the gather for backward onto the
        layer's *input* gradient, which never exists for the first layer, so it never trains.
        Here the shards are inputs of the autograd function, so its backward runs for every
        layer; the check below asks that every parameter tensor changed.
    """)
    ref = reference_train(task)
    rows = []
    for stage in (1, 2, 3):
        for world_size in (2, 4):
            r = spawn(train_zero, world_size, task=task, stage=stage,
                      name=f"ZeRO-{stage}, {world_size} ranks").returns
            diff = max_diff(r[0]["params"], ref["params"])
            changed = sum(bool((a != b).any()) for a, b in zip(r[0]["params"], ref["initial"]))
            assert diff < 1e-4 and changed == len(ref["params"]), (stage, diff, changed)
            rows.append([f"ZeRO-{stage}", world_size, r[0]["losses"][-1], diff,
                         f"{changed} of {len(ref['params'])}"])
    table(rows, header=["stage", "ranks", "last loss", "max |Δ| vs single-process AdamW",
                        "parameter tensors changed"],
          caption=f"reference last loss {ref['losses'][-1]:.6f}")


def formula_bytes(psi, n, stage, p_bytes, g_bytes, k):
    """Bytes per rank for params, grads, optimizer state under each stage (ZeRO paper, Fig. 1)."""
    shard = {"DP": (1, 1, 1), "ZeRO-1": (1, 1, n), "ZeRO-2": (1, n, n), "ZeRO-3": (n, n, n)}[stage]
    return [p_bytes * psi / shard[0], g_bytes * psi / shard[1], k * psi / shard[2]]


def memory_and_traffic():
    import matplotlib.pyplot as plt
    task = memory_task()
    n = settings.world_size
    psi = param_count(task)
    note(f"""
        ## Memory per rank and bytes on the wire, measured
        A deeper model for this one: {len(task.sizes) - 1} layers, Ψ = {psi:,}, on {n} ranks.
        Each rank reports the bytes of the tensors it actually holds: parameters, gradients,
        optimizer state, and separately the *transient* full tensors (ZeRO-2's full gradients
        waiting to be reduce-scattered, ZeRO-3's gathered layers), at their peak.

        This run is float32 throughout (on CPU there is no fast half precision), so its
        formula is 4Ψ + 4Ψ + 8Ψ (weights, gradients, two Adam moments; no separate master
        copy). The ZeRO paper's mixed-precision accounting is 2Ψ + 2Ψ + 12Ψ; both are listed.
    """)
    run = spawn(measure_stages, n, task=task, name=f"memory and traffic, {n} ranks")
    stages = ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    got = run.returns[0]
    rows = []
    for s in stages:
        h = got[s]["held"]
        fp32 = formula_bytes(psi, n, s, 4, 4, 8)
        mixed = formula_bytes(psi, n, s, 2, 2, 12)
        rows.append([s, h["params"], h["grads"], h["optimizer"], h["transient"],
                     sum(h.values()), sum(fp32), sum(mixed)] +
                    ([got[s]["peak_allocated"]] if got[s]["peak_allocated"] is not None else []))
    header = ["stage", "params (B)", "grads (B)", "optimizer (B)", "transient peak (B)",
              "measured total (B)", "fp32 formula (B)", "mixed-precision formula (B)"]
    if got["DP"]["peak_allocated"] is not None:
        header.append("GPU peak allocated (B)")
    table(rows, header=header, caption=f"rank 0, Ψ = {psi:,}, N = {n}")
    if got["DP"]["peak_allocated"] is None:
        note("On a GPU this table also shows `torch.cuda.max_memory_allocated()` per stage "
             "(activations and workspace included); this build ran on CPU, where there is none.")

    fig, ax = plt.subplots(figsize=(8, 3.6))
    colours = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "transient": "#c0c0c0"}
    for i, s in enumerate(stages):
        h = got[s]["held"]
        predicted = dict(zip(["params", "grads", "optimizer"], formula_bytes(psi, n, s, 4, 4, 8)))
        for dx, parts, hatch in [(-0.2, h, None), (0.2, predicted, "//")]:
            bottom = 0
            for key in ["params", "grads", "optimizer", "transient"]:
                value = parts.get(key, 0) / 2**20
                ax.bar(i + dx, value, 0.38, bottom=bottom, color=colours[key], hatch=hatch,
                       edgecolor="black", linewidth=0.4, label=key if i == 0 and dx < 0 else None)
                bottom += value
    ax.set_xticks(range(len(stages)), [f"{s}\nmeasured | formula" for s in stages])
    ax.set_ylabel("MB per rank")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"bytes per rank, float32 run, Ψ = {psi:,}, N = {n} (hatched: 4Ψ+4Ψ+8Ψ formula)")
    figure(fig, caption="measured (left bar of each pair) beside the formula (right, hatched)")

    note(f"""
        Measured and predicted agree up to padding (each tensor is padded to a multiple of
        N) and the transient full tensors, which the formulas leave out: ZeRO-3 holds about two
        layers in full (the one running and the prefetched one), ZeRO-2 a couple of full
        gradients in flight. For scale, the paper's example — Ψ = 7.5 B parameters on N = 64
        GPUs with mixed-precision Adam — gives
        {formula_bytes(7.5e9, 64, 'DP', 2, 2, 12) and sum(formula_bytes(7.5e9, 64, 'DP', 2, 2, 12)) / 1e9:.0f} GB per GPU
        for DP, {sum(formula_bytes(7.5e9, 64, 'ZeRO-1', 2, 2, 12)) / 1e9:.1f} GB for ZeRO-1,
        {sum(formula_bytes(7.5e9, 64, 'ZeRO-2', 2, 2, 12)) / 1e9:.1f} GB for ZeRO-2 and
        {sum(formula_bytes(7.5e9, 64, 'ZeRO-3', 2, 2, 12)) / 1e9:.2f} GB for ZeRO-3
        (formula evaluated here).
    """)

    last = task.sizes[-2] * task.sizes[-1] + task.sizes[-1]
    ring = (n - 1) / n
    theory = {"DP": 2 * ring * psi, "ZeRO-1": 2 * ring * psi, "ZeRO-2": 2 * ring * psi,
              "ZeRO-3": ring * (3 * psi - last)}
    table([[s, got[s]["bytes_per_step"], theory[s] * 4, got[s]["bytes_per_step"] / (4 * psi),
            {"DP": "all-reduce (= RS + AG)", "ZeRO-1": "reduce-scatter + all-gather",
             "ZeRO-2": "reduce-scatter + all-gather",
             "ZeRO-3": "all-gather fwd + all-gather bwd + reduce-scatter"}[s]] for s in stages],
          header=["stage", "bytes sent per rank per step (counted)", "theory (bytes)",
                  "counted / (4 bytes × Ψ)", "collectives"],
          caption=f"N = {n}: a ring sends (N−1)/N of a tensor per pass; theory ≈ 2Ψ for DP/ZeRO-1/2, ≈ 3Ψ for "
                  "ZeRO-3 (our ZeRO-3 keeps the last layer gathered from forward to backward: "
                  "2L−1 all-gathers instead of 2L)")
    note("""
        The bytes are counted by the `Collectives` wrapper every implementation calls, as each
        rank sends them in a ring (gloo may pick other algorithms; NCCL uses rings or trees, with
        the same bandwidth term). ZeRO-1 and ZeRO-2 are free in bandwidth; ZeRO-3 pays 1.5× for
        holding only 1/N of the parameters.
    """)
    see(Collectives)


def pytorch_versions():
    task = small_task()
    note("""
        ## PyTorch's own: DistributedDataParallel and FSDP2
        `DistributedDataParallel` is the bucketed, overlapped all-reduce above, in C++.
        FSDP2 (`torch.distributed.fsdp.fully_shard`) is ZeRO-3 on per-parameter `DTensor`
        shards; we make each `Linear` its own unit, as in our ZeRO-3. On CPU it needs a CPU
        device mesh: `init_device_mesh("cpu", (N,))`.
    """)
    see(wrap_pytorch)
    n = settings.world_size
    ref = reference_train(task)
    results = {
        "ours: DDP (bucketed)": spawn(train_data_parallel, n, task=task, grad_sync="bucketed",
                                      bucket_mb=0.002, name="ours: bucketed DDP").returns[0],
        "PyTorch DDP": spawn(train_pytorch, n, task=task, kind="ddp", name="PyTorch DDP").returns[0],
        "ours: ZeRO-3": spawn(train_zero, n, task=task, stage=3, name="ours: ZeRO-3").returns[0],
        "PyTorch FSDP2": spawn(train_pytorch, n, task=task, kind="fsdp2", name="PyTorch FSDP2").returns[0],
    }
    table([[step + 1, ref["losses"][step]] + [r["losses"][step] for r in results.values()]
           for step in range(task.steps)],
          header=["step", "single process"] + list(results), caption=f"losses, {n} ranks")
    table([[k, max_diff(r["params"], ref["params"])] for k, r in results.items()],
          header=["implementation", "max |Δ param| vs single process"])
    timed = timing_task()
    bucket_mb = 2.0 if not settings.quick else 0.25
    kinds = ["bucketed", "ddp", "zero1", "zero2", "zero3", "fsdp2"]
    t = spawn(time_variants, TIMING_RANKS, task=timed, kinds=kinds, bucket_mb=bucket_mb,
              reps=3 if settings.quick else 5, name="step time: ours vs PyTorch").returns[0]
    table([["DDP", t["bucketed"] * 1e3, t["ddp"] * 1e3, t["bucketed"] / t["ddp"]],
           ["ZeRO-3 / FSDP2", t["zero3"] * 1e3, t["fsdp2"] * 1e3, t["zero3"] / t["fsdp2"]],
           ["ZeRO-1 (ours only)", t["zero1"] * 1e3, None, None],
           ["ZeRO-2 (ours only)", t["zero2"] * 1e3, None, None]],
          header=["", "ours (ms/step)", "PyTorch (ms/step)", "ours / PyTorch"],
          caption=f"timing model Ψ = {param_count(timed):,}, {TIMING_RANKS} ranks, medians, measured in one run")


def local_sgd_section():
    import matplotlib.pyplot as plt
    task = Task(batch=16)
    n = settings.world_size
    steps = 48 if settings.quick else 160
    note(f"""
        ## Beyond one sync per step: local SGD and compressed updates
        Averaging gradients every step is one end of a spectrum. Local SGD (federated
        averaging when the ranks are phones) lets each rank take H steps on its own data and
        then averages the *parameters* — with plain SGD and H = 1 that is exactly data
        parallelism. Konečný et al. (2016) also shrink what is sent: a random mask keeps a
        fraction of the coordinates (with a shared seed, only values travel), and quantization
        sends 8 bits per value with stochastic rounding. Here {n} ranks, each with its own data
        stream, SGD, {steps} local steps; the held-out loss after each sync against the bytes
        each rank has sent.
    """)
    see(average_update)
    see(local_sgd)
    variants = [(1, ""), (4, ""), (16, ""), (4, "mask"), (4, "int8"), (4, "mask+int8")]
    run = spawn(local_sgd_sweep, n, task=task, variants=variants, steps=steps, name="local SGD sweep")
    curves = run.returns[0]
    assert all(len({r[k]["checksum"] for r in run.returns}) == 1 for k in curves), "ranks disagree after sync"
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, c in curves.items():
        xs, ys = zip(*c["curve"][1:])           # from the first sync on (log axis: no zero)
        ax.plot([x / 2**20 for x in xs], ys, marker=".", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per rank (cumulative)")
    ax.set_ylabel("held-out loss")
    ax.legend(fontsize=8)
    figure(fig, caption=f"held-out loss after each sync vs bytes communicated (starting loss "
                        f"{curves['H=1 fp32']['curve'][0][1]:.3f}): fewer syncs and smaller messages "
                        "buy more loss per byte")
    table([[k, c["curve"][-1][0], c["curve"][-1][1], len(c["curve"]) - 1] for k, c in curves.items()],
          header=["variant", "bytes sent per rank", "final held-out loss", "syncs"],
          caption=f"{n} ranks, {steps} local steps each; ranks hold identical models after every sync (checked)")


def scaling_notes():
    note("""
        ## Notes: batch size, learning rate, offload
        **Learning rate and batch size.** Data parallelism grows the global batch with the
        number of ranks. Goyal et al. scale the learning rate linearly with the batch, after a
        warm-up, and train ResNet-50 with batches of 8k in an hour; the square-root rule keeps
        the gradient noise per step constant instead. Past that, layer-wise adaptive rates keep
        very large batches stable: LARS for SGD and LAMB for Adam (You et al.). Historic
        arc: ImageNet ResNet-50 went from about 29 hours on 8 P100s (He et al. 2016) to about
        72 s on 2048 V100s (Yamazaki et al. 2019).

        **Offload.** ZeRO-Offload keeps the fp32 optimizer state and the update on the CPU and
        the compute on the GPU, ZeRO-Infinity adds NVMe; both trade PCIe bandwidth for GPU
        memory. Data parallelism alone stops scaling well once the per-rank batch becomes too
        small to hide the all-reduce — typically past a few hundred ranks — which is where
        the next lectures' tensor and pipeline parallelism come in.
    """)
    for url, title in [
        ("https://arxiv.org/abs/1706.02677", "Goyal et al. 2017, Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"),
        ("https://arxiv.org/abs/1708.03888", "You et al. 2017, Large Batch Training of Convolutional Networks (LARS)"),
        ("https://arxiv.org/abs/1904.00962", "You et al. 2019, Large Batch Optimization for Deep Learning: Training BERT in 76 minutes (LAMB)"),
        ("https://arxiv.org/abs/1910.02054", "Rajbhandari et al. 2020, ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"),
        ("https://arxiv.org/abs/2101.06840", "Ren et al. 2021, ZeRO-Offload: Democratizing Billion-Scale Model Training"),
        ("https://arxiv.org/abs/2104.07857", "Rajbhandari et al. 2021, ZeRO-Infinity: Breaking the GPU Memory Wall"),
        ("https://arxiv.org/abs/1610.05492", "Konečný et al. 2016, Federated Learning: Strategies for Improving Communication Efficiency"),
        ("https://arxiv.org/abs/1903.12650", "Yamazaki et al. 2019, Yet Another Accelerated SGD: ResNet-50 Training on ImageNet in 74.7 seconds"),
        ("https://arxiv.org/abs/2304.11277", "Zhao et al. 2023, PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel"),
    ]:
        see(url, title=title)


def main():
    intro()
    the_task()
    ddp_from_scratch()
    overlap_and_buckets()
    gradient_accumulation()
    zero_stages()
    memory_and_traffic()
    pytorch_versions()
    local_sgd_section()
    scaling_notes()


def bench():
    """Ours vs PyTorch's, side by side in one run: bucketed DDP vs DDP, ZeRO-3 vs FSDP2."""
    task = timing_task()
    t = spawn(time_variants, TIMING_RANKS, task=task, kinds=["bucketed", "ddp", "zero3", "fsdp2"],
              bucket_mb=2.0, reps=7, name="bench: ours vs PyTorch").returns[0]
    return [f"lecture_03: bucketed DDP {t['bucketed'] * 1e3:.1f} ms/step vs PyTorch DDP "
            f"{t['ddp'] * 1e3:.1f} ms/step: ratio {t['bucketed'] / t['ddp']:.2f} (target <= 1.1)",
            f"lecture_03: ZeRO-3 {t['zero3'] * 1e3:.1f} ms/step vs FSDP2 {t['fsdp2'] * 1e3:.1f} "
            f"ms/step: ratio {t['zero3'] / t['fsdp2']:.2f} (target <= 1.3)"]
