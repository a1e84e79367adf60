"""Published GPU measurements lecture 05 draws, carried as data with their citation (not measured
here: the page says so on the figure and in its caption)."""

# Qi, Wan, Huang, Lin 2024, "Zero Bubble Pipeline Parallelism" (ICLR 2024; arXiv 2401.10241),
# Section 5.2, Table 4 "Experiment result details": GPT-3-like models on up to 32 NVIDIA A100 SXM
# 80G GPUs (4 nodes, RoCE RDMA), Megatron-LM; pipeline only, p = #GPU. ZB-1p: their automatic
# schedule under 1F1B's activation memory; ZB-2p: under twice that; 1F1B-I: interleaved 1F1B.
QI_TABLE_4_SOURCE = ("https://arxiv.org/abs/2401.10241",
                     "Qi, Wan, Huang, Lin 2024, Zero Bubble Pipeline Parallelism (ICLR 2024), Table 4")
QI_TABLE_4_HARDWARE = "up to 32 NVIDIA A100 SXM 80G GPUs, 4 nodes"
QI_TABLE_4_SCHEDULES = ("1F1B", "1F1B-I", "ZB-1p", "ZB-2p")
# model: (GPUs, micro-batch counts, {schedule: samples per GPU per second at each count}, {schedule: memory GB})
QI_TABLE_4 = {
    "1.5B": (8, (24, 32, 64),
             {"ZB-2p": (14.5, 14.8, 14.9), "ZB-1p": (12.9, 13.4, 14.2), "1F1B": (11.8, 12.5, 13.6),
              "1F1B-I": (13.1, 13.4, 13.9)},
             {"ZB-2p": 59, "ZB-1p": 32, "1F1B": 30, "1F1B-I": 40}),
    "6.2B": (8, (24, 32, 64),
             {"ZB-2p": (4.32, 4.35, 4.39), "ZB-1p": (3.88, 4.00, 4.20), "1F1B": (3.50, 3.70, 4.03),
              "1F1B-I": (4.01, 4.08, 4.19)},
             {"ZB-2p": 70, "ZB-1p": 42, "1F1B": 39, "1F1B-I": 48}),
    "14.6B": (16, (48, 64, 128),
              {"ZB-2p": (1.81, 1.83, 1.85), "ZB-1p": (1.61, 1.67, 1.76), "1F1B": (1.40, 1.49, 1.64),
               "1F1B-I": (1.54, 1.59, 1.66)},
              {"ZB-2p": 51, "ZB-1p": 33, "1F1B": 32, "1F1B-I": 39}),
    "28.3B": (32, (96, 128, 256),
              {"ZB-2p": (0.99, 1.00, 1.00), "ZB-1p": (0.87, 0.90, 0.96), "1F1B": (0.76, 0.80, 0.88),
               "1F1B-I": (0.82, 0.85, 0.90)},
              {"ZB-2p": 74, "ZB-1p": 44, "1F1B": 43, "1F1B-I": 58}),
}


def speedups_over_1f1b(table=QI_TABLE_4):
    """{model: (GPUs, micro-batches, {schedule: throughput / 1F1B's})} at each model's fewest
    micro-batches (m = 3p: where the bubble weighs most)."""
    out = {}
    for model, (gpus, ms, thr, _) in table.items():
        out[model] = (gpus, ms[0], {s: thr[s][0] / thr["1F1B"][0] for s in QI_TABLE_4_SCHEDULES})
    return out
