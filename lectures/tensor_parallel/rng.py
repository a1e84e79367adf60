"""Dropout under tensor and sequence parallelism: a mask that is a function of where it is drawn.

Under tensor parallelism some activations are *replicated* (every rank of the group holds the
whole tensor: the residual stream after g's all-reduce) and some are *split* (each rank holds its
shard: the attention probabilities of its heads, a column-parallel layer's output, and with
sequence parallelism the residual stream's sequence shard). A dropout mask on a replicated tensor
must be the same on every rank, or the copies silently stop being copies; a mask on a split tensor
must differ from rank to rank, or every shard gets the same pattern. Megatron-LM keeps two CUDA
generator states for this (`model_parallel_cuda_manual_seed`: the default one seeded alike on the
tensor-parallel ranks, a tracked one seeded with an offset plus the rank) and saves and restores
both around activation recomputation.

Here a mask is *counter-based* instead: a pure function of a key (seed, stream, step, site, and
for the split stream the rank), drawn from a fresh generator seeded with a hash of the key, in
the spirit of Philox (Salmon et al. 2011, https://doi.org/10.1145/2063384.2063405), where the
numbers at a given (key, counter) are computed rather than read from a state that advances. A
recomputed forward asks for the same key and gets the same mask, with nothing to save or
restore. `one_process` keys draw the whole tensor's mask from the shared seed and keep this
rank's slice: the exact mask one process would use, at `tp`× the random numbers.
"""
import dataclasses
import hashlib
import numbers

import torch
import torch.distributed as dist

from lectures.tensor_parallel.ops import _size_rank
from util import device


@dataclasses.dataclass(frozen=True)
class MaskKey:
    """What a mask is a function of. `parts`: ints and strings (seed, stream, step, site, ...).
    `slice_of`: None, or (dim, n, index): draw the whole tensor (its dim `dim` n times this
    tensor's) and keep chunk `index` of n along that dim."""
    parts: tuple
    slice_of: tuple = None

    def __post_init__(self):
        for part in self.parts:
            if isinstance(part, bool) or not isinstance(part, (int, str)):
                raise TypeError(f"a mask key is made of ints and strings (seed, step, layer, site); "
                                f"got {part!r} of type {type(part).__name__} in {self.parts!r}")

    def seed(self):
        """A 63-bit seed from the parts: the same in every process (Python's hash() of a string
        is not; it changes from process to process)."""
        digest = hashlib.blake2b(repr(self.parts).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2 ** 63 - 1)


def _check_p(p):
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p < 1:
        raise ValueError(f"dropout probability must be a number in [0, 1), got {p!r} (p = 1 would "
                         "drop everything and divide by zero)")


def keep_mask(key, shape, p, device="cpu"):
    """The boolean keep-mask (True = kept, probability 1 - p) for `key` and `shape`: the same
    every time it is asked for, in any process on the same kind of device (a CPU generator
    and a CUDA one draw different numbers from the same seed)."""
    _check_p(p)
    shape = tuple(shape)
    if key.slice_of is None:
        return _draw(key, shape, p, device)
    dim, n, index = key.slice_of
    dim = dim % len(shape)
    whole = shape[:dim] + (shape[dim] * n,) + shape[dim + 1:]
    return _draw(key, whole, p, device).chunk(n, dim)[index]   # n × the random numbers


def _draw(key, shape, p, device):
    generator = torch.Generator(device=device)
    generator.manual_seed(key.seed())
    return torch.rand(shape, generator=generator, device=device) >= p


def dropout(x, p, key, training=True):
    """Inverted dropout: x · mask / (1 − p), with the mask of `key`. Backward multiplies the
    gradient by the same mask (autograd saves it), so no random state is involved after the
    forward."""
    _check_p(p)
    if not isinstance(key, MaskKey):
        raise TypeError(f"dropout needs a MaskKey (from TPRandom.replicated/split/one_process), "
                        f"got {type(key).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"dropout of a {x.dtype} tensor: it needs floating-point values")
    if not training or p == 0:
        return x
    keep = keep_mask(key, x.shape, p, x.device)
    return x * (keep.to(x.dtype) / (1 - p))


class TPRandom:
    """The two random streams of one tensor-parallel group, from one user seed.

        replicated(site...)  the same key on every rank of the group: masks for replicated tensors
        split(site...)       a different key on each rank: masks for this rank's shard
        one_process(dim, site...)  this rank's slice of the mask one process would draw for the
                             whole tensor (split along `dim`): exact, at tp× the random numbers

    Every key also holds `step` (set it, or call next_step(), once per training step), so a
    site's mask changes from step to step but not between a forward and its recomputation.
    A site must name each dropout uniquely within a step (layer, name, micro-batch).
    `check=True` makes every replicated key an all-gather that refuses keys the ranks disagree
    on (a step counter out of step on one rank): a debugging aid, one collective per dropout."""

    def __init__(self, seed, group, check=False):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.seed, self.step, self.group, self.check = seed, 0, group, check
        self.size, self.rank = _size_rank(group)   # refuses a group this rank is not in
        # once, at the start: the replicated stream needs one seed on every rank
        self._same_everywhere(seed, "the ranks of the tensor-parallel group were given different seeds "
                              "{}; pass the same seed on every rank (the split stream adds the rank itself)")

    def _same_everywhere(self, number, message):
        if self.size == 1:
            return
        mine = torch.tensor([number], dtype=torch.int64, device=device())   # NCCL needs it on the GPU
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        values = [int(v) for v in every]
        if len(set(values)) > 1:
            raise ValueError("TPRandom: " + message.format(values))

    @classmethod
    def single_process(cls, seed):
        """The streams of one process with no group: its one_process keys draw the whole mask,
        which is what the tensor-parallel ranks' one_process slices must equal."""
        streams = cls.__new__(cls)
        streams.seed, streams.step, streams.group, streams.check = seed, 0, None, False
        streams.size, streams.rank = 1, 0
        return streams

    def next_step(self):
        self.step += 1

    def replicated(self, *site):
        key = MaskKey(("replicated", self.seed, self.step, *site))
        if self.check:
            self._same_everywhere(key.seed(), f"the ranks asked for different replicated masks at site {site!r} "
                                  "(key seeds {{}}): their steps or sites disagree")
        return key

    def split(self, *site):
        return MaskKey(("split", self.seed, self.step, self.rank, *site))

    def one_process(self, dim, *site):
        return MaskKey(("one process", self.seed, self.step, *site), slice_of=(dim, self.size, self.rank))
