"""Two memory meters, one job each: what a block of code allocated and still holds (`LiveBytes`),
and what autograd keeps from the forward pass for the backward pass (`SavedBytes`).

Both work on any device (they watch tensors, not an allocator), both count a storage once however
many views share it, and both are tested on cases whose answer is known to the byte: one
`nn.Linear`, a view, an in-place op, an `out=` result, an optimizer step (tests/test_memory.py).

What they do not see: memory an operator uses internally and frees before it returns (kernel
workspaces, a matmul's packed copies), and the allocator's own rounding and caching. PyTorch's
`torch.cuda.max_memory_allocated` (GPU) or `MemTracker` see some of that; these meters count
the tensors a program can reason about.
"""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree):
    """The storages of every tensor in a (nested) argument list, by data pointer."""
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"}


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage allocated inside `with LiveBytes() as m:` and still alive (`m.now`),
    and the most alive at once (`m.peak`).

    Every operator's outputs pass through this dispatch mode. An output is new memory only if its
    storage is not one of the operator's inputs' storages: a view (`aten.t(weight)` inside
    `F.linear`), an in-place result (`x.add_(1)`, AdamW's updates) and an `out=` result reuse
    memory that existed before, so they are not counted. A storage is forgotten when it is freed."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self._live = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        old = _storages((args, kwargs))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() not in old:
                    self._add(st)
        return out

    def _add(self, storage):
        key, n = storage.data_ptr(), storage.nbytes()
        if n and key not in self._live:
            self._live[key] = n
            self.now += n
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, key)

    def _free(self, key):
        self.now -= self._live.pop(key, 0)

    def reset_peak(self):
        """Start a new peak from what is alive now (to measure one phase of a step)."""
        self.peak = self.now


class _Held:
    """What autograd keeps in place of a saved tensor while a SavedBytes meter is on: the tensor
    and a note to the meter when autograd lets go of it."""
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


class SavedBytes:
    """Bytes of the tensors autograd saves for backward inside `with meter:` (enter it as often as
    you like: once per micro-batch, say).

    - `live`: bytes saved and not yet released by autograd (it releases a node's saved tensors
      when the backward has used them, or when the graph is dropped); `peak`: the most at once.
    - `total`: bytes of every storage ever saved; `tensors`: one (shape, dtype, bytes) per
      storage, in the order saved (a storage released and later saved again counts again: a
      recomputed activation is new memory).

    Storages are counted once, however many saved views share them (q, k and v cut from one
    buffer). Tensors sharing storage with `exclude` (pass the model's parameters: a Linear saves
    its weight, but a weight is not an activation) are left out."""

    def __init__(self, exclude=()):
        self._exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self._refs = {}
        self.live = self.peak = 0
        self.tensors = []
        self._hooks = []

    @property
    def total(self):
        return sum(b for _, _, b in self.tensors)

    def _pack(self, t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key[0] in self._exclude or key[1] == 0:
            return t
        if key not in self._refs:      # a storage autograd does not hold yet
            self.tensors.append((tuple(t.shape), t.dtype, key[1]))
            self._refs[key] = 0
            self.live += key[1]
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        # Hold a detached alias (same storage): holding `t` itself would also hold its grad_fn
        # when `t` is an operation's own output (tanh's, LayerNorm's statistics), a reference cycle
        # through C++ that gc cannot break; a backward that runs only some nodes (zero-bubble's
        # separate W) would then leak those tensors.
        return _Held(t.detach(), key, self)

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Held) else x

    def _release(self, key):
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= key[1]

    def reset_peak(self):
        self.peak = self.live

    def hold(self, tensors):
        """Count tensors held for the backward outside autograd (a split backward keeps each
        module's output gradient from B to W): their storages join `live` until `let_go`.
        Returns the bytes added."""
        held = {}
        for t in tensors:
            st = t.untyped_storage()
            if (st.data_ptr(), st.nbytes()) not in self._refs:
                held[st.data_ptr()] = st.nbytes()
        added = sum(held.values())
        self.live += added
        self.peak = max(self.peak, self.live)
        return added

    def let_go(self, nbytes):
        self.live -= nbytes

    def __enter__(self):
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc):
        self._hooks.pop().__exit__(*exc)


def saved_bytes(fn, exclude=()):
    """(fn()'s result, bytes autograd saved for backward while it ran): the activation memory of
    one forward, parameters in `exclude` left out."""
    with SavedBytes(exclude) as meter:
        out = fn()
    return out, meter.total
