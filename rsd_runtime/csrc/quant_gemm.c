/* rsd_runtime.quant's kernel: y[R, N] = x[R, K] @ W[N, K]^T where W is held in a GGML block format
   (Q8_0, Q5_0, Q4_K, Q6_K; ggml-common.h) and x, y are float32. See quant.py.

   Weights are rebuilt in float32 exactly as gguf-py's dequantize computes them (the same products in the
   same order: this file is compiled with -ffp-contract=off, so no multiply-add is fused behind our back),
   JB = 4 weight rows at a time, and multiplied with groups of up to RN input rows (RN x JB accumulators in
   registers all along K). Up to RN rows, each 256-weight chunk is rebuilt into an L1 buffer and multiplied
   at once; more rows, the JB rows are rebuilt whole (L2) and every group reads them there. Either way each
   block is read from memory once a call, and the block rows ahead are prefetched by hand.

   Exactness: a row's sum runs over k in one fixed order (VW lanes, chunk by chunk, one horizontal sum at
   the end) whatever the other rows of the call, so a tree's row gets bit for bit the one-token row's value.
   The AVX2 and AVX-512 builds differ in VW (8 or 16 lanes) and RN (3 or 6). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(QUANT_AVX512)
#define VW 16
typedef __m512 vf;
typedef __m512i vi;
#define VZERO() _mm512_setzero_ps()
#define VSET1(a) _mm512_set1_ps(a)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VCVT(i) _mm512_cvtepi32_ps(i)
#define U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p)))   /* VW bytes -> int32 */
#define I8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p)))
#define ISET1(a) _mm512_set1_epi32(a)
#define IAND(a, b) _mm512_and_si512(a, b)
#define IOR(a, b) _mm512_or_si512(a, b)
#define ISUB(a, b) _mm512_sub_epi32(a, b)
#define IADD(a, b) _mm512_add_epi32(a, b)
#define ISRL(a, n) _mm512_srli_epi32(a, n)
#define ISLL(a, n) _mm512_slli_epi32(a, n)
#define ISRLV(a, b) _mm512_srlv_epi32(a, b)
#define ILANES() _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
static inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
#else
#define VW 8
typedef __m256 vf;
typedef __m256i vi;
#define VZERO() _mm256_setzero_ps()
#define VSET1(a) _mm256_set1_ps(a)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VCVT(i) _mm256_cvtepi32_ps(i)
#define U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p)))
#define I8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p)))
#define ISET1(a) _mm256_set1_epi32(a)
#define IAND(a, b) _mm256_and_si256(a, b)
#define IOR(a, b) _mm256_or_si256(a, b)
#define ISUB(a, b) _mm256_sub_epi32(a, b)
#define IADD(a, b) _mm256_add_epi32(a, b)
#define ISRL(a, n) _mm256_srli_epi32(a, n)
#define ISLL(a, n) _mm256_slli_epi32(a, n)
#define ISRLV(a, b) _mm256_srlv_epi32(a, b)
#define ILANES() _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
static inline float hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
#endif

#define JB 4    /* weight rows rebuilt and multiplied together */
#define PREFETCH_BLOCKS 2 /* how many blocks of JB weight rows ahead to prefetch */
#if VW == 16
#define RN 6 /* input rows a register group holds: RN x JB accumulators (24 of the 32 zmm registers) */
#else
#define RN 3 /* 12 of the 16 ymm registers */
#endif

#include "ggml_blocks.h"

/* Rebuild the n weights (a multiple of 32, at most CK) at k = k0 (a multiple of CK) of one weight row into
   out[n], exactly as dequantize does. A K-quant block is CK weights, so its scales are decoded once. */
#define CK 256
#define REBUILD static inline __attribute__((always_inline)) void

REBUILD rebuild_q8_0(const uint8_t* row, int64_t k0, int64_t n, float* out) {
    for (int64_t e = 0; e < n; e += 32) {
        const uint8_t* blk = row + (k0 + e) / 32 * 34;
        const vf d = VSET1(f16(blk));
        for (int i = 0; i < 32; i += VW) VSTORE(out + e + i, VMUL(VCVT(I8(blk + 2 + i)), d)); /* q * d */
    }
}

REBUILD rebuild_q5_0(const uint8_t* row, int64_t k0, int64_t n, float* out) {
    for (int64_t e = 0; e < n; e += 32) {
        const uint8_t* blk = row + (k0 + e) / 32 * 22;
        const vf d = VSET1(f16(blk));
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        const uint8_t* qs = blk + 6;
        for (int i = 0; i < 32; i += VW) { /* element i: nibble (i < 16 low, else high) of qs[i % 16], bit i of qh */
            const vi nib = i < 16 ? IAND(U8(qs + i), ISET1(15)) : ISRL(U8(qs + i - 16), 4);
            const vi hb = IAND(ISRLV(ISET1((int)qh), IADD(ILANES(), ISET1(i))), ISET1(1));
            VSTORE(out + e + i, VMUL(d, VCVT(ISUB(IOR(nib, ISLL(hb, 4)), ISET1(16))))); /* d * (q - 16) */
        }
    }
}

REBUILD rebuild_q4_k(const uint8_t* row, int64_t k0, int64_t n, float* out) {
    (void)n;
    const uint8_t* blk = row + k0 / CK * 144;
    const uint8_t* qs = blk + 16;
    uint32_t packed[4];
    q4_k_scales(blk + 4, packed);
    float D[8], M[8]; /* d * sc and dmin * m, one float32 product each as dequantize's */
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)packed));     /* sc[0..7] */
    const __m256i mins = _mm256_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(packed + 2))); /* m[0..7] */
    _mm256_storeu_ps(D, _mm256_mul_ps(_mm256_set1_ps(f16(blk)), _mm256_cvtepi32_ps(bytes)));
    _mm256_storeu_ps(M, _mm256_mul_ps(_mm256_set1_ps(f16(blk + 2)), _mm256_cvtepi32_ps(mins)));
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) { /* sub-block j: 32 weights */
        const vf Dj = VSET1(D[j]), Mj = VSET1(M[j]);
        const uint8_t* q = qs + 32 * (j / 2); /* low nibbles: sub-block 2c, high ones: 2c + 1 */
#if VW == 16 /* the 16 values a code can take, computed as below, then looked up */
        const vf table = VSUB(VMUL(Dj, VCVT(ILANES())), Mj);
        for (int l = 0; l < 32; l += VW) {
            const vi nib = j % 2 ? ISRL(U8(q + l), 4) : IAND(U8(q + l), ISET1(15));
            VSTORE(out + 32 * j + l, _mm512_permutexvar_ps(nib, table));
        }
#else
        for (int l = 0; l < 32; l += VW) {
            const vi nib = j % 2 ? ISRL(U8(q + l), 4) : IAND(U8(q + l), ISET1(15));
            VSTORE(out + 32 * j + l, VSUB(VMUL(Dj, VCVT(nib)), Mj)); /* (d * sc) * q - dmin * m */
        }
#endif
    }
}

REBUILD rebuild_q6_k(const uint8_t* row, int64_t k0, int64_t n, float* out) {
    (void)n;
    const uint8_t* blk = row + k0 / CK * 210;
    const int8_t* sc = (const int8_t*)(blk + 192);
    const float d = f16(blk + 208);
    const __m128i low4 = _mm_set1_epi8(15), low2 = _mm_set1_epi8(3), bias = _mm_set1_epi8(32);
    float D[16]; /* d * sc, one float32 product each as dequantize's */
    const __m128i sc16 = _mm_loadu_si128((const __m128i*)sc);
    const __m256 dv = _mm256_set1_ps(d);
    _mm256_storeu_ps(D, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc16))));
    _mm256_storeu_ps(D + 8, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc16, 8)))));
    for (int e = 0; e < CK; e += 16) { /* e = 128 h + 64 t + l: low 4 bits from ql[64 h + l] >> 4 t, high */
        const int h = e / 128, t = e % 128 / 64, l = e % 64; /* 2 from qh[32 h + l % 32] >> 2 (2 t + l / 32) */
        const __m128i ql = _mm_loadu_si128((const __m128i*)(blk + 64 * h + l));
        const __m128i qh = _mm_loadu_si128((const __m128i*)(blk + 128 + 32 * h + l % 32));
        const __m128i lo = _mm_and_si128(_mm_srli_epi16(ql, 4 * t), low4); /* 16 codes as bytes */
        const __m128i hi = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh, 2 * (2 * t + l / 32)), low2), 4);
        const __m128i q = _mm_sub_epi8(_mm_or_si128(lo, hi), bias); /* q - 32 in [-32, 31] */
        const vf De = VSET1(D[e / 16]);
#if VW == 16
        VSTORE(out + e, VMUL(De, VCVT(_mm512_cvtepi8_epi32(q)))); /* (d * sc) * (q - 32) */
#else
        VSTORE(out + e, VMUL(De, VCVT(_mm256_cvtepi8_epi32(q))));
        VSTORE(out + e + 8, VMUL(De, VCVT(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))));
#endif
    }
}

/* G input rows x (row stride K) times JB weight rows into y[r, j + q] (q < jn; row stride N), the sums in
   G x JB registers all along K, lanes summed in k order (the same whatever G: a row's bits its own). The
   weights come rebuilt whole (wbuf: JB x K floats, L2) or, where wbuf is NULL, a sub-block at a time into
   a 32-float buffer that stays in L1. */
#define GROUP(T, G)                                                                                           \
    static void group_##T##_##G(const float* x, int64_t K, const uint8_t* const* wr, const float* wbuf,      \
                                float* y, int64_t N, int64_t j, int64_t jn, const char* pf, int64_t pf_lines) { \
        float cb[JB * CK] __attribute__((aligned(64)));                                                       \
        vf a[G][JB];                                                                                          \
        _Pragma("GCC unroll 6") for (int r = 0; r < G; r++)                                                   \
            _Pragma("GCC unroll 4") for (int q = 0; q < JB; q++) a[r][q] = VZERO();                           \
        for (int64_t k0 = 0, line = 0; k0 < K; k0 += CK) {                                                    \
            const int64_t n = K - k0 < CK ? K - k0 : CK;                                                      \
            for (const int64_t end = pf_lines * (k0 + n) / K; pf && line < end; line++)                        \
                _mm_prefetch(pf + 64 * line, _MM_HINT_T0); /* the next weight rows, a share a chunk */       \
            const float* w = wbuf ? wbuf + k0 : cb;                                                           \
            const int64_t ws = wbuf ? K : CK;                                                                 \
            if (!wbuf) _Pragma("GCC unroll 4") for (int q = 0; q < JB; q++) rebuild_##T(wr[q], k0, n, cb + CK * q); \
            for (int64_t e = 0; e < n; e += VW) {                                                             \
                vf wv[JB];                                                                                    \
                _Pragma("GCC unroll 4") for (int q = 0; q < JB; q++) wv[q] = VLOAD(w + q * ws + e);          \
                _Pragma("GCC unroll 6") for (int r = 0; r < G; r++) {                                         \
                    const vf xv = VLOAD(x + r * K + k0 + e);                                                  \
                    _Pragma("GCC unroll 4") for (int q = 0; q < JB; q++) a[r][q] = VFMA(xv, wv[q], a[r][q]); \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < G; r++)                                                                           \
            for (int q = 0; q < jn; q++) y[r * N + j + q] = hsum(a[r][q]);                                    \
    }

/* Output columns [n0, n1): up to RN rows each sub-block is rebuilt and multiplied at once; more rows, the
   JB weight rows are rebuilt whole into wbuf, then each group of RN rows multiplied with them. */
#define COLS(T)                                                                                               \
    GROUP(T, 1) GROUP(T, 2) GROUP(T, 3) GROUP(T, 4) GROUP(T, 5) GROUP(T, 6)                                  \
    static void cols_##T(const float* x, const uint8_t* w, float* y, int64_t R, int64_t K, int64_t N,        \
                         int64_t row_bytes, float* wbuf, int64_t n0, int64_t n1) {                            \
        for (int64_t j = n0; j < n1; j += JB) {                                                               \
            const int64_t jn = n1 - j < JB ? n1 - j : JB;                                                     \
            const uint8_t* wr[JB]; /* past the last column: row j again, not stored */                        \
            for (int q = 0; q < JB; q++) wr[q] = w + (j + (q < jn ? q : 0)) * row_bytes;                      \
            const float* wb = R > RN ? wbuf : 0;                                                              \
            /* Rows are often short (a 1536-wide Q4_K row is 864 bytes): the hardware prefetcher barely      \
               trains on each 4-row block, so the block PREFETCH_BLOCKS ahead is prefetched by hand. */      \
            const int64_t ahead = j + PREFETCH_BLOCKS * JB;                                                   \
            const char* pf = ahead + JB <= n1 ? (const char*)(w + ahead * row_bytes) : 0;                     \
            const int64_t pf_lines = (JB * row_bytes + 63) / 64;                                             \
            if (wb)                                                                                           \
                for (int q = 0; q < JB; q++)                                                                  \
                    for (int64_t k0 = 0; k0 < K; k0 += CK)                                                   \
                        rebuild_##T(wr[q], k0, K - k0 < CK ? K - k0 : CK, wbuf + q * K + k0);                 \
            for (int64_t r0 = 0; r0 < R; r0 += RN) {                                                          \
                const int64_t g = R - r0 < RN ? R - r0 : RN;                                                  \
                const float* xr = x + r0 * K;                                                                 \
                float* yr = y + r0 * N;                                                                       \
                switch (g) {                                                                                  \
                    case 1: group_##T##_1(xr, K, wr, wb, yr, N, j, jn, r0 ? 0 : pf, pf_lines); break;        \
                    case 2: group_##T##_2(xr, K, wr, wb, yr, N, j, jn, r0 ? 0 : pf, pf_lines); break;        \
                    case 3: group_##T##_3(xr, K, wr, wb, yr, N, j, jn, r0 ? 0 : pf, pf_lines); break;        \
                    case 4: group_##T##_4(xr, K, wr, wb, yr, N, j, jn, r0 ? 0 : pf, pf_lines); break;        \
                    case 5: group_##T##_5(xr, K, wr, wb, yr, N, j, jn, r0 ? 0 : pf, pf_lines); break;        \
                    default: group_##T##_6(xr, K, wr, wb, yr, N, j, jn, r0 ? 0 : pf, pf_lines); break;       \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }
COLS(q8_0) COLS(q5_0) COLS(q4_k) COLS(q6_k)

#include "thread_buffer.h"
#include <omp.h>

/* The row bytes of a K-wide weight of GGML `type`, or 0 for a type or width this file does not take. */
static int64_t row_bytes(int64_t type, int64_t K) {
    switch (type) {
        case Q8_0: return K % 32 ? 0 : K / 32 * 34;
        case Q5_0: return K % 32 ? 0 : K / 32 * 22;
        case Q4_K: return K % 256 ? 0 : K / 256 * 144;
        case Q6_K: return K % 256 ? 0 : K / 256 * 210;
        default: return 0;
    }
}

/* y[R, N] = x[R, K] @ W^T for W of GGML `type` (N rows of row_bytes): 0 on success, -1 for a type or shape
   this file does not take (1 <= R <= 64), -2 without memory for the rebuilt rows. Columns split over
   `threads` of the caller's OpenMP team (torch's own workers, as small_gemm_threads). */
int quant_gemm(const float* x, const uint8_t* w, float* y, int64_t R, int64_t K, int64_t N, int64_t type,
               int64_t threads) {
    const int64_t rb = row_bytes(type, K);
    if (!rb || R < 1 || R > 64) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t n0 = (N * t / nt) & ~(int64_t)(JB - 1), n1 = t + 1 == nt ? N : (N * (t + 1) / nt) & ~(int64_t)(JB - 1);
        float* wbuf = R > RN ? thread_buffer(JB * K * (int64_t)sizeof(float)) : 0; /* each worker its own */
        if (R > RN && !wbuf) failed = 1;
        else switch (type) {
            case Q8_0: cols_q8_0(x, w, y, R, K, N, rb, wbuf, n0, n1); break;
            case Q5_0: cols_q5_0(x, w, y, R, K, N, rb, wbuf, n0, n1); break;
            case Q4_K: cols_q4_k(x, w, y, R, K, N, rb, wbuf, n0, n1); break;
            default: cols_q6_k(x, w, y, R, K, N, rb, wbuf, n0, n1); break;
        }
    }
    return failed ? -2 : 0;
}

/* Rebuild every row of W into out[N, K] float32: the dequantised weight (tests; dequantise-on-load). */
int quant_rebuild(const uint8_t* w, float* out, int64_t K, int64_t N, int64_t type) {
    const int64_t rb = row_bytes(type, K);
    if (!rb) return -1;
    for (int64_t j = 0; j < N; j++)
        for (int64_t k0 = 0; k0 < K; k0 += CK) {
            const int64_t n = K - k0 < CK ? K - k0 : CK;
            switch (type) {
                case Q8_0: rebuild_q8_0(w + j * rb, k0, n, out + j * K + k0); break;
                case Q5_0: rebuild_q5_0(w + j * rb, k0, n, out + j * K + k0); break;
                case Q4_K: rebuild_q4_k(w + j * rb, k0, n, out + j * K + k0); break;
                default: rebuild_q6_k(w + j * rb, k0, n, out + j * K + k0); break;
            }
        }
    return 0;
}
