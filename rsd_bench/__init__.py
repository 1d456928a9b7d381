"""Every benchmark and report, one package; `rsd bench NAME` runs one (rsd_bench.cli lists them), and each
is also `python -m rsd_bench.<module>`:

    methods            speculative methods against the target alone on one loaded pair, in one process;
                       the paper's protocols (a package: planning, timing, report, run, compare, ...)
    disaggregated      the deciding benchmark: the pipeline through the real services (redis, verifier,
                       drafter, gateway processes) against the target alone, placement in the result
    services           the services' overhead against in-process, N concurrent sessions, the step split
                       (gateway_runs: runs through the gateway; services_report: its markdown)
    loadtest           concurrent clients against a running gateway
    forward_cost       a target forward of n tokens against one, per linear kernel
    prefill_cost       a new session's prompt chain + tree: logits for the tree only against every row
    draft_batching     N sessions drafting at once, packed into one forward per level against alone
    predraft_coverage  how often the verdict's outcome is among the drafter's k likeliest
    gpu_check          every step path on CUDA (gpu_record: what its result records)
    exactness, architectures   reports of the test suite's exact enumerations and architecture matrix
    spectr_rsd_toy, pair_divergence   SpecTr against RSD-S on toy pairs, and where a real pair sits on them
    index              benchmarks/results/INDEX.md from the result files

Shared: machine (what a result records about the machine and the run), prompts (the prompt set), stats
(bootstrap intervals). Each benchmark writes benchmarks/results/<name>.json and .md.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here reaches a model hub
