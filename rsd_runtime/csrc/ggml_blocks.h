/* What the quantised kernels share about GGML's block formats (ggml-common.h). */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

enum { Q8_0 = 8, Q5_0 = 6, Q4_K = 12, Q6_K = 14 }; /* GGML type ids */

static inline float f16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The 8 scales and 8 mins of a Q4_K block (6 bits each, packed in 12 bytes as ggml's get_scale_min_k4 reads
   them), unpacked 4 at a time in 32-bit words (ggml's own trick): sc[j] = byte j of out[0..1], m[j] of out[2..3]. */
static inline void q4_k_scales(const uint8_t* s, uint32_t out[4]) {
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    out[0] = u[0] & k1;
    out[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    out[2] = u[1] & k1;
    out[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
}
