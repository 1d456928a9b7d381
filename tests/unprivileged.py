"""Child processes that meet file permissions as a service user does.

root ignores file permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so a test run as root could not
see a read-only kernel cache or another user's 0644 lock file refuse anything. Its children here drop
both capabilities from their bounding set before exec (prctl PR_CAPBSET_DROP): still uid 0, they own
root's files as before but honour every mode bit, as any other user. A non-root test drops nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
import tempfile

import pytest

_PR_CAPBSET_DROP = 24
_CAPS = (1, 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child between fork and exec only calls it


def _drop_capabilities() -> None:
    for cap in _CAPS:
        if _prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def popen(args: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(args), the child honouring file permissions (skips the test where it cannot)."""
    if not honours_permissions():
        pytest.skip("cannot start a child that honours file permissions (root without CAP_SETPCAP)")
    return subprocess.Popen(args, preexec_fn=_drop_capabilities if os.geteuid() == 0 else None, **kwargs)


def run(args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(args, capture_output=True, text=True) in such a child."""
    with popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            raise
    return subprocess.CompletedProcess(args, child.returncode, out, err)


@functools.cache
def honours_permissions() -> bool:
    """Whether such a child is refused writing a file of mode 0444 (checked once)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "read-only")
        open(path, "w").close()
        os.chmod(path, 0o444)
        code = f"open({path!r}, 'w')"
        try:
            child = subprocess.run(
                [sys.executable, "-c", code],
                preexec_fn=_drop_capabilities if os.geteuid() == 0 else None,
                capture_output=True,
                text=True,
                timeout=60,
            )
        except subprocess.SubprocessError:  # the drop failed in the child
            return False
        return child.returncode != 0 and "PermissionError" in child.stderr
