"""Run one benchmark by name: `rsd bench NAME [flags]`; `rsd bench NAME -h` gives its flags.

Each benchmark is named after what it measures and is also `python -m MODULE`, the module BENCHMARKS names
(`rsd bench methods` is `python -m rsd_bench.methods`).

    rsd bench methods --quick                   # every method against the target alone, in one process
    rsd bench disaggregated --name cpu-disaggregated   # the deciding one: through the real services
    rsd bench index                             # rewrite benchmarks/results/INDEX.md
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with main(argv) -> int, what it measures)
BENCHMARKS = {
    "methods": (
        "rsd_bench.methods.cli",
        "speculative methods against the target alone on one loaded pair, in one process; the paper's protocols",
    ),
    "compare": ("rsd_bench.methods.compare", "two methods of one `methods` result, depth by depth"),
    "disaggregated": (
        "rsd_bench.disaggregated",
        "the pipeline through the real services (redis, verifier, drafter, gateway) against the target alone",
    ),
    "net": (
        "rsd_bench.net",
        "drafter and verifier across an emulated network (a delay relay): plain vs pre-drafting per delay",
    ),
    "capacity": (
        "rsd_bench.capacity",
        "N drafter processes against one verifier over the delay relay: tokens/s per verifier, clients at a rate",
    ),
    "simulate": (
        "rsd_bench.simulate",
        "a discrete-event model of E drafters x P verifier replicas: checked against a net run, replicas needed",
    ),
    "vs_llamacpp": (
        "rsd_bench.llamacpp",
        "llama.cpp's target alone and speculative mode against rsd's, same GGUF files, prompts and threads",
    ),
    "services": ("rsd_bench.services", "the services' overhead against in-process, N concurrent sessions, step split"),
    "loadtest": ("rsd_bench.loadtest", "N concurrent clients against a gateway: latency, throughput, memory"),
    "forward_cost": ("rsd_bench.forward_cost", "a target forward of n tokens against one, per linear kernel"),
    "prefill_cost": ("rsd_bench.prefill_cost", "a new session's prompt chain + tree: tree logits only against all"),
    "draft_batching": ("rsd_bench.draft_batching", "N sessions drafting at once, one forward per level, against alone"),
    "predraft_coverage": ("rsd_bench.predraft_coverage", "how often the verdict's outcome is among the k likeliest"),
    "gpu_check": ("rsd_bench.gpu_check", "every step path on CUDA with the real pair's shapes, forward costs"),
    "exactness": ("rsd_bench.exactness", "each method's exact one-step law against the target's, by enumeration"),
    "architectures": ("rsd_bench.architectures", "each architecture of the test matrix: exact or refused"),
    "rule_gap": ("rsd_bench.rule_gap", "each verification rule against the optimal acceptance (LP), toy laws"),
    "rule_replay": (
        "rsd_bench.rule_replay",
        "each verification rule's exact expected accepted drafts on the same recorded trees of the real pair",
    ),
    "spectr_rsd_toy": ("rsd_bench.spectr_rsd_toy", "SpecTr against RSD-S on toy pairs: expected tokens per call"),
    "pair_divergence": ("rsd_bench.pair_divergence", "where a real pair sits on the toy map: top-1 mass, TV"),
    "index": ("rsd_bench.index", "benchmarks/results/INDEX.md: the current run of each benchmark per machine"),
}


def build_parser() -> argparse.ArgumentParser:
    width = max(map(len, BENCHMARKS))
    listing = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in BENCHMARKS.items())
    ap = argparse.ArgumentParser(
        prog="rsd bench",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"benchmarks:\n{listing}",
    )
    ap.add_argument("name", choices=BENCHMARKS, metavar="NAME", help="the benchmark (listed below)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = build_parser().parse_args(argv[:1]).name  # the rest are the benchmark's own flags (-h included)
    return importlib.import_module(BENCHMARKS[name][0]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
