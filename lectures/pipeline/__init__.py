"""Pipeline parallelism (lecture 05's building blocks).

- `schedules`: schedules as data, one list of actions per rank (GPipe, 1F1B, interleaved,
  zero bubble, DualPipeV).
- `simulate`: checking a schedule and simulating it against a cost model (bubble, memory, deadlock).
- `executor`: the GPT cut into stages, and one executor that runs any schedule on real ranks.
- `explorer`: the data behind the page's schedule explorer.
- `demos`: what each rank runs in the lecture's demos, and the one-process references they are checked against.
- `figures`: the drawings of the lecture's page and its appendix.
- `deep_dives`: the appendix page, the deep dives the lecture runs inside `with deep_dive(...)`.
"""
