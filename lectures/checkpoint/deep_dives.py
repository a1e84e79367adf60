"""The sections of lecture 08's appendix page."""
import os

from lectures.checkpoint.demos import metadata_rows, workdir
from util import note, table


def dcp_metadata():
    """The .metadata of the checkpoint the lecture wrote under dp×tp: three tensors' boxes and
    their files."""
    path = os.path.join(workdir("saved-under-dp-tp", fresh=False), "step-000002")
    if not os.path.exists(os.path.join(path, ".metadata")):
        return
    rows = []
    for key in ("model/blocks.0.attn.q_proj.weight", "model/blocks.0.ln1.weight",
                "model/blocks.0.mlp.fc_out.weight"):
        for offset, size, where in metadata_rows(path, key):
            rows.append([key, str(offset), str(size), where])
    note("""
        The `.metadata` file of the dp×tp checkpoint above, for three tensors: each box with
        its offset, its size and the file that holds it. The fused Q, K, V weight of a
        tensor-parallel rank became boxes of three tensors; the LayerNorm weight, held whole by
        all four ranks, was written once; the row-parallel weight is split by columns.
    """)
    table(rows, header=["tensor", "offset", "size", "file"],
          caption="Boxes recorded by DCP for three tensors of the checkpoint written under dp×tp (4 ranks).")
