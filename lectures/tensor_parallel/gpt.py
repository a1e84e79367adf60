"""Tensor parallelism applied to the GPT of `lectures/model/gpt.py`, twice: with our layers
(`parallelize_gpt`) and with PyTorch's DTensor sharding annotations (`parallelize_gpt_dtensor`).

Like torchtitan's `parallelize` functions, the model file stays plain PyTorch and the parallelism
is a plan applied afterwards: module-name patterns -> a style that builds the module's replacement
(or hooks its input). The split follows Megatron-LM (Shoeybi et al. 2019,
https://arxiv.org/abs/1909.08053): heads split across ranks, the MLP column -> row, the embedding
and LM head split by vocabulary; with sequence parallelism (Korthikanti et al. 2022,
https://arxiv.org/abs/2205.05198) the LayerNorms and the residual stream hold s/tp positions.
"""
import copy
import fnmatch
import functools

import torch
import torch.distributed as dist

from lectures.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, SequenceParallelLayerNorm,
                                             SequenceParallelPositions, _value)
from lectures.tensor_parallel.attention import TensorParallelAttention
from lectures.tensor_parallel.ops import _check_agreed, _size_rank
from lectures.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy
from util import new_group


def tp_group(world_size, tp):
    """The tensor-parallel group of this rank: consecutive ranks (a node's GPUs) form a group.
    Every rank creates every group, in the same order, as torch.distributed requires."""
    if tp == world_size:
        return dist.group.WORLD
    mine = None
    for start in range(0, world_size, tp):
        g = new_group(list(range(start, start + tp)))
        if dist.get_rank() in range(start, start + tp):
            mine = g
    return mine


# =========================================================================================
# parallelize_gpt: a plan from module names to how each is split
# =========================================================================================
# Every module that owns parameters must be in the plan; one that is not is refused rather
# than silently left replicated.

def _replicate(module, group):
    """Keep the module whole on every rank (its gradients come out identical everywhere)."""
    return module


def gpt_plan(cfg, sequence_parallel=False):
    """The tensor-parallel plan for lecture 01's GPT, in the order it is applied (the token
    embedding before the LM head, so a tied head can share the embedding's slice)."""
    sp = sequence_parallel
    col, row = ColumnParallelLinear.from_full, RowParallelLinear.from_full
    norm = SequenceParallelLayerNorm.from_full if sp else _replicate
    return {
        "tok_emb": functools.partial(VocabParallelEmbedding.from_full, sequence_parallel=sp),
        "pos_emb": SequenceParallelPositions.from_full if sp else _replicate,
        "blocks.*.ln1": norm,
        # Q, K and V fused into one column-parallel matmul (whole heads per rank; K/V heads split
        # or replicated), the output projection row-parallel: the module is replaced whole
        "blocks.*.attn": functools.partial(TensorParallelAttention.from_full, sequence_parallel=sp),
        "blocks.*.ln2": norm,
        "blocks.*.mlp.fc_in": functools.partial(col, sequence_parallel=sp),
        "blocks.*.mlp.fc_out": functools.partial(row, input_is_parallel=True, sequence_parallel=sp),
        "ln_f": norm,
        # The LM head keeps its vocabulary slice of the logits: vocab_parallel_cross_entropy
        # reads them where they are, so the (b, s, v) logits never exist on one rank.
        "lm_head": functools.partial(col, sequence_parallel=sp, gather_output=False),
    }


def check_splittable(cfg, tp):
    """Refuse, with the reason, a GPT that tp ranks cannot split this way."""
    problems = []
    if cfg.n_heads % tp:
        problems.append(f"tp={tp} must divide the {cfg.n_heads} attention heads (each rank keeps whole heads)")
    if cfg.kv_heads % tp and tp % cfg.kv_heads:
        problems.append(f"tp={tp} must divide the {cfg.kv_heads} K/V heads (split them) or be a multiple "
                        "of them (replicate each on the ranks whose query heads read it)")
    if cfg.vocab_size % tp:
        problems.append(f"tp={tp} must divide the vocabulary of {cfg.vocab_size} (pad it to a multiple of tp)")
    if cfg.ff % tp:
        problems.append(f"tp={tp} must divide the MLP width {cfg.ff}")
    if problems:
        raise ValueError("parallelize_gpt cannot split this model: " + "; ".join(problems))


def parallelize_gpt(model, group, sequence_parallel=False, plan=None):
    """A tensor-parallel COPY of lecture 01's GPT on `group` (the model given is not modified):
    heads split across ranks with Q, K, V fused (K/V heads split too, or replicated when tp is a
    multiple of them), the MLP
    column -> row, vocabulary-parallel embedding and LM head. Its forward returns this rank's
    vocabulary slice of the logits (b, s, v/tp); use `tp_loss` (vocab-parallel cross-entropy).
    With `sequence_parallel`, LayerNorms and the residual stream hold s/tp positions per rank, and
    the sequence length must be divisible by tp."""
    tp, _ = _size_rank(group)
    if hasattr(model, "tp_group") or any(hasattr(m, "group") for m in model.modules()):
        raise ValueError("parallelize_gpt: this model is already tensor-parallel (it came from "
                         "parallelize_gpt); pass the unsplit GPT")
    cfg = model.cfg
    # before anything a rank could refuse alone: every rank must be splitting the same model
    _check_agreed({"vocab_size": cfg.vocab_size, "seq_len": cfg.seq_len, "d_model": cfg.d_model,
                   "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "kv_heads": cfg.kv_heads, "ff": cfg.ff,
                   "tie_embeddings": cfg.tie_embeddings, "dtype": getattr(torch, cfg.dtype),
                   "sequence_parallel": sequence_parallel}, group, "parallelize_gpt")
    check_splittable(cfg, tp)
    tied = model.lm_head.weight is model.tok_emb.weight
    model = copy.deepcopy(model)   # never mutate what we were given
    plan = plan or gpt_plan(cfg, sequence_parallel)
    planned, replaced = set(), set()
    for pattern, style in plan.items():
        for name, module in list(model.named_modules()):
            if not fnmatch.fnmatchcase(name, pattern):
                continue
            if any(name.startswith(p + ".") for p in replaced):
                continue   # inside a module already replaced whole (the attention)
            replacement = style(module, group)
            planned.add(name)
            if replacement is not module:
                replaced.add(name)
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, leaf, replacement)
            if name == "lm_head" and tied:   # same rows of the same table: share the slice
                replacement.weight = model.tok_emb.weight
    unplanned = [name for name, m in model.named_modules()
                 if name not in planned and not any(name.startswith(p + ".") for p in replaced)
                 and any(True for _ in m.parameters(recurse=False))]
    if unplanned:
        raise ValueError(f"parallelize_gpt: no plan entry for {unplanned}; add one (or _replicate)")
    model.tp_group, model.sequence_parallel = group, sequence_parallel
    return model


def tp_loss(model, tokens, targets):
    """The mean next-token loss of a model from parallelize_gpt, without gathering the logits."""
    if model.sequence_parallel and tokens.shape[1] % dist.get_world_size(model.tp_group):
        raise ValueError(f"sequence parallelism needs tp={dist.get_world_size(model.tp_group)} to "
                         f"divide the sequence length {tokens.shape[1]}")
    return vocab_parallel_cross_entropy(model(tokens), targets, model.tp_group)


def full_parameters(model, grad=False):
    """{name: full tensor} of a model from parallelize_gpt, named like the unsplit GPT's
    parameters (slices all-gathered; every rank must call it). `grad=True`: the gradients."""
    out = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if hasattr(module, "full_tensors"):
            out.update({prefix + k: v for k, v in module.full_tensors(grad).items()})
        else:
            out.update({prefix + k: _value(p, grad).clone() for k, p in module.named_parameters(recurse=False)})
    return out


# =========================================================================================
# The same split with PyTorch's DTensor: a plan of sharding annotations
# =========================================================================================

def dtensor_plan(sequence_parallel=False):
    """torch.distributed.tensor.parallel's plan for the GPT, module pattern -> ParallelStyle.
    Each style says how the module's weights are laid out (Colwise: Shard(0) of the weight,
    Rowwise: Shard(1)) and how its inputs and outputs are laid out on the mesh; DTensor derives
    the collectives (and their backward) from the layouts."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()     # how the residual stream is laid out
    plan = {
        # vocabulary-parallel embedding: rows of the table sharded, partial sums reduced
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "blocks.*.attn": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "blocks.*.attn.q_proj": ColwiseParallel(),
        "blocks.*.attn.k_proj": ColwiseParallel(),
        "blocks.*.attn.v_proj": ColwiseParallel(),
        "blocks.*.attn.o_proj": RowwiseParallel(output_layouts=residual),
        "blocks.*.mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "blocks.*.mlp.fc_in": ColwiseParallel(),
        "blocks.*.mlp.fc_out": RowwiseParallel(output_layouts=residual),
        # use_local_output=False: the logits stay a DTensor sharded on the vocabulary, which
        # loss_parallel() reads without gathering them
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan.update({
            # positions: rows sharded like the vocabulary, the sum reduce-scattered over the
            # sequence so it adds to the sequence-parallel token embedding
            "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "blocks.*.ln1": SequenceParallel(),
            "blocks.*.ln2": SequenceParallel(),
            "ln_f": SequenceParallel(),
        })
    return plan


def parallelize_gpt_dtensor(model, mesh, sequence_parallel=False):
    """A copy of the GPT split by torch's parallelize_module on a 1-D DeviceMesh."""
    from torch.distributed.tensor.parallel import parallelize_module
    cfg, tp = model.cfg, mesh.size()
    check_splittable(cfg, tp)
    if cfg.kv_heads % tp:
        raise ValueError(f"this DTensor plan splits KV heads too: tp={tp} must divide {cfg.kv_heads}")
    if cfg.tie_embeddings:
        raise ValueError("this DTensor plan does not tie the embedding (Rowwise) and head (Colwise) layouts")
    model = parallelize_module(copy.deepcopy(model), mesh, dtensor_plan(sequence_parallel))
    for block in model.blocks:
        # parallelize_module shards the weights but leaves nn.Linear's out_features at the full
        # width; the attention reads its local head count from it (torchtitan likewise sets
        # n_heads //= tp on each layer).
        for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
            proj.out_features //= tp
    return model

