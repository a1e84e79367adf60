"""The same resharding checkpoint with PyTorch's own pieces: FSDP2 (`fully_shard`) and DTensor
tensor parallelism (`parallelize_module`), saved with `get_state_dict` + `dcp.save` under one
mesh and loaded with `dcp.load` + `set_state_dict` under another.

`get_state_dict` returns the model's and the optimizer's state keyed by the unsplit model's
names, every value a DTensor that knows its placement on the mesh; DCP writes each rank's local
shard with its global offsets (`compute_local_shape_and_global_offset`), and reads into the
DTensors of the new mesh the parts each needs — the same as `lectures.checkpoint.store`, with the
boxes derived from placements instead of listed.
"""
import logging

import torch.distributed.checkpoint as dcp

from lectures.layout.demos import _dp_rows
from lectures.layout.pytorch import pytorch_layout


def _full(module):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for k, p in module.named_parameters()}


def pytorch_save(rank, world_size, run, layout, directory, steps):
    """Train `steps` steps under `layout` (FSDP2 / DTensor) and save model and optimizer with
    DCP; returns the full parameters and the kinds of tensor get_state_dict gave."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    module, step = pytorch_layout(run.cfg, layout, run.lr)
    for s in range(steps):
        step(*_dp_rows(run, layout, s))
    model_sd, optim_sd = get_state_dict(module, step.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": steps}, checkpoint_id=directory)
    return {"params": _full(module), "kinds": sorted({type(v).__name__ for v in model_sd.values()})}


def pytorch_resume(rank, world_size, run, layout, directory, until):
    """Build `layout` afresh, load the checkpoint (written under any other mesh) with
    set_state_dict, train to step `until`; returns the loaded and the final full parameters."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    module, step = pytorch_layout(run.cfg, layout, run.lr)
    model_sd, optim_sd = get_state_dict(module, step.optimizer)     # the new mesh's DTensors, to fill
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(module, step.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full(module)
    for s in range(state["step"], until):
        step(*_dp_rows(run, layout, s))
    return {"start": state["step"], "loaded": loaded, "params": _full(module)}
