"""`rsd bench methods` (= `python -m rsd_bench.methods`): every speculative method against autoregressive
decoding on one loaded drafter/target pair, in one process; the paper's protocols (fixed_depth,
fixed_nodes). rsd_bench.methods.cli has the usage and the flags.

    planning     methods as specs, the paper protocols, the flags -> a Plan
    timing       forward costs, the time of each target step, tallies and result rows
    hf_assisted  the outside peer: transformers' assisted generation on the same models
    report       markdown, pivots, PNG plots
    run          one run: load the models, generate, write the result files
    cli          build_parser and main
    compare      two methods of one result, depth by depth, with bootstrap intervals

The prompt set (rsd_bench.prompts), the machine record (rsd_bench.machine) and the bootstrap
(rsd_bench.stats) are shared with the other benchmarks.
"""
