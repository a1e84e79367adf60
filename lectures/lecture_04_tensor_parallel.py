"""Tensor and sequence parallelism: split every matrix of a layer across ranks

Each rank holds a slice of every weight matrix and computes its slice of every product; a few
collectives, written as autograd functions with their forward *and* backward, put the
slices back together. The GPT of lecture 01 is split this way, checked against one process, and
then split again with PyTorch's DTensor sharding annotations.
"""
import contextlib
import copy
import functools
import logging
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lectures.gpt import GPT, GPTConfig, batch, loss_fn
from lectures.memory import saved_bytes
# The building blocks, each in its module; the names are imported here too so that
# `from lectures.lecture_04_tensor_parallel import parallelize_gpt` keeps working.
from lectures.tensor_parallel import (ColumnParallelLinear, ColumnParallelLinearFunction,  # noqa: F401
                                      RowParallelLinear, SequenceParallelLayerNorm, SequenceParallelPositions,
                                      ShareKVHeads, TensorParallelAttention)
from lectures.tp_gpt import (check_splittable, dtensor_plan, full_parameters, gpt_plan,  # noqa: F401
                             parallelize_gpt, parallelize_gpt_dtensor, tp_group, tp_loss)
from lectures.tp_ops import (SEQ_DIM, AllGatherSequence, CopyToRegion, GatherFromRegion,  # noqa: F401
                             GatherFromSequence, ReduceFromRegion, ReduceScatterSequence, ScatterToRegion,
                             ScatterToSequence, _all_gather, _all_reduce, _reduce_scatter, _split,
                             all_gather_sequence, copy_to_region, gather_from_region, gather_from_sequence,
                             reduce_from_region, reduce_scatter_sequence, scatter_to_region,
                             scatter_to_sequence, shard_checks, traced)
from lectures.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
from util import device, figure, note, quiet, see, settings, span, spawn, table, timeline

# =========================================================================================
# 1. Rank functions: train the split GPT, and the single-process reference
# =========================================================================================

def reference_loss(logits, targets):
    """Lecture 01's loss_fn, but a float64 model keeps float64 (loss_fn computes in float32),
    so the tests can compare to ~1e-12."""
    if logits.dtype == torch.float64:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss_fn(logits, targets)


def train_reference(cfg, steps=3, batch_size=5, lr=3e-3, seed=0):
    """One process, lecture 01's GPT and loss, torch.optim.AdamW: what the split model must equal.
    Returns the losses, the first step's logits and gradients, the parameters after `steps`."""
    model = GPT(cfg).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = {"losses": []}
    for step in range(steps):
        tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, step, seed))
        logits = model(tokens)
        loss = reference_loss(logits, targets)
        loss.backward()
        if step == 0:
            out["logits"] = logits.detach().cpu()
            out["grads"] = {k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {k: p.detach().cpu().clone() for k, p in model.named_parameters()}
    return out


def train_tp(rank, world_size, cfg, steps=3, batch_size=5, lr=3e-3, seed=0, tp=None,
             sequence_parallel=False, sync_layernorm_grads=True):
    """The same run, split over a tensor-parallel group of `tp` ranks (default: all of them).
    With tp < world_size the other groups train the same model independently: every group must
    equal the reference, which checks that nothing leaked across groups.
    `sync_layernorm_grads=False` (with sequence parallelism) leaves out the all-reduce of the
    LayerNorms' partial gradients: the demo of what goes wrong without it."""
    group = tp_group(world_size, tp or world_size)
    plan = None
    if not sync_layernorm_grads:
        plan = gpt_plan(cfg, sequence_parallel)
        for name in ("blocks.*.ln1", "blocks.*.ln2", "ln_f"):
            plan[name] = functools.partial(SequenceParallelLayerNorm.from_full, sync_grads=False)
    model = parallelize_gpt(GPT(cfg).to(device()), group, sequence_parallel=sequence_parallel, plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = {"losses": []}
    for step in range(steps):
        tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, step, seed))
        local_logits = model(tokens)
        loss = vocab_parallel_cross_entropy(local_logits, targets, group)
        loss.backward()
        if step == 0:
            out["logits"] = _all_gather(local_logits.detach(), local_logits.dim() - 1, group).cpu()
            out["grads"] = {k: v.cpu() for k, v in full_parameters(model, grad=True).items()}
            out["local_shapes"] = {k: tuple(p.shape) for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {k: v.cpu() for k, v in full_parameters(model).items()}
    return out


def train_dtensor(rank, world_size, cfg, steps=3, batch_size=5, lr=3e-3, seed=0, sequence_parallel=False):
    """train_tp's run with parallelize_module instead of parallelize_gpt. The loss is computed
    inside loss_parallel() (cross_entropy on logits sharded on the vocabulary never gathers
    them), and backward must run inside it too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    mesh = init_device_mesh(device().type, (world_size,), mesh_dim_names=("tp",))
    model = parallelize_gpt_dtensor(GPT(cfg).to(device()), mesh, sequence_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t
    out = {"losses": []}
    for step in range(steps):
        tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, step, seed))
        logits = model(tokens)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        if step == 0:
            out["logits"] = full(logits.detach()).cpu()
            out["grads"] = {k: full(p.grad).detach().cpu() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(full(loss).item())
    out["params"] = {k: full(p.detach()).cpu() for k, p in model.named_parameters()}
    return out


# =========================================================================================
# 2. Rank functions of the demos
# =========================================================================================

def _collective_name(op):
    s = str(op).lower()
    for key, name in (("reduce_scatter", "reduce-scatter"), ("allgather", "all-gather"),
                      ("all_gather", "all-gather"), ("allreduce", "all-reduce"),
                      ("all_reduce", "all-reduce"), ("alltoall", "all-to-all"),
                      ("all_to_all", "all-to-all"), ("broadcast", "broadcast")):
        if key in s:
            return name
    return s


def count_collectives(fn):
    """(fn(), {collective: count}) as seen by torch's CommDebugMode, which intercepts both
    c10d calls (ours) and DTensor's functional collectives."""
    from torch.distributed.tensor.debug import CommDebugMode
    with warnings.catch_warnings():
        # CommDebugMode tracks modules with a full backward hook on each, and PyTorch warns when
        # such a hook fires on a module none of whose inputs require a gradient: the GPT and its
        # token embedding, whose input is token ids. Harmless (the counts are unaffected).
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        with CommDebugMode() as mode:
            result = fn()
    counts = {}
    for op, c in mode.get_comm_counts().items():
        name = _collective_name(op)
        counts[name] = counts.get(name, 0) + c
    return result, counts


def _seeded(seed):
    torch.manual_seed(seed)   # the same on every rank: the demos' full tensors agree
    return seed


def linear_demo(rank, world_size, b=3, s=5, h=8, h_out=12):
    """A column-parallel then a row-parallel layer against the unsplit nn.Linear pair: what each
    rank holds, and the largest difference in every output and gradient."""
    group, diff = dist.group.WORLD, lambda a, c: (a - c).abs().max().item()
    _seeded(0)
    a, c = nn.Linear(h, h_out).to(device()), nn.Linear(h_out, h).to(device())
    x = torch.randn(b, s, h, device=device())
    G = torch.randn(b, s, h, device=device())
    xr = x.clone().requires_grad_(True)
    ref = c(a(xr))
    (ref * G).sum().backward()
    col = ColumnParallelLinear.from_full(a, group)
    row = RowParallelLinear.from_full(c, group, input_is_parallel=True)
    xt = x.clone().requires_grad_(True)
    mid = col(xt)
    y = row(mid)
    (y * G).sum().backward()
    return {
        "shapes": {"x": tuple(x.shape), "column weight": tuple(col.weight.shape),
                   "column output (kept split)": tuple(mid.shape), "row weight": tuple(row.weight.shape),
                   "row output (summed)": tuple(y.shape)},
        "diffs": {"output": diff(y, ref), "input gradient": diff(xt.grad, xr.grad),
                  "column weight gradient": diff(col.full_tensors(grad=True)["weight"], a.weight.grad),
                  "row weight gradient": diff(row.full_tensors(grad=True)["weight"], c.weight.grad),
                  "biases' gradients": max(diff(col.full_tensors(grad=True)["bias"], a.bias.grad),
                                           diff(row.bias.grad, c.bias.grad))},
    }


def mlp_comms(rank, world_size, b=4, s=8, h=16, sequence_parallel=False):
    """The Megatron MLP, ours and DTensor's: collectives counted forward and backward, and the
    two outputs compared."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from util.measure import bytes_sent
    group, sp = dist.group.WORLD, sequence_parallel
    _seeded(1)
    full = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).to(device())
    x = torch.randn(b, s, h, device=device())
    G = torch.randn(b, s, h, device=device())
    xin = _split(x, 1, group) if sp else x
    Gin = _split(G, 1, group) if sp else G
    ours = nn.Sequential(ColumnParallelLinear.from_full(full[0], group, sequence_parallel=sp), nn.GELU(),
                         RowParallelLinear.from_full(full[2], group, sequence_parallel=sp))
    mesh = init_device_mesh(device().type, (world_size,))
    plan = ({"0": ColwiseParallel(input_layouts=Shard(1)), "2": RowwiseParallel(output_layouts=Shard(1))}
            if sp else {"0": ColwiseParallel(), "2": RowwiseParallel()})
    theirs = parallelize_module(copy.deepcopy(full), mesh, plan)
    out = {}
    checks = shard_checks(False)   # count what Megatron's schedule needs, not the safety check
    checks.__enter__()
    for name, model in (("ours", ours), ("DTensor", theirs)):
        xx = xin.clone().requires_grad_(True)
        for _ in range(2):   # warm-up, so the bytes below are the steady state
            (model(xx) * Gin).sum().backward()
        with bytes_sent() as sent:
            y, fwd = count_collectives(lambda: model(xx))
            _, bwd = count_collectives(lambda: (y * Gin).sum().backward())
        out[name] = {"forward": fwd, "backward": bwd, "y": y.detach(), "bytes": sent.bytes}
    checks.__exit__(None, None, None)
    out["max |ours - DTensor|"] = (out["ours"]["y"] - out["DTensor"]["y"]).abs().max().item()
    return out


def attention_cases(rank, world_size, cases):
    """One training step of a one-layer GPT per (heads, KV heads) case: the logits and gradients
    (for comparing with one process) and what each rank keeps of Q and K."""
    out = []
    for cfg in cases:
        r = train_tp(rank, world_size, cfg, steps=1, batch_size=3)
        model = parallelize_gpt(GPT(cfg), dist.group.WORLD)
        attn = model.blocks[0].attn
        out.append({"logits": r["logits"], "grads": r["grads"],
                    "q heads": attn.q_heads_held, "kv heads": attn.kv_held, "kv kind": attn.kv_layout,
                    "qkv weight": tuple(attn.weight.shape)})
    return out


def refuse_split(rank, world_size, cfg):
    """parallelize_gpt's message for a model it cannot split."""
    try:
        parallelize_gpt(GPT(cfg), dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return None


def vocab_demo(rank, world_size, vocab=4096, b=4, s=32, h=32):
    """Vocabulary-parallel embedding, LM head and cross-entropy vs the unsplit ones: the loss, and
    the largest tensor this rank holds (saved for backward, or the logits) vs the full logits."""
    group = dist.group.WORLD
    _seeded(2)
    emb, head = nn.Embedding(vocab, h).to(device()), nn.Linear(h, vocab, bias=False).to(device())
    tokens = torch.randint(vocab, (b, s), device=device())
    targets = torch.randint(vocab, (b, s), device=device())
    ref = F.cross_entropy(head(emb(tokens)).flatten(0, 1), targets.flatten())
    ref.backward()
    pemb = VocabParallelEmbedding.from_full(emb, group)
    phead = ColumnParallelLinear.from_full(head, group)
    largest = [0]

    def pack(t):
        largest[0] = max(largest[0], t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = phead(pemb(tokens))
        loss = vocab_parallel_cross_entropy(logits, targets, group)
    loss.backward()
    largest[0] = max(largest[0], logits.numel() * logits.element_size())
    return {"loss": loss.item(), "ref": ref.item(),
            "grad diff": (pemb.full_tensors(grad=True)["weight"] - emb.weight.grad).abs().max().item(),
            "largest": largest[0], "full logits": b * s * vocab * logits.element_size(),
            "local logits": tuple(logits.shape)}


def _block_input(cfg, b, group, sp):
    _seeded(3)
    x = torch.randn(b, cfg.seq_len, cfg.d_model, device=device())
    G = torch.randn(b, cfg.seq_len, cfg.d_model, device=device())
    return (_split(x, 1, group), _split(G, 1, group)) if sp else (x, G)


def sp_traffic(rank, world_size, cfg, b=4):
    """One block's forward and backward with sequence parallelism off and on: the collectives
    (CommDebugMode) and the bytes this rank wrote (median of 5)."""
    with shard_checks(False):   # count what Megatron's schedule needs, not the safety check
        return _sp_traffic(cfg, b)


def _sp_traffic(cfg, b):
    import statistics
    from util.measure import bytes_sent
    group, out = dist.group.WORLD, {}
    for sp in (False, True):
        block = parallelize_gpt(GPT(cfg).to(device()), group, sequence_parallel=sp).blocks[0]
        x, G = _block_input(cfg, b, group, sp)
        x.requires_grad_(True)
        for _ in range(2):
            (block(x) * G).sum().backward()
        sizes = []
        for _ in range(5):
            with bytes_sent() as sent:
                (block(x) * G).sum().backward()
            sizes.append(sent.bytes)
        y, fwd = count_collectives(lambda: block(x))
        _, bwd = count_collectives(lambda: (y * G).sum().backward())
        out[sp] = {"forward": fwd, "backward": bwd, "bytes": statistics.median(sizes)}
    # The collectives alone, on one (b, s, h) activation: all-reduce vs reduce-scatter + all-gather
    x = torch.randn(b, cfg.seq_len, cfg.d_model, device=device())
    prims = {"all-reduce": lambda: _all_reduce(x, group),
             "reduce-scatter": lambda: _reduce_scatter(x, 1, group),
             "all-gather": lambda: _all_gather(_split(x, 1, group), 1, group)}
    out["activation bytes"] = x.numel() * x.element_size()
    for name, fn in prims.items():
        fn()
        sizes = []
        for _ in range(5):
            with bytes_sent() as sent:
                fn()
            sizes.append(sent.bytes)
        out[name] = statistics.median(sizes)
    return out


def activation_formula(cfg, b, t, sp):
    """Bytes one block saves for backward per rank (float32), in units of b·s·h: 4 + 12/t under
    tensor parallelism, 16/t with sequence parallelism (every term divided by t, as in Korthikanti
    et al. 2022, Table 2; no dropout, no s×s attention matrix here), plus the per-token statistics: 2 LayerNorms × (mean, rstd) per
    position (sliced by SP) and the attention's log-sum-exp per head and position (split by heads)."""
    unit = b * cfg.seq_len * cfg.d_model * 4
    stats = 4 * (4 * b * cfg.seq_len / (t if sp else 1) + b * cfg.n_heads * cfg.seq_len / t)
    return unit * (16 / t if sp else 4 + 12 / t) + stats


def activation_memory(rank, world_size, cfg, b=4):
    """Activation bytes of one block on this rank, sequence parallelism off and on."""
    group, out = dist.group.WORLD, {}
    for sp in (False, True):
        block = parallelize_gpt(GPT(cfg).to(device()), group, sequence_parallel=sp).blocks[0]
        x, _ = _block_input(cfg, b, group, sp)
        x.requires_grad_(True)
        out[sp] = saved_bytes(lambda: block(x), exclude=block.parameters())[1]
    return out


def traced_block(rank, world_size, cfg, b=8, sequence_parallel=False, steps=2):
    """A per-rank timeline of one block's forward and backward: compute spans around the
    collectives, which record their own spans (traced())."""
    group = dist.group.WORLD
    block = parallelize_gpt(GPT(cfg).to(device()), group, sequence_parallel=sequence_parallel).blocks[0]
    x, G = _block_input(cfg, b, group, sequence_parallel)
    x.requires_grad_(True)
    with quiet():
        (block(x) * G).sum().backward()   # warm-up
    with traced(), shard_checks(False):
        for _ in range(steps):
            with span("forward"):
                y = block(x)
            with span("backward"):
                (y * G).sum().backward()


def _make_step(model, opt, cfg, batch_size, loss):
    tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, 0))

    def step():
        loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def time_steps(rank, world_size, cfg, batch_size=16, kinds=("ours",), repeats=7):
    """Median training-step times (util.measure) of the kinds asked for, on the same ranks, with
    their repeats interleaved so that machine noise hits them alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from util.measure import measure_side_by_side
    steps = {}
    for kind in kinds:
        if kind == "one process":
            model = GPT(cfg).to(device())
            steps[kind] = _make_step(model, torch.optim.AdamW(model.parameters()), cfg, batch_size,
                                     lambda m, t, y: reference_loss(m(t), y))
        elif kind.startswith("ours"):
            model = parallelize_gpt(GPT(cfg).to(device()), dist.group.WORLD, sequence_parallel="SP" in kind)
            steps[kind] = _make_step(model, torch.optim.AdamW(model.parameters()), cfg, batch_size, tp_loss)
        else:
            mesh = init_device_mesh(device().type, (world_size,))
            model = parallelize_gpt_dtensor(GPT(cfg).to(device()), mesh, "SP" in kind)

            def dt_step(model=model, opt=torch.optim.AdamW(model.parameters())):
                from torch.distributed.tensor.parallel import loss_parallel
                tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, 0))
                logits = model(tokens)
                with loss_parallel():
                    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            steps[kind] = dt_step
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one core per rank, whatever the number of ranks
    try:
        with quiet(), shard_checks(False):
            return measure_side_by_side(steps, warmup=2, repeats=repeats)
    finally:
        torch.set_num_threads(threads)


def redistribute_table(rank, world_size):
    """DTensor layouts on a 1-D mesh: for each (from, to), the collective CommDebugMode saw, the
    local shape, and whether the values are still the full tensor's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    mesh = init_device_mesh(device().type, (world_size,), mesh_dim_names=("tp",))
    full = torch.arange(4 * world_size * 2 * world_size, dtype=torch.float32,
                        device=device()).reshape(4 * world_size, 2 * world_size)
    rows = []
    cases = [(Shard(0), Replicate()), (Shard(0), Shard(1)), (Replicate(), Shard(0)),
             (Partial(), Replicate()), (Partial(), Shard(0))]
    with _quiet_log("torch.distributed.tensor._collective_utils"):
        # Shard(0) -> Shard(1) is an all-to-all on NCCL. gloo runs all_to_all_single too, but
        # DTensor's CPU path chooses an all-gather and a slice instead and logs a warning on every
        # rank. The table shows that choice and the note under it explains it, so the warning is
        # kept out of the build's output.
        for src, dst in cases:
            if isinstance(src, Partial):   # each rank holds full / N: the sum over ranks is `full`
                dt = DTensor.from_local(full / world_size, mesh, [src], run_check=False)
            else:
                dt = distribute_tensor(full, mesh, [src])
            moved, counts = count_collectives(lambda: dt.redistribute(mesh, [dst]))
            ok = torch.allclose(moved.full_tensor(), full)
            rows.append([str(src), str(dst), ", ".join(f"{k} ×{v}" for k, v in counts.items()) or "none",
                         str(tuple(dt.to_local().shape)), str(tuple(moved.to_local().shape)), ok])
    return rows


@contextlib.contextmanager
def _quiet_log(name):
    """Inside, the logger `name` prints only errors."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def compare_with_dtensor(rank, world_size, cfg, batch_size=4, steps=3, sequence_parallel=False):
    """Ours and DTensor's parallelize_module trained side by side from the same GPT; also the
    collectives of one step of each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    out = {"ours": train_tp(rank, world_size, cfg, steps, batch_size, sequence_parallel=sequence_parallel),
           "DTensor": train_dtensor(rank, world_size, cfg, steps, batch_size, sequence_parallel=sequence_parallel)}
    from torch.distributed.tensor import DTensor, Partial
    tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, 0))
    model = parallelize_gpt(GPT(cfg).to(device()), dist.group.WORLD, sequence_parallel=sequence_parallel)
    opt = torch.optim.AdamW(model.parameters())
    mesh = init_device_mesh(device().type, (world_size,))
    dmodel = parallelize_gpt_dtensor(GPT(cfg).to(device()), mesh, sequence_parallel)
    dopt = torch.optim.AdamW(dmodel.parameters())

    def dbackward():
        logits = dmodel(tokens)
        with loss_parallel():
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    # A whole step, forward + backward and the optimizer step counted apart (the second step:
    # AdamW's first creates its state)
    with shard_checks(False):
        for _ in range(2):
            _, ours_fb = count_collectives(lambda: tp_loss(model, tokens, targets).backward())
            _, ours_opt = count_collectives(opt.step)
            opt.zero_grad()
            _, dt_fb = count_collectives(dbackward)
            out["DTensor partial grads"] = sorted(k for k, p in dmodel.named_parameters()
                                                  if isinstance(p.grad, DTensor) and any(isinstance(pl, Partial) for pl in p.grad.placements))
            out["DTensor grad placements"] = {k: repr(p.grad.placements[0]) for k, p in dmodel.named_parameters()
                                              if isinstance(p.grad, DTensor)}
            _, dt_opt = count_collectives(dopt.step)
            dopt.zero_grad()
    out["ours counts"], out["ours optimizer counts"] = ours_fb, ours_opt
    out["DTensor counts"], out["DTensor optimizer counts"] = dt_fb, dt_opt
    return out


# =========================================================================================
# 3. The lecture
# =========================================================================================

def demo_cfg():
    """Lecture 01's GPT as it trains there (quick: a shorter sequence)."""
    return GPTConfig(seq_len=16) if settings.quick else GPTConfig()


def tp_sizes():
    """The tensor-parallel sizes the demos show: 2 and 4 (quick: 2; the tests cover 4)."""
    return (2,) if settings.quick else (2, 4)


def max_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def fmt_counts(counts):
    return ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items())) or "none"


def intro():
    note("""
        # Tensor and sequence parallelism
        Data parallelism (lecture 03) copies the model and splits the batch; it stops helping when
        one layer no longer fits or is too slow on one device. Tensor parallelism splits the
        layer itself: every weight matrix is cut into slices, one per rank, and each rank
        computes its slice of every product. Megatron-LM (Shoeybi et al. 2019) showed that for a
        transformer the cuts can be placed so that a whole MLP or attention block needs a single
        all-reduce forward and a single one backward. Sequence parallelism (Korthikanti et al.
        2022) then splits what is left over (LayerNorms, residual stream) along the sequence.

        Every building block below is a few lines of PyTorch with its backward written out; each
        is checked against one process on real ranks (gloo on CPU, NCCL on GPUs), and the same
        split is then expressed with PyTorch's DTensor sharding annotations.

        **What you will learn:** how a weight matrix is cut by columns or by rows and which
        collective joins the pieces; Megatron's conjugate operators f and g; a tensor-parallel
        MLP, attention (with grouped-query K/V heads) and vocabulary; sequence parallelism and
        the activation memory it saves; why tensor parallelism's communication sits on the
        critical path. **What you need:** lecture 01's GPT (blocks, heads, LayerNorm) and
        lecture 02's collectives (all-reduce = reduce-scatter + all-gather); in PyTorch,
        `torch.autograd.Function` (a forward and a hand-written backward) and `nn.Linear`.
    """)
    see("https://arxiv.org/abs/1909.08053", "Shoeybi et al. 2019, Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism")
    see("https://arxiv.org/abs/2205.05198", "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models")


def conjugate_operators():
    note("""
        ## The conjugate operators f and g
        A tensor-parallel region starts where a replicated tensor is used by split weights and
        ends where split partial results are summed. Two operators mark the borders, each the
        other's transpose: **f** is the identity forward (every rank already has the input) and an
        all-reduce backward (each rank's slice of the weights contributes part of the input's
        gradient); **g** is an all-reduce forward (the partial sums are added) and the identity
        backward (the summed output's gradient is already on every rank). Each is an
        `autograd.Function` that takes its process group explicitly and never changes its input.
    """)
    see(CopyToRegion)
    see(ReduceFromRegion)
    note("Gathering or splitting the last dimension are a conjugate pair too, and so are the "
         "sequence-parallel all-gather and reduce-scatter (further down):")
    see(GatherFromRegion)
    see(ScatterToRegion)


def column_and_row():
    note("""
        ## Column- and row-parallel linear
        Write a linear layer as $Y = XA$ with $A$ of shape $h_{in} \\times h_{out}$. Split $A$ by
        **columns**, $A = [A_1, \\dots, A_N]$: rank $r$ computes $Y_r = XA_r$, its slice of the output
        features, and nothing needs adding (gather the slices only if someone needs all of $Y$).
        Split $A$ by **rows** and $X$ by columns to match: rank $r$ computes $X_r A_r$, a full-size
        *partial* result, and $Y = \\sum_r X_r A_r$ takes an all-reduce. A column-parallel layer
        followed by a row-parallel one needs no communication in between: the split output of the
        first is exactly the split input of the second. (`nn.Linear` stores $A^T$, so a column
        slice of $A$ is a slice of the weight's rows.)
    """)
    see(ColumnParallelLinear)
    see(RowParallelLinear)
    ref_shapes = None
    for n in tp_sizes():
        run = spawn(linear_demo, n, name=f"column then row-parallel linear, {n} ranks")
        r = run.returns[0]
        if ref_shapes is None:
            ref_shapes = {"x": r["shapes"]["x"]}
        table([[k, str(v)] for k, v in r["shapes"].items()] + [[f"max |ours − one process|: {k}", v] for k, v in r["diffs"].items()],
              header=["", f"{n} ranks (rank 0)"],
              caption=f"what each of {n} ranks holds, and the largest difference from nn.Linear in one process")
    figure(cut_figure(n, r["shapes"]), caption=f"the two cuts of a weight matrix over {n} ranks, with the shapes "
           "rank 0 held in the run above (math orientation: Y = XA)")
    note("""
        The differences are float32 rounding (the sums are added in another order). The input
        gradient is the interesting one: each rank's column slice contributes $dY_r A_r^T$, and
        f's all-reduce adds them.
    """)


def cut_figure(n, shapes):
    """Column- and row-parallel cuts of A (h_in x h_out) and B (h_out x h_in), coloured by rank,
    labelled with the local shapes a rank held (nn.Linear stores the transpose)."""
    import matplotlib.pyplot as plt
    colours = [plt.cm.tab10(i) for i in range(n)]
    h_out, h_in = shapes["column weight"][0] * n, shapes["column weight"][1]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for ax, kind in zip(axes, ("column", "row")):
        rows, cols = (h_in, h_out) if kind == "column" else (h_out, h_in)
        for r in range(n):
            if kind == "column":   # A = [A_1 ... A_n]: rank r owns a block of columns
                rect = (r * cols / n, 0, cols / n, rows)
            else:                  # B = [B_1; ...; B_n]: rank r owns a block of rows
                rect = (0, rows - (r + 1) * rows / n, cols, rows / n)
            ax.add_patch(plt.Rectangle(rect[:2], rect[2], rect[3], color=colours[r], alpha=0.75, ec="black"))
            ax.text(rect[0] + rect[2] / 2, rect[1] + rect[3] / 2, f"rank {r}", ha="center", va="center",
                    fontsize=10, rotation=90 if kind == "column" else 0)
        ax.set_xlim(0, cols)
        ax.set_ylim(0, rows)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        local = shapes["column weight"][::-1] if kind == "column" else shapes["row weight"][::-1]
        name = "A" if kind == "column" else "B"
        ax.set_title(f"{kind}-parallel: {name} is {rows}×{cols},\nrank 0 holds {local[0]}×{local[1]}", fontsize=10)
        ax.set_xlabel("output features" if kind == "column" else "output features (whole)", fontsize=10)
        ax.set_ylabel("input features (whole)" if kind == "column" else "input features", fontsize=10)
    axes[0].text(0.5, -0.3, r"$Y_r = X A_r$: a slice of $Y$, no collective", transform=axes[0].transAxes,
                 ha="center", fontsize=10)
    axes[1].text(0.5, -0.3, r"$Z = \sum_r Y_r B_r$: partial sums, all-reduce", transform=axes[1].transAxes,
                 ha="center", fontsize=10)
    fig.tight_layout()
    return fig


def fg_figure(n, counts):
    """The Megatron MLP on n ranks between f and g, with the collective each runs forward and
    backward (the counts measured by CommDebugMode in the demo)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 1.8 + 0.9 * n))
    ax.set_xlim(0, 10)
    ax.set_ylim(-1.5, n - 0.4)
    ax.set_axis_off()
    box = lambda x, y, text, c: (ax.add_patch(plt.Rectangle((x - 0.55, y - 0.25), 1.1, 0.5, color=c, alpha=0.8)),
                                 ax.text(x, y, text, ha="center", va="center", fontsize=10))
    mid = (n - 1) / 2
    box(0.6, mid, "X\n(whole)", "#cccccc")
    box(2.2, mid, "f", "#8fbc8f")
    for r in range(n):
        y = n - 1 - r
        ax.annotate("", xy=(3.45, y), xytext=(2.75, mid), arrowprops=dict(arrowstyle="->"))
        box(4.0, y, f"X·A_{r}", plt.cm.tab10(r))
        box(5.6, y, "GELU", plt.cm.tab10(r))
        box(7.2, y, f"·B_{r}", plt.cm.tab10(r))
        ax.annotate("", xy=(5.05, y), xytext=(4.55, y), arrowprops=dict(arrowstyle="->"))
        ax.annotate("", xy=(6.65, y), xytext=(6.15, y), arrowprops=dict(arrowstyle="->"))
        ax.annotate("", xy=(8.25, mid), xytext=(7.75, y), arrowprops=dict(arrowstyle="->"))
        ax.text(9.9, y, f"rank {r}", ha="right", va="center", fontsize=9, color="gray")
    box(8.8, mid, "g", "#8fbc8f")
    ax.annotate("", xy=(1.65, mid), xytext=(1.15, mid), arrowprops=dict(arrowstyle="->"))
    fwd = ", ".join(f"{k} ×{v}" for k, v in counts["forward"].items()) or "none"
    bwd = ", ".join(f"{k} ×{v}" for k, v in counts["backward"].items()) or "none"
    ax.text(2.2, -0.55, "f: identity forward,\nall-reduce backward", ha="center", va="center", fontsize=10)
    ax.text(8.8, -0.55, "g: all-reduce forward,\nidentity backward", ha="center", va="center", fontsize=10)
    ax.text(5.5, -1.25, f"measured: forward {fwd}; backward {bwd}", ha="center", va="center", fontsize=10)
    return fig


def megatron_mlp():
    note("""
        ## The Megatron MLP: one all-reduce each way
        $\\mathrm{MLP}(X) = \\mathrm{GELU}(XA)B$ with $A$ column-parallel and $B$ row-parallel: the
        GELU is elementwise, so it runs on each rank's slice. Forward: f (nothing), two local
        matmuls, g (one all-reduce). Backward: g (nothing), two local matmuls, f (one all-reduce).
        Splitting $A$ by rows instead would need an all-reduce *before* the GELU, which does not
        commute with the sum. Counted below with PyTorch's `CommDebugMode`, for ours and for the
        same MLP split by DTensor's `ColwiseParallel`/`RowwiseParallel`:
    """)
    n = 2 if settings.quick or settings.world_size not in (2, 4) else settings.world_size
    rows = []
    for sp in (False, True):
        r = spawn(mlp_comms, n, sequence_parallel=sp,
                  name=f"Megatron MLP collectives, {'SP' if sp else 'no SP'}, {n} ranks").returns[0]
        for who in ("ours", "DTensor"):
            rows.append(["with SP" if sp else "without SP", who, fmt_counts(r[who]["forward"]),
                         fmt_counts(r[who]["backward"]), r[who]["bytes"]])
        rows.append(["with SP" if sp else "without SP", "max |ours − DTensor| (output)", r["max |ours - DTensor|"], "", ""])
        if not sp:
            fg_counts = r["ours"]
    figure(fg_figure(n, fg_counts), caption=f"the Megatron MLP on {n} ranks: f where the whole input enters, g "
           "where the partial sums leave; the counts are the ones in the table below")
    table(rows, header=["", "", "forward", "backward", "bytes this rank wrote (fwd + bwd)"],
          caption=f"collectives in one MLP forward and backward, {n} ranks (CommDebugMode; bytes from /proc/self/io)")
    note("""
        One all-reduce forward, one backward, for both. With sequence parallelism (below) each
        all-reduce becomes an all-gather on the way in and a reduce-scatter on the way out; ours
        also all-gathers the input a second time in backward, because it keeps only its slice of
        the input for the weight gradient (Megatron-LM does the same to save memory); DTensor keeps
        the gathered input instead. Our column-parallel backward also starts the input
        gradient's all-reduce before it computes the weight gradient, so the two overlap:
    """)
    see(ColumnParallelLinearFunction)


def attention_heads():
    note("""
        ## Attention: whole heads per rank
        Heads are independent until the output projection, so Q, K and V are column-parallel
        (each rank keeps $a/t$ whole heads), attention runs locally on those heads, and the output
        projection is row-parallel: again one all-reduce each way. This needs $t \\mid a$. As in
        Megatron-LM, Q, K and V are **one** column-parallel matmul: this rank's weight is
        $[W_q; W_k; W_v]$ for its heads, one f on the input, and in backward one input-gradient
        all-reduce that overlaps the Q/K/V weight gradient (three layers behind one shared f would
        leave that all-reduce blocking, after all three).

        Grouped-query attention has fewer K/V heads, $k < a$. When $t \\mid k$ they are split like
        the queries. When $k \\mid t$, each rank's $a/t$ query heads all read the same K/V head, so
        the rank holds that one head: each K/V head is replicated on the $t/k$ ranks that read it
        (vLLM's layout), and its gradient is summed over them. Other combinations would give a
        rank query heads from unequal groups, and are refused.
    """)
    see(TensorParallelAttention)
    see(ShareKVHeads)
    base = GPTConfig(n_layers=1, seq_len=8, d_model=32)
    overrides = [dict(n_heads=4), dict(n_heads=8, n_kv_heads=2), dict(n_heads=4, n_kv_heads=1)]
    rows, layouts = [], {}
    for n in tp_sizes():
        cfgs = [dataclasses_replace(base, **o) for o in overrides]
        run = spawn(attention_cases, n, cases=cfgs, name=f"attention heads split, {n} ranks")
        for i, cfg in enumerate(cfgs):
            ref = train_reference(cfg, steps=1, batch_size=3)
            g = run.returns[0][i]
            layouts[(n, cfg.n_heads, cfg.kv_heads)] = [r[i] for r in run.returns]
            d, h, k = cfg.head_dim, cfg.d_model, cfg.kv_heads
            held = 2 * len(g["kv heads"]) * d * h
            traffic = 0 if g["kv kind"] == "split" else 2 * k * d * (h + 1) * 4
            rows.append([n, cfg.n_heads, k, len(g["q heads"]), len(g["kv heads"]), g["kv kind"],
                         str(g["qkv weight"]), f"{held} of {2 * k * d * h}", traffic,
                         (g["logits"] - ref["logits"]).abs().max().item(), max_diff(g["grads"], ref["grads"])])
    table(rows, header=["tp", "heads", "K/V heads", "Q heads per rank", "K/V heads per rank", "K/V layout",
                        "fused Q/K/V weight per rank", "K/V weight elements per rank (of the whole)",
                        "extra all-reduce in backward (buffer bytes)", "max |Δ logits|", "max |Δ gradient|"],
          caption="one step of a one-layer GPT against one process; float32")
    note("""
        A replicated K/V head costs memory (each reader holds it: $2dh$ elements per rank instead of
        $2kdh/t$) and one all-reduce per layer in backward, of a buffer with a slot per K/V head
        (weights and biases), to sum each head's gradient over its readers. With one K/V head
        (multi-query attention) that buffer is exactly the head's gradient; with more, an
        all-reduce over only the $t/k$ readers of each head (a subgroup) would move $k\\times$
        fewer bytes.
    """)
    figure(gqa_figure(layouts), caption="what each rank holds: its query heads (blue) and the K/V heads "
           "they read (orange); an orange head on several ranks is replicated (taken from the split layers)")
    n = tp_sizes()[-1]
    bad = dataclasses_replace(base, n_heads=n - 1, d_model=8 * (n - 1))
    msg = spawn(refuse_split, n, cfg=bad, name=f"attention heads: tp={n} does not divide {n - 1} head(s)").returns[0]
    note(f"With {n - 1} head(s) and {n} ranks there is no way to give each rank whole heads, and "
         f"`parallelize_gpt` says so: *{msg}*")


def gqa_figure(layouts):
    """One panel row per (tp, heads, K/V heads) case: a box per rank with its query and K/V heads."""
    import matplotlib.pyplot as plt
    cases = list(layouts)
    fig, axes = plt.subplots(len(cases), 1, figsize=(8, 1.05 * len(cases) + 0.3), squeeze=False)
    for ax, key in zip(axes[:, 0], cases):
        n, a, k = key
        width = 1 / n
        for r, g in enumerate(layouts[key]):
            x0 = r * width
            ax.add_patch(plt.Rectangle((x0 + 0.005, 0.02), width - 0.01, 0.96, fill=False, lw=1.2))
            ax.text(x0 + width / 2, 0.86, f"rank {r}", ha="center", va="center", fontsize=10)
            for j, q in enumerate(g["q heads"]):
                span = (width - 0.02) / len(g["q heads"])
                ax.add_patch(plt.Rectangle((x0 + 0.01 + j * span, 0.42), span * 0.9, 0.28, color="#4c72b0"))
                ax.text(x0 + 0.01 + (j + 0.45) * span, 0.56, f"q{q}", ha="center", va="center", color="white", fontsize=9)
            for j, kv in enumerate(g["kv heads"]):
                span = (width - 0.02) / len(g["kv heads"])
                ax.add_patch(plt.Rectangle((x0 + 0.01 + j * span, 0.06), span * 0.9, 0.28, color="#dd8452"))
                ax.text(x0 + 0.01 + (j + 0.45) * span, 0.2, f"kv{kv}", ha="center", va="center", color="white", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_axis_off()
        ax.set_title(f"tp={n}, {a} query heads, {k} K/V heads: K/V {layouts[key][0]['kv kind']}", fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def dataclasses_replace(cfg, **changes):
    import dataclasses
    return dataclasses.replace(cfg, **changes)


def vocab_parallel():
    note("""
        ## Vocabulary-parallel embedding and cross-entropy
        The embedding table and the LM head are $v \\times h$, the largest matrices of a small
        model. Split the vocabulary: rank $r$ owns token ids $[rv/t, (r+1)v/t)$. The embedding
        looks up the tokens it owns, writes zeros for the rest, and g sums the ranks' rows. The
        LM head is column-parallel and keeps its slice of the logits; the loss is then computed
        from the slices: the max, the sum of exponentials and the target's logit are each
        all-reduced (one number per token each), and the $(b, s, v)$ logits never exist anywhere.
    """)
    see(VocabParallelEmbedding)
    see(vocab_parallel_cross_entropy)
    vocab = 1024 if settings.quick else 8192
    rows = []
    for n in tp_sizes():
        r = spawn(vocab_demo, n, vocab=vocab, name=f"vocab-parallel embedding and loss, {n} ranks").returns[0]
        rows.append([n, r["loss"], r["ref"], abs(r["loss"] - r["ref"]), r["grad diff"], str(r["local logits"]),
                     r["largest"], r["full logits"]])
    table(rows, header=["tp", "loss", "one process", "|Δ loss|", "max |Δ embedding grad|", "local logits",
                        "largest tensor a rank holds (bytes)", "full logits (bytes)"],
          caption=f"vocabulary {vocab}, batch 4 × 32 tokens, h = 32")
    note("The largest tensor a rank holds shrinks with tp: the logits it keeps are 1/tp of the full ones.")


def training():
    cfg, steps = demo_cfg(), (10 if settings.quick else 60)
    note(f"""
        ## A tensor-parallel GPT trains on lecture 01's task
        `parallelize_gpt` applies a plan, in the spirit of torchtitan: the model file stays plain
        PyTorch, and a dict from module names to how each is split is applied afterwards. It
        returns a copy, so the unsplit model stays available for comparison. Every module that
        owns parameters must be in the plan, or it refuses. Below, lecture 01's GPT
        ({cfg.n_layers} layers, h = {cfg.d_model}, {cfg.n_heads} heads, sequence {cfg.seq_len})
        trains for {steps} AdamW steps (batch 16) split over {" and ".join(map(str, tp_sizes()))} ranks, beside one process.
    """)
    see(gpt_plan)
    see(parallelize_gpt)
    ref = train_reference(cfg, steps=steps, batch_size=16)
    runs = {n: spawn(train_tp, n, cfg=cfg, steps=steps, batch_size=16, name=f"TP GPT trains, tp={n}").returns
            for n in tp_sizes()}
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(range(1, steps + 1), ref["losses"], lw=4, alpha=0.35, color="k", label="one process")
    for n, style in zip(tp_sizes(), ("-", "--")):
        ax.plot(range(1, steps + 1), runs[n][0]["losses"], style, label=f"tp={n}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    figure(fig, caption="training loss, tensor-parallel on top of one process")
    rows = []
    for n, r in runs.items():
        spread = max(max_diff(x["params"], r[0]["params"]) for x in r)
        rows.append([n, r[0]["losses"][-1], ref["losses"][-1], max_diff(r[0]["params"], ref["params"]), spread])
    table(rows, header=["tp", "final loss", "one process", "max |Δ parameter| vs one process",
                        "max |Δ| between ranks' gathered parameters"],
          caption=f"after {steps} steps (float32: the differences are rounding, amplified a little by Adam)")


def sequence_parallelism():
    cfg = demo_cfg()
    sp_collectives(cfg)             # the same bytes as TP, in other collectives
    sp_activation_memory(cfg)       # what it saves: the activations TP left whole
    sp_layernorm_gradients(cfg)     # what it costs: the replicated weights' gradients are partial


def sp_collectives(cfg):
    note("""
        ## Sequence parallelism
        Tensor parallelism leaves the LayerNorms, the residual adds (and dropout) replicated: every
        rank computes them on the whole $(b, s, h)$ activation and keeps the whole thing for
        backward. Korthikanti et al. split those along the sequence instead: each rank owns $s/t$
        positions there. Entering a tensor-parallel region then takes an **all-gather** along the
        sequence (backward: reduce-scatter), and leaving it a **reduce-scatter** (backward:
        all-gather). A ring all-reduce *is* a reduce-scatter followed by an all-gather, so the
        bytes are the same.
    """)
    sp_split_figure(cfg, t=2, b=4)
    see(AllGatherSequence)
    see(ReduceScatterSequence)
    n = 2
    r = spawn(sp_traffic, n, cfg=cfg, name=f"sequence parallelism: one block's collectives, {n} ranks").returns[0]
    table([["off" if not sp else "on", fmt_counts(r[sp]["forward"]), fmt_counts(r[sp]["backward"]), r[sp]["bytes"]]
           for sp in (False, True)],
          header=["SP", "forward", "backward", "bytes this rank wrote, fwd + bwd (median of 5)"],
          caption=f"one transformer block, {n} ranks, b = 4, s = {cfg.seq_len}, h = {cfg.d_model} (CommDebugMode; /proc/self/io)")
    ring = lambda k: (n - 1) / n * r["activation bytes"] * k
    table([["all-reduce", r["all-reduce"], ring(2)],
           ["reduce-scatter", r["reduce-scatter"], ring(1)],
           ["all-gather", r["all-gather"], ring(1)],
           ["reduce-scatter + all-gather", r["reduce-scatter"] + r["all-gather"], ring(2)]],
          header=["collective on one (b, s, h) activation", "bytes this rank wrote (measured)", "ring algorithm (formula)"],
          caption=f"{n} ranks, gloo on this machine, activation {r['activation bytes']} bytes")
    note(f"""
        In the ring algorithm (NCCL's), reduce-scatter + all-gather moves exactly the bytes of one
        all-reduce. gloo on CPU does not: its reduce-scatter wrote {r['reduce-scatter'] / r['all-reduce']:.2f}×
        the bytes of its all-reduce (it reduces everything, then keeps a slice), so here the block
        with SP wrote {r[True]['bytes'] / r[False]['bytes']:.2f}× the bytes of the block without. The
        rest of the extra is ours: the MLP's input all-gathered again in backward (the price of
        keeping only its slice) and six small all-reduces of the LayerNorm and row-parallel bias
        gradients, which under SP each rank computes from its positions only.
    """)


def sp_split_figure(cfg, t, b):
    """One block with sequence parallelism, left to right: what each rank holds at every step
    (its shape for this page's GPT) and the collective at each change of split."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    s, h, f, hd = cfg.seq_len, cfg.d_model, cfg.ff, cfg.head_dim
    seq, ten, col = "#9ecae1", "#fdae6b", "#d9d9d9"
    steps = [("x", f"({b}, {s // t}, {h})", seq), ("LayerNorm", f"({b}, {s // t}, {h})", seq),
             ("all-gather\n(g)", "", col), ("Q, K, V,\nattention, O", f"heads {cfg.n_heads // t} of {cfg.n_heads}", ten),
             ("reduce-scatter\n(ḡ)", "", col), ("+ residual,\nLayerNorm", f"({b}, {s // t}, {h})", seq),
             ("all-gather\n(g)", "", col), ("MLP", f"width {f // t} of {f}", ten),
             ("reduce-scatter\n(ḡ)", "", col), ("+ residual", f"({b}, {s // t}, {h})", seq)]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    per_row, w = 5, 1.6
    ax.set_xlim(0, per_row * w)
    ax.set_ylim(-0.2, 4.3)
    ax.axis("off")
    for i, (name, shape, colour) in enumerate(steps):
        row, k = divmod(i, per_row)
        x0, y0 = k * w, 2.3 - 2.0 * row
        collective = colour == col
        ax.add_patch(FancyBboxPatch((x0 + 0.12, y0 + 0.35), w - 0.24, 0.95,
                                    boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=colour,
                                    edgecolor="black", lw=0.8, linestyle="--" if collective else "-"))
        ax.text(x0 + w / 2, y0 + 0.82, name, ha="center", va="center", fontsize=9.5)
        if shape:
            ax.text(x0 + w / 2, y0 + 0.12, shape, ha="center", va="center", fontsize=9, color="#333")
        if k:
            ax.annotate("", xy=(x0 + 0.12, y0 + 0.82), xytext=(x0 - 0.12, y0 + 0.82),
                        arrowprops=dict(arrowstyle="->", lw=0.9))
    # the second row continues the first: from the attention's reduce-scatter to the residual
    ax.annotate("", xy=(w / 2, 0.3 + 1.3), xytext=(per_row * w - w / 2, 2.3 + 0.35),
                arrowprops=dict(arrowstyle="->", lw=0.9, color="#666", shrinkA=0, shrinkB=0))
    ax.text(0.1, 4.05, f"per rank, t = {t}:  blue = split along the sequence ({s // t} of {s} positions)",
            fontsize=9.5, ha="left", va="center")
    ax.text(0.1, 3.75, "orange = split across heads or MLP width;  grey dashed = the collective between",
            fontsize=9.5, ha="left", va="center")
    figure(fig, caption=f"Where sequence parallelism splits one block ({t} ranks, this page's GPT: b = {b}, s = {s}, "
                        f"h = {h}, {cfg.n_heads} heads of {hd}, MLP width {f}). Every shape is what a rank holds. "
                        "Backward runs the same path right to left with each collective swapped "
                        "(all-gather ↔ reduce-scatter).")


def sp_activation_memory(cfg):
    note("""
        **Activation memory.** For one block, autograd saves (units of $bsh$ values, from counting
        what this code saves): the block input and the attention residual (LayerNorm inputs, 2),
        the two LayerNorm outputs read by the projections (2), Q, K, V (3), the attention output
        (1), the MLP's hidden layer before and after GELU (4 + 4). Tensor parallelism splits the
        last 12 but not the first 4: $4 + 12/t$. With sequence parallelism the LayerNorm inputs
        are slices, and the column-parallel layers (the fused QKV and `fc_in`) save only their
        input's sequence slice and all-gather it again in backward, so nothing of size $bsh$ stays
        whole: $16/t$. Every term is divided by $t$, as in Korthikanti et al.'s $sbh \\cdot 34/t$ for
        Megatron with sequence parallelism (their count is in bytes of 16-bit values and includes
        dropout masks, which this GPT has none of).
        (Plus per-token LayerNorm statistics and the attention's log-sum-exp; CPU SDPA's flash
        kernel keeps no $s \\times s$ matrix, so the paper's $5as/h$ term is absent.)
    """)
    see(saved_bytes)
    b = 4
    rows = []
    block, x = GPT(cfg).blocks[0], torch.randn(b, cfg.seq_len, cfg.d_model, requires_grad=True)
    one = saved_bytes(lambda: block(x), exclude=block.parameters())[1]
    formula = activation_formula(cfg, b, 1, False)
    rows.append([1, "—", one, formula, one / formula])
    for t in tp_sizes():
        m = spawn(activation_memory, t, cfg=cfg, b=b, name=f"sequence parallelism: activation bytes, {t} ranks").returns[0]
        for sp in (False, True):
            formula = activation_formula(cfg, b, t, sp)
            rows.append([t, "on" if sp else "off", m[sp], formula, m[sp] / formula])
    table(rows, header=["tp", "SP", "saved for backward, bytes per rank (measured)", "formula", "measured / formula"],
          caption=f"one block's activations, b = {b}, s = {cfg.seq_len}, h = {cfg.d_model}, float32")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [("one process" if r[0] == 1 else f"tp={r[0]}, SP {r[1]}") for r in rows]
    colours = ["gray" if r[0] == 1 else ("#4c72b0" if r[1] == "off" else "#55a868") for r in rows]
    bars = ax.barh(range(len(rows)), [r[2] / 1e3 for r in rows], color=colours)
    ax.bar_label(bars, labels=[f"{r[2] / 1e3:.0f} kB" for r in rows], padding=3, fontsize=9)
    ax.set_yticks(range(len(rows)), labels, fontsize=10)
    ax.invert_yaxis()
    ax.set_xlim(0, max(r[2] for r in rows) / 1e3 * 1.25)
    ax.set_xlabel("saved for backward per rank (kB, measured)", fontsize=10)
    figure(fig, caption="one block's activation memory per rank: tensor parallelism alone leaves 4 units whole; "
           "with sequence parallelism all 16 shrink with tp (the table's numbers)")
    exact = all(r[2] == r[3] for r in rows)
    note("The measured bytes equal the formula exactly in every row: this code reaches the paper's $16/t$."
         if exact else "Where measured and formula differ, the table's last column says by how much.")


def sp_layernorm_gradients(cfg):
    note("""
        **The LayerNorm gradients.** Under SP each rank's LayerNorm sees only its positions, so the
        gradient of its (replicated) weight and bias is a partial sum. They must be all-reduced —
        here, by passing the weights through f — or the replicas drift apart and none equals the
        one-process model:
    """)
    see(SequenceParallelLayerNorm)
    steps = 5
    ref = train_reference(cfg, steps=steps, batch_size=8)
    rows = []
    for sync in (True, False):
        rr = spawn(train_tp, 2, cfg=cfg, steps=steps, batch_size=8, sequence_parallel=True, sync_layernorm_grads=sync,
                   name=f"SP LayerNorm gradients {'all-reduced' if sync else 'not all-reduced'}").returns
        ln = [k for k in ref["params"] if ".ln" in k or k.startswith("ln_f")]
        rows.append(["all-reduced (f)" if sync else "left out", max_diff(rr[0]["params"], ref["params"]),
                     max((rr[0]["params"][k] - rr[1]["params"][k]).abs().max().item() for k in ln)])
    table(rows, header=["LayerNorm gradients", f"max |Δ parameter| vs one process after {steps} steps",
                        "max |rank 0 − rank 1| of the LayerNorm weights"],
          caption="sequence parallelism, 2 ranks")


def critical_path():
    tp_timeline_and_step_times(demo_cfg())   # measured here: what waits for what
    tp_at_scale()                           # computed: why tp stays inside a node


def tp_timeline_and_step_times(cfg):
    from util.measure import machine, timing_ranks
    note("""
        ## Communication on the critical path
        Data parallelism's all-reduce can hide behind the backward of earlier layers (lecture 03).
        Tensor parallelism's cannot, mostly: the next matmul needs the all-reduced activation.
        Only the input-gradient all-reduce of a column-parallel layer has work to hide behind (the
        weight gradient). A block has two column-parallel matmuls, the MLP's `fc_in` and the
        attention's fused Q/K/V, so each backward starts two all-reduces early; had Q, K and V
        stayed three layers behind one f, the attention's all-reduce would run after all three
        weight gradients, blocking. The timeline of one block on 2 ranks:
    """)
    run = spawn(traced_block, 2, cfg=cfg, b=8, name="TP block timeline, 2 ranks")
    figure(timeline(run.spans, title="one TP block: forward, backward and their collectives (2 steps)"),
           caption="per-rank spans measured on the ranks; each async all-reduce overlaps a weight-gradient matmul")
    mine = [sp for sp in run.spans if sp["rank"] == 0]
    back = [sp for sp in mine if sp["label"] == "backward"]
    in_back = [sp["label"] for sp in mine if any(b["start"] <= sp["start"] <= b["end"] for b in back)]
    asyncs, blocking = in_back.count("all-reduce (async)"), in_back.count("all-reduce")
    note(f"""
        In {len(back)} backward passes rank 0 ran {asyncs} asynchronous all-reduce(s) (each
        beside a weight-gradient matmul) and {blocking} blocking one(s). The forward's two
        all-reduces (g after `o_proj` and after `fc_out`) block: the residual add needs them.
    """)
    ranks = timing_ranks(4)
    tps = [t for t in (1, 2, 4, 8) if t <= ranks]
    rows, times = [], {}
    for t in tps:
        kind = "one process" if t == 1 else "ours"
        times[t] = spawn(time_steps, t, cfg=cfg, batch_size=16, kinds=(kind,), repeats=3 if settings.quick else 9,
                         name=f"TP step time, tp={t}").returns[0][kind]
        rows.append([t, times[t].ms()])
    table(rows, header=["tp", "training step, median (IQR)"], caption=f"lecture 01's GPT, batch 16, {machine(ranks)}")
    ratio = times[tps[-1]].median / times[1].median
    why = ("slower: the model is tiny, so the collectives' fixed cost over TCP outweighs what "
           "splitting the matmuls saves" if ratio > 1 else
           f"faster, but short of the ideal 1/{tps[-1]}: every block waits for its collectives")
    note(f"""
        On {machine(ranks)}, each running one thread, a step at tp={tps[-1]} takes
        {ratio:.2f}× the one-process time, {why}.
    """)


def tp_at_scale():
    note("""
        On real hardware the question is bandwidth. Per layer, forward and backward, tensor
        parallelism all-reduces the $(b, s, h)$ activation 4 times (with SP: 4 all-gather +
        reduce-scatter pairs instead, the same bytes in a ring); a ring all-reduce moves
        $2(t-1)/t$ of it per rank.
        For a GPT-3-sized layer in bf16 against the link speeds of lecture 02:
    """)
    rows = []
    for name, h, s_, t in (("GPT-3 175B layer", 12288, 2048, 8), ("Llama-2 70B-like layer", 8192, 4096, 8)):
        act = 1 * s_ * h * 2
        per_rank = 4 * 2 * (t - 1) / t * act
        flops = 72 * s_ * h * h / t                # fwd + bwd ≈ 3 × 24·b·s·h² per layer, split t ways
        compute = flops / 989e12                   # H100 SXM dense bf16 peak
        rows.append([name, f"h={h}, s={s_}, b=1, t={t}", per_rank / 1e6, compute * 1e3,
                     per_rank / 450e9 * 1e3, per_rank / 50e9 * 1e3])
    table(rows, header=["", "shape", "MB per rank per layer (fwd + bwd)", "compute ms at peak",
                        "NVLink 450 GB/s: ms", "InfiniBand NDR 50 GB/s: ms"],
          caption="computed, not measured: H100 peak 989 TFLOP/s bf16; link speeds per direction as in lecture 02")
    nv = ", ".join(f"{r[0]}: {r[4] / r[3]:.2f}×" for r in rows)
    ib = ", ".join(f"{r[0]}: {r[5] / r[3]:.1f}×" for r in rows)
    note(f"""
        Communication over compute, over NVLink: {nv}; over InfiniBand: {ib}. Both columns are
        ideal: the compute assumes the GPU at its peak (a real layer runs below it, which shrinks
        these ratios by the same factor), the links their full speed (a real all-reduce falls
        short of it, which grows them). Over InfiniBand the all-reduces
        would take longer than the matmuls they sit between, and most of them cannot be hidden
        (the next matmul needs their result). Hence tensor parallelism stays inside a node
        (tp ≤ 8) and data/pipeline parallelism span nodes.
    """)


def dtensor_section():
    dtensor_redistribute()          # placements, and the collective each change of placement runs
    dtensor_parallelize_module()    # the GPT split by a plan of placements, against ours


def dtensor_redistribute():
    note("""
        ## Sharding annotations: DTensor
        Mesh-TensorFlow (Shazeer et al. 2018) first wrote model parallelism as layouts: name the
        tensor dimensions, say which ones are split over which axis of a mesh of devices, and let
        the library insert the collectives. GShard and GSPMD (Lepikhin et al. 2020; Xu et al. 2021)
        made the same idea an annotation on an ordinary program: say how a few tensors are laid out over a mesh of devices, and the compiler
        propagates layouts and inserts the collectives. PyTorch's DTensor is the eager version: a
        tensor carries a `DeviceMesh` and a placement per mesh dimension — `Shard(d)`,
        `Replicate()`, or `Partial()` (each rank holds a summand) — and changing placement runs the
        collective that does it:
    """)
    see("https://arxiv.org/abs/1811.02084", "Shazeer et al. 2018, Mesh-TensorFlow: Deep Learning for Supercomputers")
    see("https://arxiv.org/abs/2006.16668", "Lepikhin et al. 2020, GShard: Scaling Giant Models with Conditional Computation and Automatic Sharding")
    see("https://arxiv.org/abs/2105.04663", "Xu et al. 2021, GSPMD: General and Scalable Parallelization for ML Computation Graphs")
    see("https://pytorch.org/docs/stable/distributed.tensor.html", "PyTorch DTensor documentation")
    n = 2
    rows = spawn(redistribute_table, n, name=f"DTensor redistribute table, {n} ranks").returns[0]
    table(rows, header=["from", "to", "collective (CommDebugMode)", "local shape before", "after", "values equal the full tensor"],
          caption=f"a {4 * n}×{2 * n} tensor on a mesh of {n} ranks")
    note("""
        Shard → Replicate is an all-gather, Partial → Replicate an all-reduce, Partial → Shard a
        reduce-scatter, Replicate → Shard a local slice with no communication. Shard(0) → Shard(1)
        is an all-to-all on NCCL. gloo has an all-to-all too (`all_to_all_single` runs on CPU, uneven
        splits included), but DTensor's redistribution on CPU does not use it: it all-gathers the
        whole tensor and keeps its slice (and logs a warning whose comment claims gloo lacks
        all-to-all), which is what the table shows. Same result, $t\\times$ the memory and more bytes.
    """)


def dtensor_parallelize_module():
    note("""
        `parallelize_module` applies a plan of such layouts to modules: `ColwiseParallel` shards a
        Linear's weight on dim 0, `RowwiseParallel` on dim 1, `SequenceParallel` runs a LayerNorm
        on sequence shards, `PrepareModuleInput` redistributes a module's input, and
        `loss_parallel()` computes cross-entropy on logits sharded on the vocabulary. The plan for
        the same GPT:
    """)
    see(dtensor_plan)
    cfg = GPTConfig(seq_len=8, d_model=32, n_heads=4, dtype="float64")
    rows = []
    for n, sp in ((2, False), (2 if settings.quick else 4, True)):
        r = spawn(compare_with_dtensor, n, cfg=cfg, sequence_parallel=sp,
                  name=f"ours vs DTensor parallelize_module, {n} ranks, {'SP' if sp else 'no SP'}").returns[0]
        rows.append([n, "on" if sp else "off", (r["ours"]["logits"] - r["DTensor"]["logits"]).abs().max().item(),
                     max_diff(r["ours"]["grads"], r["DTensor"]["grads"]),
                     max_diff(r["ours"]["params"], r["DTensor"]["params"]),
                     fmt_counts(r["ours counts"]), fmt_counts(r["ours optimizer counts"]),
                     fmt_counts(r["DTensor counts"]), fmt_counts(r["DTensor optimizer counts"])])
        last = r
    table(rows, header=["tp", "SP", "max |Δ logits|", "max |Δ gradient|", "max |Δ parameter| after 3 AdamW steps",
                        "ours: forward + backward", "ours: AdamW step", "DTensor: forward + backward",
                        "DTensor: AdamW step"],
          caption="float64, the same GPT split both ways; collectives of one whole training step (CommDebugMode)")
    same = rows[0][5] == rows[0][7] and rows[0][6] == rows[0][8]
    partial = ", ".join(f"`{k}`" for k in last["DTensor partial grads"]) or "none"
    bias = last["DTensor grad placements"].get("blocks.0.attn.o_proj.bias", "?")
    note(f"""
        The two agree to rounding. Without SP a whole step's collectives are {"the same" if same
        else "different"}: {rows[0][5]} and {rows[0][6]} in the optimizer step (ours),
        {rows[0][7]} and {rows[0][8]} (DTensor). With SP ({rows[1][0]} ranks) they differ in where the work is done:
        we all-gather the MLP input again in backward (keeping only a slice) and all-reduce the
        partial gradients of the replicated LayerNorm weights, row-parallel biases and positions
        during backward, through f, so our optimizer step communicates nothing ({rows[1][6]}). DTensor leaves
        the LayerNorm gradients as `Partial` placements ({partial}); the row-parallel bias gradient
        is `{bias}` (not `Partial`): only the norms are left for the optimizer to reduce.
        A `Partial` gradient is reduced every time the optimizer *reads* it, and AdamW's foreach
        step reads each several times: its step ran {rows[1][8]}. Counting only forward and
        backward, as one easily does, hides that cost. Ours is a few hundred lines you can read;
        DTensor's is a general layout algebra that derives the collectives from the annotations.
    """)


def summary():
    note("""
        ## What to remember
        - A column cut ($A = [A_1, \\dots, A_t]$) gives each rank a slice of the output and needs no
          collective; a row cut gives partial sums that an all-reduce adds.
        - f (identity forward, all-reduce backward) and g (all-reduce forward, identity backward)
          bracket a column → row pair: one all-reduce each way per MLP and per attention.
        - Attention splits by whole heads ($t \\mid a$); Q, K, V fused into one column-parallel
          matmul let backward overlap the input-gradient all-reduce with the weight gradient.
          K/V heads are split when $t \\mid k$, else replicated on the ranks that read them.
        - Vocabulary parallelism splits the embedding and LM head; the loss needs three
          per-token all-reduces and the full logits never exist.
        - Sequence parallelism turns each all-reduce into a reduce-scatter + all-gather (the same
          bytes in a ring) and splits the activations TP left whole, at the price of
          all-reducing the replicated LayerNorm gradients.
        - Most of TP's communication blocks the next matmul: keep tp inside a node.

        The companion notebook, `lectures/notebooks/lecture_04_tensor_parallel.ipynb`, runs every
        section above and lets you split the GPT your way (`make jupyter` opens it).
    """)


def main():
    intro()
    conjugate_operators()       # the two operators everything else is built from
    column_and_row()            # the two ways to split one matrix
    megatron_mlp()              # composing them: one all-reduce per direction
    attention_heads()           # the same for attention, including GQA
    vocab_parallel()            # the biggest matrices: embedding, head and the loss
    training()                  # the whole GPT, split and trained, equal to one process
    sequence_parallelism()      # what TP leaves replicated, split along the sequence
    critical_path()             # why TP stays inside a node
    dtensor_section()           # the same thing as sharding annotations
    summary()                   # what to remember, and where to try it


def bench():
    """Our TP GPT step vs DTensor's parallelize_module step, same model and ranks, interleaved."""
    from util.measure import timing_ranks
    n = timing_ranks(2)
    t = spawn(time_steps, n, cfg=GPTConfig(), batch_size=16, kinds=("ours", "DTensor"), repeats=15,
              name="bench: ours vs DTensor TP").returns[0]
    return [f"lecture_04: TP GPT step (tp={n}) {t['ours'].median * 1e3:.1f} ms vs DTensor parallelize_module "
            f"{t['DTensor'].median * 1e3:.1f} ms: ratio {t['ours'].median / t['DTensor'].median:.2f} (target <= 1.1)"]
