"""Vocabulary parallelism: the embedding table and the cross-entropy split by token id.

The embedding and the LM head are the largest matrices of a small model (v × h). Megatron-LM
(Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053) splits the vocabulary: each
rank owns a contiguous range of token ids, looks up only those, and the loss is computed from
each rank's slice of the logits, so the (b, s, v) logits never exist on one rank. The LM head
itself is a column-parallel linear (`lectures/tensor_parallel/layers.py`).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lectures.tensor_parallel.layers import _shard_of_full, _take, _value
from lectures.tensor_parallel.ops import (_AgreedOnFirstCall, _all_gather, _all_reduce, _check_agreed, _size_rank,
                                          reduce_from_region, reduce_scatter_sequence)


class VocabParallelEmbedding(_AgreedOnFirstCall, nn.Module):
    """Rows of the embedding table split by token id: a rank looks up the tokens it owns, writes
    zeros for the others, and the ranks' partial rows are summed by g (or reduce-scattered along
    the sequence with `sequence_parallel`)."""

    def __init__(self, num_embeddings, embedding_dim, group, sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        n, r = _size_rank(group)
        _check_agreed({"num_embeddings": num_embeddings, "embedding_dim": embedding_dim,
                       "dtype": dtype or torch.get_default_dtype(), "sequence_parallel": sequence_parallel},
                      group, "VocabParallelEmbedding")
        if num_embeddings % n:
            raise ValueError(f"VocabParallelEmbedding: vocabulary {num_embeddings} does not split over "
                             f"{n} ranks (Megatron pads the vocabulary to a multiple of the ranks)")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per = num_embeddings // n
        self.start, self.end = r * per, (r + 1) * per
        # this rank's rows of the nn.Embedding this seed would draw (N(0, 1), the whole table)
        self.weight = nn.Parameter(_shard_of_full((num_embeddings, embedding_dim), 0, group, nn.init.normal_,
                                                  device, dtype))

    @classmethod
    def from_full(cls, embedding, group, **options):
        """This rank's rows of an ordinary nn.Embedding (which is left untouched)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding.from_full needs an nn.Embedding, got {type(embedding).__name__}")
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding does not support padding_idx or max_norm")
        w = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, device=w.device,
                    dtype=w.dtype, **options)
        with torch.no_grad():
            layer.weight.copy_(_take(w, 0, group))
        return layer

    def forward(self, tokens):
        self._agree_on_input(tokens, "VocabParallelEmbedding")
        # Every rank sees all the token ids: each can refuse a bad one by itself, before any
        # collective (else an id no rank owns would be embedded as zeros, silently).
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.num_embeddings):
            raise ValueError(f"VocabParallelEmbedding: token ids must lie in [0, {self.num_embeddings}); "
                             f"got ids from {tokens.min().item()} to {tokens.max().item()}")
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, self.group)
        return reduce_from_region(partial, self.group)

    def full_tensors(self, grad=False):
        return {"weight": _all_gather(_value(self.weight, grad), 0, self.group)}

    def extra_repr(self):
        return f"tokens [{self.start}, {self.end}) of {self.num_embeddings}, dim={self.embedding_dim}"


def vocab_parallel_cross_entropy(local_logits, targets, group):
    """Mean cross-entropy over all tokens when each rank holds only its vocabulary slice of the
    logits (..., v/tp): the full logits are never gathered. Per token it all-reduces three
    numbers' worth: the max (for stability), the sum of exponentials, and the target's logit.

        loss = log Σ_ranks Σ_local exp(z − m) − (z_target − m)

    g (all-reduce forward, identity backward) is the right conjugate for the sums because every
    rank then holds the same loss and back-propagates into its own slice."""
    n, _ = _size_rank(group)
    _agree_on_loss(local_logits, targets, group)
    per = local_logits.shape[-1]
    if targets.shape != local_logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match logits {tuple(local_logits.shape)}")
    if targets.numel() and (targets.min() < 0 or targets.max() >= per * n):
        raise ValueError(f"targets must lie in [0, {per * n}) (no ignore_index here)")
    return _VocabParallelCrossEntropy.apply(local_logits, targets, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The loss's forward and backward written out, as Megatron-LM's _VocabParallelCrossEntropy:
    the shifted logits become the local softmax in place and are saved once (at least fp32), with
    which tokens' targets this rank holds; backward is (softmax − one-hot) × grad / tokens, each
    rank for its own slice. Composed from autograd ops the loss kept two copies of the slice
    (exp's output and the shifted logits, which gather keeps): twice F.cross_entropy's bytes."""

    @staticmethod
    def forward(ctx, local_logits, targets, group):
        _, r = _size_rank(group)
        per = local_logits.shape[-1]
        z = local_logits.to(torch.promote_types(local_logits.dtype, torch.float32), copy=True)  # ours to overwrite
        m = _all_reduce(z.amax(dim=-1), group, op=dist.ReduceOp.MAX)
        z.sub_(m.unsqueeze(-1))
        mine = (targets >= r * per) & (targets < (r + 1) * per)
        local_target = (targets - r * per).masked_fill(~mine, 0)
        target_logit = _all_reduce(z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine, group)
        sum_exp = _all_reduce(z.exp_().sum(dim=-1), group)
        z.div_(sum_exp.unsqueeze(-1))                       # the local slice of the softmax
        ctx.save_for_backward(z, mine, local_target)
        ctx.dtype = local_logits.dtype
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, local_target = ctx.saved_tensors
        out = softmax.clone()
        out.scatter_add_(-1, local_target.unsqueeze(-1), -mine.unsqueeze(-1).to(out.dtype))
        out.mul_(grad / max(1, local_target.numel()))
        return out.to(ctx.dtype), None, None


def _agree_on_loss(local_logits, targets, group):
    """The ranks agree on the logits' dtype and shape (their vocabulary slices must be equal) and
    the targets' shape, before the loss's all-reduces: one small all-gather on every call. A
    function cannot remember a "first call" safely: a rank that once raised before its check
    would skip the next one while the others run it, and the check's own collective would then
    meet another collective (gloo aborts). Modules check once; they are built alike on every rank."""
    facts = {"logits dtype": local_logits.dtype, "logits dims": local_logits.dim(), "targets dims": targets.dim()}
    facts.update({f"logits size {i}": size for i, size in enumerate(local_logits.shape[:6])})
    facts.update({f"targets size {i}": size for i, size in enumerate(targets.shape[:6])})
    _check_agreed(facts, group, "vocab_parallel_cross_entropy")
