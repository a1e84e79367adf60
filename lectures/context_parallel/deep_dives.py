"""The appendix page of lecture 06: its deep dives, each a section function that the lecture's
main() calls inside `with deep_dive(...)` (USP, PyTorch's own `context_parallel`, balancing the
experts, node-limited routing), in that order, with the helpers and rank functions only they use."""
import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lectures.context_parallel.demos import (_TRAINING, AUX_WEIGHT, BIAS_STEP, attention_inputs, attention_sizes, fwd_bwd,
                                             reference_attention, train_moe_gpt)
from lectures.context_parallel.figures import pytorch_cp_figure, usp_figure
from lectures.context_parallel.moe import MoE, z_loss
from lectures.context_parallel.ring import ring_attention
from lectures.context_parallel.sharding import zigzag_shard, zigzag_unshard
from lectures.context_parallel.variants import ATTENTION, install_cpu_context_parallel_shim
from util import device, figure, note, see, spawn, table


def usp_deep_dive():
    import matplotlib.pyplot as plt
    note("""
        ## Deep dive: Ulysses × ring (USP)
        Ulysses is limited by the number of heads,
        the ring by its growing traffic; USP (Fang & Zhao 2024) combines them on a 2-D grid of
        ranks: the sequence is split over a ring dimension of size R and, within each ring
        position, over a Ulysses dimension of size U. The Ulysses all-to-all turns each
        U-group's sequence shards into head shards (h/U heads of its s/R positions), then ring
        attention runs over the R ranks that share those heads, and a second all-to-all
        turns the result back. CP degree U·R may then exceed the head count.
    """)
    see("https://arxiv.org/abs/2405.07719", "Fang & Zhao 2024: USP: A Unified Sequence Parallelism Approach for Long Context Generative AI")
    U, R, h = 2, 2, 4
    colors = plt.get_cmap("tab10").colors
    fig = usp_figure(R, h, U, colors)
    figure(fig, caption=f"USP with U = {U} (Ulysses) × R = {R} (ring) = {U * R} ranks and {h} heads: ranks "
                        f"{list(range(U))} and {list(range(U, 2 * U))} are Ulysses groups; in attention, each rank's "
                        "queries attend around a ring of the ranks holding the same heads")


def pytorch_context_parallel():
    from util.measure import compare, machine, timing_ranks
    note("""
        ## PyTorch's own: `context_parallel`
        `torch.distributed.tensor.experimental.context_parallel(mesh, buffers=..., buffer_seq_dims=...)`
        shards the given tensors along the sequence (head-tail order for causal attention: our
        zig-zag) and routes `F.scaled_dot_product_attention` to its context-parallel attention.
        How K/V move is an option, and **torch 2.13's default is not a ring**: `set_rotate_method`
        chooses `"allgather"` (the default: the forward all-gathers K/V once) or `"alltoall"` (K/V
        pass from rank to rank, a ring). Either way dK/dV travel around the ring by all-to-all in
        backward. In torch 2.13 its handlers cover the CUDA kernels only; on CPU it fails with
        "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
        registered". The shim below registers that op (and its backward) with PyTorch's own
        `_templated_ring_attention` functions, which then follow the rotate method; on a GPU it is
        not used. Both rotate methods are checked against one process like our variants.
    """)
    see(install_cpu_context_parallel_shim)
    see(rotate_method)
    n = timing_ranks(4)
    S, h, d = attention_sizes()
    Sc = 24
    q, k, v, dout = attention_inputs(Sc, 4)
    ref = reference_attention(q, k, v, dout, True)
    r = spawn(pytorch_cp_demo, n, check_len=Sc, seq_len=S, heads=h, head_dim=d,
              name=f"PyTorch context_parallel vs one process and vs ours, {n} ranks").returns
    diffs = {how: [(zigzag_unshard([x["check"][how][i] for x in r], 2) - ref[i]).abs().max().item() for i in range(4)]
             for how in ("allgather", "alltoall")}
    t = r[0]["timing"]
    table([[f"max |Δ| vs one process, rotate {how!r} (float64, s = {Sc}): output, dQ, dK, dV",
            ", ".join(f"{x:.1e}" for x in diffs[how])] for how in diffs] +
          [["PyTorch's layout equals our zig-zag", t["same_layout"]],
           ["max |Δ| PyTorch vs our ring (float32 outputs)", t["max_diff"]]],
          header=["check", "value"], caption="PyTorch merges partials in float32 (`convert_to_f32`), hence ~1e-7 "
                                             "in float64")
    names = list(PYTORCH_VS_OURS)
    table([[name, t["time"][name].ms(), t["sent"][name] / 2**20, t["sent"][name] / t["shard_bytes"]] for name in names],
          header=["implementation", "forward+backward", "MiB rank 0 sent", "sent / one K shard"],
          caption=f"causal attention, s = {S}, {h} heads, head dim {d}, float32, zig-zag; {machine(n)}; the four "
                  "take turns, repetition by repetition (ours are timed again here, beside PyTorch's, under the "
                  "same load; the all-gather section's run was separate, so the two can differ by the machine's "
                  "drift); bytes from /proc/self/io")
    fig = pytorch_cp_figure(names, t)
    figure(fig, caption="like against like: PyTorch's default (all-gather) beside ours, PyTorch's all-to-all "
                        "rotation beside our ring (blue: PyTorch, orange: ours; bars: medians, whiskers: "
                        "interquartile range)")
    ag = compare(t["time"]["ours, all-gather"], t["time"]["PyTorch, all-gather (default)"], "ours", "PyTorch's")
    ring = compare(t["time"]["ours, ring"], t["time"]["PyTorch, all-to-all rotation (a ring)"], "our ring",
                   "PyTorch's all-to-all rotation")
    note(f"""
        All-gather against all-gather: {ag}. Ring against ring: {ring}.
        {rotate_words(t["sent"], n)}
        Both sides run the same fused CPU kernel on the blocks, so what remains is how the work
        around it is organised (read in torch 2.13's `_templated_ring_attention(_backward)`):

        - **Backward of the all-gather variant.** PyTorch saves only the local K/V and
          all-gathers them again in backward, then passes the dK/dV accumulators around the ring
          (n all-to-alls); ours keeps the gathered K/V for backward (more memory, no second
          gather) and sends dK/dV home with one reduce-scatter — on gloo a full all-reduce.
          Measured, ours sent {t["sent"]["ours, all-gather"] / t["sent"]["PyTorch, all-gather (default)"]:.2f}×
          the bytes PyTorch's all-gather did.
        - **One kernel call per step or several.** Under zig-zag PyTorch halves the query or the
          key block so each step is one kernel call; ours calls the kernel once per pair of
          segments (up to three per step) and merges each partial in Python.
        - **How a ring hop travels.** PyTorch's rotation is an `all_to_all_single` in which each
          rank sends to one other (`permute_tensor`); ours is a batched `isend`/`irecv` pair.
        - **Precision of the merge.** PyTorch merges partials in float32 (`convert_to_f32`), ours in
          float32 or float64, as the inputs are.
    """)


def rotate_words(sent, n):
    """Whether PyTorch's two rotate methods can be told apart by their bytes at this size."""
    a, b = sent["PyTorch, all-gather (default)"], sent["PyTorch, all-to-all rotation (a ring)"]
    words = f"PyTorch's all-gather sent {a / 2**20:.3f} MiB and its rotation {b / 2**20:.3f} MiB ({a / b:.3f}×)"
    if abs(a / b - 1) < 0.02:
        return (f"{words}: each rank's K/V reach every other rank once either way, so the bytes are equal, and "
                f"both compute the same blocks with the same kernel. At {n} "
                "ranks the two PyTorch rows differ by timing only; what the choice changes is memory (the "
                "gathered K/V held at once) and how many waits a step has, not bytes.")
    return f"{words}."


def pytorch_cp_demo(rank, world_size, check_len, seq_len, heads, head_dim):
    """Both PyTorch comparisons in one run: equality with one process (both rotate methods), then
    speed and bytes against ours."""
    return {"check": {how: pytorch_context_parallel_attention(rank, world_size, check_len, 4, rotate=how)
                      for how in ("allgather", "alltoall")},
            "timing": pytorch_vs_ours(rank, world_size, seq_len, heads, head_dim)}


def pytorch_context_parallel_attention(rank, world_size, seq_len, heads, head_dim=8, batch=2,
                                       dtype="float64", causal=True, rotate="allgather"):
    """PyTorch's `context_parallel` around plain F.scaled_dot_product_attention (its head-tail
    layout, i.e. zig-zag, for causal), K/V moved by `rotate` ('allgather', torch 2.13's default, or
    'alltoall', a ring); returns this rank's output and gradients in our zig-zag order, to compare
    with one process exactly as our own variants are."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    if device().type == "cpu":
        install_cpu_context_parallel_shim()
    mesh = init_device_mesh(device().type, (world_size,), mesh_dim_names=("cp",))
    q, k, v, dout = (t.to(device()) for t in attention_inputs(seq_len, heads, head_dim, batch, dtype))
    with rotate_method(rotate), context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
        ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
        out.backward(dout)
    return [t.detach().cpu() for t in (out, ql.grad, kl.grad, vl.grad)]


@contextlib.contextmanager
def rotate_method(method):
    """PyTorch's context-parallel K/V rotation inside the block: 'allgather' (torch 2.13's default:
    the forward all-gathers K/V once) or 'alltoall' (K/V pass from rank to rank, a ring). Only dK/dV
    always rotate by all-to-all. Restores the previous setting (a private option: one place)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    before = cp._cp_options.rotate_method
    cp.set_rotate_method(method)
    try:
        yield
    finally:
        cp._cp_options.rotate_method = before


PYTORCH_VS_OURS = {   # name: (whose, how K/V move); like compared with like
    "PyTorch, all-gather (default)": ("pytorch", "allgather"), "ours, all-gather": ("ours", "all-gather"),
    "PyTorch, all-to-all rotation (a ring)": ("pytorch", "alltoall"), "ours, ring": ("ours", "ring")}


def pytorch_vs_ours(rank, world_size, seq_len, heads, head_dim, repeats=7):
    """PyTorch's context_parallel with each rotate method against our variant that moves K/V the
    same way: causal attention, zig-zag (= PyTorch's head-tail) layout, float32, forward+backward.
    Returns the timings (all four take turns) and the bytes this rank sent in one step of each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from util.measure import bytes_sent, measure_side_by_side
    if device().type == "cpu":
        install_cpu_context_parallel_shim()
    mesh = init_device_mesh(device().type, (world_size,), mesh_dim_names=("cp",))
    full = [t.to(device()) for t in attention_inputs(seq_len, heads, head_dim, 1, "float32")]
    q, k, v, dout = (t.clone() for t in full)
    mine = [zigzag_shard(t, rank, world_size, 2) for t in full]

    def step(whose, how):
        if whose == "pytorch":
            def run():
                with rotate_method(how):
                    fwd_bwd(functools.partial(F.scaled_dot_product_attention, is_causal=True), q, k, v, dout)
            return run
        return lambda: fwd_bwd(functools.partial(ATTENTION[how], causal=True, layout="zigzag"), *mine)
    fns = {name: step(*spec) for name, spec in PYTORCH_VS_OURS.items()}
    sent = {}
    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers={q, k, v, dout}):
        # the four take turns, so drift on a busy machine hits them alike
        t = measure_side_by_side(fns, warmup=2, repeats=repeats)
        for name, fn in fns.items():
            dist.barrier()
            with bytes_sent() as b:
                fn()
            sent[name] = b.bytes
        ql = q.detach().requires_grad_()
        their_out = F.scaled_dot_product_attention(ql, k, v, is_causal=True).detach()
    our_out = ring_attention(*mine[:3], causal=True, layout="zigzag")
    return {"time": t, "sent": sent, "same_layout": bool(torch.equal(q, mine[0])),
            "max_diff": (their_out - our_out).abs().max().item(), "shard_bytes": q.numel() * q.element_size()}



def balancing_deep_dive():
    note("""
        ## Deep dive: the balance loss's weight, balancing without a loss, and the router z-loss
        An auxiliary loss balances by pushing on the
        router's gradients, which also pulls against the language-modelling loss. DeepSeek-V3
        balances without a loss: each expert has a bias added to its score *only when choosing*
        the top-k experts (the gate still uses the unbiased score), and after each step the bias
        of every overloaded expert falls by γ and every underloaded one rises by γ (they use
        γ = 0.001 for most of training, with a very small sequence-wise balance loss beside it).
        The fourth run of the training above did this with γ = {γ}, without any balance loss,
        and with two simplifications: its scores are the softmax probabilities, where DeepSeek-V3's
        affinities are sigmoids normalised over the chosen experts, and its γ is 10× theirs, to
        act within a short run.
    """.replace("{γ}", str(BIAS_STEP)))
    see("https://arxiv.org/abs/2412.19437", "DeepSeek-AI 2024: DeepSeek-V3 Technical Report (§2.1.2, auxiliary-loss-free load balancing)")
    alpha_words()
    see(MoE.update_bias)
    z_loss_section()


def alpha_words():
    """Why α = AUX_WEIGHT, from the balancing runs of mixture_of_experts() (kept in _TRAINING)."""
    r, labels = _TRAINING.get("logs"), _TRAINING.get("labels")
    if not r:
        return
    steps = len(r[0]["loss"])
    tail = max(1, steps // 10)
    mean = lambda xs: sum(xs[-tail:]) / tail
    load = {label: mean(log["max_load"]) for label, log in zip(labels, r)}
    loss = {label: mean(log["loss"]) for label, log in zip(labels, r)}
    base, a1, a2 = loss[labels[0]], loss[labels[1]], loss[labels[2]]
    if all(abs(x / base - 1) < LOSS_NOISE for x in (a1, a2)):     # say "no clear difference" once
        loss_sentence = (f"The loss over the last steps: {a1:.3f} with α = 0.01 and {a2:.3f} with "
                         f"α = {AUX_WEIGHT}, against {base:.3f} without balancing: no clear difference here.")
    else:
        loss_sentence = (f"The loss over the last steps: {loss_words(a1, base, 'α = 0.01')}; "
                         f"{loss_words(a2, base, f'α = {AUX_WEIGHT}')}.")
    note(f"""
        **Why α = {AUX_WEIGHT} here, 10× Switch's 0.01.** Fedus et al. chose α = 10⁻² as large enough to
        balance and small enough not to disturb the language-modelling loss, over runs of many
        thousands of steps. This run has {steps} steps: with α = 0.01 the busiest expert ended at {load[labels[1]]:.2f}× the mean
        load (none: {load[labels[0]]:.2f}×), with α = {AUX_WEIGHT} at {load[labels[2]]:.2f}×.
        {loss_sentence} {SINGLE_RUN}
        Balancing can cost loss (the router is pushed away from its preferred experts) or save
        it (fewer dropped tokens: {mean(r[0]["dropped"]):.1%} of choices dropped without
        balancing, {mean(r[2]["dropped"]):.1%} with α = {AUX_WEIGHT}). The larger weight is for a
        short demonstration, not a recommendation.
    """)


LOSS_NOISE = 0.05   # single runs of one seed: loss differences below 5% are not read as a result
SINGLE_RUN = "(One run of one seed each: differences under 5% are not ranked.)"


def loss_words(loss, baseline, name, without="without balancing"):
    """A loss against a baseline run's (by default the unbalanced one), in words from its sign and
    size: "no clear difference" within LOSS_NOISE (single runs), otherwise higher or lower by the
    percentage."""
    rel = loss / baseline - 1
    if abs(rel) < LOSS_NOISE:
        return f"{name} {loss:.3f} against {baseline:.3f} {without}, no clear difference here"
    return f"{name} {loss:.3f}, {abs(rel):.0%} {'higher' if rel > 0 else 'lower'} than {baseline:.3f} {without}"


Z_WEIGHT = 1e-3   # ST-MoE's router z-loss weight


def z_loss_section():
    """ST-MoE's router z-loss, trained: the α = AUX_WEIGHT run again with the z-loss in its loss,
    against the same run without it (both from mixture_of_experts())."""
    note("""
        **The router z-loss.** ST-MoE adds another auxiliary term, for stability rather than
        balance: the mean squared log-sum-exp of the router logits, $\\frac{1}{T}\\sum_t (\\log\\sum_e
        e^{x_{t,e}})^2$. It pulls each token's log-sum-exp towards 0, so no logit can grow
        large, where an exponential in low precision loses its digits (weight 10⁻³ in ST-MoE). Since
        the softmax ignores a common shift, the term need not change the routing: it is smallest
        when the log-sum-exp is 0, which for equal logits means −log E each, not 0.
    """)
    see("https://arxiv.org/abs/2202.08906", "Zoph et al. 2022: ST-MoE: Designing Stable and Transferable Sparse Expert Models (router z-loss)")
    see(z_loss)
    logs, configs = _TRAINING.get("logs"), _TRAINING.get("configs")
    if not logs:
        return
    base = configs.index({"aux": AUX_WEIGHT})
    z_run = spawn(train_moe_gpt, 1, configs=[dict(configs[base], z=Z_WEIGHT)], steps=_TRAINING["steps"], batch_size=8,
                  name="MoE GPT training with the router z-loss").returns[0]
    runs = {f"balance loss α = {AUX_WEIGHT}": logs[base], f"the same, + z-loss × {Z_WEIGHT:g}": z_run}
    tail = max(1, _TRAINING["steps"] // 10)
    mean = lambda xs: sum(xs[-tail:]) / tail
    table([[name, mean(lg["z"]), mean(lg["max_logit"]), mean(lg["loss"]), mean(lg["max_load"])]
           for name, lg in runs.items()],
          header=["run", "router z-loss", "largest logit per token (mean)", "loss", "busiest / mean load"],
          caption=f"the same model, data and seed, {_TRAINING['steps']} steps, with and without the z-loss in the "
                  f"loss; means over the last {tail} steps, over the router of every layer")
    (a, b) = runs.values()
    note(f"""
        Trained with the z-loss, the routers' z-loss ended at {mean(b["z"]):.3f} against
        {mean(a["z"]):.3f} without it ({mean(b["z"]) / mean(a["z"]):.2f}×), and each token's largest logit at
        {mean(b["max_logit"]):.3f} against {mean(a["max_logit"]):.3f}: {z_words(a, b, mean)}
        {loss_words(mean(b["loss"]), mean(a["loss"]), "The loss", "without the z-loss")}. {SINGLE_RUN}
    """)
    labels = _TRAINING["labels"]
    table([[label, mean(lg["max_load"]), mean(lg["loss"]), mean(lg["z"])] for label, lg in zip(labels, logs)],
          header=["balancing", "busiest / mean load", "loss", "router z-loss (not in the loss)"],
          caption=f"the four balancing runs above, means over the last {tail} steps: none of them trains on the z-loss")


def z_words(without, with_z, mean):
    """Whether the z-loss run's logits ended smaller, in words from the numbers."""
    if mean(with_z["z"]) < mean(without["z"]) and mean(with_z["max_logit"]) < mean(without["max_logit"]):
        return "the term did what it is for, in a run this short."
    return "in a run this short the term has not yet moved the logits down."


def node_limited_deep_dive():
    note("""
        ## Deep dive: why DeepSeek-V3 limits each token to 4 nodes
        With hundreds of fine-grained experts and
        top-8 routing, a token's experts could sit on up to 8 different nodes, and every copy
        crosses the slow inter-node network (InfiniBand) both ways. DeepSeek-V3 first picks at
        most 4 nodes per token (by the best expert scores on each node), then the experts within
        them, so each token crosses IB at most 4 times and is forwarded to its experts over the
        fast intra-node NVLink — bounding the all-to-all traffic that dominates EP's cost.
    """)
    see("https://arxiv.org/abs/2412.19437", "DeepSeek-AI 2024: DeepSeek-V3 Technical Report (node-limited routing)")
