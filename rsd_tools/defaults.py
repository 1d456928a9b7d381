"""Defaults shared by several tools (rsd generate, rsd cluster, rsd bench, the service benchmark, the
load test): one place, so that their flags and help texts agree."""

from pathlib import Path

from rsd.methods import DEFAULT_SHAPES  # noqa: F401  (the algorithm's; re-exported for the tools)

DEFAULT_METHOD = "rsd_s"
CODE_PROMPT = "# Return the n-th Fibonacci number\ndef fibonacci(n):"  # a prompt for the real (code) pair
TEMPERATURES = "0,1"  # the benchmarks' temperatures, comma-separated
RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"  # where the benchmarks write
