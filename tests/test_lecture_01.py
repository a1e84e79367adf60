"""Lecture 01: the model's parameter count, activation accounting, recomputation, accumulation,
fp8 scaling and online-softmax attention, each against an independent reference."""
import math

import pytest
import torch
import torch.nn.functional as F

from lectures import lecture_01_memory_and_precision as L
from lectures.model import (FORMATS, GPT, MEM_CATEGORIES, CastWeightCopies, GPTConfig, MasterWeights, Recomputed,
                            SavedBytes, accumulate, accumulated_gradients, accumulation_error, attention_with_lse,
                            bandwidths, batch, block_activations, causal_attention, chunked_cross_entropy,
                            dequantize_fp8, entropy_rate, fake_training_step, format_properties, fp16_gradients,
                            fp32_gradients, fp8_matmul_error, freeze_threshold, gradient_error, gradient_rms,
                            keep_bits, loss_fn, loss_memory, memory_timeline, merge_attention, naive_causal_attention,
                            online_softmax_attention, ordinary_channels, outlier_matrices, overflow_table, param_count,
                            per_tensor_error, quantize_fp8, recomputation_step, reconciled_bytes, round_to,
                            scaled_mm_error, scaling_over_steps, threads, train_curve, values_between)
from lectures.model.deep_dives import (ACCUMULATOR_MODELS, a_step_too_big_to_hold, bf16_attention_errors,
                                       closest_to_paper, delayed_scaling, fp8_scaling_errors, fp8_verdict,
                                       tiles_first_win)
from lectures.model.demos import attention_peak_bytes, autocast_held_before_backward
from lectures.model.figures import memory_phases_figure
from tests.conftest import built

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """As the lecture does: tiny tensors, and cores shared with other work."""
    with threads(1):
        yield


CONFIGS = [GPTConfig(), GPTConfig(n_kv_heads=2), GPTConfig(n_kv_heads=1, tie_embeddings=True),
           GPTConfig(tie_embeddings=True),
           GPTConfig(d_model=96, n_heads=6, n_kv_heads=3, n_layers=3, d_ff=200, vocab_size=101, seq_len=17),
           GPTConfig(d_model=20, n_heads=5, n_layers=1, vocab_size=7, seq_len=3)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_param_count_equals_numel(cfg):
    assert param_count(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_param_count_estimate_for_plain_gpt():
    """The syllabus' estimate is exact for untied heads once positions and the head are added."""
    c = GPTConfig(d_model=32, n_heads=4, n_layers=3, vocab_size=50, seq_len=9)
    h, v, n = c.d_model, c.vocab_size, c.n_layers
    assert param_count(c) == h * v + n * (12 * h * h + 13 * h) + 2 * h + c.seq_len * h + h * v


@pytest.mark.parametrize("attention", ["sdpa", "naive"])
@pytest.mark.parametrize("seq", [8, 33, 64])
@pytest.mark.parametrize("cfg", [GPTConfig(), GPTConfig(d_model=48, n_heads=3, d_ff=100)], ids=str)
def test_saved_activations_equal_reconciled_formula(cfg, seq, attention):
    fn = causal_attention if attention == "sdpa" else naive_causal_attention
    measured = block_activations(cfg, 3, seq, fn).total
    assert measured == sum(reconciled_bytes(cfg, 3, seq, attention).values())


def test_reconciled_formula_is_papers_without_dropout_in_fp32():
    """Remove the small terms: what is left is 2 × (34 − 2)/34 of the paper's linear term."""
    cfg, b, s = GPTConfig(), 2, 64
    terms = reconciled_bytes(cfg, b, s, "sdpa")
    big = sum(v for k, v in terms.items() if "mean" not in k and "log-sum-exp" not in k)
    assert big == 2 * 32 * s * b * cfg.d_model


def test_saved_activations_deduplicate_and_skip_parameters():
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedBytes(exclude=lin.parameters()) as saved:
        y = lin(x)
        z = (y * y).sum()      # y saved twice by mul: one storage
    assert saved.total == x.nbytes + y.nbytes
    del y, z                   # the graph goes, and autograd lets go of what it saved
    assert saved.live == 0


def test_memory_timeline_step_one_grows_then_flat():
    rows = memory_timeline(GPTConfig(), batch_size=4, steps=3)
    after_step = [r["tracker"]["Total"] for r in rows if r["phase"] == "optimizer step"]
    assert after_step[1] == after_step[2]
    start = [r["tracker"]["Total"] for r in rows if r["phase"] == "zero_grad"]
    psi = param_count(GPTConfig())
    assert rows[0]["tracker"]["Optstate"] == 0 and start[0] - rows[0]["tracker"]["Parameter"] >= 8 * psi
    for r in rows:
        assert r["own"]["Parameter"] == r["tracker"]["Parameter"] == 4 * psi
        if r["phase"] == "backward":
            assert r["tracker"]["Gradient"] == r["own"]["Gradient"] == 4 * psi
        if r["phase"] == "zero_grad" and r["step"] > 1:
            # what is alive when zero_grad starts: gradients (4Ψ), Adam's m and v (8Ψ), and
            # the batch and loss; AdamW's in-place updates of the parameters are not new memory
            assert 12 * psi <= r["peak"] < 12 * psi + 4 * psi / 10


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gradients_equal_and_memory_falls(mode):
    cfg = GPTConfig(n_layers=3)
    ref = recomputation_step(cfg, 4, "none")
    got = recomputation_step(cfg, 4, mode)
    for k in ref["grads"]:
        torch.testing.assert_close(got["grads"][k], ref["grads"][k], rtol=1e-6, atol=1e-7)
    assert got["held"] < ref["held"]
    if mode == "full":         # only each block's input is kept, not its insides
        assert got["held"] < 0.15 * ref["held"]


def test_recomputation_full_below_selective():
    cfg = GPTConfig(n_layers=3)
    assert recomputation_step(cfg, 4, "full")["held"] < recomputation_step(cfg, 4, "selective")["held"]


def test_recomputation_refuses_unknown_mode():
    with pytest.raises(ValueError, match="recomputation mode"):
        Recomputed(torch.nn.Identity(), "some")


@pytest.mark.parametrize("k", [2, 3, 6])
def test_accumulation_equals_big_batch(k):
    cfg = GPTConfig(dtype="float64")
    big, held_big = accumulated_gradients(cfg, 6, 1)
    got, held = accumulated_gradients(cfg, 6, k)
    for n in big:
        torch.testing.assert_close(got[n], big[n], rtol=1e-10, atol=1e-12)
    assert held * k == pytest.approx(held_big, rel=0.01)     # a micro-batch's activations: 1/k


def test_accumulation_refuses_uneven_split():
    with pytest.raises(ValueError, match="equal micro-batches"):
        accumulated_gradients(GPTConfig(), 7, 2)


def test_format_properties_match_finfo():
    for name, dtype in FORMATS.items():
        p = format_properties(name, dtype)
        eps = torch.finfo(dtype).eps
        assert p["max rel. error in [1, 2] (measured)"] <= eps / 2 * 1.0001
        if dtype != torch.float32:
            assert p["values in [1, 2]"] == round(1 / eps) + 1


def test_loss_scaling_rescues_fp16_gradients():
    cfg = GPTConfig()
    ref = fp32_gradients(cfg, 16)
    g0, c0, skip0 = fp16_gradients(cfg, 16)
    g1, c1, skip1 = fp16_gradients(cfg, 16, scale=2.0 ** 16)
    _, _, skip2 = fp16_gradients(cfg, 16, scale=2.0 ** 32)
    assert c1["flushed to zero"] < c0["flushed to zero"] and c1["subnormal"] < c0["subnormal"] / 10
    assert gradient_error(g1, ref) < gradient_error(g0, ref)
    assert not skip0 and not skip1 and skip2


def test_master_weights_bytes_per_parameter():
    cfg = GPTConfig()
    psi = param_count(cfg)
    tokens, targets = batch(cfg, 4, 0)
    for acc, total in [(False, 16), (True, 20)]:
        model = GPT(cfg.__class__(dtype="bfloat16"))
        mw = MasterWeights(model, lr=1e-3, fp32_accumulation=acc)
        loss_fn(model(tokens), targets).backward()
        if acc:
            mw.accumulate()
            loss_fn(model(tokens), targets).backward()
        mw.step()
        loss_fn(model(tokens), targets).backward()
        assert sum(mw.held().values()) == total * psi


def test_master_weights_keep_small_updates():
    cfg = GPTConfig()
    _, unchanged_32 = train_curve(cfg, "fp32", 20, 2e-4, batch_size=8, log_every=19)
    _, unchanged_bf = train_curve(cfg, "bf16 weights", 20, 2e-4, batch_size=8, log_every=19)
    _, unchanged_mw = train_curve(cfg, "bf16 + fp32 master", 20, 2e-4, batch_size=8, log_every=19)
    assert unchanged_bf > 0.1 > max(unchanged_mw, unchanged_32)


@pytest.mark.parametrize("outlier", [1e4, 1e5])
def test_fp8_tile_scaling_beats_per_tensor_on_outliers(outlier):
    a, w = outlier_matrices(128, 256, 128, outlier=outlier, seed=3)
    keep = ordinary_channels(256, seed=3)                   # the channels the outliers do not own
    per_tensor = fp8_matmul_error(a, w, channels=keep)
    tiles = fp8_matmul_error(a, w, (1, 128), (128, 128), channels=keep)
    assert tiles < 0.8 * per_tensor
    assert tiles < 0.1                        # only the tile holding the outlier channel loses


def test_fp8_scaling_choice_does_not_matter_without_outliers():
    a, w = outlier_matrices(128, 256, 128, outlier=1.0, seed=3)
    assert fp8_matmul_error(a, w) == pytest.approx(fp8_matmul_error(a, w, (1, 128), (128, 128)), rel=0.15)


def test_fp8_quantize_roundtrip_and_refusal():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 4)[:, None]
    q, s = quantize_fp8(x, (1, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 2)
    half_subnormal_step = s.repeat_interleave(128, dim=1) * 2 ** -10   # below 2^-6, e4m3 steps by 2^-9
    assert ((dequantize_fp8(q, s) - x).abs() <= x.abs() * 2 ** -4 + half_subnormal_step).all()
    with pytest.raises(ValueError, match="does not divide"):
        quantize_fp8(torch.randn(4, 100), (1, 128))


def test_scaled_mm_per_tensor_matches_simulation():
    a, w = outlier_matrices(64, 128, 32, outlier=100.0)
    got = scaled_mm_error(a, w)
    if got is None:
        pytest.skip("torch._scaled_mm does not run on this build")
    assert got == pytest.approx(fp8_matmul_error(a, w), rel=1e-3)


CASES = [(causal, bs, s) for causal in (False, True) for bs, s in [(1, 5), (4, 37), (16, 37), (37, 37), (64, 37), (7, 50)]]


@pytest.mark.parametrize("causal,block,seq", CASES)
def test_online_softmax_attention_equals_sdpa(causal, block, seq):
    g = torch.Generator().manual_seed(block * 100 + seq)
    q, k, v = (torch.randn(2, 3, seq, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = online_softmax_attention(q, k, v, block, causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    d_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(ref, (q, k, v), d_out)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_online_softmax_attention_fp32_noncontiguous_and_uneven_lengths():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 11, 3, 8, generator=g).transpose(1, 2).requires_grad_()   # non-contiguous
    k = torch.randn(2, 3, 23, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 3, 23, 8, generator=g, requires_grad=True)
    out = online_softmax_attention(q, k, v, 5)
    ref = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(online_softmax_attention(q, k, v, 4), ref.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="causal"):
        online_softmax_attention(q, k, v, 4, causal=True)


def test_attention_with_lse_offsets_and_merge_give_causal_attention():
    """Two halves of the keys attended separately at their true positions and merged (what a
    ring of two ranks does) equal causal attention over the whole sequence, with gradients."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 12, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    half = 6
    outs = []
    for qs in (0, half):
        qq = q[..., qs:qs + half, :]
        a = attention_with_lse(qq, k[..., :half, :], v[..., :half, :], causal=True, q_offset=qs, k_offset=0)
        b = attention_with_lse(qq, k[..., half:, :], v[..., half:, :], causal=True, q_offset=qs, k_offset=half)
        outs.append(merge_attention(*a, *b)[0])        # query block 0 sees no key of block 1
    out = torch.cat(outs, dim=-2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_online_softmax_never_holds_the_score_matrix():
    s, block = 512, 32
    naive = attention_peak_bytes(naive_causal_attention, 1, 2, s, 8)
    online = attention_peak_bytes(lambda q, k, v: online_softmax_attention(q, k, v, block, causal=True), 1, 2, s, 8)
    # beyond q, k and v (kᵀ is a view of k, not new memory): the fp32 scores, the masked scores
    # and the probabilities of 2 heads alive at once, and the s × s bool mask
    assert naive == 3 * 2 * s * s * 4 + s * s
    assert online < naive / 4


def test_the_task_loss_falls():
    cfg = GPTConfig()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for t in range(80):
        tokens, targets = batch(cfg, 16, t)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(cfg.vocab_size)) < 0.1
    assert sum(losses[-10:]) / 10 < losses[0] - 1.0
    assert entropy_rate(cfg) < sum(losses[-10:]) / 10


def test_batch_is_deterministic_and_step_dependent():
    cfg = GPTConfig()
    a, b, c = batch(cfg, 4, 3), batch(cfg, 4, 3), batch(cfg, 4, 4)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])


def test_gpt_runs_under_fake_tensor_mode():
    huge = GPTConfig(vocab_size=1000, seq_len=128, d_model=1024, n_layers=1, n_heads=8)
    rows = fake_training_step(huge, batch_size=1)
    assert rows["after optimizer step"]["Parameter"] == 2 * param_count(huge)



# --- statements the numbers back -----------------------------------------------------------

def test_memtracker_activations_exceed_saved_bytes_by_the_loss_alone():
    """MemTracker files the loss (4 bytes) under activations; everything else it counts after
    the forward is what autograd saved, the fp32 log-softmax included."""
    rows = memory_timeline(GPTConfig(), batch_size=4, steps=1)
    assert rows[0]["tracker"]["Activation"] - rows[0]["own"]["Activation"] == 4


def test_values_in_one_to_two_counted_from_bits_for_every_format():
    for name, dtype in FORMATS.items():
        mantissa = round(-math.log2(torch.finfo(dtype).eps))
        assert format_properties(name, dtype)["values in [1, 2]"] == 2 ** mantissa + 1
    assert format_properties("fp32", torch.float32)["values in [1, 2]"] == 2 ** 23 + 1     # not the 200,001 samples
    with pytest.raises(ValueError, match="representable"):
        values_between(1.0, 1.1, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="0 < lo < hi"):
        values_between(2.0, 1.0, torch.float16)


def test_e4m3_cast_saturates_and_the_others_overflow():
    over = overflow_table((1e6, float("inf"), -float("inf")))
    assert over["fp8 e4m3fn"] == [448.0, 448.0, -448.0]           # no inf to detect
    assert over["fp16"] == [math.inf, math.inf, -math.inf]
    assert over["fp8 e5m2"] == [math.inf, math.inf, -math.inf]
    assert math.isnan(round_to(torch.tensor([math.nan]), torch.float8_e4m3fn).item())


@pytest.mark.parametrize("lr", [3e-4, 1e-4, 2e-3, 1e-5, 7e-4])
def test_bf16_freeze_threshold_is_exact(lr):
    """A bf16 weight w stays put under an update of lr exactly when lr < ulp(w)/2: every
    representable w from the threshold up to 4× it is frozen, and every w in the binade just
    below it moves (for lr = 3e-4 the threshold is 0.125, not lr·2⁸ = 0.077)."""
    t = freeze_threshold(lr)
    if lr == 3e-4:
        assert t == 0.125
    def representable(lo, hi):
        return torch.arange(int(lo * 2 ** 14), int(hi * 2 ** 14)).double().div(2 ** 14).to(torch.bfloat16).unique()
    frozen = representable(t, 4 * t)
    assert (frozen + torch.tensor(lr, dtype=torch.float64)).to(torch.bfloat16).eq(frozen).all()
    below = representable(t / 2, t)
    below = below[below < t]
    assert (below.double() + lr).to(torch.bfloat16).ne(below).all()
    with pytest.raises(ValueError, match="positive"):
        freeze_threshold(0.0)


def test_loss_scaling_rescues_the_smallest_gradients_tensor_by_tensor():
    cfg = GPTConfig()
    ref = fp32_gradients(cfg, 16)
    unscaled = per_tensor_error(fp16_gradients(cfg, 16)[0], ref)
    scaled = per_tensor_error(fp16_gradients(cfg, 16, scale=2.0 ** 16)[0], ref)
    rms = gradient_rms(ref)
    real = sorted((k for k in rms if "k_proj.bias" not in k), key=rms.get)   # K's bias: zero up to rounding
    for k in real[:4]:
        assert unscaled[k] > 10 * scaled[k]
    assert all(rms[k] < 1e-9 for k in rms if "k_proj.bias" in k)


def test_accumulator_model_exact_with_enough_bits_and_promotion_bounds_the_error():
    g = torch.Generator().manual_seed(0)
    a = round_to(torch.randn(8, 300, generator=g), torch.float8_e4m3fn)
    b = round_to(torch.randn(300, 8, generator=g), torch.float8_e4m3fn)
    torch.testing.assert_close(accumulate(a, b, bits=53), a.double() @ b.double(), rtol=0, atol=0)
    assert keep_bits(torch.tensor([1 + 2 ** -20], dtype=torch.float64), 14).item() == 1.0
    long, short = accumulation_error(2048), accumulation_error(128)
    assert long > 5 * short                                    # a 14-bit sum degrades with k
    assert accumulation_error(2048, promote_every=128) < 2 * short   # promotion: no worse than k = 128
    with pytest.raises(ValueError, match="positive"):
        accumulate(a, b, promote_every=0)


def test_mxfp8_scales_are_powers_of_two_and_nothing_saturates():
    x = torch.randn(4, 96) * torch.logspace(-3, 3, 4)[:, None]
    q, s = quantize_fp8(x, (1, 32), power_of_two=True)
    assert s.shape == (4, 3)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    blocks = q.float().abs().reshape(4, 3, 32).amax(-1)
    assert (blocks <= 448).all() and (blocks >= 448 / 2).all()  # rounding the scale up: at most 2× of range
    a, w = outlier_matrices(64, 128, 32, outlier=1e5, seed=1)
    assert fp8_matmul_error(a, w, (1, 32), (32, 1), power_of_two=True) < 0.06


def test_delayed_scaling_saturates_when_the_amax_jumps():
    errs = scaling_over_steps([1.0] * 5 + [8.0] + [1.0] * 3, history=4)
    current, delayed, saturated = zip(*errs)
    assert saturated[5] > 0.5 and delayed[5] > 10 * current[5]
    assert saturated[0] == 0 and delayed[0] == current[0]       # first step: no history, current scale
    assert all(s == 0 for s in saturated[6:])                   # the jump is in the window now


@pytest.mark.parametrize("chunk", [1, 7, 32, 1000])
def test_chunked_cross_entropy_equals_the_whole_loss(chunk):
    g = torch.Generator().manual_seed(chunk)
    head = torch.nn.Linear(16, 50, bias=chunk % 2 == 1).double()
    hidden = torch.randn(3, 11, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(50, (3, 11), generator=g)
    whole = F.cross_entropy(head(hidden).reshape(-1, 50), targets.reshape(-1))
    got = chunked_cross_entropy(hidden, head, targets, chunk)
    torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)
    params = [hidden] + list(head.parameters())
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(whole, params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_chunked_cross_entropy_drops_the_log_softmax_and_refuses_misuse():
    cfg = GPTConfig(vocab_size=4096)
    whole, chunked = loss_memory(cfg, 4), loss_memory(cfg, 4, chunk_rows=16)
    assert whole["held"] - chunked["held"] >= whole["log_softmax"]    # b·s·v·4 bytes no longer held
    assert chunked["peak"] < 0.75 * whole["peak"]
    head = torch.nn.Linear(4, 5)
    with pytest.raises(ValueError, match="positive"):
        chunked_cross_entropy(torch.randn(2, 4), head, torch.zeros(2, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="targets"):
        chunked_cross_entropy(torch.randn(2, 4), head, torch.zeros(3, dtype=torch.long), 1)


def test_autocast_keeps_fp32_master_weights():
    cfg = GPTConfig()
    curve_32, _ = train_curve(cfg, "fp32", 12, 3e-4, batch_size=4, log_every=11)
    curve_ac, unchanged = train_curve(cfg, "autocast bf16", 12, 3e-4, batch_size=4, log_every=11)
    assert abs(curve_ac[-1][1] - curve_32[-1][1]) < 0.01 and unchanged < 0.1


def test_memory_phase_figure_labels_whole_and_legend_outside_the_bars():
    rows = memory_timeline(GPTConfig(), batch_size=2, steps=2)
    fig = memory_phases_figure(rows)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[:4] == ["fwd", "bwd", "opt", "zero"]       # short, so that they never overlap (newcomer 10)
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.get_xticklabels()]
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:]))
    tallest = max(sum(r["tracker"].get(c, 0) for c in MEM_CATEGORIES) for r in rows) / 1e6
    assert ax.get_ylim()[1] > tallest                                 # the bars stay inside the axes
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.y0 >= ax.get_window_extent().y1                     # the legend sits above the axes
    import matplotlib.pyplot as plt
    plt.close(fig)


# --- what the page claims, checked against the code and the sources it cites -----------------

def test_autocast_keeps_its_bf16_weight_copies_from_forward_to_backward():
    """Every Linear's bf16 weight copy is saved for backward (2 bytes per weight
    parameter) by the forward; without autocast nothing is copied."""
    cfg = GPTConfig()
    model = GPT(cfg)
    tokens, targets = batch(cfg, 4, 0)
    with CastWeightCopies(model) as copies, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model(tokens), targets)
    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert copies.bytes == 2 * sum(w.numel() for w in linear) and copies.numel == sum(w.numel() for w in linear)
    assert 0 < copies.numel < param_count(cfg)                         # embeddings, norms, biases not copied
    loss.backward()
    with CastWeightCopies(model) as outside:                           # no autocast: nothing cast
        loss_fn(model(tokens), targets)
    assert outside.bytes == 0


def _page_of(section):
    """The notes, table cells and captions `section` records, as one lower-case string."""
    from util import record
    import matplotlib.pyplot as plt
    rec = record.Recorder()
    previous = record.use(rec)
    try:
        section()
    finally:
        record.use(previous)
        plt.close("all")
    return " ".join(str(v) for r in rec.records for k, v in r.items()
                    if k in ("text", "rows", "header", "caption")).lower()


def test_parameters_and_bytes_page_counts_autocast_copies_until_backward():
    text = _page_of(L.parameters_and_bytes)
    assert "live only during the forward" not in text
    assert "bf16 weight copies saved by the forward, freed by the backward" in text
    counted = _page_of(L.counting_parameters)                               # its deep dive
    assert "assumes f = 4h" in counted and "h=96 l=3 a=6 kv=3 f=200" in counted   # the miss named


def test_delayed_scaling_names_transformer_engines_window():
    """TE's default amax history is 1024 steps, ours 8 for the plot."""
    text = _page_of(delayed_scaling)
    assert "1024" in text and "last 8 steps" not in text


def test_format_caption_gives_median_and_worst_case():
    """The curve is the median (about eps/4); the worst case is eps/2."""
    text = _page_of(L.formats_and_rounding)
    assert "worst case eps/2" in text and "accurate to ~eps/4" not in text


def test_copy_size_is_beyond_the_largest_cache(tmp_path):
    """The bandwidth copy's two buffers are at least 4x the last-level cache."""
    for level, size in enumerate(["32K", "1024K", "32768K"]):
        (tmp_path / f"index{level}").mkdir()
        (tmp_path / f"index{level}" / "size").write_text(size + "\n")
    from lectures.model import copy_bytes_beyond_cache, largest_cache_bytes
    assert largest_cache_bytes(str(tmp_path)) == 32 * 2 ** 20
    assert 2 * copy_bytes_beyond_cache(32 * 2 ** 20) >= 4 * 32 * 2 ** 20
    assert largest_cache_bytes(str(tmp_path / "missing")) is None
    with pytest.raises(ValueError):
        copy_bytes_beyond_cache(0)


def test_memtracker_residue_after_backward_is_the_batch_and_the_loss():
    """The bytes MemTracker keeps under activations after a backward are the
    batch's int64 token ids and targets and the 4-byte loss, nothing else."""
    rows = memory_timeline(GPTConfig(), batch_size=16, steps=2)
    for r in rows[1:4] + rows[5:8]:
        assert r["tracker"]["Activation"] == r["batch"] + r["loss"] == 2 * 16 * 32 * 8 + 4


def test_recomputation_policy_is_named_ours_and_the_papers_distinguished():
    """Our selective policy is not Korthikanti et al.'s; no unsupported
    'a few percent'."""
    import inspect
    src = inspect.getsource(L.recomputation)
    assert "a selective policy of our own" in src and "It is not" in src and "few percent" not in src


def test_mxfp8_scale_called_a_variant_of_the_ocp_rule():
    """The OCP scale is 2^(floor(log2 amax) - emax); ours rounds up."""
    import math as m
    x = torch.full((1, 32), 300.0)
    _, scale = quantize_fp8(x, (1, 32), power_of_two=True)
    ocp = 2.0 ** (m.floor(m.log2(300.0)) - 8)                         # 2^0: 300 fits in e4m3's 448
    assert scale.item() == 1.0 == ocp
    x = torch.full((1, 32), 500.0)                                    # above 448 at scale 2^0
    _, scale = quantize_fp8(x, (1, 32), power_of_two=True)
    assert scale.item() == 2.0 and 2.0 ** (m.floor(m.log2(500.0)) - 8) == 1.0   # OCP would saturate
    assert "Mishra et al. 2025" in quantize_fp8.__doc__                    # NVIDIA's recipe


def test_fake_tensor_table_uses_readable_units():
    """Small values in kB, not 1.6e-05 GB; the header is not 'after' again."""
    import inspect
    src = inspect.getsource(a_step_too_big_to_hold)
    assert "fmt_bytes(r.get(c, 0))" in src and 'header=["phase"' in src


# ---- fp8 conclusions that follow their numbers ----------------------------------------------

def test_fp8_outliers_sit_in_tokens_and_in_channels():
    a, w = outlier_matrices(200, 1024, 8, outlier=1e3, frac=0.01, channel_frac=0.002)
    keep = ordinary_channels(1024, channel_frac=0.002)
    assert (~keep).sum() == 2
    assert (a[:, ~keep].abs().median(0).values > 100).all()            # outlier channels on every token
    assert (a[:, keep].abs().amax(1) > 500).sum() == 2                 # and two outlier tokens
    assert a.abs().max() < 1e3 * 10                                     # crossings are not squared


def test_fp8_tiles_beat_rows_only_once_outlier_channels_are_large():
    """Per-channel outliers give the 1×128 tiles something to win; small ones little. Review N1:
    the activations' granularities are compared with the weight's scales held fixed."""
    m, k, n = 128, 512, 128
    keep = ordinary_channels(k)
    big = fp8_scaling_errors(*outlier_matrices(m, k, n, outlier=1e5), keep)
    assert big["tiles 1×128, 128×128"] < 0.7 * big["per token, weight 128×128"] < 0.7 * big["per-tensor"]
    small = fp8_scaling_errors(*outlier_matrices(m, k, n, outlier=1e2), keep)
    assert small["tiles 1×128, 128×128"] > 0.9 * small["per token, weight 128×128"]     # within 10%
    # the row-wise column's edge at small outliers is the weight's per-column scales, not the activations'
    assert small["row-wise (per token)"] < small["per token, weight 128×128"]


def _fp8_row(per_tensor, rowwise, tiles, per_token=None):
    return {"per-tensor": per_tensor, "row-wise (per token)": rowwise, "tiles 1×128, 128×128": tiles,
            "per token, weight 128×128": rowwise if per_token is None else per_token}


def test_fp8_verdict_is_read_from_the_table():
    never = [(1.0, _fp8_row(0.04, 0.03, 0.035)), (1e5, _fp8_row(0.5, 0.031, 0.035))]
    assert tiles_first_win(never) is None
    assert "At no outlier size" in fp8_verdict(never) and "up to 100000×" in fp8_verdict(never)
    wins = [(1.0, _fp8_row(0.04, 0.03, 0.035)), (1e4, _fp8_row(0.06, 0.05, 0.035)),
            (1e5, _fp8_row(0.5, 0.1, 0.04))]
    assert tiles_first_win(wins) == 1e4
    text = fp8_verdict(wins)
    assert "up to 1×" in text and "From 10000× on, the tiles win: 0.035 against 0.05 per token" in text
    # the row-wise column (per-column weight scales) is not what decides: the fixed-weight one is
    fixed = [(1.0, _fp8_row(0.04, 0.03, 0.035, per_token=0.06))]
    assert tiles_first_win(fixed) == 1.0 and "weight's scales held fixed" in fp8_verdict(wins)


def test_e8m0_scale_costs_only_the_block_maximum():
    """A power-of-two scale loses no precision on a block's other values; what it
    loses is the exactness of the block's largest value, which an exact scale maps onto 448."""
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))
    blocks = x.reshape(-1, 32)
    is_max = blocks.abs() == blocks.abs().amax(1, keepdim=True)
    rel = {}
    for p2 in (False, True):
        back = dequantize_fp8(*quantize_fp8(x, (1, 32), power_of_two=p2)).reshape(-1, 32)
        rel[p2] = ((back - blocks).abs() / blocks.abs())
    assert rel[True][~is_max].mean().item() == pytest.approx(rel[False][~is_max].mean().item(), rel=0.02)
    assert rel[False][is_max].max() < 1e-6 < 1e-3 < rel[True][is_max].mean()
    keep = ordinary_channels(1024)
    errors = fp8_scaling_errors(*outlier_matrices(128, 1024, 128, outlier=1e5), keep)
    assert errors["MXFP8 1×32, exact scale"] < errors["MXFP8 1×32, e8m0 scale"]
    assert errors["MXFP8 1×32, exact scale"] < errors["tiles 1×128, 128×128"]


def test_scaled_mm_row_wise_matches_simulation_on_the_ordinary_channels():
    a, w = outlier_matrices(64, 256, 32, outlier=1e5)
    keep = ordinary_channels(256)
    got = scaled_mm_error(a, w, rowwise=True, channels=keep)
    if got is None:
        pytest.skip("torch._scaled_mm does not run on this build")
    assert got == pytest.approx(fp8_matmul_error(a, w, (1, 256), (256, 1), channels=keep), rel=0.05)
    assert scaled_mm_error(a, w, channels=keep) == pytest.approx(fp8_matmul_error(a, w, channels=keep), rel=1e-3)


def test_accumulator_model_that_reproduces_deepseeks_two_percent():
    """DeepSeek-V3 §3.3.2 reports a maximum relative error of nearly 2% for k = 4096
    with a ~14-bit accumulator; the error depends on the assumed rounding, and the page picks
    the model nearest the paper's number."""
    worst = {name: accumulation_error(4096, group=g, rounding=r, worst=True)
             for name, (g, r) in ACCUMULATOR_MODELS.items()}
    best = closest_to_paper(worst)
    assert 0.01 < worst[best] < 0.03
    assert worst["rounded to nearest after every product"] < 0.005 < 0.03 < worst["truncated after every product"]
    g = torch.Generator().manual_seed(0)
    a = round_to(torch.randn(4, 64, generator=g), torch.float8_e4m3fn)
    b = round_to(torch.randn(64, 4, generator=g), torch.float8_e4m3fn)
    torch.testing.assert_close(accumulate(a, b, bits=53, group=4, rounding="nearest"), a.double() @ b.double())
    with pytest.raises(ValueError, match="divisor"):
        accumulate(a, b, promote_every=128, group=3)


def test_autocast_bytes_between_forward_and_backward_depend_on_zero_grad():
    """12 + copies in a loop that sets gradients to None before the forward, 16 +
    copies when last step's gradients are alive (gradient accumulation)."""
    cfg = GPTConfig()
    tokens, targets = batch(cfg, 4, 0)
    psi = param_count(cfg)
    standard, copies = autocast_held_before_backward(GPT(cfg), None, tokens, targets, set_to_none=True)
    kept, _ = autocast_held_before_backward(GPT(cfg), None, tokens, targets, set_to_none=False)
    assert sum(standard.values()) == 12 * psi + copies.bytes
    assert sum(kept.values()) == 16 * psi + copies.bytes
    text = _page_of(L.parameters_and_bytes)
    for held in (standard, kept):
        assert f"{sum(held.values()) / psi:.1f}" in text
    assert "set_to_none=true" in text and "accumulation" in text


@pytest.mark.timed
def test_elementwise_kernels_reach_the_copy_bandwidth():
    """With preallocated outputs, add and GELU move bytes at the rate a copy does,
    not 6× slower (which is what timing a fresh 64 MB output per call measures)."""
    from lectures.model import copy_rate, elementwise_rate
    nbytes = 64 * 2 ** 20
    bw, _ = copy_rate(nbytes, repeats=5)
    add, _, add_intensity = elementwise_rate(nbytes // 4, "add", repeats=5)
    gelu, _, gelu_intensity = elementwise_rate(nbytes // 4, "gelu", repeats=5)
    assert add / add_intensity > 0.5 * bw
    assert gelu / gelu_intensity > 0.25 * bw         # GELU's erf costs arithmetic on one thread


def test_attention_scores_of_bf16_inputs_are_computed_in_fp32():
    """The backward recomputes the scores from fp32 operands, so the forward must compute them in
    fp32 too (not multiply q kᵀ in bf16 and upcast), or the backward's P is not the forward's: the
    forward's log-sum-exp is that of the fp32 scores, and our bf16 attention errs about as little
    as PyTorch's SDPA."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g).bfloat16() for _ in range(3))
    _, lse = attention_with_lse(q, k, v, causal=True)
    scores = (q.float() @ k.float().transpose(-2, -1)) * 32 ** -0.5
    scores = scores.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-6, atol=1e-6)
    errors = bf16_attention_errors()
    assert errors["ours"][0] < 1.5 * errors["SDPA"][0] and errors["ours"][1] < 1.5 * errors["SDPA"][1]


def test_allocator_and_torchao_float8_are_on_the_main_path():
    """The main path names the CUDA caching allocator beside the meter, and
    torchao's float8 as PyTorch's own fp8 path (prose with a citation: it needs an fp8 GPU)."""
    import inspect
    step, formats = inspect.getsource(L.anatomy_of_a_step), inspect.getsource(L.master_weights)
    assert "memory_reserved" in step and "expandable_segments" in step and "_dump_snapshot" in step
    assert "convert_to_float8_training" in formats and "rowwise_with_gw_hp" in formats
    assert "docs.pytorch.org/ao" in formats


def test_bandwidths_side_by_side_put_add_and_gelu_near_the_copy():
    """The roofline's three memory-bound points, timed in the same rotating rounds."""
    rates = bandwidths(64 * 2 ** 20, repeats=3)
    assert set(rates) == {"copy", "add", "gelu"}
    assert rates["add"][0] > 0.5 * rates["copy"][0] and rates["gelu"][0] > 0.25 * rates["copy"][0]


# --- issue 39: the review's N2, N3 and N6 ----------------------------------------------------

def test_roofline_is_drawn_through_its_ridge():
    """N6: the roof's corner lies at peak/bw, not cut by a straight line between powers of two."""
    from lectures.model.figures import roof_points
    peak, bw = 166.1e9, 32.0e9
    xs = roof_points(peak, bw)
    assert peak / bw in xs and xs == sorted(xs)
    assert max(min(peak, x * bw) for x in xs) == peak


def test_write_allocate_explains_add_above_the_copy():
    """N2: counting 8 bytes for a copy and 12 for an add leaves out the read a store's
    write-allocate makes; at one real bandwidth the add's counted rate is 1.125× the copy's."""
    from lectures.model.roofline import write_allocate_rate
    assert write_allocate_rate(32.0e9, "copy") == pytest.approx(32.0e9)
    assert write_allocate_rate(32.0e9, "add") == pytest.approx(36.0e9)
    import inspect
    from lectures.model import deep_dives
    source = inspect.getsource(deep_dives.roofline)
    assert "write-allocate" in source and "load that changed" not in source


def test_a_2x_median_gap_is_never_called_a_tie():
    """N3: overlapping spreads with medians 2× apart are said as a gap the machine cannot rank."""
    from util.measure import Timing, compare
    from util.render import visible_text
    blocked = Timing([31.9e-3, 32.5e-3, 33.1e-3, 33.2e-3, 33.3e-3])
    naive = Timing([15.2e-3, 15.9e-3, 16.3e-3, 33.0e-3, 33.4e-3])      # a few slow repeats
    said = visible_text(compare(blocked, naive, "our blocked version", "the naive one"))
    assert "no measurable difference" not in said and "2.03× lower" in said and "no firm ranking" in said


def test_attention_variants_are_timed_taking_turns():
    """N3: the three attention kernels are timed side by side, not one after the other."""
    import inspect
    assert "measure_side_by_side" in inspect.getsource(L.attention_memory)
