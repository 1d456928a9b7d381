"""The benchmarks with commands of their own, each `python -m rsd_bench.<name>` (`rsd bench`, the paper's
protocols on one loaded pair, is rsd_tools.bench):

    disaggregated      the deciding benchmark: the pipeline through the real services (redis, verifier,
                       drafter, gateway processes) against the target alone, placement in the result
    services           the services' overhead against in-process, N concurrent sessions, the step split
                       (gateway_runs: runs through the gateway; services_report: its markdown)
    forward_cost       a target forward of n tokens against one, per linear kernel
    prefill_cost       a new session's prompt chain + tree: logits for the tree only against every row
    draft_batching     N sessions drafting at once, packed into one forward per level against alone
    predraft_coverage  how often the verdict's outcome is among the drafter's k likeliest
    loadtest           concurrent clients against a running gateway

Each writes benchmarks/results/<name>.json and .md with the CPU flags and the placement.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here reaches a model hub
