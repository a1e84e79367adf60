"""What each rank runs in lecture 03's demos, and the one-process references they are checked
against; the lecture launches them with spawn() and narrates what they return. Also the analysis
of those returns and the helpers that put it into words (the published-scale estimate and
fp32_words, zero2_words, best_rules, both_ratios, span_of), each beside the run it reads."""
import contextlib
import dataclasses
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from util import device, mesh_options, quiet, settings, span
from util.measure import Timing, bytes_sent, compare, measure, measure_side_by_side, timing_ranks

from lectures.data_parallel.ddp import BucketedAllReduce, Collectives, broadcast_parameters, make_grad_sync
from lectures.data_parallel.overlap import ComputeStandIn, agreed_wait, measured_against_model
from lectures.data_parallel.zero import Zero1, Zero2, Zero3

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


def make_batches(task, steps=None, seed_offset=0, input_shift=0.0):
    """A fixed random 'teacher' network labels Gaussian inputs: learnable, and the same on every
    rank because it depends only on the seed. `input_shift` moves the inputs' centre (non-IID
    data for local SGD)."""
    g = torch.Generator().manual_seed(1000 + task.seed)          # one teacher for all streams
    teacher = [torch.randn(a, b, generator=g) / math.sqrt(a) for a, b in zip(task.sizes, task.sizes[1:])]
    g.manual_seed(2000 + task.seed + seed_offset)                # the rows: one stream per offset
    batches = []
    for _ in range(steps or task.steps):
        x = torch.randn(task.batch, task.sizes[0], generator=g) + input_shift
        y = x
        for i, w in enumerate(teacher):
            y = y @ w if i == len(teacher) - 1 else torch.tanh(2 * y @ w)
        batches.append((x.to(device(), task.torch_dtype), y.to(device(), task.torch_dtype)))
    return batches


def shard_rows(t, rank, world_size):
    """This rank's distinct, contiguous slice of a global batch (partitioned ahead of time)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard_rows: rank {rank} is not in [0, {world_size})")
    if t.shape[0] % world_size:
        raise ValueError(f"shard_rows: the global batch of {t.shape[0]} rows does not split evenly "
                         f"over {world_size} ranks")
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


def max_diff(params, reference):
    return max((a - b).abs().max().item() for a, b in zip(params, reference))


# =========================================================================================
# 2-3. Collectives that count what they send; DDP from scratch
# =========================================================================================
# The building blocks (Collectives, broadcast_parameters, the three gradient syncs and
# plan_buckets) live in lectures/data_parallel/ddp.py; the training step and the rank functions are here.

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
    comm.sent, comm.sent_by_gloo, comm.calls, wire = 0, 0, 0, 0
    for x, y in make_batches(task):
        with bytes_sent() as written:           # what this rank really wrote to its sockets
            loss = data_parallel_step(model, sync, opt, shard_rows(x, rank, world_size),
                                      shard_rows(y, rank, world_size), micro_batches)
        wire += written.bytes or 0
        losses.append(global_mean(loss))
        sums.append(checksum(model.parameters()))
    return {"losses": losses, "checksums": sums, "initial": initial,
            "params": [p.detach().cpu().clone() for p in model.parameters()],
            "bytes_per_step": comm.sent / task.steps, "calls_per_step": comm.calls / task.steps,
            "gloo_per_step": comm.sent_by_gloo / task.steps,
            "wire_per_step": wire / task.steps, "held": held_by_adamw(model, opt)}


def held_by_adamw(model, opt):
    """Bytes of parameters, gradients and optimizer state this rank actually holds (gradients
    as they were before zero_grad: we count their sizes, which zero_grad does not change)."""
    nbytes = lambda t: t.numel() * t.element_size()
    params = list(model.parameters())
    state = sum(nbytes(v) for p in params for v in opt.state[p].values() if v.dim() > 0)
    return {"params": sum(map(nbytes, params)), "grads": sum(map(nbytes, params)), "optimizer": state,
            "transient": 0}


# =========================================================================================
# 3b. Data sharding: a sampler per rank, and the uneven last batch
# =========================================================================================

def sampler_epochs(rank, world_size, n_rows, epochs, drop_last, set_epoch=True, seed=0):
    """The indices `DistributedSampler` hands this rank in each epoch."""
    from torch.utils.data import DistributedSampler
    sampler = DistributedSampler(range(n_rows), num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=drop_last)
    out = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)     # reseeds the shuffle: a new order every epoch
        out.append(list(sampler))
    return out


def strided_batches(rank, world_size, n_rows, batch):
    """A hand-made partition without padding: rank r takes rows r, r+N, r+2N, ... in batches.
    When N does not divide the rows, ranks end up with different numbers of batches."""
    mine = list(range(rank, n_rows, world_size))
    return [mine[i:i + batch] for i in range(0, len(mine), batch)]


def uneven_with_join(rank, world_size, n_rows, batch, steps_seen=None):
    """PyTorch DDP over batches whose count differs between ranks. Without help, the ranks with
    one batch more would wait forever in its gradient all-reduce. Inside `Join`, a rank that has
    run out keeps answering the others' all-reduces with zeros ("shadowing" them) until everyone
    is done, then the last rank to finish broadcasts the final model."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    xs = torch.randn(n_rows, 5)
    ys = xs.sum(1, keepdim=True)
    model = DistributedDataParallel(nn.Linear(5, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = strided_batches(rank, world_size, n_rows, batch)
    with Join([model]):
        for idx in batches:
            F.mse_loss(model(xs[idx]), ys[idx]).backward()
            opt.step()
            opt.zero_grad()
    return {"batches": len(batches), "checksum": checksum(model.parameters())}


# =========================================================================================
# 4. ZeRO: shard the optimizer state, then the gradients, then the parameters
# =========================================================================================
# The building blocks (Zero1, Zero2, Zero3 and their helpers) are in lectures/data_parallel/zero.py.

def train_zero(rank, world_size, task, stage=1, micro_batches=1, eval_between=False):
    """ZeRO-1/2/3 with the same data, loss and checks as `train_data_parallel`. With
    `micro_batches` > 1 each rank accumulates gradients over that many micro-batches per step;
    `eval_between` computes a loss under `torch.no_grad()` between backward and step (what a
    logging line does), which must not change training."""
    comm = Collectives(world_size)
    model = make_model(task, seed=task.seed + rank)
    broadcast_parameters(model, comm)
    initial = [p.detach().cpu().clone() for p in model.parameters()]
    zero = {1: Zero1, 2: Zero2}[stage](model, comm, task) if stage < 3 else Zero3(model, comm, task)
    if stage == 3:
        del model                          # from here on, only shards
    net = zero if stage == 3 else zero.model
    losses, sums = [], []
    comm.sent, comm.sent_by_gloo, comm.calls, wire = 0, 0, 0, 0
    for x, y in make_batches(task):
        xs, ys = shard_rows(x, rank, world_size), shard_rows(y, rank, world_size)
        assert xs.shape[0] % micro_batches == 0, "equal micro-batches, or loss/micro_batches is wrong"
        total = 0.0
        with bytes_sent() as written:
            for xm, ym in zip(xs.chunk(micro_batches), ys.chunk(micro_batches)):
                loss = F.mse_loss(net(xm), ym) / micro_batches
                loss.backward()
                total += loss.item()
            if eval_between:
                with torch.no_grad():
                    F.mse_loss(net(xs), ys).item()
            zero.step()
        wire += written.bytes or 0
        losses.append(global_mean(total))
        # Under ZeRO-3 no rank holds a replica to checksum; stages 1 and 2 still replicate.
        sums.append(None if stage == 3 else checksum(zero.model.parameters()))
    sent, calls, by_gloo = comm.sent, comm.calls, comm.sent_by_gloo    # before the final gather
    final = zero.full_parameters() if stage == 3 else [p.detach().cpu().clone() for p in net.parameters()]
    return {"losses": losses, "checksums": sums, "initial": initial, "params": final,
            "bytes_per_step": sent / task.steps, "calls_per_step": calls / task.steps,
            "gloo_per_step": by_gloo / task.steps,
            "wire_per_step": wire / task.steps, "held": zero.held}


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


def zero2_words(t):
    """Our ZeRO-2's step time against ZeRO-1's and ZeRO-3's, in words from the timings."""
    said = (f"Our ZeRO-2 against ZeRO-1: {compare(t['zero2'], t['zero1'], 'ZeRO-2', 'ZeRO-1')}; "
            f"against ZeRO-3: {compare(t['zero2'], t['zero3'], 'ZeRO-2', 'ZeRO-3')}.")
    if t["zero2"].q1 > max(t["zero1"].q3, t["zero3"].q3):
        said += (" It sends the same bytes as ZeRO-1, but its hooks reduce-scatter one tensor at a "
                 "time during backward with at most one in flight (`Zero2(in_flight=1)`, to bound "
                 "the full gradients alive), so backward stops to wait for each in turn; then it "
                 "still all-gathers every tensor after the step, blocking, as ZeRO-1 does. It pays "
                 "ZeRO-3's per-tensor waits during backward without ZeRO-3's prefetching.")
    return said


# =========================================================================================
# 6. Timing: every variant in one run, interleaved, several repetitions, median
# =========================================================================================

def build_variant(kind, task, rank, world_size, bucket_mb, comm):
    """Returns step(x, y) for one variant of data-parallel training ("bucketed:0.25": bucketed
    with 0.25 MB buckets, overriding `bucket_mb`)."""
    if kind.startswith("bucketed:"):
        kind, bucket_mb = "bucketed", float(kind.split(":")[1])
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
    """A `Timing` (seconds per step) of each variant. The variants take turns, one timed
    repetition of `steps` steps each, in a rotating order, so background noise hits all of them
    alike (`measure_side_by_side`); each repetition starts after a barrier and keeps the
    slowest rank."""
    comm = Collectives(world_size)
    x, y = [shard_rows(t, rank, world_size) for t in make_batches(task, steps=1)[0]]
    steps_of = {k: build_variant(k, task, rank, world_size, bucket_mb, comm) for k in kinds}
    with quiet():                                    # timing runs leave no spans on the page
        for k in kinds:
            for _ in range(warmup):
                steps_of[k](x, y)
        runs = {k: (lambda k=k: [steps_of[k](x, y) for _ in range(steps)]) for k in kinds}
        times = measure_side_by_side(runs, warmup=0, repeats=reps)
    return {k: Timing([s / steps for s in t.samples]) for k, t in times.items()}


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


def merge_in_flight(spans, label="all-reduce (async)"):
    """The spans with each rank's overlapping `label` spans merged into one per stretch of time
    in flight (a per-parameter sync launches dozens at once: one lane each would be unreadable).
    Returns (spans, how many were merged on the busiest rank; 0 if they never overlapped)."""
    keep = [s for s in spans if s["label"] != label]
    merged, most = [], 0
    for rank in sorted({s["rank"] for s in spans}):
        mine = sorted((s for s in spans if s["label"] == label and s["rank"] == rank),
                      key=lambda s: s["start"])
        groups = []
        for s in mine:
            if groups and s["start"] <= groups[-1]["end"]:
                groups[-1]["end"] = max(groups[-1]["end"], s["end"])
                groups[-1]["count"] += 1
            else:
                groups.append({**s, "count": 1})
        if any(g["count"] > 1 for g in groups):
            most = max(most, len(mine))
        merged += groups
    name = label.replace("all-reduce", "all-reduces in flight") if most else label
    return keep + [{k: v for k, v in g.items() if k != "count"} | {"label": name} for g in merged], most


def stand_in_model(layers, width, forward_s=0.0, backward_s=0.0):
    """`layers` Linear(width, width) layers, each followed by a compute stand-in that waits
    (releases the core) in forward and/or backward: the release-the-core mode's model."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers)
                           for m in (nn.Linear(width, width), ComputeStandIn(forward_s, backward_s))])


def released_buckets(rank, world_size, layers=6, width=1024, reps=7, min_wait=0.004):
    """DDP's overlap in release-the-core mode: each layer's backward compute is a stand-in that
    waits as long as one layer's gradient all-reduce takes, and each layer is a bucket. Without
    overlap the buckets are all-reduced after backward; with it each is launched by the hook the
    moment its gradients are in (BucketedAllReduce). Returns the timings read against the model
    (pattern "produce": the last bucket's all-reduce cannot hide)."""
    comm = Collectives(world_size)
    x = torch.randn(1, width, device=device())   # one row: the real matmuls stay small beside the waits
    layer_mb = width * (width + 1) * 4 / 2 ** 20

    def build(wait):
        model = stand_in_model(layers, width, backward_s=wait).to(device())
        return model, BucketedAllReduce(model, comm, bucket_mb=0.99 * layer_mb)   # one layer per bucket

    model, sync = build(0.0)
    send = lambda: [dist.all_reduce(f) for f in sync.flat]
    wait = agreed_wait(measure(send, warmup=2, repeats=reps).median, layers, min_wait)
    model, sync = build(wait)

    def backward(synced):
        sync.sync = synced
        model(x).square().mean().backward()

    def sequential():
        backward(False)
        send()
        model.zero_grad(set_to_none=False)

    def overlapped():
        backward(True)
        sync.finish()
        model.zero_grad(set_to_none=False)

    def compute():
        backward(False)
        model.zero_grad(set_to_none=False)

    t = measure_side_by_side({"compute": compute, "comm": send, "sequential": sequential,
                              "overlapped": overlapped}, warmup=1, repeats=reps)
    return measured_against_model(t, layers, "produce")


def released_prefetch(rank, world_size, layers=6, width=1024, reps=7, min_wait=0.004, real_rows=64):
    """ZeRO-3's prefetch in release-the-core mode: a forward of `layers` sharded layers, each
    followed by a stand-in that waits as long as one layer's all-gather takes; with prefetch, the
    next layer's weights travel during the wait, without it each layer gathers when it runs.
    Returns the timings read against the model (pattern "consume": the first gather is exposed),
    and under "real" the same forward with real matmuls of `real_rows` rows and no stand-in,
    without and with prefetch, timed taking turns."""
    comm, task = Collectives(world_size), Task()
    x = torch.randn(1, width, device=device())   # one row: the real matmuls stay small beside the waits
    probe = Zero3(stand_in_model(layers, width).to(device()), comm, task, prefetch=False)

    def send():
        for layer in probe.layers:
            layer.gather()
            layer.free()
    wait = agreed_wait(measure(send, warmup=2, repeats=reps).median, layers, min_wait)
    full = stand_in_model(layers, width, forward_s=wait).to(device())
    on, off = (Zero3(stand_in_model(layers, width, forward_s=wait).to(device()), comm, task, prefetch=p)
               for p in (True, False))
    real_x = torch.randn(real_rows, width, device=device())
    real_on, real_off = (Zero3(stand_in_model(layers, width).to(device()), comm, task, prefetch=p)
                         for p in (True, False))
    with torch.no_grad():
        t = measure_side_by_side({"compute": lambda: full(x), "comm": send, "sequential": lambda: off(x),
                                  "overlapped": lambda: on(x)}, warmup=1, repeats=reps)
        real = measure_side_by_side({"sequential": lambda: real_off(real_x), "overlapped": lambda: real_on(real_x)},
                                    warmup=1, repeats=reps)
    return {**measured_against_model(t, layers, "consume"), "real": real, "real_rows": real_rows}


def timing_world():
    """Ranks for timing demos: as many as the lecture's world size, but never more than the
    cores (more would time the operating system taking turns, not the algorithm)."""
    return timing_ranks(settings.world_size)


# =========================================================================================
# 8. Rank functions for the measurements
# =========================================================================================

def budget_probe(rank, world_size, task):
    """This run's own numbers for the overlap budget: forward+backward and forward alone on
    this rank's rows (backward = the difference), and an all-reduce of every gradient at once."""
    model = make_model(task, task.seed)
    x, y = [shard_rows(t, rank, world_size) for t in make_batches(task, steps=1)[0]]

    def forward():
        with torch.no_grad():
            F.mse_loss(model(x), y)

    def forward_backward():
        F.mse_loss(model(x), y).backward()
        model.zero_grad(set_to_none=False)

    flat = torch.zeros(param_count(task), device=device(), dtype=task.torch_dtype)
    return {"forward": measure(forward, warmup=2, repeats=9),
            "forward+backward": measure(forward_backward, warmup=2, repeats=9),
            "all-reduce": measure(lambda: dist.all_reduce(flat), warmup=2, repeats=9)}


def published_scale_numbers(psi=7e9, nic=50e9, tokens=8 * 4096, peak=989e12, mfu=0.4, grad_bytes=2):
    """The seconds of `published_scale`: the all-reduce of gradients of `grad_bytes` each
    (2: bf16) and the backward of one step."""
    return {"comm": 2 * (grad_bytes * psi) / nic, "backward": 4 * psi * tokens / (mfu * peak)}


def published_scale(psi=7e9, nic=50e9, tokens=8 * 4096, peak=989e12, mfu=0.4):
    """The overlap budget of a 7B model on H100s with one 400 Gb/s NDR port each, in words: the
    ring all-reduce of the bf16 gradient (2Ψ bytes, each rank sending 2(n-1)/n of it, about 4Ψ
    bytes) against backward (about 4Ψ FLOPs per token) at `mfu` of the dense bf16 peak."""
    seconds = published_scale_numbers(psi, nic, tokens, peak, mfu)
    comm, backward = seconds["comm"], seconds["backward"]
    ratio = backward / comm
    verdict = (f"Backward is {ratio:.1f}× the all-reduce: with overlap it hides {ratio:.1f} times "
               "over, so this configuration is far from communication-bound. The all-reduce would stay "
               f"hidden down to about {tokens / ratio:,.0f} tokens per GPU" if ratio > 1.2 else
               f"The all-reduce is {1 / ratio:.1f}× backward: even perfect overlap leaves it exposed"
               if ratio < 0.8 else "The two are about equal: this configuration is on the edge")
    return (f"A {psi / 1e9:.0f}-billion-parameter model in bf16 has 2Ψ = {2 * psi / 1e9:.0f} GB of "
            f"gradients. Across nodes each H100 typically has one 400 Gb/s InfiniBand NDR port "
            f"(ConnectX-7): {nic / 1e9:.0f} GB/s per direction at line rate, of which NCCL achieves "
            f"about 47 (lecture 07). A ring all-reduce over many nodes "
            f"sends about 2 × 2Ψ = {4 * psi / 1e9:.0f} GB per GPU (the factor $\\frac{{2(n-1)}}{{n}}$ → 2), "
            f"which takes about {comm:.2f} s at line rate. Backward costs about twice the forward's 2Ψ FLOPs "
            f"per token, 4Ψ·tokens: with 8 sequences of 4,096 tokens per GPU, $4 \\times "
            f"{psi / 1e9:.0f} \\cdot 10^9 \\times {tokens} \\approx {4 * psi * tokens / 1e15:.2f} \\cdot 10^{{15}}$ FLOPs. "
            f"The H100's dense bf16 peak is {peak / 1e12:.0f} TFLOP/s. At {mfu:.0%} of it, "
            f"backward takes about {backward:.2f} s. {verdict}. "
            f"{fp32_words(psi, nic, tokens, peak, mfu)} "
            "The budget tightens as the batch per GPU shrinks (more GPUs for the same global "
            "batch), or when sharding adds traffic (ZeRO-3 sends 1.5× DP's bytes); then large "
            "jobs keep that traffic on fast links (shard inside a node, HSDP across), or send "
            "fewer bytes (lower-precision gradients, the compression in the deep dives below).")


def fp32_words(psi, nic, tokens, peak, mfu):
    """The same budget with the gradients reduced in fp32, as Llama 3 does and lecture 07's
    model charges: twice the bytes."""
    fp32 = published_scale_numbers(psi, nic, tokens, peak, mfu, grad_bytes=4)
    return (f"Llama 3 reduce-scatters its gradients in fp32 for numerical stability (Llama 3 "
            f"report, §3.3.2), and lecture 07's model charges that. Reduced in fp32, the "
            f"all-reduce doubles to {fp32['comm']:.2f} s and backward is "
            f"{fp32['backward'] / fp32['comm']:.1f}× it.")


def train_at_batch(batch, rule, base_batch, base_lr, samples, warmup_frac=0.1, seed=0):
    """Plain SGD on the teacher task with a global batch of `batch`, seeing `samples` samples in
    all (so bigger batches take fewer steps), the learning rate scaled from (base_batch, base_lr)
    by `rule` ("none", "sqrt", "linear"), with a linear warm-up over the first tenth of the
    steps (Goyal et al.). Returns the held-out loss at the end."""
    k = batch / base_batch
    lr = base_lr * {"none": 1.0, "sqrt": math.sqrt(k), "linear": k}[rule]
    steps = max(1, samples // batch)
    task = Task(batch=batch, steps=steps, seed=seed)
    model = make_model(task, seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    warm = max(1, int(warmup_frac * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    for x, y in make_batches(task):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    x_eval, y_eval = make_batches(Task(batch=512, steps=1, seed=seed), seed_offset=999)[0]
    with torch.no_grad():
        loss = F.mse_loss(model(x_eval), y_eval).item()
    return loss if math.isfinite(loss) else float("nan")


def lr_scaling(rank, world_size, configs, **kw):
    """Each rank trains its share of the (batch, rule) configurations (one process each)."""
    return {(b, r): train_at_batch(b, r, **kw) for b, r in configs[rank::world_size]}


def best_rules(got, batches, rules, base_batch):
    """'Lowest loss per batch size' in words. At the base batch every rule gives the base rate,
    so all rules are the same run: that batch is reported as a tie, not won by list order."""
    said = []
    for b in batches:
        losses = {r: got[b, r] if math.isfinite(got[b, r]) else float("inf") for r in rules}
        low = min(losses.values())
        tied = [r for r in rules if losses[r] == low]
        if b == base_batch or len(tied) == len(rules):
            said.append(f"{b}: all equal (at the base batch every rule gives the base rate)"
                        if b == base_batch else f"{b}: all equal")
        else:
            said.append(f"{b}: {' = '.join(tied)}")
    return "Lowest held-out loss per batch size here: " + "; ".join(said) + "."


def memory_task():
    """The deeper model whose memory and bytes per rank lecture 03 measures under DP and ZeRO."""
    width, depth = (64, 8) if settings.quick else (192, 16)
    return Task(sizes=(32,) + (width,) * depth + (10,), batch=16, steps=2)


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
                     "gloo_per_step": result["gloo_per_step"],
                     "wire_per_step": result["wire_per_step"], "calls_per_step": result["calls_per_step"],
                     "peak_allocated": torch.cuda.max_memory_allocated() if device().type == "cuda" else None}
    return out


def formula_bytes(psi, n, stage, p_bytes, g_bytes, k):
    """Bytes per rank for params, grads, optimizer state under each stage (ZeRO paper, Fig. 1)."""
    shard = {"DP": (1, 1, 1), "ZeRO-1": (1, 1, n), "ZeRO-2": (1, n, n), "ZeRO-3": (n, n, n)}[stage]
    return [p_bytes * psi / shard[0], g_bytes * psi / shard[1], k * psi / shard[2]]


def both_ratios(a, b):
    """'1.50× and 1.52×', or '1.50× each' when they print alike."""
    return f"{a:.2f}× each" if f"{a:.2f}" == f"{b:.2f}" else f"{a:.2f}× and {b:.2f}×"


def span_of(values):
    """'1.00–1.03×', or '1.01×' when the range prints as one number."""
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{lo}×" if lo == hi else f"{lo}–{hi}×"


def fsdp2_variant(rank, world_size, task, reshard=True, mixed=False, hsdp=False, wrap=True):
    """Train `task` under FSDP2 with one knob changed; report what each rank holds, what it
    wrote to its sockets per step, and the bytes of activations saved for backward.
    reshard: `reshard_after_forward` (free the gathered weights after forward and gather them
    again for backward, or keep them until backward). mixed: `MixedPrecisionPolicy` with bf16
    parameters for compute and fp32 gradient reduction. hsdp: a 2-D mesh, sharded within
    groups of world_size/2 ranks and replicated across the 2 groups. wrap=False: plain model,
    no FSDP (the activation baseline)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = make_model(task, task.seed)
    if wrap:
        if hsdp:
            mesh = init_device_mesh(device().type, (2, world_size // 2),
                                    mesh_dim_names=("replicate", "shard"), backend_override=mesh_options(2))
        else:
            mesh = init_device_mesh(device().type, (world_size,))      # the default group itself
        kw = {"mesh": mesh, "reshard_after_forward": reshard}
        if mixed:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, **kw)
        fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=task.weight_decay)
    rows = task.batch // world_size
    activations = []

    def pack(t):                     # tensors saved for backward that carry the batch dimension
        if t.dim() and t.shape[0] == rows:
            activations.append(t.numel() * t.element_size())
        return t

    losses, wire = [], 0
    for step, (x, y) in enumerate(make_batches(task)):
        xs, ys = shard_rows(x, rank, world_size), shard_rows(y, rank, world_size)
        with bytes_sent() as written:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if step == 0 else contextlib.nullcontext():
                loss = F.mse_loss(model(xs).float(), ys)
            loss.backward()
            opt.step()
            opt.zero_grad()
        wire += written.bytes or 0
        losses.append(global_mean(loss.item()))
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p
    full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p
    return {"losses": losses, "wire_per_step": wire / task.steps,
            "held": sum(local(p).numel() * local(p).element_size() for p in model.parameters()),
            "activations": sum(activations),
            "params": [full(p).detach().float().cpu().clone() for p in model.parameters()]}
