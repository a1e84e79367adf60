"""Collectives and data parallelism (lectures 02 and 03's building blocks).

- `collectives`: rings and trees by hand, and their α–β cost.
- `ddp`: gradient synchronisation after backward, by bucket, overlapped with backward.
- `zero`: ZeRO stages 1, 2 and 3; `compression`: talking less (int8 updates, PowerSGD, a Nesterov outer step).
- `communication_demos`, `communication_deep_dives`: what lecture 02's demos run on each rank, and
  its appendix page's sections; `demos`, `deep_dives`: the same for lecture 03; `figures`: both
  lectures' drawings.
"""
