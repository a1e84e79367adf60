"""A run that survives (lecture 08's building blocks): checkpoints that load under any layout,
and restarts after a failure.

- `store`: `save`, `load`, `export` of lecture 07's `LayoutTrainer` with
  torch.distributed.checkpoint; every rank writes the boxes of the global tensors it holds
  (`lectures.layout.shards`), and loads the boxes of its own layout from whatever was saved.
- `restart`: the job torchrun restarts after a rank dies, and the checkpoint interval that
  loses the least work (Young 1974, Daly 2006).
- `pytorch`: the same with PyTorch's own pieces, FSDP2 and DTensor, through `get_state_dict` /
  `set_state_dict`.
- `demos`, `figures`, `deep_dives`: what lecture 08's page runs on each rank, and its drawings.

Global-norm clipping lives with the trainer (`Run(max_grad_norm=...)`, `lectures.layout.shards`).
"""
from lectures.checkpoint.store import (Boxes, BoxLoadPlanner, BoxSavePlanner, CheckpointError, checkpoint_path, export,
                                       finish, load, save, saved_steps, train_resumable, trainer_state)
from lectures.checkpoint.restart import (expected_waste, init_group, read_events, run_job, torchrun_command,
                                         young_daly)
from lectures.checkpoint.pytorch import pytorch_resume, pytorch_save

__all__ = ["Boxes", "BoxLoadPlanner", "BoxSavePlanner", "CheckpointError", "checkpoint_path", "export", "finish",
           "load", "save", "saved_steps", "train_resumable", "trainer_state",
           "expected_waste", "init_group", "read_events", "run_job", "torchrun_command", "young_daly",
           "pytorch_resume", "pytorch_save"]
