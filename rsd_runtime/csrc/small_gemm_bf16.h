/* bfloat16 operands for the AVX-512 tiling (AVX512-BF16): vdpbf16ps multiplies 32 bf16 pairs into 16
   float32 lanes; each output is summed in float32 and rounded to bf16 to nearest even, as torch does. Shared
   by the AVX512-BF16 kernel and the AMX one (which computes the columns past its tiles with it). */
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
#include "small_gemm_tiles.h"
