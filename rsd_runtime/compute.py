"""One compute thread per model: where a service's multi-threaded torch work runs.

torch parallelises CPU ops with OpenMP, and libgomp keeps a team of worker threads for every thread
that ever ran a parallel region. Once a process holds more OpenMP threads than it may use cores, libgomp
stops letting idle workers spin (about 100 spins, then sleep), and every parallel region pays a futex
wake-up. The services ran their forwards on whichever executor thread was free (asyncio.to_thread, one
drafting thread per session) beside the main thread that had loaded the model: several teams, and each
parallel region markedly slower than with one.

So each model service loads, warms up and runs its model on one ComputeThread with the placement's
thread count, and its process entry calls single_threaded() for everything else (asyncio, sampling in
the drafting threads, gRPC): those run torch inline, with no team of their own. Tests that run several
services in one process keep working (one team per service: slower, never wrong).

A team spins while it waits between parallel regions, which is what makes it fast, and what makes two
busy processes on the same cores ruinous: a worker spins on a core the other process's thread needs, and
every barrier waits out a scheduler slice (each far slower than alone). So services given the same cores
take turns: with `turns`, a
ComputeThread holds an exclusive flock on that file for each job (one packed forward, one verification),
so at most one of them computes at a time; services on cores of their own never wait, and one-thread
services (no workers to spin) take no turns. The services on a machine may run as different users: the
file is opened read-only (flock needs no write access) and made readable by all (0644, whatever the umask)
by whoever creates it; where an existing one cannot be opened (another user's 0600 file), a service
logs a warning and takes turns in a file of its own user's (turns_file's name with "-uid<uid>").
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

log = logging.getLogger(__name__)


class ComputeThread:
    """A single worker thread running torch with `threads` intra-op threads (0: the process's count)."""

    def __init__(self, threads: int = 0, name: str = "compute", turns: str | None = None):
        self.threads = threads or torch.get_num_threads()
        # turns: a lock file shared with the processes on the same cores (turns_file), or None
        self._turns_fd = _open_turns(turns) if turns else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=self._init)
        self._ident = self._executor.submit(threading.get_ident).result()  # started and sized now

    @property
    def takes_turns(self) -> bool:
        """Whether its jobs wait for their turn on cores shared with other services."""
        return self._turns_fd is not None

    def _init(self) -> None:
        torch.get_num_threads()  # torch sizes a new thread lazily from the process default: do it first,
        torch.set_num_threads(self.threads)  # then set this thread's own count, which stays

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on the compute thread, from any thread (inline when already on it)."""
        if threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        return self._executor.submit(self._job, fn, *args, **kwargs).result()

    async def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on the compute thread, awaited from asyncio."""
        return await asyncio.wrap_future(self._executor.submit(self._job, fn, *args, **kwargs))

    def _job(self, fn: Callable[..., T], *args, **kwargs) -> T:
        if self._turns_fd is None:
            return fn(*args, **kwargs)
        fcntl.flock(self._turns_fd, fcntl.LOCK_EX)  # our turn on the shared cores
        try:
            return fn(*args, **kwargs)
        finally:
            fcntl.flock(self._turns_fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._turns_fd is not None:
            self._executor.submit(os.close, self._turns_fd)  # after any job still queued
            self._turns_fd = None
        self._executor.shutdown(wait=False)


def service_compute(cores: str, threads: int, name: str) -> ComputeThread:
    """A model service's compute thread for its placement (cores "0-1,3" style, as applied; threads): it
    takes turns with the other services on exactly these cores unless it runs one thread (no workers)."""
    return ComputeThread(threads, name, turns_file(cores) if threads > 1 else None)


def turns_file(cores: str) -> str:
    """The lock file of the model services on exactly these cores ("0-1,3" style: Placement.cores)."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(shm, f"rsd-cores-{cores or 'any'}.lock")


def _open_turns(path: str) -> int:
    """A descriptor of the turns file `path` to flock, whoever created the file; else of this user's own."""
    try:
        return _open_readable(path)
    except PermissionError as e:
        root, ext = os.path.splitext(path)
        own = f"{root}-uid{os.getuid()}{ext}"
        log.warning(
            "cannot open the turns file %s (%s): taking turns with this user's services only, in %s", path, e, own
        )
        return _open_readable(own)


def _open_readable(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        pass
    try:  # O_EXCL: never O_CREAT an existing file (fs.protected_regular refuses that in /dev/shm for another's)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDONLY, 0o644)
    except FileExistsError:  # another service made it meanwhile
        return os.open(path, os.O_RDONLY)
    os.fchmod(fd, 0o644)  # the umask may have taken the others' read access
    return fd


def single_threaded() -> None:
    """The calling thread, and every thread started after it, run torch ops with one thread; the calling
    thread's OpenMP workers, if it had any (it loaded something), are let go. A ComputeThread made before
    keeps its own count. A service process calls it on its main thread once its compute thread exists."""
    torch.set_num_threads(1)
    gomp = _libgomp()
    if gomp is not None:  # OpenMP 5.0: free the calling thread's team (libgomp: that thread's pool only)
        gomp.omp_pause_resource_all(OMP_PAUSE_HARD)


OMP_PAUSE_HARD = 2


def _libgomp():
    """torch's own libgomp (already loaded: the same library), or None (another OpenMP, or none)."""
    import ctypes
    from pathlib import Path

    for path in sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*")):
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None
