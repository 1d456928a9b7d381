"""A CPU kernel for linear layers over a handful of rows: `y[R, N] = x[R, K] @ w[N, K]^T` with R <= 64.

A draft tree or a tree verification feeds each linear layer 2-16 rows. BLAS (MKL/oneDNN through F.linear)
is tuned for large matrices: on one core it takes 3-4x the one-row time for 6 rows, while the product is
still bound by reading the weight once (1.5B fp32: ~6 GB per forward). This kernel streams each weight
once for all rows: it walks the weight two output rows at a time (12 KB for K = 1536, held in L1) and
multiplies that block with every group of up to 6 input rows, in 12 AVX2 accumulators.

    y = small_gemm(x, weight)         # x [R, K] float32, weight [N, K] float32, both contiguous

Exactness: a row's result is the same whatever rows share its call (each row has its own accumulators,
summed over K in the same order), so a tree's node gets bit-for-bit the value it would get alone; against
F.linear it differs by float rounding only (tests/test_small_gemm.py).

The kernel is C compiled at first use with the system compiler (`cc`, -O3 -mavx2 -mfma) into
~/.cache/rsd/kernels and called through ctypes (which releases the GIL, so threads split the output
columns). `available()` says whether it can run here: an x86-64 CPU with AVX2 and FMA and a compiler;
where it cannot, callers keep their torch path (speed only; the law is unchanged).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

MAX_ROWS = 64  # above this, BLAS is the faster path

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* y[r, j] = sum_k x[r, k] * w[j, k] for output columns j in [n0, n1); K % 8 == 0. */
void small_gemm(const float* x, const float* w, float* y, int64_t R, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t j = n0; j < n1; j += 2) {
        const int two = j + 1 < n1;
        const float* w0 = w + j * K;
        const float* w1 = two ? w0 + K : w0;
        for (int64_t r0 = 0; r0 < R; r0 += 6) {
            const int rn = R - r0 < 6 ? (int)(R - r0) : 6;
            const float* xr = x + r0 * K;
            __m256 a0[6], a1[6];
            for (int r = 0; r < 6; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
            if (rn == 6) {
                for (int64_t k = 0; k < K; k += 8) {
                    const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
#pragma GCC unroll 6
                    for (int r = 0; r < 6; r++) {
                        const __m256 xv = _mm256_loadu_ps(xr + r * K + k);
                        a0[r] = _mm256_fmadd_ps(v0, xv, a0[r]);
                        a1[r] = _mm256_fmadd_ps(v1, xv, a1[r]);
                    }
                }
            } else {
                for (int64_t k = 0; k < K; k += 8) {
                    const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
                    for (int r = 0; r < rn; r++) {
                        const __m256 xv = _mm256_loadu_ps(xr + r * K + k);
                        a0[r] = _mm256_fmadd_ps(v0, xv, a0[r]);
                        a1[r] = _mm256_fmadd_ps(v1, xv, a1[r]);
                    }
                }
            }
            for (int r = 0; r < rn; r++) {
                y[(r0 + r) * N + j] = hsum(a0[r]);
                if (two) y[(r0 + r) * N + j + 1] = hsum(a1[r]);
            }
        }
    }
}
"""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return "avx2" in flags and "fma" in flags


def _build() -> ctypes.CDLL:
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("RSD_KERNEL_DIR", Path.home() / ".cache" / "rsd" / "kernels"))
    so = cache / f"small_gemm-{digest}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src, out = Path(tmp) / "small_gemm.c", Path(tmp) / so.name
            src.write_text(_SOURCE)
            cc = os.environ.get("CC", "cc")
            cmd = [cc, "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", str(src), "-o", str(out)]
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
            os.replace(out, so)  # atomic: another process may be building the same file
    lib = ctypes.CDLL(str(so))
    lib.small_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
    lib.small_gemm.restype = None
    return lib


def available() -> bool:
    """Whether the kernel runs on this machine (built on first call; the reason is logged once if not)."""
    global _lib, _failed
    with _lock:
        if _lib is None and _failed is None:
            if not _cpu_has_avx2_fma():
                _failed = "the CPU has no AVX2+FMA"
            else:
                try:
                    _lib = _build()
                except (OSError, subprocess.SubprocessError) as e:
                    _failed = f"cannot build it: {getattr(e, 'stderr', '') or e}"
            if _failed:
                log.info("small_gemm kernel off: %s", _failed)
        return _lib is not None


def supports(x: Tensor, weight: Tensor) -> bool:
    """Whether small_gemm takes these operands: float32 CPU tensors, K a multiple of 8, 1..MAX_ROWS rows."""
    return (
        x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and x.shape[-1] == weight.shape[1]
        and weight.shape[1] % 8 == 0
        and 0 < x.numel() // x.shape[-1] <= MAX_ROWS
        and available()
    )


def small_gemm(x: Tensor, weight: Tensor, threads: int | None = None) -> Tensor:
    """x [R, K] @ weight[N, K]^T -> [R, N] (float32, CPU; check `supports` first). `threads` (default
    torch's thread count) split the N output columns; each thread streams its own part of the weight."""
    global _pool, _pool_size
    x, weight = x.contiguous(), weight.contiguous()
    (rows, k), n = x.shape, weight.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    threads = max(1, min(threads or torch.get_num_threads(), n // 256))
    args = (x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, k, n)
    if threads == 1:
        _lib.small_gemm(*args, 0, n)
        return y
    if _pool_size < threads:
        _pool, _pool_size = ThreadPoolExecutor(threads, thread_name_prefix="small_gemm"), threads
    cuts = [(n * i // threads) & ~1 for i in range(threads)] + [n]  # even starts: the kernel pairs columns
    list(_pool.map(lambda i: _lib.small_gemm(*args, cuts[i], cuts[i + 1]), range(threads)))
    return y
