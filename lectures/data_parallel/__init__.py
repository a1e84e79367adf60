"""Collectives and data parallelism (lectures 02 and 03's building blocks).

- `collectives`: rings and trees by hand, and their α–β cost.
- `ddp`: gradient synchronisation after backward, by bucket, overlapped with backward.
- `overlap`: a compute stand-in that releases the core, and the model of an overlapped step.
- `zero`: ZeRO stages 1, 2 and 3; `compression`: talking less (int8 updates, PowerSGD, a Nesterov outer step).
- `communication_demos`, `communication_deep_dives`: what lecture 02's demos run on each rank, and
  its appendix page's sections; `demos`, `deep_dives`: the same for lecture 03; `figures`: both
  lectures' drawings.

The building blocks below are the package's public names; import them from here,
`from lectures.data_parallel import ring_all_reduce, Zero3`,
and the page code (`demos`, `figures`, `deep_dives`) from its own module.
"""
from lectures.data_parallel.collectives import (ring_all_reduce, pipelined_ring_all_reduce, bus_bandwidth_factor,
                                                bandwidths, SWEPT, sweep, binomial_broadcast_sends, optimal_bytes,
                                                wire_bytes, fit_alpha_beta, crossover_bytes)
from lectures.data_parallel.ddp import (Collectives, broadcast_parameters, AllReduceAfterBackward, OverlappedAllReduce,
                                        plan_buckets, BucketedAllReduce, make_grad_sync)
from lectures.data_parallel.zero import (shard_size, take_shard, adamw_update, ShardedAdamW, Zero1, Zero2, Zero3Layer,
                                         Zero3LinearFunction, Zero3)
from lectures.data_parallel.compression import average_update, PowerSGD, NesterovOuter
from lectures.data_parallel.overlap import (release_core, agreed_wait, ComputeStandIn, overlapped_step, overlap_model,
                                            measured_against_model)

__all__ = [
    "ring_all_reduce", "pipelined_ring_all_reduce", "bus_bandwidth_factor", "bandwidths", "SWEPT", "sweep",
    "binomial_broadcast_sends", "optimal_bytes", "wire_bytes", "fit_alpha_beta", "crossover_bytes",
    "Collectives", "broadcast_parameters", "AllReduceAfterBackward", "OverlappedAllReduce", "plan_buckets",
    "BucketedAllReduce", "make_grad_sync",
    "shard_size", "take_shard", "adamw_update", "ShardedAdamW", "Zero1", "Zero2", "Zero3Layer",
    "Zero3LinearFunction", "Zero3",
    "average_update", "PowerSGD", "NesterovOuter",
    "release_core", "agreed_wait", "ComputeStandIn", "overlapped_step", "overlap_model", "measured_against_model",
]
