"""The layouts of lecture 07 built from PyTorch's own pieces instead of ours.

`init_device_mesh` for the mesh, `parallelize_module` with `ColwiseParallel` / `RowwiseParallel`
for tensor parallelism (DTensor parameters, `loss_parallel()` on vocabulary-sharded logits; the
plan follows Megatron-LM's column → row pairs, Shoeybi et al. 2019), `fully_shard` (FSDP2; Zhao
et al. 2023, "PyTorch FSDP") on the dp dimension, and `PipelineStage` with `Schedule1F1B` on the
pp dimension. Applied to lecture 01's GPT in torchtitan's order (tp, then pp, then FSDP), and
checked against the same one-process run as ours in tests/test_lecture_07.py.
"""
import contextlib

import torch
import torch.nn.functional as F

from lectures.model.gpt import GPT
from lectures.layout.mesh import torch_mesh
from lectures.pipeline.executor import GPTStage
from util import device


def pytorch_tp_plan():
    """parallelize_module's plan for lecture 01's GPT: Megatron's column → row pairs, the
    embedding split by vocabulary (RowwiseParallel on an Embedding), the LM head column-wise
    with its output left as a vocabulary-sharded DTensor for loss_parallel()."""
    # Imported here, not at the top: torch.distributed.tensor costs every process that imports
    # lecture 07 (the build, each rank, the notebook, pytest) seconds it rarely needs.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    block = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
             "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
             "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel()}
    return plan, block


def pytorch_layout(cfg, layout, lr):
    """(module, step function) of `layout` built from PyTorch's pieces:
    parallelize_module on the tp mesh dimension, fully_shard (FSDP2) on dp, and for pp a
    PipelineStage per rank driven by Schedule1F1B: any of dp, tp, pp, together or alone."""
    # Imported here, not at the top: FSDP and pipelining (which pulls in torch._dynamo) take
    # seconds to import, and only the ranks of this one demo need them.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    mesh = torch_mesh(layout.dp, layout.pp, 1, layout.tp)
    model = GPT(cfg).to(device())
    if layout.tp > 1:
        plan, block_plan = pytorch_tp_plan()
        parallelize_module(model, mesh["tp"], plan)
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], block_plan)
            # Adapter: lecture 01's attention reads its head count from the projection's
            # out_features, which a Colwise-sharded nn.Linear keeps at the global width.
            for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                proj.out_features //= layout.tp
    if layout.pp > 1:
        stage_idx = mesh["pp"].get_local_rank()
        module = GPTStage(model, stage_idx, layout.pp)
    else:
        module = model
    if layout.dp > 1:
        for block in getattr(module, "blocks", []):
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    loss_ctx = loss_parallel if layout.tp > 1 else contextlib.nullcontext

    def loss_of(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    if layout.pp > 1:
        stage = PipelineStage(module, stage_idx, layout.pp, device(), group=mesh["pp"].get_group())
        sched = Schedule1F1B(stage, n_microbatches=layout.micro_batches, loss_fn=loss_of)

    def step(tokens, targets):
        with loss_ctx():
            if layout.pp > 1:
                losses = []
                if stage_idx == 0:
                    sched.step(tokens)
                elif stage_idx == layout.pp - 1:
                    sched.step(target=targets, losses=losses)
                else:
                    sched.step()
                loss = torch.stack(losses).mean().item() if losses else None
            else:
                loss = 0.0
                for x, y in zip(tokens.chunk(layout.micro_batches), targets.chunk(layout.micro_batches)):
                    l = loss_of(module(x), y) / layout.micro_batches
                    l.backward()
                    loss += l.item()
        opt.step()
        opt.zero_grad()
        return loss
    step.optimizer = opt      # for checkpoints (lecture 08: get_state_dict(module, step.optimizer))
    return module, step
