"""Pipeline parallelism (lecture 05's building blocks).

- `schedules`: schedules as data, one list of actions per rank (GPipe, 1F1B, interleaved,
  zero bubble, DualPipeV).
- `simulate`: checking a schedule and simulating it against a cost model (bubble, memory, deadlock).
- `executor`: the GPT cut into stages, and one executor that runs any schedule on real ranks.
- `explorer`: the data behind the page's schedule explorer.
- `demos`: what each rank runs in the lecture's demos, and the one-process references they are checked against.
- `figures`: the drawings of the lecture's page and its appendix.
- `deep_dives`: the appendix page, the deep dives the lecture runs inside `with deep_dive(...)`.

The building blocks below are the package's public names; import them from here,
`from lectures.pipeline import make_schedule, simulate, PipelineExecutor`,
and the page code (`demos`, `figures`, `deep_dives`) from its own module.
"""
from lectures.pipeline.schedules import Action, Layout, Schedule, SCHEDULES, V_SHAPED, ZERO_BUBBLE, make_schedule
from lectures.pipeline.simulate import (dependencies, check_schedule, held, message_order, Simulation, simulate,
                                        consecutive_steps, steady_step, qi_bubble, theory_bubble,
                                        dualpipev_readme_bubble, p2p_deadlock)
from lectures.pipeline.executor import (GPTStage, split_gpt, PipelineExecutor, gradients_by_name, stage_parameters,
                                        build_rank, communication_plan, communication_plans)
from lectures.pipeline.explorer import formula_bubble, explorer_entries, explorer_data

__all__ = [
    "Action", "Layout", "Schedule", "SCHEDULES", "V_SHAPED", "ZERO_BUBBLE", "make_schedule",
    "dependencies", "check_schedule", "held", "message_order", "Simulation", "simulate", "consecutive_steps",
    "steady_step", "qi_bubble", "theory_bubble", "dualpipev_readme_bubble", "p2p_deadlock",
    "GPTStage", "split_gpt", "PipelineExecutor", "gradients_by_name", "stage_parameters", "build_rank",
    "communication_plan", "communication_plans",
    "formula_bubble", "explorer_entries", "explorer_data",
]
