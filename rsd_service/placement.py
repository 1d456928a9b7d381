"""Placement: which CPU cores a process may run on, and how many torch threads it uses.

A drafter and a verifier on one machine should not fight over cores: a one-token forward is bound by
memory bandwidth, so a second thread barely helps the verifier (docs/performance.md), and
the core is worth more running the drafter beside it. Each model service (and `rsd generate` /
`rsd bench`) takes `cores`, a Linux CPU list such as "0", "0-1,3" ("" = leave the affinity alone),
and `threads` (0 = one per given core, or torch's default when no cores are given).

apply_placement pins every thread the process has (the calling thread, gRPC's, an already started
OpenMP pool) with os.sched_setaffinity, so threads started later inherit the mask, and then sets
torch's intra-op threads. Call it before the model is loaded: torch sizes its default pool from the
machine at import, not from the affinity, so an unpinned count would oversubscribe the given cores.
This module does not import torch at import time (service configs parse `cores` with it).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass


def parse_cores(text: str) -> tuple[int, ...]:
    """ "0-1,3" -> (0, 1, 3); "" -> () (no pinning). Raises ValueError naming the bad part."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part and text.strip():
            raise ValueError(f"cores {text!r}: empty item (expected e.g. '0', '0-1,3')")
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cores {text!r}: cannot read {part!r} (expected a core number or a range like 0-3)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"cores {text!r}: range {part!r} runs backwards")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def format_cores(cores: tuple[int, ...] | list[int] | set[int]) -> str:
    """(0, 1, 3) -> "0-1,3" (the kernel's Cpus_allowed_list style)."""
    out, run = [], []
    for c in sorted(set(cores)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def add_placement_flags(parser) -> None:
    """--threads and --cores on an argparse parser (rsd generate, rsd bench); apply_placement applies them."""
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: one per --cores, else torch's)")
    parser.add_argument("--cores", default="", help="CPU cores this process may use, e.g. 0 or 0-1,3 (default: any)")


class PlacementError(ValueError):
    """Cores this process may not use (the services exit with it, without a traceback)."""


@dataclass(frozen=True)
class Placement:
    """What apply_placement did: the cores the process may use now, and torch's intra-op threads."""

    cores: str  # Cpus_allowed_list style, e.g. "0-1,3": the affinity after applying (all cores if not pinned)
    threads: int
    pinned: bool  # whether cores were given

    def as_dict(self) -> dict:
        return {"cores": self.cores, "threads": self.threads, "pinned": self.pinned}


def apply_placement(cores: str = "", threads: int = 0) -> Placement:
    """Pin this process to `cores` (all its threads) and set torch's threads: `threads`, else one per
    given core, else torch's default. Raises ValueError for a list that does not parse, PlacementError
    (naming the cores this process may use) for cores it may not use."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    wanted = parse_cores(cores)
    if wanted:
        allowed = os.sched_getaffinity(0)
        missing = sorted(set(wanted) - allowed)
        if missing:
            raise PlacementError(
                f"cores {cores!r}: {format_cores(missing)} not available to this process (allowed: "
                f"{format_cores(allowed)})"
            )
        _pin_all_threads(set(wanted))
    import torch

    if threads or wanted:
        torch.set_num_threads(threads or len(wanted))
    return Placement(format_cores(os.sched_getaffinity(0)), torch.get_num_threads(), bool(wanted))


def _pin_all_threads(cores: set[int]) -> None:
    """sched_setaffinity on every thread of this process: pid 0 would change the calling thread only."""
    os.sched_setaffinity(0, cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread (and every thread it starts) is pinned
        return
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(tid, cores)
