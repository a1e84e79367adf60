"""What a training step holds in memory, phase by phase: PyTorch's own tracker and our count.

`MemTracker` (torch.distributed._tools.mem_tracker), a TorchDispatchMode, sees every operator's
outputs as they leave PyTorch's dispatcher and files each new storage under parameter, gradient,
optimizer state, activation or temporary (memory a kernel frees before returning, such as a
workspace, never reaches it). `memory_timeline` samples it after each phase
of a few AdamW steps of the GPT and sets beside it our own accounting from the tensors themselves
(`held_by_training`, and the bytes autograd saved, from lectures.model.memory). Under
`FakeTensorMode`, where tensors have shapes but no storage, the same tracker counts a step of a
model far too big for this machine (`fake_training_step`). The categories follow the memory
breakdown of Rajbhandari et al. 2020 (ZeRO): parameters, gradients, optimizer states, and the
residual activations and temporaries.
"""
import dataclasses

import torch

from lectures.model.gpt import GPT, batch, loss_fn
from lectures.model.memory import LiveBytes, SavedBytes


def by_category(tracker):
    """MemTracker's current bytes on the CPU (or first) device, keyed by plain category names."""
    snap = tracker.get_tracker_snapshot("current")
    per_dev = next(iter(snap.values()))
    return {(k if isinstance(k, str) else k.value): v for k, v in per_dev.items()}


MEM_CATEGORIES = ["Parameter", "Gradient", "Optstate", "Activation", "Temp"]


def held_by_training(model, opt):
    """Our own accounting, from the tensors themselves: parameters, gradients, optimizer state."""
    params = list(model.parameters())
    return {"Parameter": sum(p.nbytes for p in params),
            "Gradient": sum(p.grad.nbytes for p in params if p.grad is not None),
            "Optstate": sum(v.nbytes for s in opt.state.values() for v in s.values()
                            if torch.is_tensor(v) and v.dim() > 0)}


class CastWeightCopies:
    """Bytes of the low-precision weight copies autograd saves for backward inside `with meter:`.

    Under `torch.autocast` a Linear casts its fp32 weight to bf16 and its matmul saves that copy
    (as a transposed view) for the input gradient, so the copy lives from forward to backward,
    not only during the forward. A saved tensor is such a copy when its autograd history, through
    views, is one cast (`ToCopyBackward0`) of one of `model`'s parameters; each storage counts
    once. `numel` counts the parameters copied."""

    _VIEWS = {"TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
              "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0"}

    def __init__(self, model):
        self._params = {id(p) for p in model.parameters()}
        self._copies = {}
        self._hooks = None

    @property
    def bytes(self):
        return sum(nbytes for _, nbytes in self._copies)

    @property
    def numel(self):
        return sum(self._copies.values())

    def _pack(self, t):
        fn = t.grad_fn
        while fn is not None and type(fn).__name__ in self._VIEWS:
            fn = fn.next_functions[0][0]
        if fn is not None and type(fn).__name__ == "ToCopyBackward0":
            source = getattr(fn.next_functions[0][0], "variable", None)
            if source is not None and id(source) in self._params:
                st = t.untyped_storage()
                self._copies[(st.data_ptr(), st.nbytes())] = source.numel()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def memory_timeline(cfg, batch_size, steps=3, lr=3e-3):
    """Train `steps` AdamW steps under PyTorch's MemTracker and sample it after every phase of
    each step; beside it, our own sums over the tensors, the bytes autograd saved, and the
    most bytes alive at once in each phase (LiveBytes). Returns one row per phase; `batch` is
    the bytes of the step's token ids and targets and `loss` of the loss tensor, which the loop
    holds to the end of the step (made inside the tracker, MemTracker files both under
    activations)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    rows = []
    with tracker, LiveBytes() as live:
        for step in range(1, steps + 1):
            tokens, targets = batch(cfg, batch_size, step)
            live.reset_peak()
            with SavedBytes(exclude=model.parameters()) as saved:
                loss = loss_fn(model(tokens), targets)
            held = dict(batch=tokens.nbytes + targets.nbytes, loss=loss.nbytes)
            rows.append(dict(step=step, phase="forward", tracker=by_category(tracker),
                             own=dict(held_by_training(model, opt), Activation=saved.total),
                             peak=live.peak, **held))
            for phase, act in [("backward", loss.backward), ("optimizer step", opt.step),
                               ("zero_grad", opt.zero_grad)]:
                live.reset_peak()
                act()
                rows.append(dict(step=step, phase=phase, tracker=by_category(tracker),
                                 own=dict(held_by_training(model, opt), Activation=0), peak=live.peak,
                                 **held))
            del loss
            tracker.reset_mod_stats()      # per-module peaks start afresh each iteration
    return rows


def fake_training_step(cfg, batch_size, dtype=torch.bfloat16):
    """One forward, backward and AdamW step of `cfg` under FakeTensorMode: tensors have shapes
    and dtypes but no storage, so MemTracker counts the bytes a real run would need without this
    machine holding them. Parameters in `dtype` with an fp32 master copy is the mixed-precision
    layout; here for simplicity parameters are `dtype` and AdamW keeps its state in `dtype`
    too, so the optimizer row reads 2 × 2 bytes per parameter."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    previous = torch.get_default_dtype()
    rows = {}
    with FakeTensorMode():
        torch.set_default_dtype(dtype)
        try:
            model = GPT(dataclasses.replace(cfg, dtype=str(dtype).split(".")[-1]))
        finally:
            torch.set_default_dtype(previous)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len))
            loss = loss_fn(model(tokens), tokens)
            rows["after forward"] = by_category(tracker)
            loss.backward()
            rows["after backward"] = by_category(tracker)
            opt.step()
            rows["after optimizer step"] = by_category(tracker)
    return rows
