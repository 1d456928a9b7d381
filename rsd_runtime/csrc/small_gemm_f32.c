/* rsd_runtime.small_gemm's float32 kernel (AVX2 + FMA): pairs of weight rows against groups of up to six
   input rows, 12 accumulators. See small_gemm.py. */
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

#include "small_gemm_threads.h"
