/* The tiling the AVX-512 kernels share, written once over these macros (the including file defines them
   first): XT / WT the input and weight element types, STEP elements a vector, ACC the accumulator vector,
   ACC_IN the operand vector, ZERO, LOAD(p) a vector of elements, FMA(acc, x, w) the dot-product step, OUT_T /
   REDUCE(acc) the row sum, and STORE(v) what y holds (YT). Four weight rows at a time against groups of up to
   six input rows: 24 accumulators, 4 weight and 1 input vector in the 32 registers (the loops are unrolled so
   that the accumulators stay there); the weight rows PREFETCH_ROWS ahead are prefetched into L2 (into L1 was
   slower). */
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
