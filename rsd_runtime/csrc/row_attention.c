/* rsd_runtime.row_attention's kernel (AVX2 + FMA): each (query row, key/value head) alone, over the row's own
   visible keys in position order, every sum in an order fixed by that key list alone. See row_attention.py. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* 8 elements as float32: LOAD_F32 / LOAD_BF16 (bfloat16 is the top half of a float32: exact) */
#define LOAD_F32(p) _mm256_loadu_ps(p)
#define LOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p))), 16))

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0, 0 below -87 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n). One
   vector function for every element, tail included, so a score's exp never depends on its lane. */
static inline __m256 exp_neg(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* out[i, h, :] = sum_j p_j v[g, keys[j], :] with p = softmax_j(scale * q[i, h, :] . k[g, keys[j], :]) over the
   row's keys keys[cu[i]:cu[i + 1]] (slots, in position order), g = h / rep. q [n, H, D] and out [n, H, D] float32
   contiguous; k, v: head g's slot s at k + g * kv_stride + s * D. D % 8 == 0. A score is one accumulator over D
   in order (QB queries times KB keys at a time: independent chains, the same sums); the exp sum is 8 lanes (key
   j in lane j % 8, zeros past the last key), then hsum; the output sums over keys in order (in out between key
   blocks). */
#define QB 4
#define KB 2
#define JBLK 64 /* keys a block: its K or V rows stay in L1 while every query of the head reads them */
#define ROW_ATTENTION(NAME, T, LOAD)                                                                     \
    int NAME(const float* q, const T* k, const T* v, const int64_t* keys, const int64_t* cu, float* out,  \
             int64_t n, int64_t H, int64_t Hkv, int64_t D, int64_t kv_stride, float scale, int64_t threads) { \
        const int64_t rep = H / Hkv;                                                                     \
        int failed = 0;                                                                                  \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")              \
        for (int64_t item = 0; item < n * Hkv; item++) {                                                 \
            const int64_t i = item / Hkv, g = item % Hkv, S = cu[i + 1] - cu[i], S8 = (S + 7) & ~7;      \
            const int64_t* key = keys + cu[i];                                                           \
            const T *kg = k + g * kv_stride, *vg = v + g * kv_stride;                                    \
            const float* qg = q + (i * H + g * rep) * D;                                                 \
            float* s = malloc(sizeof(float) * (rep * (S8 ? S8 : 8) + rep)); /* [rep, S8] scores, then exps */ \
            if (!s) { failed = 1; continue; }                                                            \
            float* sum = s + rep * (S8 ? S8 : 8); /* [rep] */                                            \
            for (int64_t jb = 0; jb < S; jb += JBLK)                                                     \
            for (int64_t r0 = 0; r0 < rep; r0 += QB) {                                                   \
                const int64_t rn = rep - r0 < QB ? rep - r0 : QB, je = S - jb < JBLK ? S : jb + JBLK;   \
                for (int64_t j = jb; j < je; j += KB) {                                                  \
                    const int64_t jn = je - j < KB ? je - j : KB;                                        \
                    const T* kj[KB];                                                                     \
                    for (int b = 0; b < KB; b++) kj[b] = kg + key[j + (b < jn ? b : 0)] * D;             \
                    __m256 acc[QB][KB];                                                                  \
                    for (int r = 0; r < QB; r++)                                                         \
                        for (int b = 0; b < KB; b++) acc[r][b] = _mm256_setzero_ps();                    \
                    for (int64_t d = 0; d < D; d += 8) {                                                 \
                        __m256 kv[KB];                                                                   \
                        _Pragma("GCC unroll 2") for (int b = 0; b < KB; b++) kv[b] = LOAD(kj[b] + d);    \
                        _Pragma("GCC unroll 4") for (int r = 0; r < QB; r++) {                           \
                            const __m256 qv = _mm256_loadu_ps(qg + (r0 + (r < rn ? r : 0)) * D + d);     \
                            _Pragma("GCC unroll 2") for (int b = 0; b < KB; b++)                         \
                                acc[r][b] = _mm256_fmadd_ps(qv, kv[b], acc[r][b]);                       \
                        }                                                                                \
                    }                                                                                    \
                    for (int r = 0; r < rn; r++)                                                         \
                        for (int b = 0; b < jn; b++) s[(r0 + r) * S8 + j + b] = hsum(acc[r][b]) * scale; \
                }                                                                                        \
            }                                                                                            \
            float* og = out + (i * H + g * rep) * D; /* [rep, D]: sums over the keys so far, then the output */ \
            for (int64_t r = 0; r < rep; r++) {                                                          \
                float* sr = s + r * S8;                                                                  \
                float mx = -INFINITY;                                                                    \
                for (int64_t j = 0; j < S; j++) mx = sr[j] > mx ? sr[j] : mx;                            \
                for (int64_t j = S; j < S8; j++) sr[j] = -INFINITY;                                      \
                __m256 lanes = _mm256_setzero_ps();                                                      \
                for (int64_t j = 0; j < S8; j += 8) {                                                    \
                    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sr + j), _mm256_set1_ps(mx))); \
                    _mm256_storeu_ps(sr + j, e);                                                         \
                    lanes = _mm256_add_ps(lanes, e);                                                     \
                }                                                                                        \
                sum[r] = hsum(lanes);                                                                    \
                for (int64_t d = 0; d < D; d++) og[r * D + d] = 0.0f;                                    \
            }                                                                                            \
            for (int64_t jb = 0; jb < S; jb += JBLK) { /* a block of values in L1 for every query */    \
                const int64_t je = S - jb < JBLK ? S : jb + JBLK;                                        \
                for (int64_t r = 0; r < rep; r++)                                                        \
                    for (int64_t d0 = 0; d0 < D; d0 += 64) { /* 8 vectors of the output in registers */  \
                        const int64_t nv = D - d0 < 64 ? (D - d0) / 8 : 8;                               \
                        const float* sr = s + r * S8;                                                    \
                        float* o = og + r * D + d0;                                                      \
                        __m256 acc[8];                                                                   \
                        for (int c = 0; c < 8; c++)                                                      \
                            acc[c] = c < nv ? _mm256_loadu_ps(o + 8 * c) : _mm256_setzero_ps();          \
                        for (int64_t j = jb; j < je; j++) {                                              \
                            const __m256 p = _mm256_set1_ps(sr[j]);                                      \
                            const T* vj = vg + key[j] * D + d0;                                          \
                            _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++)                          \
                                if (c < nv) acc[c] = _mm256_fmadd_ps(p, LOAD(vj + 8 * c), acc[c]);       \
                        }                                                                                \
                        for (int c = 0; c < nv; c++) _mm256_storeu_ps(o + 8 * c, acc[c]);                \
                    }                                                                                    \
            }                                                                                            \
            for (int64_t r = 0; r < rep; r++) {                                                          \
                const __m256 total = _mm256_set1_ps(sum[r]);                                             \
                for (int64_t d = 0; d < D; d += 8)                                                       \
                    _mm256_storeu_ps(og + r * D + d, _mm256_div_ps(_mm256_loadu_ps(og + r * D + d), total)); \
            }                                                                                            \
            free(s);                                                                                     \
        }                                                                                                \
        return failed;                                                                                   \
    }
ROW_ATTENTION(row_attention_f32, float, LOAD_F32)
ROW_ATTENTION(row_attention_bf16, uint16_t, LOAD_BF16)
