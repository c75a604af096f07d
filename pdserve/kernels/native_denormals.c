/* Denormals flushed on every thread of the caller's OpenMP pool, for torch code in between: the
 * Mamba2 chunked scan (kernels/mamba2.py) is torch's ops, and its decays e^(cum_i - cum_j) over a
 * chunk put whole blocks of values below float32's normal range (1.2e-38), where each operation
 * takes a microcode assist. A region of the same size from the same thread runs on the same pool
 * threads, so the mode set here holds for torch's parallel ops until pd_denormals_restore_threads.
 * Built into the same library as native_gemv.c. */
#include "native_simd.h"

static __thread unsigned int saved_csr; /* each pool thread's mode before the flush */

void pd_denormals_flush_threads(int threads) {
#pragma omp parallel num_threads(threads)
    saved_csr = pd_denormals_flush();
}

void pd_denormals_restore_threads(int threads) {
#pragma omp parallel num_threads(threads)
    pd_denormals_restore(saved_csr);
}
