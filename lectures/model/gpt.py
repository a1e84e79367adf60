"""The small GPT every lecture trains, and the task it learns.

A pre-LayerNorm decoder in the spirit of nanoGPT, small enough to train in seconds on a CPU,
and a synthetic language (walks through a fixed random Markov chain) whose best possible loss is
known, so a curve can be judged against it. Later lectures never edit this model: they
transform it (split its layers, its heads, its sequence) and compare against it.
"""
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A pre-LayerNorm decoder. The defaults train in seconds on a CPU."""
    vocab_size: int = 64
    seq_len: int = 32          # the longest sequence (learned positions)
    d_model: int = 64          # h
    n_layers: int = 2          # L
    n_heads: int = 4           # a
    n_kv_heads: int = None     # grouped-query attention: heads that share K/V; None = n_heads
    d_ff: int = None           # MLP width; None = 4·h
    tie_embeddings: bool = False  # the LM head reuses the token embedding
    dtype: str = "float32"
    seed: int = 0              # the initial weights depend on this alone

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("n_kv_heads", "d_ff"):   # None means the default; 0 would silently mean it too
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1 (or None for the default)")
        kv = self.kv_heads
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={kv}")

    @property
    def head_dim(self):
        return self.d_model // self.n_heads

    @property
    def kv_heads(self):
        return self.n_kv_heads or self.n_heads

    @property
    def ff(self):
        return self.d_ff or 4 * self.d_model

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)


def causal_attention(q, k, v):
    """softmax(q kᵀ/√d + causal mask) v on (batch, heads, seq, head_dim) tensors. Later lectures
    swap this for a distributed version by setting `CausalSelfAttention.attend`."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Separate Q, K, V projections (so tensor parallelism can split heads, and K/V heads
    separately under grouped-query attention), then the output projection."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model)
        self.attend = causal_attention

    def forward(self, x):
        b, s, _ = x.shape
        # Head counts come from the weights, so a layer whose heads were split across ranks
        # (lecture 04) runs this same code on its share.
        heads = self.q_proj.out_features // self.head_dim
        kv_heads = self.k_proj.out_features // self.head_dim
        q = self.q_proj(x).view(b, s, heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, kv_heads, self.head_dim).transpose(1, 2)
        if kv_heads != heads:  # grouped-query attention: each K/V head serves heads/kv_heads queries
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        y = self.attend(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.ff)
        self.fc_out = nn.Linear(cfg.ff, cfg.d_model)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """x + attn(LN(x)), then x + mlp(LN(x)): the pre-LayerNorm residual block."""

    def __init__(self, cfg):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab). Initial weights depend on cfg.seed only."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):  # a private seed: the caller's RNG is untouched
            torch.manual_seed(cfg.seed)
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            if cfg.tie_embeddings:
                self.lm_head.weight = self.tok_emb.weight
            self._init_weights()
        if cfg.torch_dtype != torch.get_default_dtype():  # a no-op .to() would fail under FakeTensorMode
            self.to(cfg.torch_dtype)

    def _init_weights(self):
        # GPT-2's scheme: N(0, 0.02) everywhere, residual outputs scaled by 1/√(2L) so the
        # residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.zeros_(p) if not name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")) \
                    else nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("o_proj.weight", "fc_out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def embed(self, tokens, positions=None):
        """Token plus position embeddings. `positions` (default 0..s−1) lets a rank that holds a
        slice of the sequence (context parallelism) embed it at its true positions."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok_emb(tokens) + self.pos_emb(positions)

    def head(self, x):
        return self.lm_head(self.ln_f(x))

    def forward(self, tokens, positions=None):
        x = self.embed(tokens, positions)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def param_count(cfg):
    """Ψ in closed form for this architecture; equals sum(p.numel()) (tested).

    The syllabus' Ψ ≈ h·v + L·(12h² + 13h) + 2h assumes 4h MLPs and full multi-head attention;
    per layer here: Q and O are h² + h each, K and V are h·h_kv + h_kv each (h_kv = kv heads ×
    head dim), the MLP 2·h·f + f + h, two LayerNorms 4h. Plus learned positions s·h, the final
    LayerNorm 2h, and an untied LM head h·v."""
    h, v, f = cfg.d_model, cfg.vocab_size, cfg.ff
    h_kv = cfg.kv_heads * cfg.head_dim
    per_layer = 2 * (h * h + h) + 2 * (h * h_kv + h_kv) + (2 * h * f + f + h) + 4 * h
    return h * v + cfg.seq_len * h + cfg.n_layers * per_layer + 2 * h + (0 if cfg.tie_embeddings else h * v)


# --- the task: sequences from a fixed random Markov chain ----------------------------------

def markov_chain(vocab_size, seed=0, branching=4):
    """A transition matrix where each token has `branching` likely successors: a model that
    learns it gets well below the uniform loss ln(vocab)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    logits = torch.randn(vocab_size, vocab_size, generator=g)
    top = logits.topk(branching, dim=1).indices
    probs = torch.full((vocab_size, vocab_size), 1e-3)
    probs.scatter_(1, top, torch.rand(vocab_size, branching, generator=g) + 0.5)
    return probs / probs.sum(dim=1, keepdim=True)


def entropy_rate(cfg, seed=0):
    """The loss a perfect model reaches (nats/token), from the chain's stationary distribution."""
    p = markov_chain(cfg.vocab_size, seed).double()
    pi = torch.full((cfg.vocab_size,), 1.0 / cfg.vocab_size, dtype=torch.float64)
    for _ in range(500):
        pi = pi @ p
    return float(-(pi[:, None] * p * p.log()).sum())


def batch(cfg, batch_size, step, seed=0):
    """(tokens, targets), each (batch_size, seq_len) int64: `batch_size` sequences walked
    through the chain, targets shifted by one. Depends only on (cfg, batch_size, step, seed),
    so every rank builds the same global batch and takes its slice."""
    p = markov_chain(cfg.vocab_size, seed)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    walk = torch.empty(batch_size, cfg.seq_len + 1, dtype=torch.long)
    walk[:, 0] = torch.randint(cfg.vocab_size, (batch_size,), generator=g)
    for t in range(cfg.seq_len):
        walk[:, t + 1] = torch.multinomial(p[walk[:, t]], 1, generator=g).squeeze(1)
    return walk[:, :-1].contiguous(), walk[:, 1:].contiguous()


def loss_fn(logits, targets):
    """Mean next-token cross-entropy (nats)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
