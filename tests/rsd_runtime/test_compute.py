"""The compute thread (rsd_runtime.compute): a service's torch work runs on one thread with the
placement's count, every other thread runs torch with one, and the main thread's OpenMP workers are
let go; the model services run their forwards there."""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from rsd_runtime.compute import ComputeThread

REPO = Path(__file__).resolve().parents[2]


def test_compute_thread_runs_everything_on_one_thread_with_its_count():
    before = torch.get_num_threads()
    compute = ComputeThread(2)
    try:
        idents = {compute.run(threading.get_ident) for _ in range(3)}
        idents.add(asyncio.run(compute.call(threading.get_ident)))
        assert len(idents) == 1 and threading.get_ident() not in idents
        assert compute.run(torch.get_num_threads) == 2
        assert torch.get_num_threads() == before  # the caller's count is its own
        assert compute.run(compute.run, threading.get_ident) in idents  # nested: inline, no deadlock
        with pytest.raises(ValueError, match="bad"):
            compute.run(_raise, ValueError("bad"))
        with pytest.raises(KeyError):
            asyncio.run(compute.call(_raise, KeyError("k")))
    finally:
        compute.close()


def _raise(error: Exception):
    raise error


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores for an OpenMP team")
def test_single_threaded_lets_the_main_threads_openmp_workers_go():
    """In a fresh process: a parallel op on the main thread starts an OpenMP worker (one more OS thread);
    after single_threaded() it is gone, the main thread and new threads run torch with one thread, and the
    compute thread keeps two."""
    code = (
        "import os, threading, torch\n"
        "torch.set_num_threads(2)\n"
        "from rsd_runtime.compute import ComputeThread, single_threaded\n"
        "count = lambda: len(os.listdir('/proc/self/task'))\n"
        "x = torch.randn(1 << 22)\n"
        "base = count(); (x * 2).sum(); main_team = count()\n"
        "c = ComputeThread(2); c.run(lambda: (x * 2).sum()); both = count()\n"
        "single_threaded()\n"
        "import time; deadline = time.monotonic() + 10\n"  # the worker exits on its own after the pause
        "while count() >= both and time.monotonic() < deadline: time.sleep(0.01)\n"
        "after = count()\n"
        "new = []; t = threading.Thread(target=lambda: new.append(torch.get_num_threads())); t.start(); t.join()\n"
        "print(main_team - base, both - main_team, after - both, torch.get_num_threads(),"
        " c.run(torch.get_num_threads), new[0])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    main_team, compute_team, released, main_threads, compute_threads, new_threads = map(int, out.stdout.split())
    assert (main_team, compute_team) == (1, 2)  # a worker for main; the compute thread and its worker
    assert released == -1  # main's worker went
    assert (main_threads, compute_threads, new_threads) == (1, 2, 1)


def test_services_on_the_same_cores_take_turns(tmp_path):
    """Two compute threads sharing a turns file (two services on the same cores) never compute at once."""
    turns = str(tmp_path / "rsd-cores-0-1.lock")
    a, b = ComputeThread(1, "a", turns), ComputeThread(1, "b", turns)
    active, most = [0], [0]
    guard = threading.Lock()

    def job():
        with guard:
            active[0] += 1
            most[0] = max(most[0], active[0])
        threading.Event().wait(0.01)  # long enough for the other thread's job to try to start
        with guard:
            active[0] -= 1

    async def both():
        await asyncio.gather(*(c.call(job) for c in (a, b) for _ in range(5)))

    try:
        asyncio.run(both())
        assert most[0] == 1
    finally:
        a.close()
        b.close()


def test_turns_file_is_named_by_the_cores():
    from rsd_runtime.compute import service_compute, turns_file

    assert turns_file("0-1").endswith("rsd-cores-0-1.lock") and turns_file("0-1") != turns_file("2-3")
    one, two = service_compute("0-1", 1, "one"), service_compute("0-1", 2, "two")
    try:
        assert not one.takes_turns and two.takes_turns  # one thread: no workers, no turns
    finally:
        one.close()
        two.close()


# A child service's compute thread on the turns file argv[1]: whether its job waited while the parent held
# the file's lock, and ran once it let go.
_TAKES_ITS_TURN = """
import logging, sys, threading
logging.basicConfig(level=logging.WARNING)
from rsd_runtime.compute import ComputeThread
compute = ComputeThread(1, "b", sys.argv[1])
done = threading.Event()
threading.Thread(target=lambda: (compute.run(lambda: None), done.set())).start()
print("ran at once" if done.wait(1.0) else "waited", flush=True)
print("ran" if done.wait(60) else "never ran", flush=True)
compute.close()
"""


@pytest.mark.parametrize("made_by", ["another user (0644)", "this user, read-only (0444)"])
def test_a_turns_file_another_user_made_still_takes_turns(tmp_path, made_by):
    """The turns file one service created (0644 whatever its umask) serves a service of another user: that
    one opens it read-only and takes turns with the first. (The child honours file permissions as a
    service user does: tests/fixtures/unprivileged.py.)"""
    from tests.fixtures import unprivileged

    path = str(tmp_path / "rsd-cores-0-1.lock")
    old = os.umask(0o077)  # a umask that denies the others everything
    try:
        ComputeThread(2, "a", path).close()
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o644
    if made_by.startswith("another"):
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, 65534, 65534)
    else:
        os.chmod(path, 0o444)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the first service computes
    try:
        child = unprivileged.popen([sys.executable, "-c", _TAKES_ITS_TURN, path], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)  # fmt: skip
        with child:
            first = child.stdout.readline().strip()
            fcntl.flock(fd, fcntl.LOCK_UN)  # its job is done
            rest, err = child.communicate(timeout=120)
    finally:
        os.close(fd)
    assert child.returncode == 0, err
    assert [first, rest.strip()] == ["waited", "ran"]
    assert "WARNING" not in err


def test_a_turns_file_it_cannot_open_leaves_it_its_own_users(tmp_path):
    """A turns file this user may not even read (an older service's 0600 one of another user): a warning, and
    turns in this user's own file beside it; the service starts."""
    from tests.fixtures import unprivileged

    path = tmp_path / "rsd-cores-0-1.lock"
    path.touch(mode=0o000)
    path.chmod(0o000)
    code = "import logging, sys; logging.basicConfig(); from rsd_runtime.compute import ComputeThread\n"
    code += "c = ComputeThread(2, 'b', sys.argv[1]); print(c.takes_turns); c.close()"
    out = unprivileged.run([sys.executable, "-c", code, str(path)], env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]
    own = tmp_path / f"rsd-cores-0-1-uid{os.getuid()}.lock"
    assert f"WARNING:rsd_runtime.compute:cannot open the turns file {path}" in out.stderr and str(own) in out.stderr
    assert own.exists() and own.stat().st_mode & 0o777 == 0o644
