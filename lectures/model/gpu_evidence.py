"""Published GPU measurements the lectures draw beside what this CPU can show: each one carried
as data, with who published it, where (table or file) and on what hardware. Nothing here was
measured by this course; every number is copied from the source named beside it, and the pages
say so on the figure. `published_figure` (lectures/model/figures.py) draws them."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Published:
    """One published measurement: `series` maps a name to its (x, y) points, as the source gives them."""
    title: str
    source: str          # who published it
    url: str
    where: str           # the table, file or section the numbers come from
    hardware: str
    x_label: str
    y_label: str
    series: dict
    kind: str = "bars"   # "bars" (x are categories), "barh" (the same, drawn across) or "line" (x are numbers, log scale)

    def caption(self, said=""):
        """The figure's caption: what it shows, then the source, linked, with where in it."""
        return (f"{said + ' ' if said else ''}Published, not measured here: {self.hardware}. Source: "
                f"[{self.source}]({self.url}), {self.where}.")


# Lecture 01: float8 against bf16 end to end (torch.compile on both).
TORCHTITAN_FP8 = Published(
    title="Llama 3.1 8B, FSDP: bf16 against float8 linears",
    source="torchtitan benchmarks, December 2024",
    url="https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
    where="Tables 1 and 3, rows FSDP + torch.compile (+ Float8)",
    hardware="Llama 3.1 8B on H100s, FSDP",
    x_label="", y_label="tokens/s per GPU",
    series={"bf16 (FSDP + torch.compile)": [("8 H100s", 6667), ("128 H100s", 6514)],
            "float8 linears (+ Float8)": [("8 H100s", 8532), ("128 H100s", 8380)]})

# Lecture 01: when a float8 GEMM pays (torchao's microbenchmark, two shapes quoted in its README).
TORCHAO_FP8_SHAPES = Published(
    title="float8 linear against bf16, by shape (M, K, N)",
    source="torchao float8 README",
    url="https://github.com/pytorch/ao/blob/main/torchao/float8/README.md",
    where="section Performance, examples 1 and 2",
    hardware="NVIDIA H100, forward + backward of a linear with dynamic float8 scaling",
    x_label="shape M, K, N", y_label="speed-up over bf16",
    series={"float8 / bf16": [("1024, 2048, 1024", 0.80), ("4096, 8192, 16384", 1.39)]})

# Lecture 02: nccl-style all-reduce bus bandwidth against message size inside one NVSwitch node.
H200_ALL_REDUCE = Published(
    title="all-reduce bus bandwidth on one 8× H200 node",
    source="Stas Bekman, Machine Learning Engineering (ml-engineering)",
    url="https://github.com/stas00/ml-engineering/blob/master/network/benchmarks/results/all-reduce-8xH200.md",
    where="network/benchmarks/results/all-reduce-8xH200.md, the busbw column",
    hardware="8× H200 SXM, NVLink 4 through NVSwitch, torch 2.9.1, NCCL 2.27.7",
    x_label="payload (bytes)", y_label="bus bandwidth (GB/s)", kind="line",
    series={"8× H200 busbw": [(32 * 2 ** 10, 1.44), (64 * 2 ** 10, 2.93), (128 * 2 ** 10, 5.73),
                              (256 * 2 ** 10, 11.74), (512 * 2 ** 10, 23.94), (2 ** 20, 39.93),
                              (2 * 2 ** 20, 64.53), (4 * 2 ** 20, 107.16), (8 * 2 ** 20, 155.53),
                              (16 * 2 ** 20, 219.89), (32 * 2 ** 20, 275.84), (64 * 2 ** 20, 346.51),
                              (128 * 2 ** 20, 401.93), (256 * 2 ** 20, 436.15), (512 * 2 ** 20, 450.29),
                              (2 ** 30, 463.58), (2 * 2 ** 30, 469.17), (4 * 2 ** 30, 473.10),
                              (8 * 2 ** 30, 477.45), (16 * 2 ** 30, 482.26)]})

# Lecture 03: FSDP from 8 to 128 GPUs, tokens per second per GPU (weak scaling: local batch fixed).
TORCHTITAN_FSDP_SCALING = Published(
    title="Llama 3.1 8B with FSDP: throughput per GPU at 8 and 128 H100s",
    source="torchtitan benchmarks, December 2024",
    url="https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
    where="Tables 1 (8 GPUs, global batch 16) and 3 (128 GPUs, global batch 256), local batch 2",
    hardware="Llama 3.1 8B on H100s (Grand Teton, 400 Gb/s RDMA per GPU), FSDP, selective activation checkpointing",
    x_label="GPUs", y_label="tokens/s per GPU",
    series={"FSDP": [("8 H100s", 5762), ("128 H100s", 5605)],
            "FSDP + torch.compile": [("8 H100s", 6667), ("128 H100s", 6514)],
            "FSDP + torch.compile + Float8": [("8 H100s", 8532), ("128 H100s", 8380)]})

# Lecture 04: async TP against TP with blocking collectives.
TORCHTITAN_ASYNC_TP = Published(
    title="async TP against vanilla TP (tp = 8 inside each node)",
    source="torchtitan benchmarks, June 2025",
    url="https://github.com/pytorch/torchtitan/blob/main/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md",
    where="the two tables (Llama3 70b on 256 H100s, FSDP 32, TP 8; Llama3 8b on 64 H100s, FSDP 8, TP 8), "
          "column tokens/sec",
    hardware="H100s (Grand Teton, 500 W), torch.compile",
    x_label="model, precision", y_label="tokens/s per GPU",
    series={"vanilla TP": [("70B bf16", 597.3), ("70B float8 tensorwise", 809.8), ("8B bf16", 4378),
                           ("8B float8 tensorwise", 5078.1)],
            "async TP": [("70B bf16", 652.4), ("70B float8 tensorwise", 942.4), ("8B bf16", 4809.4),
                         ("8B float8 tensorwise", 5570.1)]})

# Lecture 06: context parallelism: sequence length against throughput, the GPU count fixed.
TORCHTITAN_CP = Published(
    title="Llama 3.1 8B on 8 H100s: longer sequences with more CP",
    source="torchtitan benchmarks, December 2024",
    url="https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
    where="Table 2 (FSDP + CP + torch.compile + Float8, local batch 1, full activation checkpointing)",
    hardware="8 H100s (Grand Teton, 500 W)",
    x_label="sequence length (CP = 1, 2, 4, 8)", y_label="tokens/s per GPU", kind="line",
    series={"tokens/s per GPU": [(32768, 3890), (65536, 2540), (131072, 1071), (262144, 548)]})

# Lecture 08: what stopped Llama 3 405B's pre-training, by root cause (the 419 unexpected of its
# 466 interruptions in 54 days). The eleven smallest causes (NIC 7, NCCL watchdog timeouts 7,
# silent data corruption 6, GPU thermal interface and sensor 6, SSD 3, power supply 3, server
# chassis 2, IO expansion board 2, dependency 2, CPU 2, system memory 2) are drawn as one bar.
# The paper prints 30.1% beside the first row's 148, which is 35% of 419; the counts add up.
LLAMA3_INTERRUPTION_CAUSES = Published(
    title="Llama 3 405B on 16,384 H100s for 54 days: what stopped it",
    source="Llama Team 2024, The Llama 3 Herd of Models",
    url="https://arxiv.org/abs/2407.21783",
    where="§3.3.4, Table 5",
    hardware="16,384 H100s, 54 days of pre-training",
    x_label="", y_label="interruptions",
    kind="barh",
    series={"unexpected interruptions": [
        ("faulty GPU", 148), ("GPU HBM3 memory", 72), ("software bug", 54), ("network switch, cable", 35),
        ("host maintenance", 32), ("GPU SRAM memory", 19), ("GPU system processor", 17), ("11 other causes", 42)]})

# The model of lecture 06's W1 check: Llama 3.1 8B's shapes (Meta's model card / config.json).
LLAMA31_8B = {"layers": 32, "d_model": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "d_ff": 14336,
              "vocab": 128256}


def flops_per_token(seq_len, cfg=LLAMA31_8B):
    """Forward + backward FLOPs per token of a causal decoder at `seq_len` (no recomputation):
    6 × the matmul parameters, and the attention's two matmuls over on average seq_len/2 keys
    (×3 for forward + backward). Returns (matmuls, attention)."""
    d, hd = cfg["d_model"], cfg["head_dim"]
    per_layer = (2 * d * cfg["heads"] * hd + 2 * d * cfg["kv_heads"] * hd + 3 * d * cfg["d_ff"])
    params = cfg["layers"] * per_layer + d * cfg["vocab"]
    attention = 3 * cfg["layers"] * 2 * 2 * cfg["heads"] * hd * seq_len / 2
    return 6 * params, attention
