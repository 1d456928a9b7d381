/* rsd_runtime.quant's int8-activation kernel (numeric "q8_activations"; see quant.py): y[R, N] = x[R, K] @ W^T
   computed as llama.cpp's CPU backend does, for W in a GGML block format (Q8_0, Q5_0, Q4_K, Q6_K).

   Each input row is quantised on its own, as ggml's reference code does it: to Q8_K for the 256-blocks
   (quantize_row_q8_K_ref: iscale = -127 / the first value of largest magnitude, codes nearest_int(iscale * x)
   capped at 127, d = 1 / iscale, 16-sums of the codes) and to Q8_0 for the 32-blocks (quantize_row_q8_0_ref:
   d = amax / 127 stored as fp16, codes roundf(x / d)). Then per weight block an exact int32 dot product of the
   weight's integer codes with the row's codes (Q4_K: sum of sc_j * q4 . a minus sum of m_j * 32-sums; Q6_K:
   sum of sc_s * (q6 - 32) . a; Q5_0: (q5 - 16) . a; Q8_0: q . a), and the float scaling in one fixed order:
       acc = acc + (d_w * d_a) * S              (every type, blocks in k order, acc from 0)
       acc = acc - (dmin_w * d_a) * M           (Q4_K, right after)
   with no fused multiply-add (-ffp-contract=off). Integer sums are exact in any order, so a row's result is a
   function of that row alone: a tree row equals the one-token row bit for bit. quant.py's q8_reference is the
   same function in numpy (tests hold the two equal bit for bit).

   Weights: JB = 4 weight rows at a time, each block unpacked once a call into unsigned byte codes and int16
   scales in L1, then multiplied with every input row (maddubs + madd, or AVX512-VNNI's dpwssd / dpbusd); a
   one-row call decodes the K-quant blocks in registers instead. The rows two groups ahead are prefetched.
   Weights repacked 8 rows at a time (q8_gemm_x8, below; 16 at a time with AVX512-VNNI) take a faster path to
   the same bits. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(Q8_AVX512)
#define VB 64 /* bytes a K-quant vector step */
typedef __m512i vk;
#define KLOAD(p) _mm512_load_si512((const void*)(p))
#define KLOADU(p) _mm512_loadu_si512((const void*)(p))
#define KZERO() _mm512_setzero_si512()
#define KMADDUBS(a, b) _mm512_maddubs_epi16(a, b)
#if defined(Q8_VNNI)
#define KDOTW(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define KDOTW(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
#define KFOLD(v) _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1))
#else
#define VB 32
typedef __m256i vk;
#define KLOAD(p) _mm256_load_si256((const __m256i*)(p))
#define KLOADU(p) _mm256_loadu_si256((const __m256i*)(p))
#define KZERO() _mm256_setzero_si256()
#define KMADDUBS(a, b) _mm256_maddubs_epi16(a, b)
#define KDOTW(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#define KFOLD(v) (v)
#endif

#define QK 256 /* a K-quant block; the 32-blocks are handled one at a time */
#define JB 4   /* weight rows unpacked and multiplied together */
#define MAX_ROWS 64
#define PREFETCH_GROUPS 2 /* how many groups of JB weight rows ahead to prefetch */

#include "ggml_blocks.h"

/* ggml's nearest_int: round half to even through the float adder (exact for |f| < 2^22). */
static inline int nearest_int(float f) {
    const float v = f + 12582912.f;
    int i;
    memcpy(&i, &v, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* ---- the input rows, quantised: codes int8 [K], scales d [K / block], sums int16 (Q8_K: of 16; Q8_0: of 32) */

static void quantize_q8_k(const float* x, int64_t K, int8_t* qs, float* d, int16_t* sums) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float* xb = x + b * QK;
        int8_t* q = qs + b * QK;
        float max = 0, amax = 0;
        for (int j = 0; j < QK; j++) {
            const float ax = fabsf(xb[j]);
            if (ax > amax) {
                amax = ax;
                max = xb[j];
            }
        }
        if (!amax) { /* ggml leaves the sums unset here; they meet d = 0 either way */
            d[b] = 0;
            memset(q, 0, QK);
            memset(sums + 16 * b, 0, 16 * sizeof(int16_t));
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QK; j++) {
            const int v = nearest_int(iscale * xb[j]);
            q[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int s = 0; s < 16; s++) {
            int t = 0;
            for (int l = 0; l < 16; l++) t += q[16 * s + l];
            sums[16 * b + s] = (int16_t)t;
        }
        d[b] = 1 / iscale;
    }
}

static void quantize_q8_0(const float* x, int64_t K, int8_t* qs, float* d, int16_t* sums) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float* xb = x + b * 32;
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = amax > fabsf(xb[j]) ? amax : fabsf(xb[j]);
        const float db = amax / 127;
        const float id = db ? 1.0f / db : 0.0f;
        d[b] = _cvtsh_ss(_cvtss_sh(db, _MM_FROUND_TO_NEAREST_INT)); /* the fp16 scale the block stores */
        int t = 0;
        for (int j = 0; j < 32; j++) {
            const int8_t v = (int8_t)roundf(xb[j] * id);
            qs[b * 32 + j] = v;
            t += v;
        }
        sums[b] = (int16_t)t;
    }
}

/* ---- weight blocks unpacked: JB rows' codes and scales, for the block at hand */
typedef struct {
    uint8_t wq[JB][QK] __attribute__((aligned(64)));       /* unsigned codes (Q8_0: |q|) in k order */
    int16_t scv[JB][QK / 2] __attribute__((aligned(64)));  /* K-quants: each code pair's sub-block scale */
    int16_t cw[JB][16] __attribute__((aligned(32)));       /* K-quants: weights of the row's 16-sums */
    int8_t ws[JB][32] __attribute__((aligned(32)));        /* Q8_0: the signed codes (each product's sign) */
    float dw[JB] __attribute__((aligned(16)));              /* fp16 d of the block */
    float dm[JB] __attribute__((aligned(16)));              /* Q4_K: fp16 dmin */
} wblock;

/* Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 code bytes): element 64 c + l is the low nibble of
   qs[32 c + l], element 64 c + 32 + l its high nibble; sub-block j (32 elements) has scale sc[j], min m[j]. */
static inline void unpack_q4_k(const uint8_t* blk, wblock* w, int q) {
    uint32_t packed[4];
    q4_k_scales(blk + 4, packed);
    const uint8_t *sc = (const uint8_t*)packed, *m = (const uint8_t*)(packed + 2);
    w->dw[q] = f16(blk);
    w->dm[q] = f16(blk + 2);
    const __m256i low = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * c));
        _mm256_store_si256((__m256i*)(w->wq[q] + 64 * c), _mm256_and_si256(v, low));
        _mm256_store_si256((__m256i*)(w->wq[q] + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    }
    for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i*)(w->scv[q] + 16 * j), _mm256_set1_epi16(sc[j]));
    const __m128i mv = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)m)); /* m_j meets the 16-sums 2j, 2j + 1 */
    _mm_store_si128((__m128i*)w->cw[q], _mm_unpacklo_epi16(mv, mv));
    _mm_store_si128((__m128i*)(w->cw[q] + 8), _mm_unpackhi_epi16(mv, mv));
}

/* Q6_K (210 bytes: ql[128], qh[64], int8 sc[16], d): element e = 128 h + 32 g + l (g < 4, l < 32) has low
   bits ql[64 h + 32 (g % 2) + l] >> 4 (g / 2) and high bits qh[32 h + l] >> 2 g; sub-block e / 16 scale sc. */
static inline void unpack_q6_k(const uint8_t* blk, wblock* w, int q) {
    const int8_t* sc = (const int8_t*)(blk + 192);
    w->dw[q] = f16(blk + 208);
    const __m256i low4 = _mm256_set1_epi8(15), low2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
        for (int g = 0; g < 4; g++) {
            const __m256i ql = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32 * (g % 2)));
            const __m256i lo = _mm256_and_si256(g / 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), low2);
            _mm256_store_si256((__m256i*)(w->wq[q] + 128 * h + 32 * g), _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
        }
    }
    for (int s = 0; s < 16; s++) _mm_store_si128((__m128i*)(w->scv[q] + 8 * s), _mm_set1_epi16(sc[s]));
    _mm256_store_si256((__m256i*)w->cw[q], _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sc)));
}

/* Q8_0 (34 bytes: d, int8 qs[32]). */
static inline void unpack_q8_0(const uint8_t* blk, wblock* w, int q) {
    w->dw[q] = f16(blk);
    const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 2));
    _mm256_store_si256((__m256i*)w->ws[q], v);
    _mm256_store_si256((__m256i*)w->wq[q], _mm256_abs_epi8(v)); /* -128 -> 128 as a byte: still right */
}

/* Q5_0 (22 bytes: d, qh (32 bits), qs[16]): element i < 16 the low nibble of qs[i], i >= 16 the high nibble of
   qs[i - 16], bit 4 from bit i of qh; value q - 16. */
static inline void unpack_q5_0(const uint8_t* blk, wblock* w, int q) {
    w->dw[q] = f16(blk);
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m128i qs = _mm_loadu_si128((const __m128i*)(blk + 6));
    const __m128i low = _mm_set1_epi8(15);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low), _mm_and_si128(qs, low));
    /* bit i of qh into byte i: spread each byte of qh over 8 bytes, test one bit each */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                               _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                  0x0303030303030303LL));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i hb = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
    _mm256_store_si256((__m256i*)w->wq[q], _mm256_or_si256(nib, hb));
}

/* The four lanes' sums of a, b, c, e (int32 x 8 each) as one int32 x 4. */
static inline __m128i hsum4(__m256i a, __m256i b, __m256i c, __m256i e) {
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, e));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* ---- one input row times the unpacked block: the JB float accumulators acc[JB] updated (header's order) */

/* K-quants: S = sum of scv * (codes . a) over the block, C = sum of cw * the row's 16-sums. */
static inline void dot_k(const wblock* w, const int8_t* a, const int16_t* sums, __m128i* S, __m128i* C) {
    vk s[JB];
    for (int q = 0; q < JB; q++) s[q] = KZERO();
    for (int e = 0; e < QK; e += VB) {
        const vk va = KLOADU(a + e);
#pragma GCC unroll 4
        for (int q = 0; q < JB; q++) s[q] = KDOTW(s[q], KMADDUBS(KLOAD(w->wq[q] + e), va), KLOAD(w->scv[q] + e / 2));
    }
    *S = hsum4(KFOLD(s[0]), KFOLD(s[1]), KFOLD(s[2]), KFOLD(s[3]));
    const __m256i b = _mm256_loadu_si256((const __m256i*)sums);
    *C = hsum4(_mm256_madd_epi16(_mm256_load_si256((const __m256i*)w->cw[0]), b),
               _mm256_madd_epi16(_mm256_load_si256((const __m256i*)w->cw[1]), b),
               _mm256_madd_epi16(_mm256_load_si256((const __m256i*)w->cw[2]), b),
               _mm256_madd_epi16(_mm256_load_si256((const __m256i*)w->cw[3]), b));
}

static inline void row_q4_k(const wblock* w, const int8_t* a, float da, const int16_t* sums, float* acc) {
    __m128i S, M;
    dot_k(w, a, sums, &S, &M);
    const __m128 d = _mm_set1_ps(da);
    __m128 v = _mm_add_ps(_mm_load_ps(acc), _mm_mul_ps(_mm_mul_ps(_mm_load_ps(w->dw), d), _mm_cvtepi32_ps(S)));
    v = _mm_sub_ps(v, _mm_mul_ps(_mm_mul_ps(_mm_load_ps(w->dm), d), _mm_cvtepi32_ps(M)));
    _mm_store_ps(acc, v);
}

static inline void row_q6_k(const wblock* w, const int8_t* a, float da, const int16_t* sums, float* acc) {
    __m128i S, C;
    dot_k(w, a, sums, &S, &C);
    S = _mm_sub_epi32(S, _mm_slli_epi32(C, 5)); /* codes q6 - 32: 32 x the scaled 16-sums */
    const __m128 d = _mm_set1_ps(da);
    _mm_store_ps(acc, _mm_add_ps(_mm_load_ps(acc), _mm_mul_ps(_mm_mul_ps(_mm_load_ps(w->dw), d), _mm_cvtepi32_ps(S))));
}

/* 32-blocks: one ymm a block. */
#if defined(Q8_VNNI)
#define DOTB(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
#else
#define DOTB(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
#endif

static inline void row_q8_0(const wblock* w, const int8_t* a, float da, const int16_t* sums, float* acc) {
    (void)sums;
    const __m256i va = _mm256_loadu_si256((const __m256i*)a);
    __m256i s[JB];
    for (int q = 0; q < JB; q++) /* |w| . (a with w's sign): maddubs takes unsigned times signed */
        s[q] = DOTB(_mm256_load_si256((const __m256i*)w->wq[q]),
                    _mm256_sign_epi8(va, _mm256_load_si256((const __m256i*)w->ws[q])));
    const __m128i S = hsum4(s[0], s[1], s[2], s[3]);
    _mm_store_ps(acc, _mm_add_ps(_mm_load_ps(acc),
                                 _mm_mul_ps(_mm_mul_ps(_mm_load_ps(w->dw), _mm_set1_ps(da)), _mm_cvtepi32_ps(S))));
}

static inline void row_q5_0(const wblock* w, const int8_t* a, float da, const int16_t* sums, float* acc) {
    const __m256i va = _mm256_loadu_si256((const __m256i*)a);
    __m256i s[JB];
    for (int q = 0; q < JB; q++) s[q] = DOTB(_mm256_load_si256((const __m256i*)w->wq[q]), va);
    const __m128i S = _mm_sub_epi32(hsum4(s[0], s[1], s[2], s[3]), _mm_set1_epi32(16 * sums[0])); /* q5 - 16 */
    _mm_store_ps(acc, _mm_add_ps(_mm_load_ps(acc),
                                 _mm_mul_ps(_mm_mul_ps(_mm_load_ps(w->dw), _mm_set1_ps(da)), _mm_cvtepi32_ps(S))));
}


/* ---- one row: the K-quant blocks decoded in registers (ggml's AVX2 way), no unpacked copy written and read
   back. The same integers (exact), then the same float steps (row_q4_k, row_q6_k), so the bits are the unpacked
   path's. From two rows on, unpacking once costs less than decoding again for each row (measured). */
#define INLINE_ROWS 1
#if defined(Q8_VNNI)
#define DOTW256(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#else
#define DOTW256(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif
#define BCAST16(lo, hi) /* pshufb control: int16 lane lo of each 128-bit half (hi in the upper half) everywhere */ \
    _mm256_set_m128i(_mm_set1_epi16((short)((2 * (hi) + 1) << 8 | 2 * (hi))), _mm_set1_epi16((short)((2 * (lo) + 1) << 8 | 2 * (lo))))

static inline void float_step(const float* dw, const float* dm, __m128i S, __m128i M, float da, float* acc) {
    const __m128 d = _mm_set1_ps(da);
    __m128 v = _mm_add_ps(_mm_load_ps(acc), _mm_mul_ps(_mm_mul_ps(_mm_loadu_ps(dw), d), _mm_cvtepi32_ps(S)));
    if (dm) v = _mm_sub_ps(v, _mm_mul_ps(_mm_mul_ps(_mm_loadu_ps(dm), d), _mm_cvtepi32_ps(M)));
    _mm_store_ps(acc, v);
}

static inline void inline_q4_k(const uint8_t* const* blk, const int8_t* a, float da, const int16_t* sums, float* acc) {
    __m256i S[JB], M[JB];
    float dw[JB], dm[JB];
    const __m256i low = _mm256_set1_epi8(15), bs = _mm256_loadu_si256((const __m256i*)sums);
    for (int q = 0; q < JB; q++) {
        const uint8_t* b = blk[q];
        uint32_t packed[4];
        q4_k_scales(b + 4, packed);
        const __m256i sm = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)packed)); /* sc[8], m[8] */
        const __m256i scales = _mm256_permute2x128_si256(sm, sm, 0x00);
        __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * c));
            const __m256i plo = _mm256_maddubs_epi16(_mm256_and_si256(v, low), _mm256_loadu_si256((const __m256i*)(a + 64 * c)));
            const __m256i phi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                     _mm256_loadu_si256((const __m256i*)(a + 64 * c + 32)));
            s = DOTW256(s, plo, _mm256_shuffle_epi8(scales, BCAST16(2 * c, 2 * c)));
            s = DOTW256(s, phi, _mm256_shuffle_epi8(scales, BCAST16(2 * c + 1, 2 * c + 1)));
        }
        const __m128i m = _mm256_extracti128_si256(sm, 1);
        S[q] = s;
        M[q] = _mm256_madd_epi16(_mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m)), bs);
        dw[q] = f16(b);
        dm[q] = f16(b + 2);
    }
    float_step(dw, dm, hsum4(S[0], S[1], S[2], S[3]), hsum4(M[0], M[1], M[2], M[3]), da, acc);
}

static inline void inline_q6_k(const uint8_t* const* blk, const int8_t* a, float da, const int16_t* sums, float* acc) {
    __m256i S[JB], C[JB];
    float dw[JB];
    const __m256i low4 = _mm256_set1_epi8(15), low2 = _mm256_set1_epi8(3);
    const __m256i bs = _mm256_loadu_si256((const __m256i*)sums);
    for (int q = 0; q < JB; q++) {
        const uint8_t* b = blk[q];
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192))); /* sc[16] */
        __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i scales = _mm256_permute2x128_si256(sc, sc, h ? 0x11 : 0x00); /* sc[8 h .. 8 h + 7] twice */
            const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) { /* elements 128 h + 32 g ..: sub-blocks 8 h + 2 g and the next */
                const __m256i ql = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32 * (g % 2)));
                const __m256i lo = _mm256_and_si256(g / 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
                const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), low2), 4);
                const __m256i p = _mm256_maddubs_epi16(_mm256_or_si256(lo, hi),
                                                       _mm256_loadu_si256((const __m256i*)(a + 128 * h + 32 * g)));
                s = DOTW256(s, p, _mm256_shuffle_epi8(scales, BCAST16(2 * g, 2 * g + 1)));
            }
        }
        S[q] = s;
        C[q] = _mm256_madd_epi16(sc, bs);
        dw[q] = f16(b + 208);
    }
    const __m128i Sq = _mm_sub_epi32(hsum4(S[0], S[1], S[2], S[3]), _mm_slli_epi32(hsum4(C[0], C[1], C[2], C[3]), 5));
    float_step(dw, 0, Sq, Sq, da, acc);
}

/* Output columns [n0, n1) of R rows: JB weight rows at a time, block by block in k order, each block unpacked
   once and multiplied with every row. B: elements a block; BB: bytes a block; SB: the row's sums a block; INLINE: whether small calls decode
   in registers (inline_T). */
#define COLS(T, B, BB, SB, INLINE)                                                                                    \
    static void cols_##T(const int8_t* xq, const float* xd, const int16_t* xs, const uint8_t* w, float* y,   \
                         int64_t R, int64_t K, int64_t N, int64_t n0, int64_t n1) {                           \
        const int64_t nb = K / B, rb = nb * BB;                                                               \
        wblock wb;                                                                                            \
        float acc[MAX_ROWS][JB] __attribute__((aligned(16)));                                                 \
        for (int64_t j = n0; j < n1; j += JB) {                                                               \
            const int64_t jn = n1 - j < JB ? n1 - j : JB;                                                     \
            const uint8_t* wr[JB]; /* past the last column: row j again, not stored */                        \
            for (int q = 0; q < JB; q++) wr[q] = w + (j + (q < jn ? q : 0)) * rb;                             \
            memset(acc, 0, sizeof(float) * JB * R);                                                           \
            /* Rows are short (a 1536-wide Q6_K row is 1260 bytes): the hardware prefetcher barely trains on   \
               each group, so the JB rows PREFETCH_GROUPS groups ahead (contiguous) are prefetched by hand. */  \
            const int64_t ahead = j + PREFETCH_GROUPS * JB;                                                   \
            const char* pf = ahead + JB <= n1 ? (const char*)(w + ahead * rb) : 0;                            \
            const int64_t pf_lines = (JB * rb + 63) / 64;                                                     \
            for (int64_t b = 0, line = 0; b < nb; b++) {                                                      \
                for (const int64_t end = pf_lines * (b + 1) / nb; pf && line < end; line++)                     \
                    _mm_prefetch(pf + 64 * line, _MM_HINT_T0); /* the weight rows ahead, a share a block */   \
                if (INLINE && R <= INLINE_ROWS) {                                                             \
                    const uint8_t* bq[JB];                                                                    \
                    for (int q = 0; q < JB; q++) bq[q] = wr[q] + b * BB;                                      \
                    for (int64_t r = 0; r < R; r++)                                                           \
                        inline_##T(bq, xq + r * K + b * B, xd[r * nb + b], xs + (r * nb + b) * SB, acc[r]);  \
                    continue;                                                                                 \
                }                                                                                             \
                for (int q = 0; q < JB; q++) unpack_##T(wr[q] + b * BB, &wb, q);                              \
                for (int64_t r = 0; r < R; r++)                                                               \
                    row_##T(&wb, xq + r * K + b * B, xd[r * nb + b], xs + (r * nb + b) * SB, acc[r]);        \
            }                                                                                                 \
            for (int64_t r = 0; r < R; r++)                                                                   \
                for (int q = 0; q < jn; q++) y[r * N + j + q] = acc[r][q];                                    \
        }                                                                                                     \
    }
#define inline_q8_0(...) /* 32-blocks: always unpacked */
#define inline_q5_0(...)
COLS(q4_k, 256, 144, 16, 1) COLS(q6_k, 256, 210, 16, 1) COLS(q8_0, 32, 34, 1, 0) COLS(q5_0, 32, 22, 1, 0)

#include "thread_buffer.h"
#include <omp.h>

static int64_t block_elems(int64_t type) { return type == Q4_K || type == Q6_K ? QK : type == Q8_0 || type == Q5_0 ? 32 : 0; }

/* Row x[K] quantised for a weight of GGML `type`: codes qs[K], scales d[K / block], sums[K / 16] (Q8_K) or
   [K / 32] (Q8_0). 0, or -1 for a type or width this file does not take. (Exposed for the tests.) */
int q8_quantize(const float* x, int8_t* qs, float* d, int16_t* sums, int64_t K, int64_t type) {
    const int64_t be = block_elems(type);
    if (!be || K % be) return -1;
    if (be == QK) quantize_q8_k(x, K, qs, d, sums);
    else quantize_q8_0(x, K, qs, d, sums);
    return 0;
}

/* The R input rows quantised for `type` into this thread's buffer: codes *xq [R, K], scales *xd [R, nb], sums
   *xs [R, ns]. -1 without memory. */
static int quantize_input(const float* x, int64_t R, int64_t K, int64_t type, int8_t** xq, float** xd, int16_t** xs) {
    const int64_t be = block_elems(type), nb = K / be, ns = be == QK ? K / 16 : nb;
    char* buf = thread_buffer(R * (K + 4 * nb + 2 * ns) + 64);
    if (!buf) return -1;
    *xd = (float*)buf;
    *xs = (int16_t*)(*xd + R * nb);
    *xq = (int8_t*)(*xs + R * ns);
    for (int64_t r = 0; r < R; r++) q8_quantize(x + r * K, *xq + r * K, *xd + r * nb, *xs + r * ns, K, type);
    return 0;
}

/* y[R, N] = x[R, K] @ W^T in int8 activations (header) for W of GGML `type`: 0 on success, -1 for a type or
   shape this file does not take (1 <= R <= 64), -2 without memory for the quantised rows. The rows are
   quantised by the calling thread, then the columns split over `threads` of the caller's OpenMP team. */
int q8_gemm(const float* x, const uint8_t* w, float* y, int64_t R, int64_t K, int64_t N, int64_t type, int64_t threads) {
    const int64_t be = block_elems(type);
    if (!be || K % be || R < 1 || R > MAX_ROWS) return -1;
    int8_t* xq;
    float* xd;
    int16_t* xs;
    if (quantize_input(x, R, K, type, &xq, &xd, &xs)) return -2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t n0 = (N * t / nt) & ~(int64_t)(JB - 1), n1 = t + 1 == nt ? N : (N * (t + 1) / nt) & ~(int64_t)(JB - 1);
        switch (type) {
            case Q4_K: cols_q4_k(xq, xd, xs, w, y, R, K, N, n0, n1); break;
            case Q6_K: cols_q6_k(xq, xd, xs, w, y, R, K, N, n0, n1); break;
            case Q8_0: cols_q8_0(xq, xd, xs, w, y, R, K, N, n0, n1); break;
            default: cols_q5_0(xq, xd, xs, w, y, R, K, N, n0, n1); break;
        }
    }
    return 0;
}

/* ---- Weights repacked 8 rows at a time ("x8"), llama.cpp's repacking idea: the same codes, scales
   and float steps, laid out so that one 32-byte vector holds 4 consecutive codes of each of 8 weight rows.
   The input row's 4 matching codes are broadcast, so each int32 lane sums one weight row: no horizontal sums,
   the float step runs on 8 columns at once, and the integers and float order are the unpacked path's (same
   bits). Two such groups are interleaved block by block (group 2p's block b, then group 2p + 1's; an odd last
   group alone after them: quant_q8._pair_groups), so the AVX512-VNNI build reads 16 rows from one stream into
   512-bit vectors (x16, below). Per 8 rows and block (quant_q8.repack_x8 writes it):
     Q4_K (1184 bytes): fp16 d[8], fp16 dmin[8], u8 sc pairs [4][8][2], u8 m pairs [4][8][2], qs [32][8][4]:
       vector p = 8c + t holds each row's qs[32c + 4t .. + 3]: low nibbles elements 64c + 4t + k (sub-block 2c),
       high nibbles 64c + 32 + 4t + k (sub-block 2c + 1).
     Q6_K (1680 bytes): fp16 d[8], i8 sc pairs [8][8][2], ql [32][8][4], qh [16][8][4]: ql vector 16h + 8q + t
       holds ql[64h + 32q + 4t ..] (low nibbles elements 128h + 32q + 4t + k, high ones 64 further), qh vector
       8h + t holds qh[32h + 4t ..] (bits 2g of element 128h + 32g + 4t + k).
     Q8_0 (272 bytes, a 32-block): fp16 d[8], qs [8][8][4]: vector t holds each row's codes 4t .. 4t + 3.
     Q5_0 (176 bytes, a 32-block): fp16 d[8], qs [4][8][4] (vector t: each row's qs[4t ..], low nibbles elements
       4t + k, high ones 16 + 4t + k), qh [8][4] (each row's 32 high bits). */
#define X8_Q4_K 1184
#define X8_Q6_K 1680
#define X8_Q8_0 272
#define X8_Q5_0 176
#define X8_PREFETCH 8192 /* bytes ahead in the weight stream, into L2 (measured: T0, NTA and 1-32 kB lose) */
#define XB 8 /* at most this many input rows multiplied with each decoded weight vector (XCOLS' RB, quant_gemm_q8_x8.h) */
#if defined(Q8_VNNI) /* AVX512-VL's 32 vector registers hold Q6_K's accumulators for 8 rows (measured: 10-15 %
                        faster at 5-13 rows; Q4_K's lo/hi/S for 8 rows spill, 4 it keeps) */
#define Q6_RB 8
#else
#define Q6_RB 4
#endif

static inline __m256i bcast4(const int8_t* a) { int32_t v; memcpy(&v, a, 4); return _mm256_set1_epi32(v); }
/* each 32-bit lane's first (second) int16 in both of its halves */
static inline __m256i dup_lo16(__m256i pairs) {
    return _mm256_shuffle_epi8(pairs, _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                                       0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13));
}
static inline __m256i dup_hi16(__m256i pairs) {
    return _mm256_shuffle_epi8(pairs, _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                                                       2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15));
}
static inline __m256i pair16(int16_t lo, int16_t hi) { return _mm256_set1_epi32((int32_t)(uint16_t)lo | (int32_t)hi << 16); }

/* A chunk's 4 codes of 8 rows times the input's 4 codes, into the sub-block's accumulator; then the sub-block's
   sum times its scale (scale pairs: int16 [8 rows][2], `second` picks one) as int32. With AVX512-VNNI dpbusd sums
   in int32 (no int16 pairs to widen); without, maddubs pairs add up in int16 (bounds at the call sites). Either
   way the same integers. */
#if defined(Q8_VNNI)
#define DOT4(acc, u, s) _mm256_dpbusd_epi32(acc, u, s) /* 4 products of unsigned and signed bytes into int32 lanes */
static inline __m256i widen(__m256i sum) { return sum; } /* chunk_dot's sum as int32 lanes */
static inline __m256i chunk_dot(__m256i acc, __m256i codes, __m256i a4) { return _mm256_dpbusd_epi32(acc, codes, a4); }
static inline __m256i scaled(__m256i sum, __m256i pairs, int second) {
    return _mm256_mullo_epi32(sum, second ? _mm256_srai_epi32(pairs, 16) : _mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16));
}
#else
#define DOT4(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
static inline __m256i widen(__m256i sum) { return _mm256_madd_epi16(sum, _mm256_set1_epi16(1)); }
static inline __m256i chunk_dot(__m256i acc, __m256i codes, __m256i a4) {
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(codes, a4));
}
static inline __m256i scaled(__m256i sum, __m256i pairs, int second) {
    return _mm256_madd_epi16(sum, second ? dup_hi16(pairs) : dup_lo16(pairs));
}
#endif

/* The vector operations the K-quant bodies (quant_gemm_q8_x8.h) are written in, at two widths: v8_ on one group's
   8 rows in 256-bit vectors, v16_ on a pair of groups' 16 rows in 512-bit ones (AVX512-VNNI only). Loads take the
   pair's `stride` (v8_ ignores it); a "half" load reads 16 bytes of each group. */
#define AI static inline __attribute__((always_inline))
#define VOPS(W, P, SI) /* the operations both widths spell alike (P: the intrinsics' prefix, SI: their int type) */   \
    typedef __m##P##i W##i;                                                                                       \
    typedef __m##P W##f;                                                                                          \
    AI W##i W##zero(void) { return _mm##P##_setzero_##SI(); }                                                     \
    AI W##i W##set1_8(char c) { return _mm##P##_set1_epi8(c); }                                                   \
    AI W##i W##and(W##i a, W##i b) { return _mm##P##_and_##SI(a, b); }                                            \
    AI W##i W##or(W##i a, W##i b) { return _mm##P##_or_##SI(a, b); }                                              \
    AI W##i W##srli16(W##i a, int n) { return _mm##P##_srli_epi16(a, n); }                                        \
    AI W##i W##slli16(W##i a, int n) { return _mm##P##_slli_epi16(a, n); }                                        \
    AI W##i W##slli32(W##i a, int n) { return _mm##P##_slli_epi32(a, n); }                                        \
    AI W##i W##add32(W##i a, W##i b) { return _mm##P##_add_epi32(a, b); }                                         \
    AI W##i W##sub32(W##i a, W##i b) { return _mm##P##_sub_epi32(a, b); }                                         \
    AI W##i W##madd16(W##i a, W##i b) { return _mm##P##_madd_epi16(a, b); }                                       \
    AI W##f W##zerof(void) { return _mm##P##_setzero_ps(); }                                                      \
    AI W##f W##set1f(float x) { return _mm##P##_set1_ps(x); }                                                     \
    AI W##f W##addf(W##f a, W##f b) { return _mm##P##_add_ps(a, b); }                                             \
    AI W##f W##subf(W##f a, W##f b) { return _mm##P##_sub_ps(a, b); }                                             \
    AI W##f W##mulf(W##f a, W##f b) { return _mm##P##_mul_ps(a, b); }                                             \
    AI W##f W##cvtf(W##i a) { return _mm##P##_cvtepi32_ps(a); }                                                   \
    AI void W##storef(float* p, W##f a) { _mm##P##_storeu_ps(p, a); }
VOPS(v8_, 256, si256)
AI v8_i v8_load(const uint8_t* p, int64_t stride) { (void)stride; return _mm256_loadu_si256((const __m256i*)p); }
AI v8_f v8_half_ph(const uint8_t* p, int64_t stride) { (void)stride; return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
AI v8_i v8_half_u8(const uint8_t* p, int64_t stride) { (void)stride; return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)); }
AI v8_i v8_half_i8(const uint8_t* p, int64_t stride) { (void)stride; return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
AI v8_i v8_pair(int16_t lo, int16_t hi) { return pair16(lo, hi); }
AI v8_i v8_dot(v8_i acc, v8_i codes, const int8_t* a) { return chunk_dot(acc, codes, bcast4(a)); }
AI v8_i v8_scaled(v8_i sum, v8_i pairs, int second) { return scaled(sum, pairs, second); }

#if defined(Q8_VNNI)
/* Two x8 groups at once in 512-bit vectors ("x16"): the low half holds group j / 8, the high half group j / 8 + 1
   (its block `stride` bytes further), so each broadcast input code and each dpbusd serves 16 weight rows. Every
   lane does what the 256-bit path does for its column, in the same order: the same bits. (Measured on Zen 4:
   zmm dpbusd makes 1.6x the int8 products a second of the ymm one, which bound the 4-row Q4_K step; with the
   pair's groups far apart instead of interleaved, two streams cut the one-row read rate by a quarter.) */
static inline __m512i load2(const uint8_t* p, int64_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)),
                              _mm256_loadu_si256((const __m256i*)(p + stride)), 1);
}
static inline __m256i load2h(const uint8_t* p, int64_t stride) { /* 16 bytes of each group */
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
                                   _mm_loadu_si128((const __m128i*)(p + stride)), 1);
}
static inline __m512i bcast4z(const int8_t* a) { int32_t v; memcpy(&v, a, 4); return _mm512_set1_epi32(v); }
static inline __m512i scaled_z(__m512i sum, __m512i pairs, int second) {
    return _mm512_mullo_epi32(sum, second ? _mm512_srai_epi32(pairs, 16) : _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16));
}

VOPS(v16_, 512, si512)
AI v16_i v16_load(const uint8_t* p, int64_t stride) { return load2(p, stride); }
AI v16_f v16_half_ph(const uint8_t* p, int64_t stride) { return _mm512_cvtph_ps(load2h(p, stride)); }
AI v16_i v16_half_u8(const uint8_t* p, int64_t stride) { return _mm512_cvtepu8_epi16(load2h(p, stride)); }
AI v16_i v16_half_i8(const uint8_t* p, int64_t stride) { return _mm512_cvtepi8_epi16(load2h(p, stride)); }
AI v16_i v16_pair(int16_t lo, int16_t hi) { return _mm512_set1_epi32((int32_t)(uint16_t)lo | (int32_t)hi << 16); }
AI v16_i v16_dot(v16_i acc, v16_i codes, const int8_t* a) { return _mm512_dpbusd_epi32(acc, codes, bcast4z(a)); }
AI v16_i v16_scaled(v16_i sum, v16_i pairs, int second) { return scaled_z(sum, pairs, second); }
#endif

/* Q6_K chunks summed before their sub-block's scale: int16 holds 2 (pairs <= 2 * 63 * 127), int32 a whole
   sub-block's 4 (then one mullo a sub-block) */
#if defined(Q8_VNNI)
#define Q6_RUN 4
#else
#define Q6_RUN 2
#endif

static inline __attribute__((always_inline)) void
x8_q8_0_block(const uint8_t* g, int64_t stride, const int8_t* const* a, const float* da, const int16_t* const* sums, __m256* acc, const int nr) {
    (void)stride, (void)sums;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
    __m256i S[XB];
    for (int r = 0; r < nr; r++) S[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) { /* |w| . (a with w's sign): unsigned times signed, as row_q8_0 */
        const __m256i v = _mm256_loadu_si256((const __m256i*)(g + 16 + 32 * t)), u = _mm256_abs_epi8(v);
        for (int r = 0; r < nr; r++) S[r] = DOT4(S[r], u, _mm256_sign_epi8(bcast4(a[r] + 4 * t), v));
    }
    for (int r = 0; r < nr; r++)
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(da[r])), _mm256_cvtepi32_ps(S[r])));
}

/* Bit 4 of the codes 4t + k (k < 4) of a Q5_0 block, for 8 rows: each row's qh byte holding them spread over its
   4 bytes, then bit (4t + k) % 8 of byte k tested. `byte`: that byte's index in the row's 4 qh bytes. */
static inline __m256i q5_high(__m256i qh, int byte, int shift) {
    const __m256i lane = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,  /* each 32-bit lane's */
                                          0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12); /* first byte */
    const __m256i spread = _mm256_shuffle_epi8(qh, _mm256_add_epi8(lane, _mm256_set1_epi8((char)byte)));
    const __m256i bit = _mm256_set1_epi32((int32_t)(0x08040201u << shift));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

static inline __attribute__((always_inline)) void
x8_q5_0_block(const uint8_t* g, int64_t stride, const int8_t* const* a, const float* da, const int16_t* const* sums, __m256* acc, const int nr) {
    (void)stride;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(g + 144)), low = _mm256_set1_epi8(15);
    __m256i lo[XB], hi[XB];
    for (int r = 0; r < nr; r++) lo[r] = hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) { /* codes 0..31: each maddubs pair <= 2 * 31 * 127, 4 of them fit int16 */
        const __m256i v = _mm256_loadu_si256((const __m256i*)(g + 16 + 32 * t));
        const __m256i vl = _mm256_or_si256(_mm256_and_si256(v, low), q5_high(qh, t / 2, 4 * (t % 2)));
        const __m256i vh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), q5_high(qh, 2 + t / 2, 4 * (t % 2)));
        for (int r = 0; r < nr; r++) {
            lo[r] = chunk_dot(lo[r], vl, bcast4(a[r] + 4 * t));
            hi[r] = chunk_dot(hi[r], vh, bcast4(a[r] + 16 + 4 * t));
        }
    }
    for (int r = 0; r < nr; r++) { /* values q5 - 16: 16 x the block's sum of input codes off */
        const __m256i S = _mm256_sub_epi32(_mm256_add_epi32(widen(lo[r]), widen(hi[r])), _mm256_set1_epi32(16 * sums[r][0]));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(da[r])), _mm256_cvtepi32_ps(S)));
    }
}

/* The K-quant bodies and every type's column loop, written once over the width (quant_gemm_q8_x8.h): x8_ in
   256-bit vectors, one group of 8 rows; with AVX512-VNNI x16_ too, a pair of groups in 512-bit ones. */
#define W 8
#include "quant_gemm_q8_x8.h"
#undef W
#if defined(Q8_VNNI)
#define W 16
#include "quant_gemm_q8_x8.h"
#undef W
#else
#define x16_cols_q4_k x8_cols_q4_k
#define x16_cols_q6_k x8_cols_q6_k
#endif

/* y[R, N] = x[R, K] @ W^T for W repacked (quant_q8.repack_x8; N a multiple of 8): as q8_gemm, the same bits. */
int q8_gemm_x8(const float* x, const uint8_t* w, float* y, int64_t R, int64_t K, int64_t N, int64_t type, int64_t threads) {
    if (!block_elems(type) || K % block_elems(type) || N % 8 || R < 1 || R > MAX_ROWS)
        return -1;
    int8_t* xq;
    float* xd;
    int16_t* xs;
    if (quantize_input(x, R, K, type, &xq, &xd, &xs)) return -2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads(), P = (N / 8 + 1) / 2; /* pairs of groups */
        const int64_t n0 = 16 * (P * t / nt), n1 = t + 1 == nt ? N : 16 * (P * (t + 1) / nt);
        if (type == Q4_K) x16_cols_q4_k(xq, xd, xs, w, y, R, K, N, n0, n1);
        else if (type == Q6_K) x16_cols_q6_k(xq, xd, xs, w, y, R, K, N, n0, n1);
        else if (type == Q8_0) x8_cols_q8_0(xq, xd, xs, w, y, R, K, N, n0, n1);
        else x8_cols_q5_0(xq, xd, xs, w, y, R, K, N, n0, n1);
    }
    return 0;
}
