"""Lecture 06's exercises: a zig-zag shard, merging partial attention (the ring's step), top-k
routing with a capacity."""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from exercises import exercise, mutant


def _tensor(rank, shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(100 * rank + seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


# --- a zig-zag shard -------------------------------------------------------------------------

def check_zigzag(rank, world_size, fn):
    from lectures.context_parallel import zigzag_shard as course
    out = []
    for shape, dim in [((2, 13, 3), 1), ((12, 2), 0), ((1, 5), 1), ((4, 7, 2), 1)]:
        x = _tensor(0, shape, sum(shape))
        out.append((f"a {shape} sequence, sharded along dim {dim}", course(x, rank, world_size, dim),
                    fn(x.clone(), rank, world_size, dim)))
    return out


def zigzag_shard(x, rank, world_size, dim):
    """Reference: chunks r and 2n - 1 - r of 2n (torch.tensor_split's sizes)."""
    chunks = torch.tensor_split(x, 2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_equal_chunks(x, rank, world_size, dim):
    size = x.shape[dim] // (2 * world_size)
    chunks = torch.split(x, max(size, 1), dim=dim)
    return torch.cat([chunks[rank], chunks[min(2 * world_size - 1 - rank, len(chunks) - 1)]], dim=dim)


def zigzag_contiguous(x, rank, world_size, dim):
    return torch.tensor_split(x, world_size, dim=dim)[rank]


exercise(
    module=__name__, name="zigzag_shard",
    title="a zig-zag shard of a sequence (load-balanced causal context parallelism)",
    statement=(
        "**Exercise: a zig-zag shard.** Under a causal mask, the rank holding the end of a "
        "sequence has far more work than the rank holding its start. Zig-zag sharding (Llama 3's "
        "context parallelism, Llama Team 2024 §3.3.2) cuts the sequence into 2n chunks and gives "
        "rank r chunks r and 2n − 1 − r, one early and one late. Write `zigzag_shard(x, rank, "
        "world_size, dim)` returning rank r's two chunks concatenated along `dim`, with chunk "
        "sizes as `torch.tensor_split` makes them (the first ones get one more; some may be "
        "empty). The check runs 3 ranks on float64 sequences of 13, 12, 5 and 7 positions "
        "against the course's `zigzag_shard`."),
    stub=(
        "def zigzag_shard(x, rank, world_size, dim):\n"
        "    \"\"\"Chunks rank and 2*world_size - 1 - rank of x cut into 2*world_size along dim.\"\"\"\n"
        "    raise NotImplementedError(\"hint: torch.tensor_split(x, 2 * world_size, dim=dim), then \"\n"
        "                              \"torch.cat two of the chunks\")\n"),
    harness=check_zigzag, solution=zigzag_shard,
    wrong={"second chunk off by one":
               mutant(zigzag_shard, ("2 * world_size - 1 - rank", "(2 * world_size - rank) % (2 * world_size)")),
           "equal chunks (drops the remainder)": zigzag_equal_chunks,
           "contiguous shard": zigzag_contiguous},
    hint="13 positions in 6 chunks: sizes 3, 2, 2, 2, 2, 2; 5 positions: one chunk is empty",
    sizes="float64; lengths 13, 12, 5, 7 over 3 ranks (6 chunks)")


# --- merging two partial attention results: the ring's step -----------------------------------

def check_merge(rank, world_size, fn):
    """A real ring: each rank keeps its queries, the key/value blocks travel around, and every
    partial result is merged in with the student's function (and, beside it, the course's)."""
    from lectures.model import attention_with_lse, merge_attention as merge_partials
    out = []
    for seq, causal in [(13, True), (8, False)]:
        q_all, k_all, v_all = (_tensor(0, (1, 2, seq, 4), s) for s in (1, 2, 3))
        sizes = [len(c) for c in torch.tensor_split(torch.arange(seq), world_size)]
        starts = [sum(sizes[:r]) for r in range(world_size)]
        mine = slice(starts[rank], starts[rank] + sizes[rank])
        q = q_all[:, :, mine]
        ours = theirs = None
        kv_from = rank
        k, v = k_all[:, :, mine].clone(), v_all[:, :, mine].clone()
        for step in range(world_size):
            part, lse = attention_with_lse(q, k, v, causal=causal, q_offset=starts[rank], k_offset=starts[kv_from])
            if ours is None:
                ours = theirs = (part, lse)
            else:
                ours = merge_partials(*ours, part, lse)
                theirs = fn(*theirs, part, lse)
            if step < world_size - 1:               # pass the block on: send right, receive from the left
                kv_from = (kv_from - 1) % world_size
                n_in = sizes[kv_from]
                k_in, v_in = torch.empty(1, 2, n_in, 4, dtype=k.dtype), torch.empty(1, 2, n_in, 4, dtype=v.dtype)
                ops = [dist.P2POp(dist.isend, k.contiguous(), (rank + 1) % world_size),
                       dist.P2POp(dist.isend, v.contiguous(), (rank + 1) % world_size),
                       dist.P2POp(dist.irecv, k_in, (rank - 1) % world_size),
                       dist.P2POp(dist.irecv, v_in, (rank - 1) % world_size)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                k, v = k_in, v_in
        got = list(theirs) if isinstance(theirs, (list, tuple)) else theirs
        out.append((f"ring attention over {seq} positions ({sizes[rank]} on this rank), "
                    f"{'causal' if causal else 'full'}: [output, lse]", list(ours), got))
    return out + merge_edges(rank, fn, merge_partials)


def merge_edges(rank, fn, course):
    """Two merges the ring above never makes: scores in the hundreds (exp overflows float64
    unless the larger lse is subtracted first) and a query that saw no key on either side
    (both lse -inf: the union saw none either, output 0)."""
    out_a, out_b = _tensor(rank, (1, 2, 3, 4), 7), _tensor(rank, (1, 2, 3, 4), 8)
    big_a = torch.tensor([[[800.0, 5.0, -700.0], [799.0, 0.0, 750.0]]], dtype=torch.float64)
    big_b = big_a.flip(-1) - 1
    none = torch.full((1, 2, 3), float("-inf"), dtype=torch.float64)
    none[0, 0, 0] = 2.0                      # one query saw a key on side a only
    cases = []
    for label, lse_a, lse_b, a, b in [
            ("lse in the hundreds (800 and 799)", big_a, big_b, out_a, out_b),
            ("queries that saw no key on either side (lse -inf on both)", none, none.clone(),
             out_a * none.isfinite()[..., None], torch.zeros_like(out_b))]:
        got = fn(a.clone(), lse_a.clone(), b.clone(), lse_b.clone())
        cases.append((f"a direct merge, {label}: [output, lse]", list(course(a, lse_a, b, lse_b)),
                      list(got) if isinstance(got, (list, tuple)) else got))
    return cases


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Reference: rescale both by exp(lse - lse_union); safe when a side saw no keys."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return out_a * torch.exp(lse_a - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None], lse


def merge_average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


exercise(
    module=__name__, name="merge_attention",
    title="merging two partial attention results (ring attention's step)",
    statement=(
        "**Exercise: merging partial attention.** Ring attention (Liu et al. 2023) never holds "
        "all the keys: each step computes attention over one block of keys, giving an output "
        "`out` (normalised over that block) and the log-sum-exp `lse` of the block's scores per "
        "query, and merges it into what it has. Write `merge_attention(out_a, lse_a, out_b, "
        "lse_b)` returning `(out, lse)` over the union of the two key sets: lse = "
        "log(e^lse_a + e^lse_b) (`torch.logaddexp`), out = out_a·e^(lse_a − lse) + "
        "out_b·e^(lse_b − lse) — the online softmax's rescaling again. Shapes: out (b, heads, "
        "q, d), lse (b, heads, q). A query that saw no key in a block (causal mask) has lse = "
        "−∞ there, and one that saw no key on either side must get output 0 and lse −∞. The check "
        "runs a real ring on 3 and 2 ranks, float64, 13 positions (causal) and 8 (full), merging "
        "every block with your function and with the course's, then two direct merges: lse in "
        "the hundreds, and lse −∞ on both sides."),
    stub=(
        "def merge_attention(out_a, lse_a, out_b, lse_b):\n"
        "    \"\"\"(out, lse) of attention over the union of two disjoint sets of keys.\"\"\"\n"
        "    raise NotImplementedError(\"hint: lse = torch.logaddexp(lse_a, lse_b); weight each out \"\n"
        "                              \"by exp(its lse - lse) (unsqueeze the last dim)\")\n"),
    harness=check_merge, solution=merge_attention, ranks=(3, 2),
    wrong={"averages the two outputs": merge_average,
           "max instead of log-sum-exp": mutant(merge_attention, ("torch.logaddexp", "torch.maximum")),
           "forgets to divide by the new sum": mutant(
               merge_attention, ("torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))", "torch.zeros_like(lse)"))},
    hint="each partial output is normalised over its own keys: weight it by its share of the "
         "total mass, exp(lse_part - lse_total)",
    sizes="a real ring on 3 and 2 ranks; float64; 13 positions causal (uneven blocks), 8 full; "
          "lse of 800, and -inf on both sides")


# --- top-k routing with a capacity --------------------------------------------------------------

ROUTING = (((7, 4, 2, 1.0), (7, 4, 1, 0.5)), ((5, 3, 2, 1.25), (9, 4, 2, 0.5)), ((9, 6, 3, 1.0), (1, 2, 1, 1.0)))


def check_routing(rank, world_size, fn):
    from lectures.context_parallel import capacity, positions_in_expert, route, slot_counts
    out = []
    for tokens, experts, top_k, factor in ROUTING[rank]:
        logits = _tensor(rank, (tokens, experts), tokens + experts)
        _, idx, gates = route(torch.nn.Identity(), logits, top_k)
        counts = slot_counts(idx, experts)
        base = torch.cat([torch.zeros_like(counts[:1]), counts.cumsum(0)[:-1]])
        keep = positions_in_expert(idx, experts, base) < capacity(factor, tokens, top_k, experts)
        got = fn(logits.clone(), top_k, factor)
        got = list(got) if isinstance(got, (list, tuple)) else got
        out.append((f"{tokens} tokens, {experts} experts, top-{top_k}, capacity factor {factor}: "
                     "[expert indices, gates, keep]", [idx, gates, keep], got))
    return out


def route_with_capacity(logits, top_k, capacity_factor):
    """Reference: softmax, top-k, gates, GShard's priority (first choices first), capacity."""
    tokens, experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    top, idx = probs.topk(top_k, dim=-1)
    gates = top if top_k == 1 else top / top.sum(-1, keepdim=True)
    cap = math.ceil(capacity_factor * tokens * top_k / experts)
    onehot = F.one_hot(idx, experts)                       # (T, k, E)
    counts = onehot.sum(0)                                 # (k, E)
    base = torch.cat([torch.zeros_like(counts[:1]), counts.cumsum(0)[:-1]])
    pos = (onehot.cumsum(0) - onehot + base.unsqueeze(0)).gather(2, idx.unsqueeze(-1)).squeeze(-1)
    return idx, gates, pos < cap


exercise(
    module=__name__, name="route_with_capacity",
    title="top-k routing with an expert capacity (GShard's priority)",
    statement=(
        "**Exercise: top-k routing with a capacity.** A mixture-of-experts router sends each "
        "token to its k most probable experts. Write `route_with_capacity(logits, top_k, "
        "capacity_factor)` for router logits (tokens × experts) returning `(idx, gates, keep)`: "
        "`idx` (tokens × k) the top-k experts of `softmax(logits)` (`topk` order); `gates` their "
        "probabilities, renormalised to sum to 1 when k > 1 (Switch keeps the raw probability "
        "when k = 1); `keep` (tokens × k, bool): whether that choice fits in the expert, which "
        "takes at most C = ⌈factor · T · k / E⌉ assignments. Queue order is GShard's (Lepikhin et "
        "al. 2020): all first choices (in token order) before any second choice. The check runs "
        "3 ranks, each routing its own tokens (7, 5, 9, 1: uneven), float64, against the course's "
        "`route`, `capacity` and `positions_in_expert`."),
    stub=(
        "def route_with_capacity(logits, top_k, capacity_factor):\n"
        "    \"\"\"(idx, gates, keep) for router logits of shape (tokens, experts).\"\"\"\n"
        "    tokens, experts = logits.shape\n"
        "    raise NotImplementedError(\"hint: probs.topk(top_k); C = ceil(factor * T * k / E); an \"\n"
        "                              \"expert's queue holds every first choice before any second\")\n"),
    harness=check_routing, solution=route_with_capacity,
    wrong={"queue in token order, not by choice":     # a place among all earlier tokens' choices, any rank of choice
               mutant(route_with_capacity, ("onehot.cumsum(0) - onehot + base.unsqueeze(0)",
                                            "(onehot.sum(1, True).cumsum(0) - onehot.sum(1, True)).expand_as(onehot)")),
           "capacity rounded down": mutant(route_with_capacity, ("math.ceil(", "int(")),
           "top-k gates not renormalised":
               mutant(route_with_capacity, ("top if top_k == 1 else top / top.sum(-1, keepdim=True)", "top"))},
    hint="F.one_hot(idx, E) is (T, k, E): a cumulative sum over tokens gives each choice's place "
         "among earlier tokens' same choice; add the count of all earlier choices",
    sizes="float64; (tokens, experts, k, factor) = (7, 4, 2, 1.0), (7, 4, 1, 0.5), (5, 3, 2, 1.25), "
          "(9, 4, 2, 0.5), (9, 6, 3, 1.0), (1, 2, 1, 1.0)")
