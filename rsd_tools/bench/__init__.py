"""`rsd bench` (= `python -m rsd_tools.bench`): speculative methods against autoregressive decoding on
one loaded drafter/target pair. rsd_tools.bench.cli has the usage and the flags.

    prompts      the prompt set: standard-library functions, or JSON lines from a file
    planning     methods as specs, the paper protocols (fixed_depth, fixed_nodes), the flags -> a Plan
    timing       forward costs, the time of each target step, tallies and result rows
    hf_assisted  the outside peer: transformers' assisted generation on the same models
    report       markdown, README pivots, PNG plots
    machine      what the result records about the models and the machine
    run          one run: load the models, generate, write the result files
    cli          build_parser and main

More benchmarks live here with their own commands: forward_cost (a target forward of n tokens against
one, per linear kernel), prefill_cost (a new session's prompt chain + tree, logits for the tree only vs
every row), draft_batching (N sessions drafting, packed vs alone), predraft_coverage (the verdict's
outcome among the drafter's k likeliest) and disaggregated (the pipeline through the real services
against the target alone).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here reaches a model hub

from rsd_tools.bench.cli import build_parser, main

__all__ = ["build_parser", "main"]
