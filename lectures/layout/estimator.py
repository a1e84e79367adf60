"""Per-rank memory of a training step under a (dp, pp, cp, tp) layout, from formulas.

Lecture 07's memory estimator: the counts of the earlier lectures put together. Weights,
gradients and optimizer state per parameter as in ZeRO (Rajbhandari et al. 2020,
https://arxiv.org/abs/1910.02054: K = 12 bytes of optimizer state in mixed precision; gradients
accumulated in fp32 as Megatron-LM and Llama 3 do, 18 bytes per parameter rather than the ZeRO
paper's 16), divided by tp (lecture 04), pp (lecture 05) and, per ZeRO stage, the dp·cp ranks that
hold the same weights (lecture 03; as the trainer, torchtitan and Megatron-LM shard); saved activations per
token and block after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (https://arxiv.org/abs/2205.05198), with flash attention (no s×s matrix),
divided by tp (and sequence parallelism), cp (lecture 06) and the micro-batches a pipeline stage
holds. tests/test_lecture_07.py checks it against what every rank of every layout holds.

- `ModelShape`: what the formulas need to know about a decoder-only transformer.
- `Layout`: a mesh and everything else that changes memory or time (ZeRO, micro-batching,
  recomputation, precision, sequence parallelism, pipeline schedule).
- `estimate_memory(model, layout)`: bytes per rank {weights, grads, optimizer, activations}.
"""
import dataclasses
import functools
import numbers

from lectures.layout.mesh import MESH_AXES

# =========================================================================================
# Per-rank memory: weights, gradients, optimizer state, activations
# =========================================================================================

def _whole_numbers(obj, names):
    """Refuse sizes that cannot mean anything: each must be an int ≥ 1 (not a bool, not 2.5)."""
    for k in names:
        v = getattr(obj, k)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{type(obj).__name__}.{k}={v!r}: must be a whole number ≥ 1")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory and time formulas need to know about a decoder-only transformer."""
    name: str
    layers: int            # L
    hidden: int            # h
    heads: int             # a
    kv_heads: int
    ffn: int               # f
    vocab: int             # v
    seq: int               # s
    mlp_matrices: int = 2  # 2: GELU MLP (fc_in, fc_out); 3: SwiGLU (gate, up, down)
    kv_expanded: bool = False  # K/V repeated to every query head before attention (lecture 01's GQA)
    bias: bool = True
    norm_params: int = 2   # LayerNorm: weight + bias per feature; RMSNorm: 1
    learned_positions: bool = True
    tied: bool = False
    # A mixture of experts (lecture 06): `experts` routed experts per MoE block (0: dense), each
    # token to `top_k` of them, `shared_experts` that see every token, each expert an MLP of
    # width `expert_ffn`; the first `dense_layers` blocks keep a dense MLP of width `ffn`
    # (DeepSeek-V3: 256 routed, top-8, 1 shared, width 2048, 3 dense blocks first).
    experts: int = 0
    top_k: int = 1
    shared_experts: int = 0
    expert_ffn: int = 0
    dense_layers: int = 0
    # node-limited routing (DeepSeek-V3 §2.1.2: each token to experts on at most M = 4 nodes, sent
    # across nodes once per node and forwarded inside it): copies of a token the all-to-all
    # carries across nodes; 0 = no limit (all top_k copies travel)
    route_nodes: int = 0

    def __post_init__(self):
        _whole_numbers(self, ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "top_k"))
        for k in ("experts", "shared_experts", "expert_ffn", "dense_layers", "route_nodes"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"ModelShape.{k}={v!r}: must be a whole number ≥ 0")
        if self.experts and not (self.top_k <= self.experts and self.expert_ffn >= 1 and self.dense_layers < self.layers):
            raise ValueError(f"a mixture of experts needs top_k ≤ experts ({self.top_k} > {self.experts}?), "
                             f"expert_ffn ≥ 1 (got {self.expert_ffn}) and a block after the dense ones "
                             f"(dense_layers={self.dense_layers} of {self.layers})")
        if not self.experts and (self.shared_experts or self.expert_ffn or self.dense_layers or self.route_nodes
                                 or self.top_k != 1):
            raise ValueError("shared_experts, expert_ffn, dense_layers, route_nodes and top_k describe a mixture of experts: "
                             "set experts ≥ 1, or leave them at their defaults")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads} (whole heads)")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be divisible by kv_heads={self.kv_heads} "
                             "(each K/V head serves a whole group of query heads)")
        if self.mlp_matrices not in (2, 3):
            raise ValueError(f"mlp_matrices={self.mlp_matrices!r}: 2 (GELU MLP) or 3 (SwiGLU)")
        if self.norm_params not in (0, 1, 2):
            raise ValueError(f"norm_params={self.norm_params!r}: 0, 1 (RMSNorm) or 2 (LayerNorm)")

    @classmethod
    def from_gpt(cls, cfg, name="lecture 01 GPT"):
        return cls(name, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.ff,
                   cfg.vocab_size, cfg.seq_len, tied=cfg.tie_embeddings, kv_expanded=True)

    @property
    def head_dim(self):
        return self.hidden // self.heads

    @functools.cached_property
    def _hash(self):
        return hash(dataclasses.astuple(self))

    def __hash__(self):
        # the cached methods below key on the shape: a search hashes it millions of times, so
        # its fields are hashed once (dataclass's own __hash__ builds their tuple every call)
        return self._hash

    def __getstate__(self):
        # a str hashes differently in another process: the cached hash stays in this one
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @functools.cached_property
    def kv_dim(self):
        return self.kv_heads * self.head_dim

    @functools.cache
    def layer_params(self, tp=1, moe=False):
        """(sharded over tp, replicated) parameters of one block. Column-parallel Q/K/V and the
        MLP's input matrices split their outputs (weights and biases), row-parallel O and the
        MLP's output matrix split their inputs (weights; the bias is added once, replicated);
        the norms are replicated. `moe`: an MoE block without its routed experts (`expert_params`):
        attention, the router (replicated) and the shared experts in place of the dense MLP."""
        h, kv, b = self.hidden, self.kv_dim, self.bias
        sharded = (h * h + 2 * h * kv) + (h * h) + b * (h + 2 * kv)
        replicated = b * h + 2 * self.norm_params * h
        if moe:
            mlp_sharded, mlp_replicated = self.expert_params()
            sharded += self.shared_experts * mlp_sharded
            replicated += self.shared_experts * mlp_replicated + h * self.experts
        else:
            f = self.ffn
            sharded += (self.mlp_matrices - 1) * h * f + f * h + b * (self.mlp_matrices - 1) * f
            replicated += b * h
        return sharded / tp, replicated

    @functools.cache
    def expert_params(self, tp=1):
        """(sharded over tp, replicated) parameters of one expert MLP of width `expert_ffn`."""
        h, f, b = self.hidden, self.expert_ffn, self.bias
        return ((self.mlp_matrices - 1) * h * f + f * h + b * (self.mlp_matrices - 1) * f) / tp, b * h

    def is_moe(self, layer):
        """Whether block `layer` (0-based) is a mixture of experts."""
        return bool(self.experts) and layer >= self.dense_layers

    @functools.cache
    def moe_layers(self):
        return self.layers - self.dense_layers if self.experts else 0

    @functools.cache
    def active_params(self):
        """Parameters one token runs through: every MoE block's top_k routed experts, not all."""
        k = self.top_k if self.experts else 0
        return self.params() - self.moe_layers() * (self.experts - k) * sum(self.expert_params())

    @functools.cache
    def matrix_params_per_token(self, moe=False):
        """Matrix parameters (sharded, tp = 1) one token multiplies in a block: the attention and
        MLP matrices; in an MoE block the router, the shared and its top_k routed experts."""
        if not moe:
            return self.layer_params()[0]
        return (self.layer_params(moe=True)[0] + self.hidden * self.experts
                + self.top_k * self.expert_params()[0])

    @functools.cache
    def tensors_per_layer(self):
        """Parameter tensors of one dense block: 4 attention matrices, the MLP's, their biases, norms."""
        return (4 + self.mlp_matrices) * (1 + self.bias) + 2 * (self.norm_params > 0) * self.norm_params

    @functools.cache
    def embedding_params(self):
        return self.vocab * self.hidden + self.learned_positions * self.seq * self.hidden

    @functools.cache
    def head_params(self):
        """The final norm and (untied) LM head."""
        return self.norm_params * self.hidden + (0 if self.tied else self.vocab * self.hidden)

    @functools.cache
    def params(self):
        """Ψ; equals lecture 01's param_count for its GPT (tested)."""
        dense, moe = self.layers - self.moe_layers(), self.moe_layers()
        moe_block = sum(self.layer_params(moe=True)) + self.experts * sum(self.expert_params())
        return self.embedding_params() + dense * sum(self.layer_params()) + moe * moe_block + self.head_params()

    @functools.cache
    def act_elements_per_token(self, tp=1, sp=False, selective=False, moe=False):
        """Elements autograd keeps per token in one block (measured below, in float32):
        the block input x, the first norm's output, Q, K, V, the attention output and its
        log-sum-exp (flash attention: no s×s matrix), the residual after attention, the second
        norm's output, and the MLP's intermediate tensors (GELU: its input and output, 2f;
        SwiGLU: gate, up, silu(gate), product, 4f), plus the norms' mean and 1/σ (4).
        Tensor parallelism splits heads and the MLP width; sequence parallelism also splits
        the residual-stream tensors along the sequence.
        `selective`: selective recomputation (Korthikanti et al. 2022, §5: recompute what takes
        much memory and few FLOPs) rebuilds the norms' outputs from their inputs and statistics
        and the MLP's activation (GELU's output; SwiGLU's silu(gate) and product) from the
        matrix outputs; no matrix product runs again (the course's own set: Korthikanti's §5
        recomputes the attention core instead, which flash attention never stores).
        `moe`: an MoE block's MLP part is its shared and top_k routed experts' intermediates,
        plus the k dispatched input rows and k expert outputs per token and the router's E
        probabilities."""
        h, f, a = self.hidden, self.ffn, self.heads
        kv = h if self.kv_expanded else self.kv_dim        # what attention receives and saves
        per = 2 if self.mlp_matrices == 2 else 4
        if moe:
            mlp = per * self.expert_ffn * (self.top_k + self.shared_experts) // (2 if selective else 1)
            mlp += 2 * self.top_k * h + self.experts
        else:
            mlp = per * f // (2 if selective else 1)
        split = (2 * h + 2 * kv + a + mlp) / tp               # Q, attention out, K, V, lse, MLP
        stream = (2 if selective else 4) * h + 4               # x, (norm out,) x2, (norm out,) stats
        return split + (stream / tp if sp else stream)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a training step: the mesh and everything that changes memory or time."""
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    zero: int = 0                  # ZeRO stage on the dp axis (0: plain data parallelism)
    micro_batch: int = 1           # sequences per micro-batch on one dp rank
    micro_batches: int = 1         # m: micro-batches per step (pipeline / accumulation)
    recompute: str = "none"        # "none", "selective" (recompute norms and the MLP's activation) or "full"
    precision: str = "fp32"        # "fp32", "bf16" (mixed: bf16 weights/grads, fp32 master + Adam), "fp64"
    sp: bool = False               # sequence parallelism with tp
    schedule: str = "1f1b"         # "1f1b" or "gpipe"
    vocab_parallel: bool = True    # the LM head split over tp (vocab-parallel cross-entropy)
    virtual_stages: int = 1        # v: model chunks per pipeline rank (interleaved 1F1B when > 1)
    ep: int = 1                    # expert parallelism: groups of ep data-parallel ranks share out the experts
    # context parallelism's attention: "ring" (K and V passed around, lecture 06's ring attention)
    # or "allgather" (K and V all-gathered per block, dK and dV reduce-scattered: Llama 3's, §3.3.2)
    cp_algorithm: str = "ring"

    def __post_init__(self):
        _whole_numbers(self, ("dp", "pp", "cp", "tp", "micro_batch", "micro_batches", "virtual_stages", "ep"))
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}: expert parallelism groups ep of the "
                             "data-parallel ranks (it lives inside data parallelism)")
        checks = {"zero": (0, 1, 2, 3), "recompute": RECOMPUTE, "precision": tuple(PRECISION_BYTES),
                  "schedule": SCHEDULES, "cp_algorithm": ("ring", "allgather")}
        for k, allowed in checks.items():
            v = getattr(self, k)
            if isinstance(v, bool) or v not in allowed:
                raise ValueError(f"Layout.{k}={v!r}: must be one of {', '.join(map(repr, allowed))}")
        if self.virtual_stages > 1 and (self.pp == 1 or self.schedule != "1f1b"):
            raise ValueError(f"virtual_stages={self.virtual_stages} interleaves a pipeline: it needs pp > 1 "
                             f"and schedule '1f1b' (got pp={self.pp}, schedule={self.schedule!r})")

    @property
    def world(self):
        return self.dp * self.pp * self.cp * self.tp

    @property
    def global_batch(self):
        return self.dp * self.micro_batch * self.micro_batches

    def label(self):
        parts = [f"{k}{getattr(self, k)}" for k in MESH_AXES if getattr(self, k) > 1] or ["1 rank"]
        if self.ep > 1:
            parts.insert(1, f"ep{self.ep}")
        if self.cp > 1 and self.cp_algorithm != "ring":
            parts.append("CP all-gather")
        if self.zero:
            parts.append(f"ZeRO-{self.zero}")
        if self.sp:
            parts.append("SP")
        if self.recompute != "none":
            parts.append("recompute" if self.recompute == "full" else "selective recompute")
        if self.pp > 1 and self.schedule != "1f1b":
            parts.append(self.schedule)
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        parts.append(f"mb{self.micro_batch}×{self.micro_batches}")
        return " ".join(parts)


RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
PRECISION_BYTES = {  # bytes per parameter (weights, grads, optimizer state) and per activation
    "fp64": {"weights": 8, "grads": 8, "optimizer": 16, "act": 8},   # the tests' exact runs
    # float32 AdamW: fp32 weights and grads, two fp32 moments; no separate master copy.
    "fp32": {"weights": 4, "grads": 4, "optimizer": 8, "act": 4},
    # mixed precision: bf16 weights; gradients accumulated in fp32 (Megatron-LM's default, and
    # Llama 3's: micro-batches add up in fp32); fp32 master weights and the two moments, K = 12.
    # 18 bytes per parameter (the ZeRO paper's accounting has bf16 gradients: 16).
    "bf16": {"weights": 2, "grads": 4, "optimizer": 12, "act": 2},
}


# The search asks these two for the same few (layers, pp, v) a million times: cached, and tuples
# so that no caller can change a cached answer.
@functools.lru_cache(maxsize=None)
def stage_layers(layers, pp):
    """How many blocks each pipeline stage holds: lecture 05's GPTStage cuts at k·L/pp, so
    sizes differ by at most one and the later stages take the extra."""
    return tuple((k + 1) * layers // pp - k * layers // pp for k in range(pp))


@functools.lru_cache(maxsize=None)
def rank_layers(layers, pp, v=1):
    """Blocks on each pipeline rank when every rank holds v chunks: chunk c of rank r is stage
    c·pp + r of lecture 05's looped layout (v = 1: `stage_layers`)."""
    stages = stage_layers(layers, pp * v)
    return tuple(sum(stages[c * pp + r] for c in range(v)) for r in range(pp))


@functools.lru_cache(maxsize=None)
def rank_blocks(model, pp, v=1):
    """(dense blocks, MoE blocks) on each pipeline rank: which of the model's blocks chunk c
    of rank r holds (stage c·pp + r cuts at k·L/(pp·v)), sorted by kind."""
    stages = stage_layers(model.layers, pp * v)
    starts = [sum(stages[:k]) for k in range(pp * v)]
    out = []
    for r in range(pp):
        ids = [i for c in range(v) for i in range(starts[c * pp + r], starts[c * pp + r] + stages[c * pp + r])]
        moe = sum(model.is_moe(i) for i in ids)
        out.append((len(ids) - moe, moe))
    return tuple(out)


def block_params(model, layout, stage):
    """(parameters of the rank's blocks that every replica holds, routed experts' parameters):
    experts split over ep (E/ep per rank) and their matrices over tp."""
    return _block_params(model, layout.pp, layout.virtual_stages, layout.tp, layout.ep, stage)


@functools.lru_cache(maxsize=65536)     # a search asks for the same few hundred a million times
def _block_params(model, pp, v, tp, ep, stage):
    dense, moe = rank_blocks(model, pp, v)[stage]
    shared = dense * sum(model.layer_params(tp)) + moe * sum(model.layer_params(tp, moe=True))
    experts = moe * model.experts / ep * sum(model.expert_params(tp)) if model.experts else 0
    return shared, experts


def largest_block(model, layout):
    """Parameters of the largest block on a rank (a dense one, or an MoE one with its E/ep experts)."""
    dense = sum(model.layer_params(layout.tp)) if model.dense_layers or not model.experts else 0
    moe = (sum(model.layer_params(layout.tp, moe=True)) + model.experts / layout.ep * sum(model.expert_params(layout.tp))
           if model.experts else 0)
    return max(dense, moe)


def held_chunks(layout, stage):
    """(micro-batch, chunk)s whose activations a pipeline rank holds at its peak, as lecture
    05's `held` counts them on its schedules: all m·v under GPipe; under 1F1B the warm-up's
    forwards and one more. Interleaved 1F1B's warm-up is 2(p − stage − 1) + (v − 1)·g forwards,
    g the size of its first group of micro-batches (`group_sizes`), so the first rank holds
    p·(1 + (p − 1)/(p·v)) micro-batches' worth instead of p (Narayanan et al. 2021, §2.2)."""
    p, m, v = layout.pp, layout.micro_batches, layout.virtual_stages
    if p == 1:
        return 1
    if layout.schedule == "gpipe":
        return m * v
    if v == 1:
        return min(p - stage, m)
    first_group = -(-m // max(1, m // p))
    return min(m * v, 2 * (p - stage - 1) + (v - 1) * first_group + 1)


def in_flight(layout, stage):
    """Micro-batches' worth of activations a stage holds at its peak: all m under GPipe, at most
    pp − stage under 1F1B (the first stage waits longest for its backward); with v chunks per
    rank a held chunk is 1/v of the rank's blocks."""
    return held_chunks(layout, stage) / layout.virtual_stages


def stage_params(model, layout, stage):
    """Parameters held by one rank of pipeline stage `stage` (before ZeRO). With
    `vocab_parallel` the token embedding and the LM head are split by vocabulary rows."""
    tp, first, last = layout.tp, stage == 0, stage == layout.pp - 1
    n = sum(block_params(model, layout, stage))
    if first:
        n += model.embedding_params()
        if layout.vocab_parallel:
            n -= model.vocab * model.hidden * (1 - 1 / tp)
    if last:
        head = model.head_params()
        if layout.vocab_parallel and not model.tied:
            head = model.norm_params * model.hidden + model.vocab * model.hidden / tp
        n += head
    return n


def activation_bytes(model, layout, stage):
    """(stored, transient) bytes of saved activations on one rank of `stage` at the peak of a
    step: stored = (per micro-batch) × (micro-batches in flight); transient = the larger of
    one block's full activations while it is recomputed during backward (full recomputation
    only) and, on the last stage, the loss's backward: the gradient of the fp32 log-probabilities
    and of the logits, two fp32 copies of the (vocabulary-parallel) logits (≈ 4 GB each for
    Llama 3 at micro-batch 1 × 8192). Tokens per micro-batch on this rank: micro_batch · s / cp."""
    B = PRECISION_BYTES[layout.precision]["act"]
    tokens = layout.micro_batch * model.seq / layout.cp
    n_layers = rank_layers(model.layers, layout.pp, layout.virtual_stages)[stage]
    dense, moe = rank_blocks(model, layout.pp, layout.virtual_stages)[stage]
    elements = lambda selective: (dense * model.act_elements_per_token(layout.tp, layout.sp, selective)
                                  + moe * model.act_elements_per_token(layout.tp, layout.sp, selective, moe=True))
    # one block's (the largest kind's) elements, for what is rebuilt one block at a time
    one = max(model.act_elements_per_token(layout.tp, layout.sp, moe=k) for k, n in ((False, dense), (True, moe)) if n) \
        if n_layers else 0
    one_kept = max(model.act_elements_per_token(layout.tp, layout.sp, True, moe=k) for k, n in ((False, dense), (True, moe))
                   if n) if n_layers else 0
    v = model.vocab / layout.tp if layout.vocab_parallel else model.vocab
    loss_grads = 2 * v * 4 * tokens if stage == layout.pp - 1 else 0
    if layout.recompute == "full":
        stored = n_layers * model.hidden * B * (1 / layout.tp if layout.sp else 1)
        transient = max(one * B * tokens, loss_grads)
    elif layout.recompute == "selective":   # one block's recomputed norms and activation at a time
        stored, transient = elements(True) * B, max((one - one_kept) * B * tokens, loss_grads)
    else:
        stored, transient = elements(False) * B, loss_grads
    if stage == 0:
        stored += 8                                            # the int64 token ids
    if stage == layout.pp - 1:
        stored += (2 * model.hidden + 2) * B + v * 4 + 8      # final norm in/out, fp32 log-probs, targets
    return tokens * stored * in_flight(layout, stage), transient


def check_split(model, layout):
    """Refuse a layout that cannot split this model (the page's calculator refuses the same):
    whole heads per tp rank, a block per pipeline chunk, 2·cp zig-zag chunks of the sequence."""
    problems = []
    if model.heads % layout.tp or model.kv_heads % layout.tp:
        problems.append(f"tp={layout.tp} must divide the heads ({model.heads}) and the K/V heads ({model.kv_heads})")
    if layout.pp * layout.virtual_stages > model.layers:
        problems.append(f"pp × virtual stages = {layout.pp * layout.virtual_stages} must not exceed the "
                        f"layers ({model.layers}): a block per chunk")
    if layout.cp > 1 and model.seq % (2 * layout.cp):
        problems.append(f"the sequence ({model.seq}) must split into 2·cp = {2 * layout.cp} zig-zag chunks")
    if model.experts % layout.ep if model.experts else layout.ep > 1:
        problems.append(f"ep={layout.ep} must divide the routed experts ({model.experts}): whole experts per rank")
    if problems:
        raise ValueError(f"{layout.label()} cannot split this model: " + "; ".join(problems))


@functools.cache
def estimate_memory(model, layout, stage=None):
    """Per-rank bytes {weights, grads, optimizer, gathered, activations, total} for the most
    loaded pipeline stage (or `stage`). ZeRO-1 shards the optimizer state over the dp·cp ranks
    that hold the same weights (context parallelism splits tokens, not weights), ZeRO-2 also
    the gradients, ZeRO-3 also the weights (lecture 03); tp divides the matrices (lecture 04);
    pp divides the layers (lecture 05); cp divides the tokens (lecture 06). `gathered` is
    ZeRO-3's working set: two blocks' weights and gradients unsharded at once (the block being
    computed and the next one prefetched, or its gradients waiting for their reduce-scatter),
    plus the stage's embedding and LM head, which sit in FSDP's root unit and stay gathered from
    forward to backward."""
    if stage is None:   # every stage: uneven layer counts can make a middle stage the heaviest
        check_split(model, layout)
        # (max keeps the first of equals: ties go to the earliest stage)
        return max((estimate_memory(model, layout, s) for s in range(layout.pp)), key=lambda m: m["total"])
    B = PRECISION_BYTES[layout.precision]
    n = stage_params(model, layout, stage)
    dp, z = layout.dp * layout.cp, layout.zero
    n_layers = rank_layers(model.layers, layout.pp, layout.virtual_stages)[stage]
    shared, experts = block_params(model, layout, stage)
    gathered = (min(2, n_layers) * largest_block(model, layout) + n - shared - experts) * (B["weights"] + B["grads"])
    # ZeRO shards each parameter over the ranks that hold it: the routed experts over dp·cp/ep
    shards = lambda on: (n - experts) / (dp if on else 1) + experts / (dp // layout.ep if on else 1)
    stored_and_transient = activation_bytes(model, layout, stage)
    out = {"stage": stage, "params": n,
           "weights": B["weights"] * shards(z >= 3),
           "grads": B["grads"] * shards(z >= 2),
           "optimizer": B["optimizer"] * shards(z >= 1),
           "gathered": gathered if z >= 3 and dp > 1 else 0,
           "activations": sum(stored_and_transient), "stored activations": stored_and_transient[0]}
    out["total"] = out["weights"] + out["grads"] + out["optimizer"] + out["gathered"] + out["activations"]
    return out
