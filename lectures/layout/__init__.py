"""Putting the parallelisms together on one (dp, pp, cp, tp) mesh (lecture 07's building blocks).

- `mesh`: ranks on the grid, one group per axis; `trainer`: the GPT trained under any layout.
- `estimator`: per-rank memory from formulas; `step_time`: seconds per step from a cost model;
  `search`: every layout ranked, and the rule of thumb; `calculator`: the page's calculator data.
- `pytorch`: the same layouts from PyTorch's own pieces.
- `demos`, `deep_dives`, `figures`: what lecture 07's demos run on each rank (and the analysis of
  what they return), its appendix page's sections, and its page's drawings.
"""
