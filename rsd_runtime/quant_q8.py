"""The opt-in numeric mode "q8_activations": GGUF linear layers computed as llama.cpp's CPU backend computes them.

The exact mode (rsd_runtime.quant) multiplies float32 inputs with each weight rebuilt in float32. In this mode
each input row is first quantised to 8 bits per block, exactly as ggml's reference code does (Q8_K per 256
values for the Q4_K/Q6_K weights: quantize_row_q8_K_ref; Q8_0 per 32 for Q8_0/Q5_0: quantize_row_q8_0_ref),
each block's dot product is taken in integers (exact), and the block scales are applied in one fixed float
order (csrc/quant_gemm_q8.c's header). The served model is then "this file's model computed with int8
activations": a different function from the exact mode's, but a deterministic function of each row alone, so
speculative decoding against it stays exact (a tree row equals the one-token row bit for bit, tests hold it).

    layer = Q8ActivationLinear(blocks, qtype, in_features, out_features, bias)   # a QuantLinear
    y = layer(x)                                         # x [..., K] float32 -> [..., N], kernel only
    y_ref = reference(x, blocks, qtype, k)               # numpy, the same bits (tests)

It runs only where its kernel does (x86-64 with AVX2 + F16C; AVX-512 BW, and VNNI, builds where the CPU has
them): dequantised weights cannot reproduce it, so on a GPU, without the kernel or on a non-GGUF model the
mode is refused (unavailable_reason), never approximated.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging

import numpy as np
import torch
from torch import Tensor

from rsd_runtime import NUMERICS, quant, small_gemm

log = logging.getLogger(__name__)

Q8_K_TYPES = (12, 14)  # Q4_K, Q6_K: activations in Q8_K blocks of 256; Q8_0 and Q5_0 take Q8_0 blocks of 32

_BUILDS = {  # preferred first: name -> (cflags, CPU flags); no -mfma: nothing may fuse
    "avx512vnni": (
        ("-DQ8_AVX512", "-DQ8_VNNI", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mf16c"),
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "f16c"),
    ),
    "avx512": (("-DQ8_AVX512", "-mavx512f", "-mavx512bw", "-mavx2", "-mf16c"), ("avx512f", "avx512bw", "avx2", "f16c")),
    "avx2": (("-mavx2", "-mf16c"), ("avx2", "f16c")),
}


def runs_here(build: str) -> bool:
    return all(f in small_gemm._cpu_flags() for f in _BUILDS[build][1])


def build(name: str) -> ctypes.CDLL:
    """csrc/quant_gemm_q8.c built as `name` (a key of _BUILDS) and loaded (errors as small_gemm.compile_library)."""
    lib = small_gemm.compile_library(small_gemm.CSRC / "quant_gemm_q8.c", (*_BUILDS[name][0], "-ffp-contract=off"))
    lib.q8_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
    lib.q8_quantize.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
    lib.q8_gemm_x8.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
    return lib


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The kernel this process runs and its name, or (None, why none); chosen as quant's."""
    return quant.first_build(_BUILDS, build, "int8-activation kernel")


def kernel_name() -> str | None:
    """The int8-activation kernel this machine runs ("avx512vnni", "avx512", "avx2"), or None."""
    return _library()[0] and _library()[1]


def unavailable_reason(device: str = "cpu", dtype: torch.dtype = torch.float32, gguf: bool = True) -> str:
    """Why numeric "q8_activations" cannot serve a model here ("" where it can): it needs a GGUF model, float32
    on the CPU, and this kernel (dequantised weights cannot reproduce int8 activations)."""
    if not gguf:
        return "numeric 'q8_activations' computes from a GGUF file's blocks; this model is not a GGUF file"
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return (
            f"numeric 'q8_activations' runs on the CPU in float32 only, not {device} {dtype}: dequantised "
            "weights cannot reproduce its int8 activations"
        )
    if _library()[0] is None:
        return f"numeric 'q8_activations' needs its x86-64 AVX2 kernel: {_library()[1]}"
    return ""


def check_numeric(numeric: str) -> str:
    """`numeric` as NUMERICS spells it ("q8-activations" is taken too); ValueError for anything else."""
    if numeric.replace("-", "_") not in NUMERICS:
        raise ValueError(f"numeric must be one of {NUMERICS}, got {numeric!r}")
    return numeric.replace("-", "_")


# ---- Weights (Q4_K, Q6_K, Q8_0, Q5_0) repacked 8 rows at a time (csrc/quant_gemm_q8.c, "x8"): within each block,
# every 4 consecutive code bytes of 8 weight rows side by side, the scales unpacked beside them; pairs of such
# groups interleaved block by block (_pair_groups). Only the layout changes (q8_gemm_x8 computes the same bits);
# unpack_x8 gives the file's bytes back exactly.
X8_BYTES = {12: 1184, 14: 1680, 8: 272, 6: 176}  # bytes a block of 8 rows (Q4_K: 8 x 144 + 32, scales unpacked)


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes [..., 12] of Q4_K blocks -> sc, m uint8 [..., 8] (ggml's get_scale_min_k4)."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, m


def _q4_k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """_q4_k_scales' inverse: sc, m [..., 8] (6 bits each) -> the 12 bytes."""
    return np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                           (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1).astype(np.uint8)  # fmt: skip


def _across(v: np.ndarray, width: int) -> np.ndarray:
    """[G, 8, nb, n * width] (each row's bytes) -> [G, nb, n, 8, width]: `width`-byte groups of 8 rows side by side."""
    g, _, nb, n = v.shape
    return v.reshape(g, 8, nb, n // width, width).transpose(0, 2, 3, 1, 4)


def _back(v: np.ndarray, width: int) -> np.ndarray:
    """_across' inverse: [G, nb, n * 8 * width] -> [G, 8, nb, n * width]."""
    g, nb, n = v.shape
    return v.reshape(g, nb, n // (8 * width), 8, width).transpose(0, 3, 1, 2, 4).reshape(g, 8, nb, -1)


def repack_x8(blocks: np.ndarray, qtype: int, k: int) -> np.ndarray:
    """File blocks uint8 [N, row_bytes] of a Q4_K, Q6_K, Q8_0 or Q5_0 weight (N a multiple of 8) -> the x8 layout, uint8
    [N / 8 * blocks a row * X8_BYTES] (csrc/quant_gemm_q8.c says what lies where)."""
    n, nb = blocks.shape[0], k // quant.KERNEL_TYPES[qtype][1]
    b = blocks.reshape(n // 8, 8, nb, -1)
    if qtype == 8:  # Q8_0: d[8], qs [8][8][4]
        parts = [_across(b[..., 0:2], 2), _across(b[..., 2:34], 4)]
    elif qtype == 6:  # Q5_0: d[8], qs [4][8][4], qh [8][4]
        parts = [_across(b[..., 0:2], 2), _across(b[..., 6:22], 4), _across(b[..., 2:6], 4)]
    elif qtype == 12:  # d[8], dmin[8], sc pairs [4][8][2], m pairs [4][8][2], qs [32][8][4]
        sc, m = _q4_k_scales(b[..., 4:16])
        parts = [_across(b[..., 0:4], 2), _across(sc, 2), _across(m, 2), _across(b[..., 16:144], 4)]
    else:  # Q6_K: d[8], sc pairs [8][8][2], ql [32][8][4], qh [16][8][4]
        parts = [_across(b[..., 208:210], 2), _across(b[..., 192:208], 2), _across(b[..., 0:128], 4),
                 _across(b[..., 128:192], 4)]  # fmt: skip
    return _pair_groups(np.concatenate([p.reshape(n // 8, nb, -1) for p in parts], axis=-1)).reshape(-1)


def _pair_groups(x: np.ndarray, inverse: bool = False) -> np.ndarray:
    """[G, nb, X8_BYTES] groups of 8 rows <-> pairs of groups interleaved block by block ([G / 2, nb, 2, X8_BYTES],
    an odd last group after them as it is): the kernel reads 16 rows from one stream (csrc/quant_gemm_q8.c, x16)."""
    g, nb, nbytes = x.shape
    pairs, tail = x[: g - g % 2], x[g - g % 2 :]
    if inverse:
        pairs = pairs.reshape(g // 2, nb, 2, nbytes).transpose(0, 2, 1, 3)
    else:
        pairs = pairs.reshape(g // 2, 2, nb, nbytes).transpose(0, 2, 1, 3)
    return np.concatenate([pairs.reshape(-1, nb, nbytes), tail])


def unpack_x8(packed: np.ndarray, qtype: int, k: int, n: int) -> np.ndarray:
    """repack_x8's inverse: the file's blocks uint8 [N, row_bytes], byte for byte."""
    x = _pair_groups(packed.reshape(n // 8, k // quant.KERNEL_TYPES[qtype][1], X8_BYTES[qtype]), inverse=True)
    if qtype == 8:
        parts = [_back(x[..., 0:16], 2), _back(x[..., 16:], 4)]
    elif qtype == 6:
        parts = [_back(x[..., 0:16], 2), _back(x[..., 144:], 4), _back(x[..., 16:144], 4)]
    elif qtype == 12:
        sc, m = _back(x[..., 32:96], 2), _back(x[..., 96:160], 2)
        parts = [_back(x[..., 0:32], 2), _q4_k_scale_bytes(sc, m), _back(x[..., 160:], 4)]
    else:
        parts = [_back(x[..., 144:1168], 4), _back(x[..., 1168:], 4), _back(x[..., 16:144], 2), _back(x[..., 0:16], 2)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


class Q8ActivationLinear(quant.QuantLinear):
    """QuantLinear computed with int8 activations (module docstring): the same blocks, another function.
    Weights with a multiple of 8 rows are kept repacked (buffer `blocks_x8`, no `blocks`:
    file_blocks() rebuilds the file's bytes). While `exact` is set (exact_layers) it computes as QuantLinear does."""

    numeric = "q8_activations"
    exact = False

    def __init__(self, blocks: Tensor, qtype: int, in_features: int, out_features: int, bias: Tensor | None = None):
        super().__init__(blocks, qtype, in_features, out_features, bias)
        self._file = None  # exact_layers' copy of the file's bytes
        if qtype in X8_BYTES and out_features % 8 == 0:
            packed = repack_x8(self.blocks.numpy(), qtype, in_features)
            del self._buffers["blocks"]
            self.register_buffer("blocks_x8", torch.from_numpy(packed))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", int8 activations" + (", x8" if "blocks_x8" in self._buffers else "")

    @classmethod
    def fuse(cls, parts: list[Q8ActivationLinear]) -> Q8ActivationLinear | None:
        """One layer computing repacked `parts` (one type, one input width, all with a bias or none) side by side,
        or None where they differ. Their blocks are concatenated and each part's buffers become views of its
        share (no second copy). Each output column is computed as in its own layer: the same bits."""
        first = parts[0]
        kind = lambda p: (type(p), "blocks_x8" in p._buffers, getattr(p, "qtype", None), p.in_features, p.bias is None)  # noqa: E731
        if any(kind(p) != kind(first) for p in parts) or "blocks_x8" not in first._buffers:
            return None
        if any(p.out_features % 16 for p in parts[:-1]):  # an odd group would pair across parts (_pair_groups)
            return None
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.qtype, fused.in_features, fused._file = first.qtype, first.in_features, None
        fused.out_features = sum(p.out_features for p in parts)
        for name in ("blocks_x8", "bias") if first.bias is not None else ("blocks_x8",):
            values = [getattr(p, name) for p in parts]
            fused.register_buffer(name, torch.cat(values))
            for p, view in zip(parts, getattr(fused, name).split([v.shape[0] for v in values]), strict=True):
                setattr(p, name, view)
        if first.bias is None:
            fused.register_buffer("bias", None)
        return fused

    def file_blocks(self) -> Tensor:
        if "blocks_x8" not in self._buffers:
            return self.blocks
        if self._file is not None:
            return self._file
        return torch.from_numpy(unpack_x8(self.blocks_x8.numpy(), self.qtype, self.in_features, self.out_features))

    def forward(self, x: Tensor) -> Tensor:
        if self.exact:
            return super().forward(x)
        lib = _library()[0]
        if lib is None or x.device.type != "cpu":
            raise RuntimeError(unavailable_reason(str(x.device)) or "no int8-activation kernel")
        if x.dtype != torch.float32:
            raise TypeError(f"Q8ActivationLinear computes from float32 input, got {x.dtype}")
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(rows.shape[0], self.out_features)
        threads = small_gemm._threads(None, self.out_features)
        x8 = "blocks_x8" in self._buffers
        gemm, blocks = (lib.q8_gemm_x8, self.blocks_x8) if x8 else (lib.q8_gemm, self.blocks)
        for r0 in range(0, rows.shape[0], quant.MAX_ROWS):
            part, out = rows[r0 : r0 + quant.MAX_ROWS], y[r0 : r0 + quant.MAX_ROWS]
            n, k = part.shape
            if gemm(part.data_ptr(), blocks.data_ptr(), out.data_ptr(), n, k, self.out_features, self.qtype, threads):
                raise MemoryError("q8_gemm: no memory for the quantised input rows")
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


@contextlib.contextmanager
def exact_layers(model: torch.nn.Module):
    """Within: the model's int8-activation layers compute in the exact mode. For the load-time tree probe
    (attention.probe_tree_forward), which checks positions and masks against the model's own causal forward:
    that forward's attention rounds differently from the tree's, and int8 activations turn such last-bit
    differences into whole quantisation steps, which says nothing about positions. The served path is held
    to bit-for-bit row equality instead (tests/rsd_runtime/test_quant_q8.py)."""
    layers = [m for m in model.modules() if isinstance(m, Q8ActivationLinear) and not m.exact]  # re-entrant
    for m in layers:
        m.exact, m._file = True, None
        m._file = m.file_blocks()  # unpacked once for the whole probe, dropped after
    try:
        yield
    finally:
        for m in layers:
            m.exact, m._file = False, None


def quantize_rows(x: Tensor, qtype: int) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's own quantisation of x [R, K] for a weight of `qtype`: codes int8 [R, K], scales float32
    [R, K / block], sums int16 [R, K / 16 (Q8_K) or K / 32 (Q8_0)] (tests hold it to quantize_reference)."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(unavailable_reason())
    x = x.contiguous()
    r, k = x.shape
    block = 256 if qtype in Q8_K_TYPES else 32
    qs, d = torch.empty(r, k, dtype=torch.int8), torch.empty(r, k // block)
    sums = torch.empty(r, k // 16 if block == 256 else k // 32, dtype=torch.int16)
    for i in range(r):
        if lib.q8_quantize(x[i].data_ptr(), qs[i].data_ptr(), d[i].data_ptr(), sums[i].data_ptr(), k, qtype):
            raise ValueError(f"the kernel does not take type {qtype} with K = {k}")
    return qs, d, sums


# ---- the reference: the same function in numpy, step by step as ggml's reference code and the kernel's header

F32 = np.float32


def quantize_reference(x: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [R, K] -> (codes int8 [R, K], scales float32 [R, nb], sums int16) as quantize_rows."""
    r, k = x.shape
    if qtype in Q8_K_TYPES:  # quantize_row_q8_K_ref
        xb = x.reshape(r, k // 256, 256)
        first = np.abs(xb).argmax(axis=-1)[..., None]  # the first value of largest magnitude
        mx = np.take_along_axis(xb, first, axis=-1)
        zero = mx == 0
        with np.errstate(divide="ignore"):
            iscale = np.where(zero, F32(1), F32(-127) / np.where(zero, F32(1), mx)).astype(F32)
        q = np.minimum(np.rint(iscale * xb), 127).astype(np.int8)  # nearest_int: half to even
        q[np.broadcast_to(zero, q.shape)] = 0
        d = np.where(zero, F32(0), F32(1) / iscale)[..., 0].astype(F32)
        sums = q.reshape(r, k // 16, 16).astype(np.int32).sum(-1).astype(np.int16)
        return q.reshape(r, k), d, sums
    xb = x.reshape(r, k // 32, 32)  # quantize_row_q8_0_ref
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)
    v = (xb * inv).astype(F32)
    t = np.trunc(v)
    q = (t + np.where(np.abs(v - t) >= F32(0.5), np.sign(v), F32(0))).astype(np.int8)  # roundf: half away from 0
    sums = q.astype(np.int32).sum(-1).astype(np.int16)
    return q.reshape(r, k), d[..., 0].astype(np.float16).astype(F32), sums


def weight_codes(blocks: np.ndarray, qtype: int, k: int) -> dict[str, np.ndarray]:
    """The integer codes and scales of weight blocks uint8 [N, row_bytes] (ggml-common.h's layouts):
    q int [N, K] (signed value codes: Q4_K 0..15, Q6_K q - 32, Q5_0 q - 16, Q8_0 q), d float32 [N, nb], and
    sc int [N, K] (each element's sub-block scale), m int [N, K] and dmin float32 [N, nb] for Q4_K."""
    n = blocks.shape[0]
    _, be, bb = quant.KERNEL_TYPES[qtype]
    b = blocks.reshape(n, k // be, bb)
    half = lambda lo: b[..., lo : lo + 2].copy().view(np.float16)[..., 0].astype(F32)  # noqa: E731
    if qtype == 8:  # Q8_0
        return {"q": b[..., 2:].view(np.int8).astype(np.int32).reshape(n, k), "d": half(0)}
    if qtype == 6:  # Q5_0
        qh = b[..., 2:6].copy().view("<u4")[..., 0].astype(np.int64)
        qs = b[..., 6:22].astype(np.int32)
        nib = np.concatenate([qs & 15, qs >> 4], axis=-1)
        high = (qh[..., None] >> np.arange(32)) & 1
        return {"q": (nib | (high << 4)).astype(np.int32).reshape(n, k) - 16, "d": half(0)}
    if qtype == 12:  # Q4_K
        s = b[..., 4:16].astype(np.int32)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        qs = b[..., 16:144].astype(np.int32).reshape(n, k // 256, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k)  # element 64 c + 32 h + l
        return {"q": q, "d": half(0), "dmin": half(2), "sc": np.repeat(sc, 32, -1).reshape(n, k),
                "m": np.repeat(m, 32, -1).reshape(n, k)}  # fmt: skip
    ql, qh = b[..., 0:128].astype(np.int32), b[..., 128:192].astype(np.int32)  # Q6_K
    q = np.empty((n, k // 256, 2, 4, 32), np.int32)  # element 128 h + 32 g + l
    for h in range(2):
        for g in range(4):
            low = ql[..., 64 * h + 32 * (g % 2) : 64 * h + 32 * (g % 2) + 32] >> (4 * (g // 2)) & 15
            q[:, :, h, g] = low | (((qh[..., 32 * h : 32 * h + 32] >> (2 * g)) & 3) << 4)
    sc = b[..., 192:208].view(np.int8).astype(np.int32)
    return {"q": q.reshape(n, k) - 32, "d": half(208), "sc": np.repeat(sc, 16, -1).reshape(n, k)}


def reference(x: Tensor, blocks: Tensor, qtype: int, k: int) -> Tensor:
    """y [R, N] = x [R, K] @ W^T in int8 activations, step by step (module docstring; the kernel's bits)."""
    xq, xd, _ = quantize_reference(x.numpy().astype(F32), qtype)
    w = weight_codes(blocks.numpy(), qtype, k)
    be = 256 if qtype in Q8_K_TYPES else 32
    r, n, nb = x.shape[0], blocks.shape[0], k // be
    a = xq.astype(np.int64).reshape(r, nb, be)
    prod = w["q"] * w["sc"] if "sc" in w else w["q"]
    s = np.einsum("rbe,nbe->rnb", a, prod.astype(np.int64).reshape(n, nb, be))  # exact integer sums
    if qtype == 12:
        mins = np.einsum("rbe,nbe->rnb", a, w["m"].astype(np.int64).reshape(n, nb, be))
    acc = np.zeros((r, n), F32)
    for j in range(nb):  # blocks in k order, each step rounded to float32 as the kernel does
        da = xd[:, j][:, None]
        acc = (acc + (w["d"][None, :, j] * da) * s[:, :, j].astype(np.int32).astype(F32)).astype(F32)
        if qtype == 12:
            acc = (acc - (w["dmin"][None, :, j] * da) * mins[:, :, j].astype(np.int32).astype(F32)).astype(F32)
    return torch.from_numpy(acc)
