"""The data behind lecture 07's memory calculator: the model presets (lecture 01's GPT, Llama 3
8B and 70B), the bytes per parameter of each precision, and the layout it opens with.

The page's JavaScript (util/static/widgets.js) is a port of `estimate_memory` that takes the same
argument names as `ModelShape` and `Layout`; tests/test_widgets.py checks it returns the same
numbers for hundreds of random layouts."""
import dataclasses

from lectures.estimator import PRECISION_BYTES, ModelShape
from lectures.gpt import GPTConfig
from lectures.step_time import LLAMA3_70B, LLAMA3_8B


def presets():
    """{name: ModelShape fields} for the calculator's model menu."""
    shapes = [ModelShape.from_gpt(GPTConfig()), LLAMA3_8B, LLAMA3_70B]
    return {s.name: dataclasses.asdict(s) for s in shapes}


def calculator_data(model="Llama 3 8B", layout=None, memory_gb=80):
    """The widget's JSON: presets, precision table, and the layout shown first."""
    layout = layout or {"dp": 8, "tp": 8, "pp": 1, "cp": 1, "zero": 1, "micro_batch": 1,
                        "micro_batches": 1, "recompute": "full", "precision": "bf16",
                        "schedule": "1f1b", "sp": True}
    return {"presets": presets(), "precision_bytes": PRECISION_BYTES,
            "initial": {"model": model, "layout": layout, "memory_gb": memory_gb}}
