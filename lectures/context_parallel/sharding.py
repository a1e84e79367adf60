"""Sharding a sequence over the ranks of a context-parallel group: contiguous chunks, or the
zig-zag (head-tail) layout that balances causal attention (Llama 3's context parallelism, Llama
Team 2024 §3.3.2; zhuzilin's ring-flash-attention), and the segments each layout gives a rank.

Zig-zag cuts the sequence into 2n chunks and gives rank r chunks r and 2n−1−r, one early and one
late, so that under a causal mask every rank has the same work. A rank's positions are described
as segments (local start, length, global start), which is all the attention kernels of
`lectures/context_parallel/blocks.py` need to mask correctly. Lengths need not divide evenly.
"""
import torch
import torch.distributed as dist


def split_sizes(total, parts):
    """Sizes of torch.tensor_split(range(total), parts): the first total % parts get one more."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def offsets(sizes):
    """Where each part starts when parts of `sizes` follow each other: [0, s0, s0 + s1, ...]."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def check_rank(rank, world_size):
    """Refuse a rank that is not 0..world_size−1: a global rank passed where a group rank belongs
    would otherwise select another rank's chunks without a word."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size} ranks (0..{world_size - 1}): pass "
                         "the rank within the context-parallel group (dist.get_rank(group)), not the global rank")


def zigzag_chunks(rank, world_size):
    """The two chunks (of 2n) that rank r holds under zig-zag: r and 2n−1−r (one early, one late)."""
    check_rank(rank, world_size)
    return rank, 2 * world_size - 1 - rank


def zigzag_shard(x, rank, world_size, dim):
    """This rank's zig-zag slice of the full sequence x along `dim`: chunks r and 2n−1−r of 2n."""
    chunks = torch.tensor_split(x, 2 * world_size, dim=dim)
    a, b = zigzag_chunks(rank, world_size)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def zigzag_unshard(shards, dim):
    """The full sequence from every rank's zig-zag shard (a list, in rank order)."""
    n = len(shards)
    total = sum(s.shape[dim] for s in shards)
    sizes = split_sizes(total, 2 * n)
    chunks = [None] * (2 * n)
    for r, s in enumerate(shards):
        a, b = zigzag_chunks(r, n)
        chunks[a], chunks[b] = torch.split(s, [sizes[a], sizes[b]], dim=dim)
    return torch.cat(chunks, dim=dim)


def contiguous_shard(x, rank, world_size, dim):
    """This rank's contiguous slice along `dim` (torch.tensor_split's sizes)."""
    check_rank(rank, world_size)
    return torch.tensor_split(x, world_size, dim=dim)[rank]


def shard_sequence(x, rank, world_size, dim, layout="contiguous"):
    """x's slice for `rank` under `layout` ('contiguous' or 'zigzag')."""
    if layout == "zigzag":
        return zigzag_shard(x, rank, world_size, dim)
    if layout == "contiguous":
        return contiguous_shard(x, rank, world_size, dim)
    raise ValueError(f"layout must be 'contiguous' or 'zigzag', not {layout!r}")


def unshard_sequence(shards, dim, layout="contiguous"):
    """The full sequence from every rank's shard under `layout` (a list, in rank order)."""
    return zigzag_unshard(shards, dim) if layout == "zigzag" else torch.cat(shards, dim=dim)


def layout_segments(lengths, layout):
    """Every rank's segments [(local start, length, global start), ...] given every rank's local
    length: contiguous ranks follow each other; zig-zag ranks hold chunks r and 2n−1−r of 2n."""
    n = len(lengths)
    if layout == "contiguous":
        return [[(0, l, g)] for l, g in zip(lengths, offsets(lengths))]
    if layout != "zigzag":
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', not {layout!r}")
    total = sum(lengths)
    sizes = split_sizes(total, 2 * n)
    starts = offsets(sizes)
    segs = []
    for r in range(n):
        a, b = zigzag_chunks(r, n)
        if sizes[a] + sizes[b] != lengths[r]:
            raise ValueError(f"zig-zag layout: rank {r} holds {lengths[r]} positions, but chunks {a} and "
                             f"{b} of a {total}-long sequence have {sizes[a]} + {sizes[b]}; shard with "
                             "zigzag_shard")
        segs.append([(0, sizes[a], starts[a]), (sizes[a], sizes[b], starts[b])])
    return segs


def sequence_positions(seq_len, rank, world_size, layout="contiguous"):
    """The global positions of this rank's tokens (for GPT.forward(tokens, positions=...))."""
    return shard_sequence(torch.arange(seq_len), rank, world_size, 0, layout)


def striped_positions(seq_len, rank, world_size):
    """Striped attention's layout (Brandon et al. 2023): rank r holds tokens r, r+n, r+2n, … The
    other balanced layout; this course's ring implements contiguous and zig-zag, and uses this one
    only to count and draw the work (each of its blocks is a near-triangle, so a kernel needs a
    mask shifted by one for ranks after the query's)."""
    check_rank(rank, world_size)
    return torch.arange(rank, seq_len, world_size)


def causal_work(positions):
    """Score entries a rank computes in causal attention over the whole sequence, with a kernel
    that skips masked entries: a query at position p sees p + 1 keys, wherever they live."""
    return int(sum(int(p) + 1 for p in positions))


# --- Which rank holds how many positions ----------------------------------------------------

def group_info(group):
    """(group, its size, this rank's index in it); None means the default group. Every building
    block of lecture 06 calls this first, so a rank outside `group` gets one clear error (not
    zeros, not an IndexError deep inside)."""
    group = group or dist.group.WORLD
    r = dist.get_rank(group)
    if r < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of this process group: call the "
                         "layer only on the group's ranks (each rank passes the group it belongs to)")
    return group, dist.get_world_size(group), r


def agreed_lengths(local_len, signature, group, n, dev):
    """Every rank's local sequence length, and a check that the ranks agree on everything else in
    `signature` ({what: int}, e.g. heads, head dim, dtype): all in one all_gather of a few
    integers, which every rank needs anyway for the lengths. A rank that disagreed would otherwise
    post transfers of other sizes (gloo aborts the process) or compute a silently wrong answer;
    here every rank raises the same ValueError, naming what differs on which rank. The price is
    one wait for the device per call (`tolist`): the segments are planned on the host."""
    t = torch.tensor([local_len, *signature.values()], dtype=torch.int64, device=dev)
    out = [torch.zeros_like(t) for _ in range(n)]
    dist.all_gather(out, t, group=group)
    rows = [x.tolist() for x in out]
    for i, what in enumerate(signature, start=1):
        if len({row[i] for row in rows}) > 1:
            seen = ", ".join(f"rank {r}: {signature_value(what, row[i])}" for r, row in enumerate(rows))
            raise ValueError(f"the ranks of this context-parallel group disagree on {what} ({seen}): every rank "
                             "must call with the same shapes, dtype and arguments; only the sequence length may differ")
    return [row[0] for row in rows]


DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("contiguous", "zigzag")


def dtype_code(dtype):
    """A dtype as an integer every rank computes alike (−1: one of the others)."""
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def signature_value(what, code):
    """An agreed integer back in words, for the error."""
    if what == "dtype":
        return str(DTYPES[code]).replace("torch.", "") if code >= 0 else "another dtype"
    if what == "layout":
        return LAYOUTS[code] if code >= 0 else "neither layout"
    if what == "causal":
        return str(bool(code))
    return str(code)
