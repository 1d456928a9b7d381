/* rsd_runtime.small_gemm's bfloat16 kernel on AMX (Intel Xeon since Sapphire Rapids): the tile unit
   multiplies 16 weight rows x 32 k by 32 k x up to 16 input rows in one instruction (tdpbf16ps), so 16 rows
   cost the multiply time of one and every row count streams the weight at the memory's pace. The product is
   taken transposed, y^T [N, R] = w [N, K] . x^T: the weight is the tile's left operand, loaded as it lies
   (16 rows, stride K), and the input rows are packed once a call as pairs of k (the layout the right operand
   wants). Each output element is one tile lane, summed over k in a fixed order, so a row's value does not
   depend on the rows or threads sharing its call; it is rounded to bf16 to nearest even, as the AVX-512 kernel
   does. Output columns past the last multiple of 16 take the AVX-512 code (the same columns every call). */
#include "small_gemm_bf16.h"
#include "thread_buffer.h"
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
