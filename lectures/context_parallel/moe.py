"""Mixture of experts and expert parallelism.

A router gives each token a probability for each of E expert MLPs; the token goes to its top-k
experts (Switch Transformer, Fedus, Zoph, Shazeer 2021: k = 1; GShard, Lepikhin et al. 2020:
k = 2) and its output is their gate-weighted sum. Each expert takes at most C tokens (capacity);
the rest of its queue is dropped, first choices before second choices. Switch's auxiliary
balance loss keeps the router from collapsing onto a few experts. With no capacity
(`capacity_factor=None`) the layer is *dropless* (MegaBlocks; DeepSeek-V3 drops no token in
training): every expert takes all its tokens, at the price of batches whose sizes change every
step. Shared experts (DeepSeek-MoE, Dai et al. 2024) run on every token beside the routed ones.

Expert parallelism puts E/n experts on each of n ranks and moves the token rows to them and back
with two all-to-alls (dispatch, combine), as GShard does; `ExpertParallelMoE` equals `MoE` on all
ranks' tokens together, dropped tokens included. `RankCapacityMoE` sizes capacity per rank
from its own tokens, as GShard, Switch and Megatron do: it equals `MoE` applied to each rank's
tokens as a batch of its own.
"""
import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lectures.model.gpt import GPT
from lectures.context_parallel.sharding import group_info, offsets, split_sizes


class Expert(nn.Module):
    """One expert: the GPT's MLP (d_model -> d_ff -> d_model, GELU)."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


def route(router, x, top_k, bias=None):
    """Router probabilities (T, E), the top-k experts of every token (T, k) and their gates.
    Top-1 (Switch) gates by the expert's probability, so the router learns through it; top-k > 1
    renormalises the k probabilities to sum to one (GShard's top-2, Mixtral). `bias` (E,), if
    given, shifts only the *choice* of experts, not the gates (DeepSeek-V3's auxiliary-loss-free
    balancing)."""
    return route_logits(router(x), top_k, bias)


def route_logits(logits, top_k, bias=None):
    """`route` from the router's logits (T, E)."""
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k={top_k}: every token picks 1 to {logits.shape[-1]} experts (there are "
                         f"{logits.shape[-1]})")
    acc = torch.promote_types(logits.dtype, torch.float32)         # the softmax in fp32 at least
    probs = torch.softmax(logits.to(acc), dim=-1).to(logits.dtype)
    if bias is None:
        top, idx = probs.topk(top_k, dim=-1)
    else:
        idx = (probs + bias.to(probs.dtype)).topk(top_k, dim=-1).indices
        top = probs.gather(1, idx)
    gates = top if top_k == 1 else top / top.sum(-1, keepdim=True)
    return probs, idx, gates


def z_loss(logits):
    """The router z-loss of ST-MoE (Zoph et al. 2022, eq. 5): mean over tokens of
    (log Σ_e exp(logit_e))². It keeps the router's logits small, where the softmax is stable
    in low precision; ST-MoE weights it 10⁻³."""
    return torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1).pow(2).mean()


def capacity(capacity_factor, tokens, top_k, n_experts):
    """Expert capacity: C = ⌈factor · T · k / E⌉ slots per expert; None = no limit."""
    if (capacity_factor is not None and not capacity_factor >= 0) or capacity_factor == math.inf \
            or tokens < 0 or min(top_k, n_experts) < 1:
        raise ValueError(f"need factor >= 0 (or None), tokens >= 0, top_k and n_experts >= 1; got "
                         f"{capacity_factor}, {tokens}, {top_k}, {n_experts}")
    return tokens * top_k if capacity_factor is None else math.ceil(capacity_factor * tokens * top_k / n_experts)


def slot_counts(idx, n_experts):
    """(k, E): how many tokens chose expert e as their i-th choice."""
    return F.one_hot(idx, n_experts).sum(0) if idx.numel() else \
        torch.zeros(idx.shape[1], n_experts, dtype=torch.int64, device=idx.device)


def positions_in_expert(idx, n_experts, base):
    """The queue position of every (token, choice) at its expert: all first choices before any
    second choice (GShard's priority), tokens in order; `base` (k, E) = slots taken before ours."""
    onehot = F.one_hot(idx, n_experts)                              # (T, k, E)
    before = onehot.cumsum(0) - onehot                              # earlier tokens, same choice
    return (before + base.unsqueeze(0)).gather(2, idx.unsqueeze(-1)).squeeze(-1)  # (T, k)


def local_queue(idx, n_experts):
    """Queue positions (T, k) of one batch of tokens on its own, and its (k, E) choice counts."""
    counts = slot_counts(idx, n_experts)
    base = torch.cat([torch.zeros_like(counts[:1]), counts.cumsum(0)[:-1]])   # earlier choices first
    return positions_in_expert(idx, n_experts, base), counts


def balance_loss(probs_sum, first_choice_counts, tokens, n_experts):
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4): E · Σ_e f_e · P_e, with f_e
    the fraction of tokens whose first choice is e (no gradient) and P_e the mean router
    probability of e. Equals 1 under perfectly uniform routing; GShard's m_e·c_e is the same form.
    No tokens, no imbalance: 0 (not 0/0)."""
    tokens = max(tokens, 1)
    f = first_choice_counts.to(probs_sum.dtype) / tokens
    return n_experts * (f * probs_sum / tokens).sum()


class MoE(nn.Module):
    """A mixture-of-experts MLP: tokens (..., d_model) -> (..., d_model). Each token goes to its
    top-k experts; an expert takes at most C tokens (capacity), the rest of its queue is dropped
    (that choice contributes nothing; the residual connection carries the token); capacity_factor
    None is dropless. `n_shared` shared experts see every token, ungated. After forward,
    `aux_loss` holds the balance loss and `stats` the routing counts."""

    def __init__(self, d_model, d_ff, n_experts, top_k=1, capacity_factor=1.25, bias_update=0.0, n_shared=0):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.d_model, self.n_experts, self.top_k, self.capacity_factor = d_model, n_experts, top_k, capacity_factor
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(n_experts))
        # DeepSeek-MoE's shared experts: common knowledge every token needs, kept out of the routed ones
        self.shared = nn.ModuleList(Expert(d_model, d_ff) for _ in range(n_shared))
        # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias on the choice, moved by
        # `bias_update` (their γ) after each step; 0 = off.
        self.bias_update = bias_update
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        self.aux_loss, self.z_loss, self.stats = None, None, None

    def update_bias(self):
        """After a step: raise the bias of experts that got fewer tokens than the mean, lower it
        for those that got more, by γ each (DeepSeek-AI 2024, §2.1.2); no gradient involved."""
        load = torch.tensor(self.stats["tokens_per_expert"], dtype=self.expert_bias.dtype,
                            device=self.expert_bias.device)
        self.expert_bias += self.bias_update * torch.sign(load.mean() - load)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T, E = x.shape[0], self.n_experts
        logits = self.router(x)
        probs, idx, gates = route_logits(logits, self.top_k, self.expert_bias if self.bias_update else None)
        self.z_loss = z_loss(logits)
        pos, counts = local_queue(idx, E)
        cap = capacity(self.capacity_factor, T, self.top_k, E)
        keep = pos < cap
        out = shared_output(self.shared, x)
        for e, expert in enumerate(self.experts):
            t, i = torch.nonzero((idx == e) & keep, as_tuple=True)   # (an idle expert runs on 0 rows:
            out = out.index_add(0, t, gates[t, i].unsqueeze(-1) * expert(x[t]))  # zero, not None, grads)
        self.aux_loss = balance_loss(probs.sum(0), counts[0], T, E)
        self.stats = {"tokens_per_expert": counts.sum(0).tolist(), "kept_per_expert":
                      [int(((idx == e) & keep).sum()) for e in range(E)], "dropped": int((~keep).sum()),
                      "assignments": T * self.top_k, "capacity": cap, "keep": keep.detach()}
        return out.view(shape)


def shared_output(shared, x):
    """The shared experts' sum on every token (zeros when there are none): no router, no gate."""
    out = torch.zeros_like(x)
    for expert in shared:
        out = out + expert(x)
    return out


# --- Expert parallelism: experts on different ranks, tokens dispatched by all-to-all ----------

class AllToAll(torch.autograd.Function):
    """Rows of x go to the ranks in `send` counts; `recv` counts come back. Backward sends the
    gradients home: the same all-to-all with the counts swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.meta = (send, recv, group)
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        send, recv, group = ctx.meta
        return AllToAll.apply(g, recv, send, group), None, None, None


def expert_owners(n_experts, world_size):
    """Rank r owns experts [start_r, start_r + count_r): contiguous, as even as possible."""
    counts = split_sizes(n_experts, world_size)
    return counts, offsets(counts)


class ExpertParallelMoE(nn.Module):
    """The same layer with its experts spread over `group`: every rank keeps the router and its
    own experts, routes its own tokens, and the layer equals `MoE` applied to all ranks' tokens
    together (in rank order) — the same outputs, gradients and dropped tokens.

    Per forward: (1) all-gather the (k, E) choice counts, so every rank knows the global queue
    positions and drops exactly what one process would; (2) all-to-all the per-expert counts of
    the tokens each rank will send (the receivers size their buffers); (3) all-to-all the token
    rows, uneven splits; (4) run the local experts; (5) all-to-all the results back and combine
    them, weighted by the gates. `aux_loss` is this rank's share of the balance loss (the shares
    sum to the whole).

    DeepSeek-V3's bias (`bias_update` > 0) is kept on every rank: the choice uses it, and
    `update_bias` moves it by the *global* load (the all-gathered counts of step 1), so every
    rank's copy stays the same without another collective. Shared experts are replicated like
    the router: each rank runs them on its own tokens, and their gradients sum over all ranks."""

    def __init__(self, router, experts, n_experts, top_k, capacity_factor, group, bias_update=0.0,
                 expert_bias=None, shared=()):
        super().__init__()
        self.group, self.n_experts, self.top_k, self.capacity_factor = group, n_experts, top_k, capacity_factor
        self.router, self.experts, self.shared = router, experts, nn.ModuleList(shared)
        self.bias_update = bias_update
        bias = torch.zeros(n_experts) if expert_bias is None else expert_bias.detach().clone()
        if bias.shape != (n_experts,):
            raise ValueError(f"expert_bias has shape {tuple(bias.shape)}, expected ({n_experts},)")
        self.register_buffer("expert_bias", bias)
        self.aux_loss, self.stats = None, None

    @classmethod
    def from_full(cls, moe, group=None):
        """This rank's part of `moe`: a copy of the router, of the experts it owns and of
        DeepSeek-V3's expert bias and its step γ."""
        group, n, r = group_info(group)
        counts, starts = expert_owners(moe.n_experts, n)
        mine = nn.ModuleList(copy.deepcopy(moe.experts[e]) for e in range(starts[r], starts[r] + counts[r]))
        return cls(copy.deepcopy(moe.router), mine, moe.n_experts, moe.top_k, moe.capacity_factor, group,
                   bias_update=moe.bias_update, expert_bias=moe.expert_bias, shared=copy.deepcopy(moe.shared))

    def update_bias(self):
        """`MoE.update_bias` on the global load (`stats` holds all ranks' counts), so every rank
        moves its copy of the bias identically."""
        MoE.update_bias(self)

    def forward(self, x):
        group_info(self.group)                                         # refuse a rank outside the group
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        E, k = self.n_experts, self.top_k
        probs, idx, gates = route(self.router, x, k, self.expert_bias if self.bias_update else None)
        pos, per_slot, total = self._global_queue(idx)                 # (1) everyone's choices
        cap = capacity(self.capacity_factor, total, k, E)
        keep = pos < cap
        # Kept (token, choice) pairs ordered by expert, so by destination rank, then by position.
        t, i = torch.nonzero(keep, as_tuple=True)
        e = idx[t, i]
        order = torch.argsort(e * (cap + 1) + pos[t, i], stable=True)
        t, i, e = t[order], i[order], e[order]
        got, send, recv = self._exchange_counts(torch.bincount(e, minlength=E))   # (2) rows per expert
        rows = AllToAll.apply(x[t], send, recv, self.group)            # (3) dispatch
        y = self._run_experts(rows, got)                               # (4) local experts
        back = AllToAll.apply(y, recv, send, self.group)               # (5) combine
        out = shared_output(self.shared, x).index_add(0, t, gates[t, i].unsqueeze(-1) * back)
        self.aux_loss = balance_loss(probs.sum(0), per_slot[0], total, E)
        self.stats = {"tokens_per_expert": per_slot.sum(0).tolist(), "dropped_here": int((~keep).sum()),
                      "dropped": int(sum(max(0, c - cap) for c in per_slot.sum(0).tolist())) if k == 1 else None,
                      "rows_sent": send, "rows_received": recv, "capacity": cap, "keep": keep.detach()}
        return out.view(shape)

    def _global_queue(self, idx):
        """(1) All-gather every rank's (k, E) choice counts. Returns this rank's queue positions
        (T, k) as if all ranks' tokens were one batch in rank order, the global counts per choice
        (k, E), and the global number of tokens."""
        _, n, r = group_info(self.group)
        counts = slot_counts(idx, self.n_experts)
        every = [torch.empty_like(counts) for _ in range(n)]
        dist.all_gather(every, counts, group=self.group)
        every = torch.stack(every)                                     # (n, k, E)
        per_slot = every.sum(0)                                        # (k, E)
        base = torch.cat([torch.zeros_like(per_slot[:1]), per_slot.cumsum(0)[:-1]]) + every[:r].sum(0)
        return positions_in_expert(idx, self.n_experts, base), per_slot, int(every[:, 0].sum())

    def _exchange_counts(self, per_expert):
        """(2) All-to-all the rows this rank has for each expert to the experts' owners, so every
        receiver can size its buffer. Returns got (n, local experts): rows arriving from each rank
        for each local expert; the rows sent to and received from each rank."""
        _, n, _ = group_info(self.group)
        owners, first = expert_owners(self.n_experts, n)
        mine = len(self.experts)
        got = torch.empty(n * mine, dtype=torch.int64, device=per_expert.device)
        dist.all_to_all_single(got, per_expert, [mine] * n, owners, group=self.group)
        got = got.view(n, mine)
        send = [int(per_expert[a:a + c].sum()) for a, c in zip(first, owners)]
        return got, send, got.sum(1).tolist()

    def _run_experts(self, rows, got):
        """(4) The rows arrive grouped by source rank, then expert: regroup them by local expert,
        run each expert on its rows, and put the results back in arrival order."""
        n, mine = got.shape
        local = torch.arange(mine, device=rows.device).repeat(n).repeat_interleave(got.view(-1))
        perm = torch.argsort(local, stable=True)
        outs = [expert(part) for expert, part in zip(self.experts, torch.split(rows[perm], got.sum(0).tolist()))]
        return torch.cat(outs)[torch.argsort(perm)] if outs else rows


class RankCapacityMoE(ExpertParallelMoE):
    """Expert parallelism as GShard, Switch and Megatron size capacity: each rank queues its own
    tokens and gives each expert C = ⌈factor · T_r · k / E⌉ of them, T_r its own token count, so
    step (1), the all-gather of every rank's choice counts, is gone (one collective less per
    layer). The layer then equals `MoE` applied to each rank's tokens as a batch of its own
    (GShard's groups), not to all of them together: which tokens drop depends on how the ranks'
    tokens happen to route. The balance loss is each rank's group's, and `aux_loss` is its share
    of their mean. DeepSeek-V3's bias needs the global load, which this layer no longer gathers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bias_update:
            raise ValueError("RankCapacityMoE gathers no global load, so every rank would move DeepSeek-V3's "
                             "bias differently: use ExpertParallelMoE for bias_update > 0")

    def _global_queue(self, idx):
        """(1) without communication: queue positions, counts and tokens of this rank alone."""
        return (*local_queue(idx, self.n_experts), idx.shape[0])

    def forward(self, x):
        out = super().forward(x)
        self.aux_loss = self.aux_loss / group_info(self.group)[1]     # n groups' losses, averaged
        return out


def moe_gpt(cfg, n_experts, top_k, capacity_factor):
    """Lecture 01's GPT with every MLP replaced by a mixture of experts of the same width."""
    model = GPT(cfg)
    torch.manual_seed(cfg.seed)
    for block in model.blocks:
        block.mlp = MoE(cfg.d_model, cfg.ff, n_experts, top_k, capacity_factor).to(cfg.torch_dtype)
    return model
