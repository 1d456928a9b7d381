/* rsd_runtime.small_gemm's bfloat16 kernel for AVX512-BF16: the shared AVX-512 tiling over bf16 operands.
   See small_gemm.py. */
#include "small_gemm_bf16.h"
#include "small_gemm_threads.h"
