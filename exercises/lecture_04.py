"""Lecture 04's exercises: Megatron's f and g, a tensor-parallel MLP, vocab-parallel cross-entropy."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from exercises import COLLECTIVES, built_in, exercise, forbid, mutant


def _tensor(rank, shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(100 * rank + seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


# --- f and g ---------------------------------------------------------------------------------

def check_f_and_g(rank, world_size, f, g, group=None):
    from lectures.tensor_parallel import copy_to_region, reduce_from_region
    group = group or dist.group.WORLD
    out = []
    for name, mine, course in (("f", f, copy_to_region), ("g", g, reduce_from_region)):
        for shape in [(3, 5), (7,)]:
            results = []
            for op in (course, mine):
                x = _tensor(rank, shape, 1).requires_grad_()
                y = op(x, group)
                (y * _tensor(rank, shape, 2)).sum().backward()   # a different upstream gradient per rank
                results.append([y.detach(), x.grad])
            out.append((f"{name} on a {shape} float64 tensor: [forward output, gradient of x]", *results))
    return out


def f(x, group):
    """Reference: identity forward, all-reduce backward."""
    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad
    return Copy.apply(x)


def g(x, group):
    """Reference: all-reduce forward, identity backward."""
    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = x.clone()
            dist.all_reduce(out, group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad
    return Reduce.apply(x)


exercise(
    module=__name__, name="f_and_g",
    title="Megatron's conjugate operators f and g as autograd functions",
    statement=(
        "**Exercise: the f and g operators.** Megatron-LM (Shoeybi et al. 2019, §3, Fig. 3) "
        "brackets every tensor-parallel region with two conjugate operators: `f` is the identity "
        "forward and an all-reduce of the gradient backward (where a replicated tensor enters the "
        "region); `g` all-reduces forward (summing the ranks' partial results) and is the "
        "identity backward. Write `f(x, group)` and `g(x, group)`, each with a small "
        "`torch.autograd.Function` defined inside it (its `forward(ctx, x)` and `backward(ctx, "
        "grad)`); never modify the tensor you were given. The check runs both on 3 and on 2 "
        "ranks and on a sub-group (ranks 1 and 2 only: use `group`, never the default group), with "
        "float64 tensors of shapes (3, 5) and (7,) and a different upstream gradient on every "
        "rank, against the course's `copy_to_region` and `reduce_from_region`."),
    stub=(
        "def f(x, group):\n"
        "    \"\"\"Megatron's f: identity forward, all-reduce (sum) of the gradient backward.\"\"\"\n"
        "    raise NotImplementedError(\"hint: class Copy(torch.autograd.Function) with a forward that \"\n"
        "                              \"returns x.view_as(x) and a backward that all-reduces a clone\")\n"
        "\n"
        "\n"
        "def g(x, group):\n"
        "    \"\"\"Megatron's g: all-reduce (sum) forward, identity backward.\"\"\"\n"
        "    raise NotImplementedError(\"hint: the mirror image of f\")\n"),
    harness=check_f_and_g, solution=(f, g), ranks=(3, 2), subgroup=True, keeps_inputs=True,
    wrong={"f and g swapped": (g, f),
           "f averages the gradient": (mutant(f, ("return grad", "return grad / dist.get_world_size(group)")), g),
           "g all-reduces backward too": (f, mutant(g, ("return grad", "return Reduce.forward(ctx, grad)")))},
    hint="forward and backward are conjugate: what one does in the forward, the other does in "
         "the backward; the sum, not the mean",
    sizes="float64, shapes (3, 5) and (7,), a different upstream gradient per rank")


# --- a column-parallel then row-parallel MLP ---------------------------------------------------

def check_tp_mlp(rank, world_size, fn, group=None):
    from lectures.model import MLP, GPTConfig
    out = []
    for h, ff, shape in [(7, 15, (2, 3)), (4, 6, (5,))]:
        cfg = GPTConfig(d_model=h, n_heads=1, d_ff=ff, dtype="float64")
        torch.manual_seed(0)
        mlp = MLP(cfg).double()
        x = _tensor(0, (*shape, h), 3)
        expected = mlp(x).detach()
        rows = torch.tensor_split(torch.arange(ff), world_size)[rank]
        w1, b1 = mlp.fc_in.weight[rows].detach(), mlp.fc_in.bias[rows].detach()
        w2, b2 = mlp.fc_out.weight[:, rows].detach(), mlp.fc_out.bias.detach()
        got = fn(x.clone(), w1.clone(), b1.clone(), w2.clone(), b2.clone(), group or dist.group.WORLD)
        out.append((f"h={h}, f={ff} ({len(rows)} columns on this rank), input {(*shape, h)}", expected, got))
    return out


def tp_mlp(x, w1, b1, w2, b2, group):
    """Reference: column-parallel fc_in, GELU on the shard, row-parallel fc_out, g, then the bias."""
    partial = F.gelu(x @ w1.T + b1) @ w2.T
    dist.all_reduce(partial, group=group)
    return partial + b2


exercise(
    module=__name__, name="tp_mlp",
    title="a column-parallel then row-parallel MLP (one all-reduce)",
    statement=(
        "**Exercise: a tensor-parallel MLP.** Megatron splits the MLP h → f → h so that it needs "
        "one all-reduce forward: the first matrix by columns (each rank holds some of the f hidden "
        "units: rows `w1` of `fc_in.weight` and their biases `b1`), so GELU applies to each "
        "rank's slice on its own; the second by rows (`w2`, the matching columns of "
        "`fc_out.weight`), so each rank computes a partial sum of the output. Write "
        "`tp_mlp(x, w1, b1, w2, b2, group)` returning the full MLP output on every rank, "
        "`fc_out(gelu(fc_in(x)))`; `x` is replicated, `b2` (the output bias) is full; leave the "
        "inputs unchanged. The check splits the course's `MLP` over 3 and 2 ranks, and over a "
        "sub-group of them (so `group` and its ranks matter), with f = 15 and f = 6, hidden 7 "
        "and 4, float64."),
    stub=(
        "def tp_mlp(x, w1, b1, w2, b2, group):\n"
        "    \"\"\"fc_out(gelu(fc_in(x))) with fc_in split by columns and fc_out by rows.\"\"\"\n"
        "    raise NotImplementedError(\"hint: gelu(x @ w1.T + b1) @ w2.T is a partial sum: all-reduce \"\n"
        "                              \"it, and add the bias once\")\n"),
    harness=check_tp_mlp, solution=tp_mlp, ranks=(3, 2), subgroup=True, keeps_inputs=True,
    wrong={"adds the output bias on every rank":
               mutant(tp_mlp, ("@ w2.T\n", "@ w2.T + b2\n"), ("return partial + b2", "return partial")),
           "no all-reduce": mutant(tp_mlp, ("    dist.all_reduce(partial, group=group)\n", "")),
           "averages the partial sums": mutant(tp_mlp, ("partial + b2", "partial / dist.get_world_size(group) + b2"))},
    hint="the row-parallel output is a SUM of the ranks' partials; a bias added before the "
         "all-reduce is counted n times",
    sizes="float64, hidden 7 and 4, f = 15 and 6 over 3, 2 and a sub-group of ranks")


# --- vocab-parallel cross-entropy ----------------------------------------------------------------

def check_vocab_ce(rank, world_size, fn, group=None):
    from lectures.tensor_parallel import vocab_parallel_cross_entropy
    group = group or dist.group.WORLD
    out = []
    for vocab, shape, scale in [(24, (2, 5), 1.0), (12, (7,), 1.0), (18, (3, 2), 400.0)]:   # split by 1, 2, 3
        logits = _tensor(0, (*shape, vocab), 5, scale)
        targets = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(vocab))
        targets.view(-1)[0] = vocab - 1                   # one target in the last rank's slice
        per = vocab // world_size
        local = logits[..., rank * per:(rank + 1) * per].clone()
        expected = vocab_parallel_cross_entropy(local.clone(), targets, group).detach()
        single = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        assert torch.allclose(expected, single)
        got = fn(local.clone(), targets.clone(), group)
        out.append((f"vocab {vocab} ({per} per rank), targets {shape}, logits up to "
                    f"{logits.abs().max():.0f}: the mean loss", expected, got))
    return out


def vocab_parallel_ce(local_logits, targets, group):
    """Reference: global max, global sum of exponentials, the target's logit from its owner."""
    rank, per = dist.get_rank(group), local_logits.shape[-1]
    m = local_logits.amax(dim=-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = local_logits - m.unsqueeze(-1)
    sum_exp = shifted.exp().sum(-1)
    dist.all_reduce(sum_exp, group=group)
    mine = (targets >= rank * per) & (targets < (rank + 1) * per)
    local = (targets - rank * per).clamp(0, per - 1)
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
    dist.all_reduce(picked, group=group)
    return (sum_exp.log() - picked).mean()


exercise(
    module=__name__, name="vocab_parallel_ce",
    title="vocab-parallel cross-entropy without gathering the logits",
    statement=(
        "**Exercise: vocab-parallel cross-entropy.** With the LM head split by vocabulary (Megatron, "
        "Shoeybi et al. 2019 §3), rank r holds logits for tokens r·V/n … (r+1)·V/n − 1 only. Write "
        "`vocab_parallel_ce(local_logits, targets, group)` returning the mean cross-entropy over "
        "all tokens, the same as `F.cross_entropy` on the full logits, without ever gathering "
        "them: loss = log Σ exp(z − m) − (z_target − m) with m the *global* max (an all-reduce "
        "with `ReduceOp.MAX`), the sum of exponentials all-reduced, and the target's logit "
        "contributed by the rank that owns it (the others add 0). Forward only; no all-gather, and "
        "leave the inputs unchanged. The check runs 3 and 2 ranks and a sub-group of them, "
        "vocabularies 24, 12 and 18, float64, one case with logits in the hundreds (where exp() "
        "overflows), against the course's `vocab_parallel_cross_entropy`."),
    stub=(
        "def vocab_parallel_ce(local_logits, targets, group):\n"
        "    \"\"\"Mean cross-entropy; local_logits (..., V/n) is this rank's vocabulary slice.\"\"\"\n"
        "    rank, per = dist.get_rank(group), local_logits.shape[-1]\n"
        "    raise NotImplementedError(\"hint: three all-reduces: the max (ReduceOp.MAX), the sum of \"\n"
        "                              \"exp(z - max), and the target's shifted logit (0 where not yours)\")\n"),
    harness=check_vocab_ce, solution=vocab_parallel_ce, ranks=(3, 2), subgroup=True, keeps_inputs=True,
    watch=forbid("the point is never to gather the logits", *built_in(*COLLECTIVES[1:]),
                 "lectures.tensor_parallel.vocab.vocab_parallel_cross_entropy",
                 "lectures.lecture_04_tensor_parallel.vocab_parallel_cross_entropy", "exercises.solution"),
    wrong={"each rank subtracts its own max":
               mutant(vocab_parallel_ce, ("    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)\n", "")),
           "target slice of the next rank":
               mutant(vocab_parallel_ce, ("dist.get_rank(group),", "(dist.get_rank(group) + 1) % dist.get_world_size(group),")),
           "no max subtracted (overflows)": mutant(vocab_parallel_ce, ("local_logits - m.unsqueeze(-1)", "local_logits"))},
    hint="every rank must subtract the SAME max before the exponentials are summed across ranks",
    sizes="float64, vocab 24, 12, 18 over 3, 2 and a sub-group of ranks; logits up to ~1500")
