"""Linear layers on GGML-quantised weights (Q8_0, Q5_0, Q4_K, Q6_K): the model as a GGUF file holds it.

A Q4_K_M file's weight is defined by its blocks: each weight is rebuilt in float32 from its block's scales,
minimums and codes (gguf-py's dequantize, ggml-common.h's layouts). Serving the file's model means computing
with exactly those float32 weights; serving it from the blocks reads 4.5-6.6 bits a weight instead of 32.

    layer = QuantLinear(blocks, qtype, in_features, out_features, bias)   # blocks: uint8 [N, K / be * bb]
    y = layer(x)                                                            # x [..., K] float32 -> [..., N]

csrc/quant_gemm.c rebuilds each block once a call for all rows (<= 64 a call, more in calls of 64) exactly as
dequantize does (same operations, no fused multiply-add), then sums the products in float32 with one fixed
order per row: against F.linear on the dequantised weight it differs by summation order only, and a row's
bits never depend on the other rows of its call (tests/rsd_runtime/test_quant.py). It is built for AVX2 +
FMA + F16C (every x86-64 CPU of the last decade) or, where the CPU has it, AVX-512 (16 lanes); RSD_SMALL_GEMM
narrows the choice as for small_gemm ("avx2" takes the AVX2 build, "0" none).

Where the kernel cannot run (no x86-64 CPU with AVX2, no compiler, RSD_SMALL_GEMM=0) or the model goes to a
GPU, the loader dequantises on load instead (dequantize(): the same float32 weights in a plain nn.Linear),
so the law never changes with the machine, only the speed.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess

import numpy as np
import torch
from torch import Tensor

from rsd_runtime import small_gemm

log = logging.getLogger(__name__)

# GGML type id -> (name, elements a block, bytes a block) for the types the kernel computes from.
KERNEL_TYPES = {8: ("Q8_0", 32, 34), 6: ("Q5_0", 32, 22), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}  # converted to float32 on load: exact
MAX_ROWS = 64  # rows a kernel call takes (its accumulators are on the stack)

_BUILDS = {  # preferred first: name -> (cflags, CPU flags)
    "avx512": (
        ("-DQUANT_AVX512", "-mavx512f", "-mavx512bw", "-mfma", "-mf16c"),
        ("avx512f", "avx512bw", "fma", "f16c"),
    ),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
}


def runs_here(build: str) -> bool:
    """Whether this CPU has the instructions of build "avx512" or "avx2"."""
    return all(f in small_gemm._cpu_flags() for f in _BUILDS[build][1])


def build(name: str) -> ctypes.CDLL:
    """csrc/quant_gemm.c built as `name` (a key of _BUILDS) and loaded; OSError, RuntimeError or
    subprocess.SubprocessError where it cannot be (small_gemm.compile_library)."""
    cflags = (*_BUILDS[name][0], "-ffp-contract=off")
    lib = small_gemm.compile_library(small_gemm.CSRC / "quant_gemm.c", cflags)
    lib.quant_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
    lib.quant_rebuild.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3
    return lib


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The kernel this process runs and its name, or (None, why none). Built once a process."""
    lib, name = first_build(_BUILDS, build, "quantised kernel")
    if lib is None:
        log.info("no quantised kernel (GGUF models are dequantised on load): %s", name)
    return lib, name


def first_build(builds: dict, make, what: str) -> tuple[ctypes.CDLL | None, str]:
    """The first of `builds` (name -> (cflags, CPU flags), preferred first) this CPU runs and `make(name)` builds,
    and its name; or (None, why none). RSD_SMALL_GEMM narrows the choice ("avx2": that build only, "0": none)."""
    setting = os.environ.get("RSD_SMALL_GEMM", "1")
    if setting == "0":
        return None, "RSD_SMALL_GEMM=0"
    reasons = []
    for name, (_, flags) in builds.items():
        if setting == "avx2" and name != "avx2":
            continue
        missing = [f for f in flags if f not in small_gemm._cpu_flags()]
        if missing:
            reasons.append(f"{name}: the CPU lacks {', '.join(missing)}")
            continue
        try:
            lib = make(name)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            reasons.append(f"{name}: cannot build or load it: {(getattr(e, 'stderr', '') or str(e)).strip()}")
            continue
        log.info("%s: %s", what, name)
        return lib, name
    return None, "; ".join(reasons) or "no kernel"


def kernel_name() -> str | None:
    """The quantised kernel this machine runs ("avx512", "avx2"), or None (then models dequantise on load)."""
    return _library()[0] and _library()[1]


def unavailable_reason() -> str:
    return "" if _library()[0] else _library()[1]


def row_bytes(qtype: int, k: int) -> int:
    _, elems, nbytes = KERNEL_TYPES[qtype]
    return k // elems * nbytes


def dequantize(blocks: Tensor | np.ndarray, qtype: int, k: int) -> Tensor:
    """The float32 weight [N, k] that `blocks` (uint8 [N, row_bytes]) of GGML type `qtype` define: gguf-py's
    dequantize, the reference every path is held to (any GGML type it knows, not only KERNEL_TYPES)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    data = blocks.numpy() if isinstance(blocks, Tensor) else blocks
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(data, GGMLQuantizationType(qtype)))).reshape(-1, k)


def float_weight(blocks: Tensor | np.ndarray, qtype: int, k: int) -> Tensor:
    """The float32 weight [N, k] of `blocks`: the kernel's rebuild where it runs (bit for bit dequantize's, and
    far faster), else dequantize."""
    if qtype in KERNEL_TYPES and kernel_name() is not None:
        return rebuild(torch.from_numpy(np.array(blocks)) if isinstance(blocks, np.ndarray) else blocks, qtype, k)
    return dequantize(blocks, qtype, k)


def rebuild(blocks: Tensor, qtype: int, k: int) -> Tensor:
    """The kernel's own float32 rebuild of every weight [N, k] (tests hold it to dequantize bit for bit)."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"no quantised kernel here: {unavailable_reason()}")
    out = torch.empty(blocks.shape[0], k)
    if lib.quant_rebuild(blocks.data_ptr(), out.data_ptr(), k, blocks.shape[0], qtype):
        raise ValueError(f"the kernel does not take type {qtype} with K = {k}")
    return out


class QuantLinear(torch.nn.Module):
    """nn.Linear's function on a GGML-quantised weight (module docstring). `blocks` is a buffer: uint8
    [out_features, row_bytes], the file's bytes; `bias` float32 [out_features] or None."""

    def __init__(self, blocks: Tensor, qtype: int, in_features: int, out_features: int, bias: Tensor | None = None):
        super().__init__()
        if qtype not in KERNEL_TYPES:
            raise ValueError(f"GGML type {qtype} has no kernel; dequantise it instead")
        name, elems, _ = KERNEL_TYPES[qtype]
        if in_features % elems or tuple(blocks.shape) != (out_features, row_bytes(qtype, in_features)):
            shape = f"[{out_features}, {in_features}]"
            raise ValueError(f"{name} blocks {tuple(blocks.shape)} do not hold a {shape} weight")
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    def extra_repr(self) -> str:
        name = KERNEL_TYPES[self.qtype][0]
        return f"in_features={self.in_features}, out_features={self.out_features}, {name}, bias={self.bias is not None}"

    def forward(self, x: Tensor) -> Tensor:
        lib = _library()[0]
        if lib is None or x.device.type != "cpu":
            raise RuntimeError(f"QuantLinear runs on the CPU kernel only ({unavailable_reason() or x.device})")
        if x.dtype != torch.float32:
            raise TypeError(f"QuantLinear computes in float32, got {x.dtype} input")
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(rows.shape[0], self.out_features)
        threads = small_gemm._threads(None, self.out_features)
        blocks = self.file_blocks()
        for r0 in range(0, rows.shape[0], MAX_ROWS):  # every row in a call of <= 64: its bits its own
            part, out = rows[r0 : r0 + MAX_ROWS], y[r0 : r0 + MAX_ROWS]
            n, k = part.shape
            if lib.quant_gemm(part.data_ptr(), blocks.data_ptr(), out.data_ptr(), n, k, self.out_features,
                              self.qtype, threads):  # fmt: skip
                raise MemoryError(f"quant_gemm: no memory to rebuild {self.in_features}-wide weight rows")
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def file_blocks(self) -> Tensor:
        """The weight as the file holds it: uint8 [out_features, row_bytes] (a subclass may keep another layout)."""
        return self.blocks

    def dequantized(self) -> torch.nn.Linear:
        """The same layer as a plain float32 nn.Linear (dequantise-on-load: other devices, no kernel)."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.requires_grad_(False)
        linear.weight.copy_(float_weight(self.file_blocks(), self.qtype, self.in_features))
        if self.bias is not None:
            linear.bias.copy_(self.bias)
        return linear
