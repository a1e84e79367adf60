"""Collectives and data parallelism (lectures 02 and 03's building blocks).

- `collectives`: rings and trees by hand, and their α–β cost.
- `ddp`: gradient synchronisation after backward, by bucket, overlapped with backward.
- `zero`: ZeRO stages 1, 2 and 3; `compression`: talking less (int8 updates, PowerSGD, a Nesterov outer step).
"""
