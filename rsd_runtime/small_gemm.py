"""CPU kernels for linear layers over a handful of rows: `y[R, N] = x[R, K] @ w[N, K]^T` with R <= 64.

A draft tree or a tree verification feeds each linear layer 2-16 rows. BLAS (MKL/oneDNN through F.linear)
is tuned for large matrices: on one core it takes 3-4x the one-row time for 6 rows, while the product is
still bound by reading the weight once (1.5B fp32: ~6 GB per forward). These kernels stream each weight
once for all rows: they walk the weight a few output rows at a time (a block held in L1) and multiply
that block with every group of up to 6 input rows (groups of near-equal size), while they prefetch the
weight rows ahead, spread over all the groups: the next weights stream in from memory while this block's
rows are multiplied.

    y = small_gemm(x, weight)         # x [R, K], weight [N, K], both float32 or both bfloat16
    kernel_name(torch.bfloat16)       # which kernel a dtype runs on here: "amx-bf16", "avx512-bf16", ...

- float32 (AVX2 + FMA): pairs of weight rows, 12 accumulators (13 rows of the 1.5B target's
  up-projection on one Zen 3 core: 12.5 -> 8.5 ms; a whole 13-token forward 1,517 -> 1,289 ms).
- bfloat16 (AVX512-BF16, `vdpbf16ps`: 32 products a lane-wide instruction, summed in float32 and rounded
  to bfloat16 to nearest even, as torch does): four weight rows at a time, 24 accumulators. oneDNN's
  bf16 F.linear reads weights at ~8 GB/s on one Zen 4 core, where a plain stream reads 27 GB/s; this
  kernel reads at ~20 GB/s for 1-6 rows (the 1.5B up-projection: 1 row 3.7 -> 1.4 ms, 13 rows 4.4 -> 2.5).
- bfloat16 on AMX (preferred where the CPU has it): the tile unit multiplies 16 weight rows by up to 16
  input rows in one instruction, so every row count streams the weight at the memory's pace (a whole 1.5B
  forward on two Xeon cores: 1 token 330 -> 172 ms against oneDNN, 16 tokens 347 -> 222 ms).

Exactness: a row's result is the same whatever rows share its call (each row has its own accumulators or
tile lanes, summed over K in the same order), so a tree's node gets bit-for-bit the value it would get alone; against
F.linear it differs by float rounding only (tests/test_small_gemm.py).

Each kernel is C compiled at first use with the system compiler (`cc`) into ~/.cache/rsd/kernels and
called through ctypes (which releases the GIL); threads of torch's own OpenMP team split the output
columns. `available(dtype)` says whether one can run here: an x86-64 CPU with its instructions and a
compiler that knows them; where it cannot, callers keep their torch path (speed only; the law is unchanged).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

MAX_ROWS = 64  # above this, BLAS is the faster path

_SOURCE_F32 = r"""
#include <immintrin.h>
#include <stdint.h>

#define PREFETCH_ROWS 6 /* prefetch the weight rows this far ahead of the pair being multiplied */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* RN input rows (xr, row stride K) times weight rows w0, w1 into y[r, j], y[r, j + 1] (row stride N),
   in 2 * RN accumulators. While it runs it prefetches lines [p0, p0 + np) of the weight pair at pf,
   one every `every` steps: the row groups of a pair share that pair's prefetch, so the next weights
   stream in while this one's rows are multiplied, not only during its first group. */
#define GROUP(RN)                                                                                      \
    static inline void group##RN(const float* xr, const float* w0, const float* w1, int64_t K,         \
                                 const char* pf, int64_t p0, int64_t np, int64_t every, float* y,      \
                                 int64_t N, int64_t j, int two) {                                      \
        __m256 a0[RN], a1[RN];                                                                         \
        for (int r = 0; r < RN; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }   \
        int64_t line = p0;                                                                             \
        for (int64_t k = 0, s = 0; k < K; k += 8, s++) {                                               \
            if (pf && s % every == 0 && line < p0 + np) _mm_prefetch(pf + 64 * line++, _MM_HINT_T0);    \
            const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);                   \
            _Pragma("GCC unroll 6") for (int r = 0; r < RN; r++) {                                     \
                const __m256 xv = _mm256_loadu_ps(xr + r * K + k);                                     \
                a0[r] = _mm256_fmadd_ps(v0, xv, a0[r]);                                                \
                a1[r] = _mm256_fmadd_ps(v1, xv, a1[r]);                                                \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < RN; r++) {                                                                 \
            y[r * N + j] = hsum(a0[r]);                                                                \
            if (two) y[r * N + j + 1] = hsum(a1[r]);                                                   \
        }                                                                                              \
    }
GROUP(1) GROUP(2) GROUP(3) GROUP(4) GROUP(5) GROUP(6)

/* y[r, j] = sum_k x[r, k] * w[j, k] for output columns j in [n0, n1); K % 8 == 0. The rows go in groups
   of near-equal size, at most 6 (13 rows: 5, 4, 4; a lone 13th row would run 2 accumulators, bound by
   the FMA latency rather than its throughput). */
void small_gemm(const float* x, const float* w, float* y, int64_t R, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    const int64_t groups = (R + 5) / 6, lines = (2 * K * 4 + 63) / 64, steps = K / 8;
    for (int64_t j = n0; j < n1; j += 2) {
        const int two = j + 1 < n1;
        const float* w0 = w + j * K;
        const float* w1 = two ? w0 + K : w0;
        /* one row: the hardware prefetcher keeps up with two plain streams */
        const char* pf = R > 1 && j + PREFETCH_ROWS + 1 < n1 ? (const char*)(w + (j + PREFETCH_ROWS) * K) : 0;
        for (int64_t g = 0, r0 = 0; g < groups; g++) {
            const int64_t rn = (R - r0 + groups - g - 1) / (groups - g);
            const int64_t p0 = lines * g / groups, np = lines * (g + 1) / groups - p0;
            const int64_t every = np ? (steps + np - 1) / np : 1;
            const float *xr = x + r0 * K;
            float* yr = y + r0 * N;
            switch (rn) {
                case 1: group1(xr, w0, w1, K, pf, p0, np, every, yr, N, j, two); break;
                case 2: group2(xr, w0, w1, K, pf, p0, np, every, yr, N, j, two); break;
                case 3: group3(xr, w0, w1, K, pf, p0, np, every, yr, N, j, two); break;
                case 4: group4(xr, w0, w1, K, pf, p0, np, every, yr, N, j, two); break;
                case 5: group5(xr, w0, w1, K, pf, p0, np, every, yr, N, j, two); break;
                default: group6(xr, w0, w1, K, pf, p0, np, every, yr, N, j, two); break;
            }
            r0 += rn;
        }
    }
}
"""

# Appended to each kernel: the output columns split over threads of the caller's OpenMP team. The library
# links libgomp.so.1, which the loader finds already loaded by torch: the same workers as torch's own ops,
# so no second team spins beside them (a Python thread pool here ran a 2-thread bf16 forward slower than
# one thread: 229 against 204 ms, torch's idle workers spinning on the cores its threads needed).
_THREADS = r"""
#include <omp.h>
int small_gemm_threads(const void* x, const void* w, void* y, int64_t R, int64_t K, int64_t N, int64_t threads) {
    if (threads <= 1) {
        small_gemm(x, w, y, R, K, N, 0, N);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t n0 = (N * t / nt) & ~3, n1 = t + 1 == nt ? N : (N * (t + 1) / nt) & ~3; /* even starts */
        small_gemm(x, w, y, R, K, N, n0, n1);
    }
    return 0;
}
"""

# AVX-512 kernels share one tiling, written once over these macros (each kernel defines them first):
# XT / WT the input and weight element types, STEP elements a vector, ACC the accumulator vector, ZERO,
# LOAD(p) a vector of elements, FMA(acc, x, w) the dot-product step, OUT_T / REDUCE(acc) the row sum, and
# STORE(v) what y holds (YT). Four weight rows at a time against groups of up to six input rows: 24
# accumulators, 4 weight and 1 input vector in the 32 registers (the loops are unrolled so that the
# accumulators stay there); the weight rows PREFETCH_ROWS ahead are prefetched into L2 (into L1 was slower).
_TILES = r"""
#define JB 4
#define PREFETCH_ROWS 8

/* RN input rows (xr, row stride K) times the JB weight rows at w (jn of them real; the rest repeat row 0
   and are not stored) into y[r, j + q] (row stride N). Each step prefetches `per` lines of [p0, p0 + np)
   of the weight block at pf. */
#define GROUP(RN)                                                                                      \
    static inline void group##RN(const XT* xr, const WT* w, int64_t K, int64_t jn, const char* pf,      \
                                 int64_t p0, int64_t np, int64_t per, YT* y, int64_t N, int64_t j) {   \
        ACC acc[JB][RN];                                                                               \
        const WT* wq[JB];                                                                              \
        _Pragma("GCC unroll 4") for (int q = 0; q < JB; q++) {                                         \
            wq[q] = w + (q < jn ? q : 0) * K;                                                          \
            _Pragma("GCC unroll 6") for (int r = 0; r < RN; r++) acc[q][r] = ZERO;                     \
        }                                                                                              \
        int64_t line = p0;                                                                             \
        for (int64_t k = 0; k < K; k += STEP) {                                                        \
            for (int64_t i = 0; pf && i < per && line < p0 + np; i++)                                  \
                _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);                                           \
            ACC_IN wv[JB];                                                                             \
            _Pragma("GCC unroll 4") for (int q = 0; q < JB; q++) wv[q] = LOAD(wq[q] + k);              \
            _Pragma("GCC unroll 6") for (int r = 0; r < RN; r++) {                                     \
                const ACC_IN xv = LOAD(xr + r * K + k);                                                \
                _Pragma("GCC unroll 4") for (int q = 0; q < JB; q++) acc[q][r] = FMA(acc[q][r], xv, wv[q]); \
            }                                                                                          \
        }                                                                                              \
        OUT_T out[RN][JB];                                                                             \
        _Pragma("GCC unroll 6") for (int r = 0; r < RN; r++)                                           \
            _Pragma("GCC unroll 4") for (int q = 0; q < JB; q++) out[r][q] = REDUCE(acc[q][r]);        \
        for (int r = 0; r < RN; r++)                                                                   \
            for (int q = 0; q < jn; q++) y[r * N + j + q] = STORE(out[r][q]);                          \
    }
GROUP(1) GROUP(2) GROUP(3) GROUP(4) GROUP(5) GROUP(6)

/* As the float32 kernel, JB output columns at a time; K % STEP == 0. */
void small_gemm(const XT* x, const WT* w, YT* y, int64_t R, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    const int64_t groups = (R + 5) / 6, lines = (JB * K * (int64_t)sizeof(WT) + 63) / 64, steps = K / STEP;
    for (int64_t j = n0; j < n1; j += JB) {
        const int64_t jn = n1 - j < JB ? n1 - j : JB;
        const char* pf = j + PREFETCH_ROWS + JB <= n1 ? (const char*)(w + (j + PREFETCH_ROWS) * K) : 0;
        for (int64_t g = 0, r0 = 0; g < groups; g++) {
            const int64_t rn = (R - r0 + groups - g - 1) / (groups - g);
            const int64_t p0 = lines * g / groups, np = lines * (g + 1) / groups - p0;
            const int64_t per = (np + steps - 1) / steps;
            const XT* xr = x + r0 * K;
            const WT* wj = w + j * K;
            YT* yr = y + r0 * N;
            switch (rn) {
                case 1: group1(xr, wj, K, jn, pf, p0, np, per, yr, N, j); break;
                case 2: group2(xr, wj, K, jn, pf, p0, np, per, yr, N, j); break;
                case 3: group3(xr, wj, K, jn, pf, p0, np, per, yr, N, j); break;
                case 4: group4(xr, wj, K, jn, pf, p0, np, per, yr, N, j); break;
                case 5: group5(xr, wj, K, jn, pf, p0, np, per, yr, N, j); break;
                default: group6(xr, wj, K, jn, pf, p0, np, per, yr, N, j); break;
            }
            r0 += rn;
        }
    }
}
"""

# bfloat16 (AVX512-BF16): vdpbf16ps multiplies 32 bf16 pairs into 16 float32 lanes; each output is summed
# in float32 and rounded to bf16 to nearest even, as torch does.
_SOURCE_BF16 = (
    r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float f) { /* round to nearest even; a NaN stays a NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
#define XT uint16_t
#define WT uint16_t
#define YT uint16_t
#define STEP 32
#define ACC __m512
#define ACC_IN __m512bh
#define ZERO _mm512_setzero_ps()
#define LOAD(p) ((__m512bh)_mm512_loadu_si512(p))
#define FMA(acc, x, w) _mm512_dpbf16_ps(acc, x, w)
#define OUT_T float
#define REDUCE(acc) _mm512_reduce_add_ps(acc)
#define STORE(v) to_bf16(v)
"""
    + _TILES
)

# bfloat16 on AMX (Intel Xeon since Sapphire Rapids): the tile unit multiplies 16 weight rows x 32 k by 32 k x
# up to 16 input rows in one instruction (tdpbf16ps), so 16 rows cost the multiply time of one and every
# row count streams the weight at the memory's pace: on a 2-core Xeon 11-13 GB/s on one core and 18-24 on
# two for 1-16 rows, where the AVX-512 kernel reads 9 / 16 GB/s at one row and 3-6 / 6-11 at 13-16, and
# oneDNN's F.linear (AMX too, but reordering the weight each call) 5-7 / 9-11. The product is taken
# transposed, y^T [N, R] = w [N, K] . x^T: the weight is the tile's left operand, loaded as it lies (16
# rows, stride K), and the input rows are packed once a call as pairs of k (the layout the right operand
# wants). Each output element is one tile lane, summed over k in a fixed order, so a row's value does not
# depend on the rows or threads sharing its call; it is rounded to bf16 to nearest even, as above. Output
# columns past the last multiple of 16 take the AVX-512 code above (the same columns every call).
_SOURCE_AMX = r"""
#include <omp.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out the tile registers' state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):
   0 when granted, for the whole process. */
int amx_init(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#define AMX_PREFETCH_BLOCKS 1 /* prefetch the weight block this many blocks of 16 rows ahead, into L2 */

/* Output columns [n0, n1) (multiples of 16) of y [R, N] from xp, the input packed as k pairs [K / 2][R]
   (uint32: two bf16). Tiles: 0-3 the sums of row groups of 16 (output columns x input rows), 4 the weight
   block (16 rows x 32 k), 5 a full group's input (16 k pairs x 16 rows), 6 the last group's. */
static void amx_columns(const uint32_t* xp, const uint16_t* w, uint16_t* y, int64_t R, int64_t K, int64_t N,
                        int64_t n0, int64_t n1) {
    const int64_t groups = (R + 15) / 16, last = R - 16 * (groups - 1), stride = R * 4;
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int g = 0; g < 4; g++) cfg.rows[g] = 16, cfg.colsb[g] = (g < groups - 1 ? 16 : last) * 4;
    cfg.rows[4] = cfg.rows[5] = cfg.rows[6] = 16;
    cfg.colsb[4] = cfg.colsb[5] = 64;
    cfg.colsb[6] = last * 4;
    _tile_loadconfig(&cfg);
    float c[16][16];
    for (int64_t j = n0; j < n1; j += 16) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t* wj = w + j * K;
        const int64_t ahead = 16 * AMX_PREFETCH_BLOCKS;
        const char* pf = j + ahead + 16 <= n1 ? (const char*)(wj + ahead * K) : 0;
        for (int64_t k = 0; k < K; k += 32) {
            if (pf)
                for (int q = 0; q < 16; q++) _mm_prefetch(pf + (q * K + k) * 2, _MM_HINT_T1);
            _tile_loadd(4, wj + k, K * 2);
            const char* xk = (const char*)(xp + k / 2 * R);
            switch (groups) { /* tile numbers are immediates */
                case 1: _tile_loadd(6, xk, stride); _tile_dpbf16ps(0, 4, 6); break;
                case 2:
                    _tile_loadd(5, xk, stride); _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, xk + 64, stride); _tile_dpbf16ps(1, 4, 6); break;
                case 3:
                    _tile_loadd(5, xk, stride); _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(5, xk + 64, stride); _tile_dpbf16ps(1, 4, 5);
                    _tile_loadd(6, xk + 128, stride); _tile_dpbf16ps(2, 4, 6); break;
                default:
                    _tile_loadd(5, xk, stride); _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(5, xk + 64, stride); _tile_dpbf16ps(1, 4, 5);
                    _tile_loadd(5, xk + 128, stride); _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(6, xk + 192, stride); _tile_dpbf16ps(3, 4, 6);
            }
        }
        for (int g = 0; g < groups; g++) {
            switch (g) {
                case 0: _tile_stored(0, c, 64); break;
                case 1: _tile_stored(1, c, 64); break;
                case 2: _tile_stored(2, c, 64); break;
                default: _tile_stored(3, c, 64);
            }
            const int64_t rows = g < groups - 1 ? 16 : last;
            for (int64_t m = 0; m < rows; m++)
                for (int n = 0; n < 16; n++) y[(16 * g + m) * N + j + n] = to_bf16(c[n][m]);
        }
    }
    _tile_release();
}

/* y [R, N] = x [R, K] . w [N, K]^T, R <= 64, K % 32 == 0; -1 if the packing buffer cannot be had. */
int small_gemm_threads(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t R, int64_t K, int64_t N,
                       int64_t threads) {
    static __thread uint32_t* xp;
    static __thread int64_t capacity;
    if (R * K / 2 > capacity) {
        free(xp);
        capacity = R * K / 2;
        xp = malloc(capacity * 4);
        if (!xp) {
            capacity = 0;
            return -1;
        }
    }
    uint32_t* packed = xp; /* the caller's thread's buffer: xp itself names each thread's own */
    const uint32_t* x32 = (const uint32_t*)x;
    for (int64_t m = 0; m < R; m++)
        for (int64_t p = 0; p < K / 2; p++) packed[p * R + m] = x32[m * (K / 2) + p];
    const int64_t blocks = N / 16;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        amx_columns(packed, w, y, R, K, N, 16 * (blocks * t / nt), 16 * (blocks * (t + 1) / nt));
        if (t == nt - 1 && 16 * blocks < N) small_gemm(x, w, y, R, K, N, 16 * blocks, N);
    }
    return 0;
}
"""

# int8 (AVX512-VNNI): vpdpbusd multiplies 64 uint8 x int8 pairs into 16 int32 lanes (exact integer sums;
# no saturation: |255 * 127 * K| < 2^31 for K < 66,000). Int8Linear (rsd_runtime.models) quantises.
_SOURCE_INT8 = (
    r"""
#include <immintrin.h>
#include <stdint.h>
#define XT uint8_t
#define WT int8_t
#define YT int32_t
#define STEP 64
#define ACC __m512i
#define ACC_IN __m512i
#define ZERO _mm512_setzero_si512()
#define LOAD(p) _mm512_loadu_si512(p)
#define FMA(acc, x, w) _mm512_dpbusd_epi32(acc, x, w)
#define OUT_T int32_t
#define REDUCE(acc) _mm512_reduce_add_epi32(acc)
#define STORE(v) (v)
"""
    + _TILES
    + r"""
#include <omp.h>
#include <stdlib.h>
/* A whole int8 linear layer over R <= 64 float32 rows x [R, K] into y [R, N]: each row quantised symmetric to
   [-127, 127] by its own scale and shifted by 128 into uint8 (into a buffer of the calling thread's), the
   products summed exactly in int32 (in y's own memory, as int32), then y = x_scale[r] * w_scale[j] *
   (acc - w_shift[j]) + bias[j] (w_shift = 128 * sum_k w[j, k]; bias may be NULL). Columns split over
   `threads` threads of the caller's OpenMP team, as small_gemm_threads. -1 if the buffer cannot be had. */
int int8_linear(const float* x, const int8_t* w, const float* w_scale, const int32_t* w_shift, const float* bias,
                float* y, int64_t R, int64_t K, int64_t N, int64_t threads) {
    static __thread uint8_t* buffer;
    static __thread int64_t capacity;
    if (R * K > capacity) {
        free(buffer);
        capacity = R * K;
        buffer = malloc(capacity);
        if (!buffer) {
            capacity = 0;
            return -1;
        }
    }
    uint8_t* xq = buffer; /* the calling thread's: `buffer` itself names each thread's own */
    int32_t* acc = (int32_t*)y;
    float xs[64];
    for (int64_t r = 0; r < R; r++) {
        const float* xr = x + r * K;
        __m512 m = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xr + k)));
        float amax = _mm512_reduce_max_ps(m);
        if (amax < 1e-30f) amax = 1e-30f;
        xs[r] = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(127.0f / amax);
        for (int64_t k = 0; k < K; k += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + k), inv)); /* nearest even */
            q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
            q = _mm512_add_epi32(q, _mm512_set1_epi32(128));
            _mm_storeu_si128((__m128i*)(xq + r * K + k), _mm512_cvtepi32_epi8(q));
        }
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t n0 = (N * t / nt) & ~3, n1 = t + 1 == nt ? N : (N * (t + 1) / nt) & ~3;
        small_gemm(xq, w, acc, R, K, N, n0, n1);
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = n0; j < n1; j++) /* each int32 sum read, then its float written in its place */
                y[r * N + j] = xs[r] * w_scale[j] * (float)(acc[r * N + j] - w_shift[j]) + (bias ? bias[j] : 0.0f);
    }
}
"""
)


@dataclass(frozen=True)
class _Kernel:
    name: str
    source: str
    cflags: tuple[str, ...]  # what the compiler needs to emit its instructions
    cpu_flags: tuple[str, ...]  # what /proc/cpuinfo must list
    k_multiple: int  # K must be a multiple of this (one vector of the dtype)
    x_dtype: torch.dtype  # the input rows' dtype
    y_dtype: torch.dtype  # the output's


_AVX512 = ("-mavx512f", "-mavx512bw")
# Keyed by the weight's dtype: the kernels for it, preferred first; the first this machine runs is used.
_KERNELS: dict[torch.dtype, tuple[_Kernel, ...]] = {
    torch.float32: (
        _Kernel("avx2", _SOURCE_F32 + _THREADS, ("-mavx2", "-mfma"), ("avx2", "fma"), 8, torch.float32, torch.float32),
    ),
    torch.bfloat16: (
        _Kernel(
            "amx-bf16",
            _SOURCE_BF16 + _SOURCE_AMX,
            (*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
            ("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"),
            32,
            torch.bfloat16,
            torch.bfloat16,
        ),
        _Kernel(
            "avx512-bf16",
            _SOURCE_BF16 + _THREADS,
            (*_AVX512, "-mavx512bf16"),
            ("avx512f", "avx512bw", "avx512_bf16"),
            32,
            torch.bfloat16,
            torch.bfloat16,
        ),
    ),
    torch.int8: (
        _Kernel(
            "avx512-vnni",
            _SOURCE_INT8 + _THREADS,
            (*_AVX512, "-mavx512vnni"),
            ("avx512f", "avx512bw", "avx512_vnni"),
            64,
            torch.uint8,
            torch.int32,
        ),
    ),
}

_lock = threading.Lock()
_libs: dict[torch.dtype, ctypes.CDLL] = {}
_names: dict[torch.dtype, str] = {}  # the kernel each dtype runs on
_failed: dict[torch.dtype, str] = {}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset({"avx2", "fma"} if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else ())


def _build(kernel: _Kernel) -> ctypes.CDLL:
    digest = hashlib.sha256((kernel.source + " ".join(kernel.cflags)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("RSD_KERNEL_DIR", Path.home() / ".cache" / "rsd" / "kernels"))
    so = cache / f"small_gemm-{digest}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src, out = Path(tmp) / "small_gemm.c", Path(tmp) / so.name
            src.write_text(kernel.source)
            cc = os.environ.get("CC", "cc")
            cmd = [cc, "-O3", *kernel.cflags, "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(out)]
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
            os.replace(out, so)  # atomic: another process may be building the same file
    lib = ctypes.CDLL(str(so))
    lib.small_gemm_threads.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
    lib.small_gemm_threads.restype = ctypes.c_int
    if hasattr(lib, "amx_init") and lib.amx_init() != 0:
        raise OSError("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
    if hasattr(lib, "int8_linear"):
        lib.int8_linear.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4
        lib.int8_linear.restype = ctypes.c_int
    return lib


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether a kernel for weights of `dtype` runs on this machine (built on first call; the reason is logged
    once if not). float32 needs AVX2+FMA, bfloat16 AMX-BF16 or else AVX512-BF16, int8 AVX512-VNNI; all a C
    compiler. RSD_SMALL_GEMM in the environment: "0" turns them all off (their callers keep torch's path: an
    A/B of the kernels through the services), "no-amx" skips the AMX kernel (an A/B of the two bf16 ones)."""
    with _lock:
        if dtype not in _libs and dtype not in _failed:
            setting = os.environ.get("RSD_SMALL_GEMM", "1")
            reasons = []
            for kernel in _KERNELS.get(dtype, ()):
                missing = [f for f in kernel.cpu_flags if f not in _cpu_flags()]
                if setting == "0":
                    reasons.append("RSD_SMALL_GEMM=0")
                    break
                if setting == "no-amx" and kernel.name.startswith("amx"):
                    reasons.append(f"{kernel.name}: RSD_SMALL_GEMM=no-amx")
                elif missing:
                    reasons.append(f"{kernel.name}: the CPU lacks {', '.join(missing)}")
                else:
                    try:
                        _libs[dtype], _names[dtype] = _build(kernel), kernel.name
                        break
                    except (OSError, subprocess.SubprocessError) as e:
                        reasons.append(f"{kernel.name}: cannot build or start it: {getattr(e, 'stderr', '') or e}")
            if dtype in _libs:
                skipped = f" ({'; '.join(reasons)})" if reasons else ""
                log.info("small_gemm kernel for %s: %s%s", dtype, _names[dtype], skipped)
            else:
                _failed[dtype] = "; ".join(reasons) or f"no kernel for {dtype}"
                log.info("small_gemm kernel for %s off: %s", dtype, _failed[dtype])
        return dtype in _libs


def kernel_name(dtype: torch.dtype) -> str | None:
    """The kernel weights of `dtype` run on here ("amx-bf16", "avx512-bf16", "avx2", "avx512-vnni"), or None."""
    return _names.get(dtype) if available(dtype) else None


def preferred_rows(dtype: torch.dtype) -> int:
    """Up to how many rows models of this dtype should compute their linear layers here by default
    (load_model): 0 where no kernel runs; wherever one does, MAX_ROWS (each beat F.linear at every row count
    it takes where measured: bf16 oneDNN reads the weights at about half the memory's pace on Zen 4 and on
    AMX Xeons alike), and on AMX any number, in calls of MAX_ROWS: chunks of a prompt beat oneDNN's F.linear
    too (1.5B up-projection on two Xeon cores: 152 rows 21 -> 14 ms, 600 rows 52 -> 45)."""
    if not available(dtype):
        return 0
    return ANY_ROWS if _names[dtype] == "amx-bf16" else MAX_ROWS


ANY_ROWS = 1 << 30


def supports(x: Tensor, weight: Tensor) -> bool:
    """Whether small_gemm takes these operands: CPU tensors with a kernel here (float32 or bfloat16 rows and
    weights of that dtype; uint8 rows and int8 weights), K a multiple of its vector (8, 32, 64),
    1..MAX_ROWS rows."""
    kernel = _KERNELS.get(weight.dtype, (None,))[0]  # a dtype's kernels share their operand rules
    return (
        kernel is not None
        and x.dtype == kernel.x_dtype
        and x.device.type == weight.device.type == "cpu"
        and x.shape[-1] == weight.shape[1]
        and weight.shape[1] % kernel.k_multiple == 0
        and 0 < x.numel() // x.shape[-1] <= MAX_ROWS
        and available(weight.dtype)
    )


def small_gemm(x: Tensor, weight: Tensor, threads: int | None = None) -> Tensor:
    """x [R, K] @ weight[N, K]^T -> [R, N] (CPU; check `supports` first): float32 and bfloat16 in their
    dtype, uint8 rows times int8 weights as exact int32 sums. `threads` (default torch's thread count)
    split the N output columns; each thread streams its own part of the weight."""
    x, weight = x.contiguous(), weight.contiguous()
    (rows, k), n = x.shape, weight.shape[0]
    y = torch.empty(rows, n, dtype=_KERNELS[weight.dtype][0].y_dtype)
    threads = _threads(threads, n)
    if _libs[weight.dtype].small_gemm_threads(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, k, n, threads):
        raise MemoryError(f"small_gemm: no memory to pack {rows} x {k} input rows")
    return y


def int8_linear(x: Tensor, weight: Tensor, w_scale: Tensor, w_shift: Tensor, bias: Tensor | None) -> Tensor:
    """A whole int8 linear layer (models.Int8Linear's forward) in one call: x [R, K] float32 rows, each
    quantised by its own scale, times weight [N, K] int8 (scales w_scale [N] float32, w_shift [N] int32 =
    128 * the row sums) plus bias [N] float32 or None -> [R, N] float32. Needs available(torch.int8),
    K % 64 == 0 and R <= MAX_ROWS."""
    x = x.contiguous()
    (rows, k), n = x.shape, weight.shape[0]
    if not 0 < rows <= MAX_ROWS:  # the C side keeps one scale a row in a MAX_ROWS-long array
        raise ValueError(f"int8_linear takes 1..{MAX_ROWS} rows, got {rows}: split them")
    y = torch.empty(rows, n)
    if _libs[torch.int8].int8_linear(
        x.data_ptr(), weight.data_ptr(), w_scale.data_ptr(), w_shift.data_ptr(),
        bias.data_ptr() if bias is not None else None, y.data_ptr(), rows, k, n, _threads(None, n),
    ):  # fmt: skip
        raise MemoryError(f"int8_linear: no memory to quantise {rows} x {k} input rows")
    return y


def _threads(threads: int | None, n: int) -> int:
    """Threads for N output columns: the caller's count (default torch's), at most one per 256 columns."""
    return max(1, min(threads or torch.get_num_threads(), n // 256))
