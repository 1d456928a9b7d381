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

The benchmarks with commands of their own (the deciding one through the services, forward costs, draft
batching, pre-draft coverage, the load test) are in rsd_bench.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here reaches a model hub

from rsd_tools.bench.cli import build_parser, main

__all__ = ["build_parser", "main"]
