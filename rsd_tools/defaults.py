"""Defaults shared by several tools (rsd generate, rsd cluster, rsd bench, the service benchmark, the
load test): one place, so that their flags and help texts agree."""

from pathlib import Path

# The tree shape of each speculative method when none is given (rsd.methods.Method.parse reads them).
DEFAULT_SHAPES = {"sd": "4", "specinfer": "2,2,1", "spectr": "3x4", "rsd_c": "2,2,1", "rsd_s": "3x4"}
DEFAULT_METHOD = "rsd_s"
CODE_PROMPT = "# Return the n-th Fibonacci number\ndef fibonacci(n):"  # a prompt for the real (code) pair
TEMPERATURES = "0,1"  # the benchmarks' temperatures, comma-separated
RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"  # where the benchmarks write
