"""What each rank runs in lecture 01's demos, and the one-process references they are checked
against; the lecture launches them with spawn() and narrates what they return. Beside them, the
small measurements its sections take on one process: the bytes an autocast loop holds between
forward and backward, the inputs of the online-softmax checks, and attention's peak bytes."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from util import device

from lectures.model.attention import online_softmax_attention
from lectures.model.gpt import GPT, batch, loss_fn
from lectures.model.memory import LiveBytes
from lectures.model.training_memory import CastWeightCopies, held_by_training


def same_on_every_rank(rank, world_size, cfg, batch_size=8, step=3):
    """Each rank builds batch `step` and the initial GPT by itself; an all-gather of their
    checksums shows whether every rank got the same (what lectures 03–07 rely on)."""
    tokens, _ = batch(cfg, batch_size, step)
    model = GPT(cfg)
    mine = torch.tensor([float(tokens.sum()), float(tokens[:, 0].sum()),
                         sum(p.detach().double().sum().item() for p in model.parameters())],
                        dtype=torch.float64, device=device())
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return {"identical": all(torch.equal(e, everyone[0]) for e in everyone),
            "checksums": [e.tolist() for e in everyone]}


def autocast_held_before_backward(model, opt, tokens, targets, set_to_none):
    """Bytes by role that an autocast training loop holds between its second forward and that
    forward's backward, and the `CastWeightCopies` that counted the bf16 copies. With
    `set_to_none` the loop calls `opt.zero_grad(set_to_none=True)` before the forward, as a
    standard loop does, so last step's gradients are gone; without, they are alive, as in
    gradient accumulation. `opt=None`: a fresh AdamW."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    loss_fn(logits, targets).backward()
    opt.step()
    if set_to_none:
        opt.zero_grad(set_to_none=True)
    with CastWeightCopies(model) as copies, torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    loss = loss_fn(logits, targets)
    held = dict(held_by_training(model, opt), Copies=copies.bytes)
    loss.backward()                      # releases the bf16 copies
    return held, copies


def checked_attention_inputs(s=200):
    """The generator and the float64 q, k, v both online-softmax checks use."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, s, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    return g, q, k, v


def blocked_and_sdpa(q, k, v):
    """Our blocked online-softmax attention beside SDPA on the same inputs, without and with
    the causal mask, in blocks of 7 (not a divisor of s), 64 and 256 (more than s):
    (causal, block, ours, sdpa), the forward and the backward checks' cases."""
    for causal in (False, True):
        for bs in (7, 64, 256):
            yield (causal, bs, online_softmax_attention(q, k, v, bs, causal=causal),
                   F.scaled_dot_product_attention(q, k, v, is_causal=causal))


def attention_peak_bytes(attend, b, heads, s, d, backward=False, seed=0):
    """Most bytes alive at once while `attend(q, k, v)` runs (and its backward, if asked),
    beyond the inputs, measured with LiveBytes: a view of q, k or v (kᵀ) is not new memory;
    their gradients, allocated by the backward, are."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, heads, s, d, generator=g, requires_grad=backward) for _ in range(3))
    with LiveBytes() as live:
        out = attend(q, k, v)
        if backward:
            out.sum().backward()
    return live.peak
