"""Lecture 03's exercises: bucketed gradient all-reduce, a ZeRO-1 step, a distributed sampler."""
import math

import torch
import torch.distributed as dist

from exercises import exercise, mutant
from util import exercise as engine


def _tensor(rank, shape, seed):
    g = torch.Generator().manual_seed(100 * rank + seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


# --- a bucketed gradient all-reduce ---------------------------------------------------------

SHAPES = ((7, 3), (5,), (11, 2), (1,), (4, 4), (9,))        # definition order, float64
BUCKETS = (200 / 2 ** 20, 1e-9, 1.0, 400 / 2 ** 20)        # MB: mixed, one per tensor, one, two


def check_buckets(rank, world_size, fn):
    from lectures.data_parallel import plan_buckets
    out = []
    for bucket_mb in BUCKETS:
        params = [torch.nn.Parameter(_tensor(0, s, k)) for k, s in enumerate(SHAPES)]
        for k, p in enumerate(params):
            p.grad = _tensor(rank, p.shape, 50 + k)
        expected = [sum(_tensor(r, p.shape, 50 + k) for r in range(world_size)) / world_size
                    for k, p in enumerate(params)]
        fn(params, bucket_mb)             # dist.all_reduce is counted however the function spells it
        planned = [sum(p.numel() for p in bucket) for bucket in plan_buckets(params, bucket_mb)]
        label = f"bucket_mb = {bucket_mb:.3g} ({bucket_mb * 2 ** 20:.0f} bytes)"
        out.append((f"{label}: elements per dist.all_reduce call, in order", planned,
                    [numel for name, numel in engine.calls_of(fn) if name == "dist.all_reduce"]))
        out.append((f"{label}: averaged gradients (definition order)", expected, [p.grad for p in params]))
    return out


def all_reduce_gradients(params, bucket_mb):
    """Reference: the course's plan_buckets (the rule the statement spells out), one flat
    all-reduce per bucket, then the average."""
    from lectures.data_parallel.ddp import plan_buckets
    n = dist.get_world_size()
    for bucket in plan_buckets(params, bucket_mb):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        flat /= n
        for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(g.view_as(p.grad))


exercise(
    module=__name__, name="all_reduce_gradients",
    title="a bucketed gradient all-reduce (what DDP's hook does)",
    statement=(
        "**Exercise: a bucketed gradient all-reduce.** DDP (Li et al. 2020) does not all-reduce "
        "each gradient on its own: it packs them into buckets of about `bucket_mb` megabytes, in "
        "the order backward produces them (the reverse of `params`' order), and all-reduces each "
        "bucket as one flat tensor. Write `all_reduce_gradients(params, bucket_mb)`: walk `params` "
        "in reverse, add each tensor to the current bucket, close the bucket as soon as it holds at "
        "least `bucket_mb · 2**20` bytes (a tensor is never split), and for each bucket make ONE "
        "`dist.all_reduce` call on the concatenated gradients; write the *average* over ranks back "
        "into every `p.grad`. The check counts your `dist.all_reduce` calls and their sizes against "
        "the course's `plan_buckets`, on 3 and on 2 ranks, 6 float64 tensors of odd shapes, 4 bucket sizes."),
    stub=(
        "def all_reduce_gradients(params, bucket_mb):\n"
        "    \"\"\"Average every p.grad over the ranks, one dist.all_reduce per bucket (backward order).\"\"\"\n"
        "    raise NotImplementedError(\"hint: for p in reversed(params): fill a bucket until it holds \"\n"
        "                              \">= bucket_mb * 2**20 bytes; torch.cat the grads, all_reduce, / n\")\n"),
    harness=check_buckets, solution=all_reduce_gradients, ranks=(3, 2),
    watch={"torch.distributed.all_reduce": None},
    wrong={"one all-reduce per parameter":
               mutant(all_reduce_gradients, ("plan_buckets(params, bucket_mb)", "[[p] for p in params]")),
           "sums, forgets to average": mutant(all_reduce_gradients, ("        flat /= n\n", "")),
           "buckets in definition order":
               mutant(all_reduce_gradients, ("plan_buckets(params,", "plan_buckets(params[::-1],"))},
    hint="gradients become ready last layer first: fill buckets from the end of params",
    sizes="float64, 6 tensors, bucket limits 200 B, 1e-9 MB, 1 MB, 400 B")


# --- a ZeRO-1 step ----------------------------------------------------------------------------

NUMELS = (10, 2, 31)   # not divisible by 3 ranks; fewer elements than ranks


def check_zero1(rank, world_size, fn):
    from lectures.data_parallel import adamw_update, shard_size
    out = []
    lr, wd = 0.1, 0.01
    for numel in NUMELS:
        s = shard_size(numel, world_size)
        param = _tensor(0, (numel,), 7)
        ref_p = param.clone()
        ref_m, ref_v = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
        m, v = torch.zeros(s, dtype=torch.float64), torch.zeros(s, dtype=torch.float64)
        for step in (1, 2):
            grad = _tensor(rank, (numel,), 10 * step)
            mean = sum(_tensor(r, (numel,), 10 * step) for r in range(world_size)) / world_size
            adamw_update(ref_p, mean, ref_m, ref_v, step, lr, wd)
            param = fn(param.clone(), grad.clone(), m, v, step, lr, wd)
            pad = torch.zeros(s * world_size, dtype=torch.float64)
            mine = slice(rank * s, (rank + 1) * s)
            out.append((f"{numel} parameters, step {step}: the full parameter after the all-gather",
                        ref_p.clone(), param))
            exp_m = pad.clone()
            exp_m[:numel] = ref_m
            out.append((f"{numel} parameters, step {step}: this rank's first moment m (shard of {s})",
                        exp_m[mine].clone(), m.clone()))
    return out


def zero1_step(param, grad, m, v, step, lr, weight_decay):
    """Reference: reduce-scatter, AdamW on my shard, all-gather."""
    n, rank = dist.get_world_size(), dist.get_rank()
    numel = param.numel()
    s = -(-numel // n)
    flat_g = torch.zeros(s * n, dtype=grad.dtype)
    flat_g[:numel] = grad
    shard_g = torch.empty(s, dtype=grad.dtype)
    dist.reduce_scatter_single(shard_g, flat_g)
    shard_g /= n
    flat_p = torch.zeros(s * n, dtype=param.dtype)
    flat_p[:numel] = param
    p = flat_p[rank * s:(rank + 1) * s].clone()
    b1, b2, eps = 0.9, 0.999, 1e-8
    p.mul_(1 - lr * weight_decay)
    m.lerp_(shard_g, 1 - b1)
    v.mul_(b2).addcmul_(shard_g, shard_g, value=1 - b2)
    denom = (v.sqrt() / math.sqrt(1 - b2 ** step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1 ** step))
    gathered = torch.empty(s * n, dtype=param.dtype)
    dist.all_gather_single(gathered, p)
    return gathered[:numel]


exercise(
    module=__name__, name="zero1_step",
    title="a ZeRO-1 step: reduce-scatter, sharded AdamW, all-gather",
    statement=(
        "**Exercise: a ZeRO-1 step.** ZeRO stage 1 (Rajbhandari et al. 2020) keeps Adam's moments "
        "for 1/n of the parameters on each rank. Write `zero1_step(param, grad, m, v, step, lr, "
        "weight_decay)`: `param` is the full flat parameter (the same on every rank), `grad` this "
        "rank's local gradient (full, flat), `m` and `v` this rank's moments for its shard. Pad to "
        "s·n elements with s = ⌈numel/n⌉ (rank r owns elements r·s … (r+1)·s − 1, as in "
        "`lectures/data_parallel/zero.py`); (1) reduce-scatter the gradient (`dist.reduce_scatter_single`) and divide by n (the average); (2) "
        "AdamW on your shard only — decoupled weight decay p ← p(1 − lr·wd), m ← β₁m + (1−β₁)g, "
        "v ← β₂v + (1−β₂)g², p ← p − lr·(m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε), β = (0.9, 0.999), ε = 1e-8; "
        "update `m`, `v` in place; (3) all-gather the shards (`dist.all_gather_single`) and return the full updated parameter "
        "(numel elements). The check runs two steps on 3 and on 2 ranks for 10, 2 and 31 float64 parameters "
        "against the course's `adamw_update` on the averaged gradient."),
    stub=(
        "def zero1_step(param, grad, m, v, step, lr, weight_decay):\n"
        "    \"\"\"One ZeRO-1 AdamW step; returns the full updated parameter (same on every rank).\"\"\"\n"
        "    n, rank = dist.get_world_size(), dist.get_rank()\n"
        "    raise NotImplementedError(\"hint: s = -(-numel // n); pad, reduce-scatter (/ n), AdamW \"\n"
        "                              \"on shard [rank*s, (rank+1)*s), all-gather, drop the padding\")\n"),
    harness=check_zero1, solution=zero1_step, ranks=(3, 2),
    wrong={"sums the gradients, forgets to average": mutant(zero1_step, ("    shard_g /= n\n", "")),
           "updates the next rank's shard": mutant(zero1_step, ("flat_p[rank * s:(rank + 1) * s]",
                                                                "flat_p[(rank + 1) % n * s:((rank + 1) % n + 1) * s]")),
           "AdamW without bias correction": mutant(zero1_step, ("v.sqrt() / math.sqrt(1 - b2 ** step)", "v.sqrt()"),
                                                   ("-lr / (1 - b1 ** step)", "-lr"))},
    hint="pad with zeros so every shard has s = ceil(numel / n) elements; the bias corrections "
         "divide m by 1 - 0.9**step and v by 1 - 0.999**step",
    sizes="float64, 10, 2 and 31 parameters, 2 steps, lr 0.1, weight decay 0.01")


# --- the indices a distributed sampler gives a rank -------------------------------------------

# 1 row on 3 ranks pads 2: more padding than data (the padding repeats the indices as often as needed)
SAMPLER_CASES = ((10, False, False), (10, True, False), (10, True, True), (2, True, False), (1, False, False),
                 (7, False, True))


def check_sampler(rank, world_size, fn):
    from torch.utils.data import DistributedSampler
    out = []
    for n_rows, shuffle, drop_last in SAMPLER_CASES:
        sampler = DistributedSampler(range(n_rows), num_replicas=world_size, rank=rank,
                                     shuffle=shuffle, seed=3, drop_last=drop_last)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            got = fn(rank, world_size, n_rows, epoch, shuffle=shuffle, drop_last=drop_last, seed=3)
            out.append((f"{n_rows} row{'' if n_rows == 1 else 's'}, epoch {epoch}, shuffle={shuffle}, drop_last={drop_last}",
                        list(sampler), list(got) if isinstance(got, (list, tuple, range)) else got))
    return out


def sampler_indices(rank, world_size, n, epoch, shuffle=True, drop_last=False, seed=0):
    """Reference: what torch.utils.data.DistributedSampler yields."""
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        indices = torch.randperm(n, generator=g).tolist()
    else:
        indices = list(range(n))
    if drop_last:
        per_rank = n // world_size
    else:
        per_rank = -(-n // world_size)
    total = per_rank * world_size
    if total > len(indices):
        indices += (indices * -(-(total - len(indices)) // len(indices)))[:total - len(indices)]
    indices = indices[:total]
    return indices[rank:total:world_size]


exercise(
    module=__name__, name="sampler_indices",
    title="the indices a distributed sampler gives a rank",
    statement=(
        "**Exercise: the indices of a distributed sampler.** Write `sampler_indices(rank, "
        "world_size, n, epoch, shuffle=True, drop_last=False, seed=0)` returning the list of "
        "dataset indices `torch.utils.data.DistributedSampler` hands this rank in `epoch`: with "
        "`shuffle`, a permutation `torch.randperm(n, generator=g)` where `g` is seeded with "
        "`seed + epoch` (that is what `set_epoch` is for), else 0 … n−1; every rank gets the same "
        "number of indices — ⌈n/world⌉ with padding by repeating indices from the start, or "
        "⌊n/world⌋ with `drop_last` (the tail is dropped); rank r takes every world-th index "
        "starting at r. The check asks for two epochs on 3 ranks of 10, 2, 1 and 7 rows, with "
        "and without shuffling and drop_last, against PyTorch's own sampler."),
    stub=(
        "def sampler_indices(rank, world_size, n, epoch, shuffle=True, drop_last=False, seed=0):\n"
        "    \"\"\"The indices DistributedSampler gives `rank` in `epoch`.\"\"\"\n"
        "    raise NotImplementedError(\"hint: permute with a generator seeded seed + epoch, pad (or drop) \"\n"
        "                              \"to a multiple of world_size, then take indices[rank::world_size]\")\n"),
    harness=check_sampler, solution=sampler_indices,
    wrong={"contiguous blocks instead of strided":
               mutant(sampler_indices, ("[rank:total:world_size]", "[rank * per_rank:(rank + 1) * per_rank]")),
           "no padding (uneven ranks)": mutant(sampler_indices, ("if total > len(indices):", "if False:")),
           "ignores the epoch": mutant(sampler_indices, ("seed + epoch", "seed"))},
    hint="with 2 rows (or 1) on 3 ranks the padding wraps around, as often as needed: every rank "
         "still gets one index",
    sizes="10, 2, 1, 7 rows; shuffle and drop_last on and off; epochs 0 and 1")
