"""The C sources of rsd_runtime.small_gemm's kernels (compiled there at first use). Each kernel is one
translation unit: its dtype's inner product over a shared tiling, then the entry point that splits the output
columns over the caller's OpenMP team. See small_gemm for what each is for and what it measured."""

SOURCE_F32 = r"""
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
THREADS = r"""
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
TILES = r"""
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
SOURCE_BF16 = (
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
    + TILES
)

# A kernel's scratch (packed or quantised input rows): one buffer per calling thread, grown as needed and
# kept, so a call allocates nothing. Read it into a local before an OpenMP region: inside one, the
# thread-local variable would name each worker's own (empty) buffer.
BUFFER = r"""
#include <stdlib.h>
static void* thread_buffer(int64_t bytes) { /* NULL if it cannot be had */
    static __thread void* buffer;
    static __thread int64_t capacity;
    if (bytes > capacity) {
        free(buffer);
        buffer = malloc(bytes);
        capacity = buffer ? bytes : 0;
    }
    return buffer;
}
"""

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
SOURCE_AMX = (
    BUFFER
    + r"""
#include <omp.h>
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
    uint32_t* packed = thread_buffer(R * K * 2);
    if (!packed) return -1;
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
)

# int8 (AVX512-VNNI): vpdpbusd multiplies 64 uint8 x int8 pairs into 16 int32 lanes (exact integer sums;
# no saturation: |255 * 127 * K| < 2^31 for K < 66,000). Int8Linear (rsd_runtime.models) quantises.
SOURCE_INT8 = (
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
    + TILES
    + BUFFER
    + r"""
#include <omp.h>
/* A whole int8 linear layer over R <= 64 float32 rows x [R, K] into y [R, N]: each row quantised symmetric to
   [-127, 127] by its own scale and shifted by 128 into uint8 (into a buffer of the calling thread's), the
   products summed exactly in int32 (in y's own memory, as int32), then y = x_scale[r] * w_scale[j] *
   (acc - w_shift[j]) + bias[j] (w_shift = 128 * sum_k w[j, k]; bias may be NULL). Columns split over
   `threads` threads of the caller's OpenMP team, as small_gemm_threads. -1 if the buffer cannot be had. */
int int8_linear(const float* x, const int8_t* w, const float* w_scale, const int32_t* w_shift, const float* bias,
                float* y, int64_t R, int64_t K, int64_t N, int64_t threads) {
    uint8_t* xq = thread_buffer(R * K);
    if (!xq) return -1;
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
    return 0;
}
"""
)
