"""What the notebooks call: one line per step, live on a GPU and replayed from data/ without one.

    from flashlab import notebook as nb
    nb.banner("02_coalesced")         # live or replay, on which GPU, and why
    nb.show_source("02_coalesced", "load_tile")   # a function of the .cu, highlighted
    nb.show_diff("01_naive", "02_coalesced")      # what this stage changed
    ev = nb.evaluate("02_coalesced")  # build + check + time + record (live) or the recorded rows
    nb.compare()                      # every stage and baseline at the teaching config
    with nb.unless_missing():         # a cell's measured part, or one line saying what to run
        ...

By concern: view (mode, the GPU shown, what is not recorded), code (sources and diffs), static
(ptxas and SASS, no GPU), measured (checks, timings, profiles).
"""
from ..tables import NotRecorded
from .code import excerpt, extract, run_log, show_diff, show_lines, show_source
from .measured import (BackwardEvaluation, Evaluation, attention_alone, compare, evaluate,
                       evaluate_backward, in_a_model, profile, published_minimal, reached, speedup,
                       sweep_ratio, teaching_rows)
from .static import (blocks_per_sm, instruction_mix, instructions, loop_bodies, opcode_changes, resources,
                     sass_lines)
from .view import GPU, banner, not_recorded, the_gpu, unless_missing

__all__ = ["GPU", "BackwardEvaluation", "Evaluation", "NotRecorded", "attention_alone", "banner",
           "blocks_per_sm", "compare", "evaluate", "evaluate_backward", "excerpt", "extract", "in_a_model", "instruction_mix", "instructions", "loop_bodies",
           "not_recorded", "opcode_changes", "profile", "published_minimal", "reached", "resources", "run_log",
           "sass_lines", "show_diff", "show_lines", "show_source", "speedup", "sweep_ratio",
           "teaching_rows", "the_gpu", "unless_missing"]
