/* rsd_runtime.small_gemm's int8 kernel (AVX512-VNNI): vpdpbusd multiplies 64 uint8 x int8 pairs into 16
   int32 lanes (exact integer sums; no saturation: |255 * 127 * K| < 2^31 for K < 66,000), and int8_linear, a
   whole layer of rsd_runtime.linear.Int8Linear (which quantises the weights) in one call. */
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
#include "small_gemm_tiles.h"
#include "thread_buffer.h"
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

#include "small_gemm_threads.h"
