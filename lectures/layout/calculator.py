"""The data behind lecture 07's memory calculator: the model presets (lecture 01's GPT, Llama 3
8B, 70B and 405B, DeepSeek-V3), the bytes per parameter of each precision, the step-time model's hardware constants,
and the layout it opens with.

The page's JavaScript (util/static/widgets.js) is a port of `estimate_memory` that takes the same
argument names as `ModelShape` and `Layout`, and so is `step_time`; tests/test_widgets.py checks
both return the same numbers for hundreds of random layouts."""
import dataclasses
import math
import sys

from lectures.layout.estimator import PRECISION_BYTES, ModelShape
from lectures.model.gpt import GPTConfig
from lectures.layout.published import DEEPSEEK_V3
from lectures.layout.step_time import LLAMA3_405B, LLAMA3_70B, LLAMA3_8B, h100_cluster


def presets():
    """{name: ModelShape fields} for the calculator's model menu."""
    shapes = [ModelShape.from_gpt(GPTConfig()), LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, DEEPSEEK_V3]
    return {s.name: dataclasses.asdict(s) for s in shapes}


def calculator_data(model="Llama 3 8B", layout=None, hardware=(), cluster=None):
    """The widget's JSON: presets, precision table, the step-time model's constants (the H100
    cluster's, and any `Hardware` given, e.g. this machine's as the lecture measured it), and
    the layout shown first; `cluster` replaces the default H100 cluster (e.g. with the GEMM
    fraction the lecture fits). The memory cap starts at the search's: the H100 cluster's usable
    memory (the calculator and the search must agree on what fits)."""
    layout = layout or {"dp": 8, "tp": 8, "pp": 1, "cp": 1, "zero": 1, "micro_batch": 1,
                        "micro_batches": 1, "recompute": "full", "precision": "bf16",
                        "schedule": "1f1b", "sp": True, "virtual_stages": 1, "ep": 1,
                        "cp_algorithm": "ring"}
    machines = [cluster or h100_cluster(), *hardware]
    return {"presets": presets(), "precision_bytes": PRECISION_BYTES,
            "hardware": {hw.name: _finite(dataclasses.asdict(hw)) for hw in machines},
            "initial": {"model": model, "layout": layout, "memory_gib": round(machines[0].memory / 2 ** 30, 2)}}


def _finite(value):
    """JSON has no infinity: an unlimited quantity (this machine's memory; a bandwidth the fit
    found unbounded) becomes the largest float, which every formula treats the same way."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return math.copysign(sys.float_info.max, value)
    return value
