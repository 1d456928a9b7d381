"""The `rsd` command (pyproject's console script): rsd_tools' commands (generate, provision, cluster) and
`rsd bench <name>` (rsd_bench). It sits above both, so the tools never import the benchmarks.

    rsd generate --tiny --method rsd_s --shape 3x4     # rsd_tools.cli has the usage
    rsd bench -h                                       # the benchmarks by name (rsd_bench.cli)
"""

from __future__ import annotations

from rsd_tools import cli


def bench(argv: list[str]) -> int:
    from rsd_bench.cli import main  # imported on use: `rsd generate` loads no benchmark

    return main(argv)


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, {"bench": ("run a benchmark by name (rsd bench -h lists them)", bench)})
