/* quant_gemm_q8.c's repacked K-quant bodies (Q4_K, Q6_K) and every type's column loop, written once over W, the
   weight rows one vector holds; quant_gemm_q8.c includes it with W 8 (256-bit vectors, one group of 8 rows: the
   x8_ functions, v8_ operations) and, with AVX512-VNNI, W 16 (512-bit vectors over the pair of groups that
   quant_q8._pair_groups interleaves block by block: x16_, v16_). Every lane does what the other width does for
   its column, in the same order: the same bits. No include guard: it is instantiated twice. */
#ifndef CAT
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#endif
#define OP(name) CAT(CAT(v, W), _##name) /* this width's vector operation */
#define XW(name) CAT(CAT(x, W), _##name) /* this width's function */

/* Q4_K: per 32-element sub-block the codes' dot with the input (lo: low nibbles, hi: high ones) times its 6-bit
   scale, summed in int32 (S); the mins times the input's 32-sums (M); then the float step. */
AI void XW(q4_k_block)(const uint8_t* g, int64_t stride, const int8_t* const* a, const float* da,
                       const int16_t* const* sums, OP(f)* acc, const int nr) {
    const OP(f) dw = OP(half_ph)(g, stride), dm = OP(half_ph)(g + 16, stride);
    const uint8_t* qs = g + 160;
    const OP(i) low = OP(set1_8)(15);
    OP(i) S[XB];
    for (int r = 0; r < nr; r++) S[r] = OP(zero)();
    for (int c = 0; c < 4; c++) {
        OP(i) lo[XB], hi[XB];
        for (int r = 0; r < nr; r++) lo[r] = hi[r] = OP(zero)();
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const OP(i) v = OP(load)(qs + 32 * (8 * c + t), stride);
            const OP(i) vl = OP(and)(v, low), vh = OP(and)(OP(srli16)(v, 4), low);
            for (int r = 0; r < nr; r++) { /* without VNNI each pair <= 2 * 15 * 127: 8 of them fit int16 */
                lo[r] = OP(dot)(lo[r], vl, a[r] + 64 * c + 4 * t);
                hi[r] = OP(dot)(hi[r], vh, a[r] + 64 * c + 32 + 4 * t);
            }
        }
        const OP(i) sc = OP(half_u8)(g + 32 + 16 * c, stride);
        for (int r = 0; r < nr; r++)
            S[r] = OP(add32)(S[r], OP(add32)(OP(scaled)(lo[r], sc, 0), OP(scaled)(hi[r], sc, 1)));
    }
    for (int r = 0; r < nr; r++) {
        OP(i) M = OP(zero)();
        for (int u = 0; u < 4; u++) {
            const int16_t* s = sums[r] + 4 * u; /* sub-block j's sum: the 16-sums 2j and 2j + 1 */
            const OP(i) m = OP(half_u8)(g + 96 + 16 * u, stride);
            M = OP(add32)(M, OP(madd16)(m, OP(pair)((int16_t)(s[0] + s[1]), (int16_t)(s[2] + s[3]))));
        }
        const OP(f) d = OP(set1f)(da[r]);
        const OP(f) v = OP(addf)(acc[r], OP(mulf)(OP(mulf)(dw, d), OP(cvtf)(S[r])));
        acc[r] = OP(subf)(v, OP(mulf)(OP(mulf)(dm, d), OP(cvtf)(M)));
    }
}

/* Q6_K: the 6-bit codes (4 low bits from ql, 2 high from qh) dotted with the input Q6_RUN chunks at a time, times
   the sub-block's signed scale, in int32; the codes' offset of 32 taken off once, through the input's 16-sums. */
AI void XW(q6_k_block)(const uint8_t* g, int64_t stride, const int8_t* const* a, const float* da,
                       const int16_t* const* sums, OP(f)* acc, const int nr) {
    const OP(f) dw = OP(half_ph)(g, stride);
    const uint8_t *ql = g + 144, *qhb = g + 144 + 1024;
    const OP(i) low4 = OP(set1_8)(15), low2 = OP(set1_8)(3);
    OP(i) S[XB];
    for (int r = 0; r < nr; r++) S[r] = OP(zero)();
    for (int h = 0; h < 2; h++)
        for (int q = 0; q < 2; q++)
#pragma GCC unroll 4
            for (int t = 0; t < 8; t += Q6_RUN) {
                OP(i) lo[XB], hi[XB];
                for (int r = 0; r < nr; r++) lo[r] = hi[r] = OP(zero)();
#pragma GCC unroll 4
                for (int tt = t; tt < t + Q6_RUN; tt++) { /* int16: two pairs <= 2 * 63 * 127 each fit */
                    const OP(i) v = OP(load)(ql + 32 * (16 * h + 8 * q + tt), stride);
                    const OP(i) qh = OP(load)(qhb + 32 * (8 * h + tt), stride);
                    const OP(i) vl = OP(or)(OP(and)(v, low4), OP(slli16)(OP(and)(OP(srli16)(qh, 2 * q), low2), 4));
                    const OP(i) vh = OP(or)(OP(and)(OP(srli16)(v, 4), low4), OP(slli16)(OP(and)(OP(srli16)(qh, 2 * q + 4), low2), 4));
                    for (int r = 0; r < nr; r++) {
                        lo[r] = OP(dot)(lo[r], vl, a[r] + 128 * h + 32 * q + 4 * tt);
                        hi[r] = OP(dot)(hi[r], vh, a[r] + 128 * h + 64 + 32 * q + 4 * tt);
                    }
                }
                const int s = 8 * h + 2 * q + (t >= 4); /* the low nibbles' sub-block; the high ones' is s + 4 */
                const OP(i) pl = OP(half_i8)(g + 16 + 16 * (s / 2), stride);
                const OP(i) ph = OP(half_i8)(g + 16 + 16 * (s / 2 + 2), stride);
                for (int r = 0; r < nr; r++)
                    S[r] = OP(add32)(S[r], OP(add32)(OP(scaled)(lo[r], pl, s % 2), OP(scaled)(hi[r], ph, s % 2)));
            }
    for (int r = 0; r < nr; r++) {
        OP(i) C = OP(zero)();
        for (int u = 0; u < 8; u++) {
            const OP(i) p = OP(half_i8)(g + 16 + 16 * u, stride);
            C = OP(add32)(C, OP(madd16)(p, OP(pair)(sums[r][2 * u], sums[r][2 * u + 1])));
        }
        const OP(i) Sq = OP(sub32)(S[r], OP(slli32)(C, 5)); /* codes q6 - 32 */
        acc[r] = OP(addf)(acc[r], OP(mulf)(OP(mulf)(dw, OP(set1f)(da[r])), OP(cvtf)(Sq)));
    }
}

/* W columns from j (group G = j / 8; W = 16: G and G + 1) for nr input rows from r0, block after block; then each
   type's loop over its columns, RB input rows at a time, each remainder its own specialisation (accumulators in
   registers). x16: an odd last group goes through x8. */
#define XCOLS(T, BYTES, B, SB, RB)                                                                                  \
    AI void XW(T##_rows)(const int8_t* xq, const float* xd, const int16_t* xs, const uint8_t* w, float* y,       \
                         int64_t r0, int nr, int64_t K, int64_t N, int64_t j) {                                  \
        const int64_t nb = K / B, G = j / 8, step = (G | 1) < N / 8 ? 2 * BYTES : BYTES; /* paired: interleaved */ \
        const uint8_t* g = w + (G / 2) * 2 * nb * BYTES + (G % 2) * BYTES;                                      \
        OP(f) acc[XB];                                                                                           \
        for (int r = 0; r < nr; r++) acc[r] = OP(zerof)();                                                       \
        for (int64_t b = 0; b < nb; b++) {                                                                       \
            const int8_t* a[XB];                                                                                 \
            const int16_t* s[XB];                                                                                \
            float d[XB];                                                                                         \
            for (int r = 0; r < nr; r++) {                                                                       \
                a[r] = xq + (r0 + r) * K + b * B;                                                                \
                s[r] = xs + ((r0 + r) * nb + b) * SB;                                                            \
                d[r] = xd[(r0 + r) * nb + b];                                                                    \
            }                                                                                                    \
            if (r0 == 0) /* the stream X8_PREFETCH bytes ahead (alone, the hardware prefetcher falls 3x behind) */ \
                for (int l = 0; l < W / 8 * BYTES; l += 64)                                                      \
                    _mm_prefetch((const char*)g + b * step + X8_PREFETCH + l, _MM_HINT_T1);                      \
            XW(T##_block)(g + b * step, BYTES, a, d, s, acc, nr);                                                \
        }                                                                                                        \
        for (int r = 0; r < nr; r++) OP(storef)(y + (r0 + r) * N + j, acc[r]);                                   \
    }                                                                                                            \
    static void XW(cols_##T)(const int8_t* xq, const float* xd, const int16_t* xs, const uint8_t* w, float* y,   \
                             int64_t R, int64_t K, int64_t N, int64_t n0, int64_t n1) {                          \
        int64_t j = n0;                                                                                          \
        for (; j + W <= n1; j += W) {                                                                            \
            int64_t r = 0;                                                                                       \
            for (; r + RB <= R; r += RB) XW(T##_rows)(xq, xd, xs, w, y, r, RB, K, N, j);                         \
            switch (R - r) {                                                                                     \
                case 7: if (RB > 7) XW(T##_rows)(xq, xd, xs, w, y, r, 7, K, N, j); break;                        \
                case 6: if (RB > 6) XW(T##_rows)(xq, xd, xs, w, y, r, 6, K, N, j); break;                        \
                case 5: if (RB > 5) XW(T##_rows)(xq, xd, xs, w, y, r, 5, K, N, j); break;                        \
                case 4: if (RB > 4) XW(T##_rows)(xq, xd, xs, w, y, r, 4, K, N, j); break;                        \
                case 3: if (RB > 3) XW(T##_rows)(xq, xd, xs, w, y, r, 3, K, N, j); break;                        \
                case 2: if (RB > 2) XW(T##_rows)(xq, xd, xs, w, y, r, 2, K, N, j); break;                        \
                case 1: XW(T##_rows)(xq, xd, xs, w, y, r, 1, K, N, j); break;                                    \
            }                                                                                                    \
        }                                                                                                        \
        if (W > 8 && j < n1) x8_cols_##T(xq, xd, xs, w, y, R, K, N, j, n1);                                      \
    }
XCOLS(q4_k, X8_Q4_K, QK, 16, 4)
XCOLS(q6_k, X8_Q6_K, QK, 16, Q6_RB)
#if W == 8 /* the 32-blocks: 256-bit bodies only (quant_gemm_q8.c) */
XCOLS(q8_0, X8_Q8_0, 32, 1, 4)
XCOLS(q5_0, X8_Q5_0, 32, 1, 4)
#endif
#undef XCOLS
#undef XW
#undef OP
