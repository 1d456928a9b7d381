/* The entry point of a small_gemm kernel (included last by each .c that defines small_gemm()): the output
   columns split over threads of the caller's OpenMP team. The library links libgomp.so.1, which the loader
   finds already loaded by torch: the same workers as torch's own ops, so no second team spins beside them
   (a Python thread pool beside torch's idle, spinning workers made two threads slower than one). */
#include <omp.h>
int small_gemm_threads(const void* x, const void* w, void* y, int64_t R, int64_t K, int64_t N, int64_t threads) {
    if (threads <= 1) {
        small_gemm(x, w, y, R, K, N, 0, N);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t n0 = (N * t / nt) & ~3, n1 = t + 1 == nt ? N : (N * (t + 1) / nt) & ~3; /* even starts */
        small_gemm(x, w, y, R, K, N, n0, n1);
    }
    return 0;
}
