"""Attention whose every query row is reduced alone, so a tree node gets bit for bit the one-token step's value.

sdpa reduces a query row over all L keys of its forward, the masked-out ones included, in blocks and lanes set
by L and by how many query rows share the call. A tree node at depth d sees the prefix and its d ancestors with
its cousins' keys between them; the one-token step after committing the same path sees the same keys side by
side; a packed verifier forward puts other sessions' keys around them. Each rounds differently (float32: ~1e-7
of the logits; bfloat16 flips greedy at near-ties). Here each (query row, key/value head) is one task over the
row's own visible keys, in slot order (which is position order in every layout the runners make: the prefix,
then tree nodes after their parents), and every sum runs in an order fixed by that key list alone:

    score_j = scale * (q . k_j)                    one accumulator over D, in order
    p_j     = exp(score_j - max_j score_j)         one vector exp for every key (no scalar tail)
    out     = (sum_j p_j v_j) / (sum_j p_j)        numerator over j in order; denominator in 8 lanes (j % 8)

so a row's output depends on its query and its visible keys and values only: not on how many rows share the
forward, which sessions they belong to, which masked keys sit between its own, or the thread count.

    out = row_attention(query, key, value, allowed, scale)   # [1, H, n, D], [1, H_kv, L, D] x2, [n, L] -> [1, n, H, D]

The kernel (rsd_runtime/csrc/row_attention.c, AVX2 + FMA, float32 or bfloat16 keys, float32 sums)
is built like rsd_runtime.small_gemm's and runs where its float32 kernel does (`available`); against sdpa it
differs by float rounding only (tests/rsd_runtime/test_batch_invariance.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess

import torch
from torch import Tensor

from rsd_runtime import small_gemm

log = logging.getLogger(__name__)

_FUNCTIONS = {torch.float32: "row_attention_f32", torch.bfloat16: "row_attention_bf16"}


def available() -> bool:
    """Whether the kernel runs here: where small_gemm's float32 kernel does (an x86-64 CPU with AVX2 + FMA, a
    compiler; RSD_SMALL_GEMM=0 turns both off) and it builds. Built on the first call; the reason logged if not.
    RSD_ROW_ATTENTION=0 turns it off alone (grouped_sdpa instead: faster trees, rows no longer batch-invariant)."""
    return os.environ.get("RSD_ROW_ATTENTION", "1") != "0" and _library() is not None


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not small_gemm.available(torch.float32):
        log.info("row attention off: small_gemm's float32 kernel does not run here")
        return None
    try:
        lib = small_gemm.compile_library(small_gemm.CSRC / "row_attention.c", ("-mavx2", "-mfma"))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("row attention off: cannot build or load it: %s", getattr(e, "stderr", "") or e)
        return None
    for name in _FUNCTIONS.values():  # (q, k, v, keys, cu_keys, out, n, H, H_kv, D, kv_stride, scale, threads)
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int64]
        getattr(lib, name).restype = ctypes.c_int
    return lib


def supports(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether row_attention takes these: one sequence on the CPU, key and value of query's dtype (float32 or
    bfloat16), D a multiple of 8, each head's slots [L, D] contiguous, query heads a multiple of key heads."""
    return (
        query.dim() == key.dim() == value.dim() == 4
        and query.shape[0] == key.shape[0] == value.shape[0] == 1
        and query.device.type == key.device.type == value.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype
        and query.dtype in _FUNCTIONS
        and query.shape[-1] == key.shape[-1] == value.shape[-1]
        and query.shape[-1] % 8 == 0
        and key.shape[1] == value.shape[1]
        and query.shape[1] % key.shape[1] == 0
        and key.stride() == value.stride()
        and key.stride()[2:] == (key.shape[-1], 1)
        and available()
    )


def row_attention(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """softmax(scale * q k^T) v over each row's allowed keys: query [1, H, n, D], key/value [1, H_kv, L, D] (query
    head h reads key head h // (H / H_kv)), allowed [n, L] bool (True = may attend; at least one a row) ->
    [1, n, H, D] in query's dtype. Check `supports` first."""
    _, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    slots = allowed.nonzero()  # [M, 2] (row, slot) in row-major order: each row's keys in slot order
    cu_keys = torch.zeros(n + 1, dtype=torch.int64)  # [n + 1] row i's keys are keys[cu_keys[i]:cu_keys[i + 1]]
    torch.cumsum(allowed.sum(1), 0, out=cu_keys[1:])
    keys = slots[:, 1].contiguous()  # [M]
    q = query[0].transpose(0, 1).float().contiguous()  # [n, H, D]
    out = torch.empty(n, heads, dim)  # [n, H, D] float32
    threads = max(1, min(torch.get_num_threads(), n * kv_heads))
    failed = getattr(_library(), _FUNCTIONS[query.dtype])(
        q.data_ptr(), key.data_ptr(), value.data_ptr(), keys.data_ptr(), cu_keys.data_ptr(), out.data_ptr(),
        n, heads, kv_heads, dim, key.stride(1), scale, threads,
    )  # fmt: skip
    if failed:
        raise MemoryError(f"row_attention: no memory for the scores of {n} rows")
    return out.to(query.dtype)[None]
