/* Few-row fp32 products y = x @ w.T, 4 to 32 rows: batched decode of fp32 models.
 *
 * Why: at these rows a decode step's products read the weights once for every row, so they should stream the
 * weights near the read bandwidth; oneDNN's packed fp32 GEMM (what took them before) read SmolLM2-135M's 540 MB at
 * 11-15 GB/s on the 2-core Xeon VM (probe 24 GB/s), and `matvec.c`'s row kernel re-reads x for every weight row.
 *
 * Here the weight is read in place, row-major, 4 rows at a time (`WN`): their vectors along K stay in L1 while
 * every block of 6 x rows (`XM`; 4 for a last block of at most 4) runs past them, 24 fp32 accumulators of
 * 16 lanes each (one per x row and weight row), reduced across lanes at the end. While the first x block runs,
 * the weight rows `PREFETCH_GROUPS` groups ahead are prefetched into L2, one line per 16 k (the hardware
 * prefetcher alone left the stream at ~half the bandwidth). Over SmolLM2-135M's 121 projections (ad hoc ctypes
 * pass, median of 7, ms, against oneDNN's packs through their Python op): 4 rows 23.8-24.9 vs 35.5, 8 rows
 * 27.1-31.4 vs 38.0, 16 rows 40.8-42.0 vs 49.3, 32 rows 59.3-61.9 vs 62.8.
 *
 * Exact up to summation order: fp32 products and sums (16 partial sums per output, then added across lanes), so
 * results agree with other fp32 paths to rounding, not bit for bit. Every output is computed by one thread, so
 * the thread count does not change the bits.
 *
 * Interface: as matvec.c's entries (x [M, K], `count` weights [ns[g], K], y [M, sum ns], a thread count); it is
 * called from matvec.c's fp32 entry for M >= GEMM_F32_MIN_ROWS. Returns 0, or -1 without touching y when its
 * buffer cannot be allocated (the caller then runs the row kernel).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define TARGET_F32 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define INLINE static inline __attribute__((always_inline))
#define WN 4              /* weight rows per group, their K-vectors reused from L1 by every x block */
#define XM 6              /* x rows per block: 24 accumulators (8 rows' 32 spill: 16 rows 50 vs 42 ms) */
#define PREFETCH_GROUPS 2 /* prefetch the weight rows this many groups ahead (1: 5-10% slower at 8 rows) */

/* y[r, i] = sum_k x[r, k] w[i, k] for r < mr (of ROWS_ rows, the rest zero in x), i < nr (of WN rows, the rest
 * readable); `next` the weight rows to prefetch, or NULL */
#define DEFINE_BLOCK(NAME, ROWS_)                                                                                 \
    INLINE TARGET_F32 void NAME(const float *x, long mr, long K, const float *w, long nr, float *y, long ldy,  \
                                const float *next) {                                                          \
        __m512 acc[ROWS_][WN];                                                                                \
        for (int r = 0; r < ROWS_; r++)                                                                       \
            for (int i = 0; i < WN; i++) acc[r][i] = _mm512_setzero_ps();                                     \
        long k = 0;                                                                                           \
        for (; k + 16 <= K; k += 16) { /* unmasked loads in the loop: a masked one cannot fold into the FMA */ \
            __m512 wv[WN];                                                                                    \
            for (int i = 0; i < WN; i++) {                                                                    \
                if (next != NULL)                                                                             \
                    _mm_prefetch((const char *)(next + i * K + k), _MM_HINT_T1);                              \
                wv[i] = _mm512_loadu_ps(w + i * K + k);                                                       \
            }                                                                                                 \
            for (int r = 0; r < ROWS_; r++) {                                                                 \
                __m512 xv = _mm512_loadu_ps(x + r * K + k);                                                   \
                for (int i = 0; i < WN; i++) acc[r][i] = _mm512_fmadd_ps(xv, wv[i], acc[r][i]);               \
            }                                                                                                 \
        }                                                                                                     \
        if (k < K) {                                                                                          \
            __mmask16 m = (__mmask16)((1u << (K - k)) - 1);                                                   \
            for (int i = 0; i < WN; i++) {                                                                    \
                __m512 wv = _mm512_maskz_loadu_ps(m, w + i * K + k);                                          \
                for (int r = 0; r < ROWS_; r++)                                                               \
                    acc[r][i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + r * K + k), wv, acc[r][i]);      \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < ROWS_; r++)                                                                       \
            if (r < mr)                                                                                       \
                for (int i = 0; i < WN; i++)                                                                  \
                    if (i < nr)                                                                               \
                        y[r * ldy + i] = _mm512_reduce_add_ps(acc[r][i]);                                     \
    }

DEFINE_BLOCK(block6, XM)
DEFINE_BLOCK(block4, 4)

TARGET_F32 int astrai_gemm_f32(const float *x, long M, long K, const float *const *ws, const long *ns, long count,
                               float *y, int threads) {
    long ldy = 0;
    for (long g = 0; g < count; g++) ldy += ns[g];
    if (M <= 0 || K <= 0 || ldy <= 0)
        return 0;
    long padded = (M + XM - 1) / XM * XM; /* x with zero rows up to a whole block: blocks read every row */
    size_t tail_bytes = (sizeof(float) * WN * K + 63) / 64 * 64;
    threads = threads < 1 ? 1 : threads;
    float *xp = aligned_alloc(64, (sizeof(float) * padded * K + 63) / 64 * 64);
    float *tails = aligned_alloc(64, tail_bytes * threads);
    if (xp == NULL || tails == NULL) {
        free(xp);
        free(tails);
        return -1;
    }
    memcpy(xp, x, sizeof(float) * M * K);
    memset(xp + M * K, 0, sizeof(float) * (padded - M) * K);
#pragma omp parallel num_threads(threads)
    {
        float *tail = tails + omp_get_thread_num() * (tail_bytes / sizeof(float));
        long offset = 0;
        for (long g = 0; g < count; g++) {
            long N = ns[g], groups = (N + WN - 1) / WN;
#pragma omp for schedule(static) nowait
            for (long q = 0; q < groups; q++) {
                long n0 = q * WN, nr = N - n0 < WN ? N - n0 : WN;
                const float *w = ws[g] + n0 * K;
                if (nr < WN) { /* the weight's last rows: a zero-padded copy, so the blocks read WN rows */
                    memcpy(tail, w, sizeof(float) * nr * K);
                    memset(tail + nr * K, 0, sizeof(float) * (WN - nr) * K);
                    w = tail;
                }
                const float *next = q + PREFETCH_GROUPS < groups - 1 ? ws[g] + (n0 + PREFETCH_GROUPS * WN) * K : NULL;
                for (long m0 = 0; m0 < M; m0 += XM) {
                    float *out = y + m0 * ldy + offset + n0;
                    if (M - m0 <= 4)
                        block4(xp + m0 * K, M - m0, K, w, nr, out, ldy, m0 == 0 ? next : NULL);
                    else
                        block6(xp + m0 * K, M - m0, K, w, nr, out, ldy, m0 == 0 ? next : NULL);
                }
            }
            offset += N;
        }
    }
    free(xp);
    free(tails);
    return 0;
}
