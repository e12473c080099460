/* Many-row products y = x @ w.T with int8 weights: the prefill and mixed steps of int8 models, fp32 x.
 *
 * Why: `matvec.c` walks each weight row once per two x rows, so past ~16 rows it reloads x for every weight row and
 * turns compute-bound on loads; the other way, widening every int8 weight to fp32 in memory for a GEMM, writes and
 * re-reads 4 bytes per weight per call: an int8 model's prefill ran 2x slower than the fp32 model's
 * (docs/benchmarks.md, "CPU int8 prefill").
 *
 * Here each thread widens a panel of its own weight rows to fp32 in a buffer that stays in L2 (`PANEL_BYTES`), then
 * multiplies the panel against every row of x with a register-blocked micro-kernel: `TILE_N` (12) weight rows by 32
 * x rows, 24 fp32 accumulators along the x rows, one `vfmadd231ps` per weight and 16 rows with the weight broadcast
 * from the panel, x read from a copy packed as [K][32] per block of 32 rows (zeros past M). The accumulators hold
 * columns of y; they go out with a scatter store once per tile, masked to the rows that exist. Over SmolLM2-135M's
 * projections on the 2-core box: 35.5 ms at 32 rows against 93.0 widening for MKL, 1685 against 2784 at 2048
 * (`benchmarks/bench_packed_linear.py --int8`).
 *
 * bf16 x has no such kernel: oneDNN's bf16 GEMM on the widened weight measured as fast or faster than a `vdpbf16ps`
 * version of this one at 16-512 rows (512 rows: 181 vs 278 ms over the same projections).
 *
 * Exact in the same sense as the matvec kernel: the widened weights are the integers themselves, products and sums
 * are fp32, and the result is the product with the integer weights (the caller applies each row's scale). The
 * summation order differs from other paths, so results agree to fp32 rounding, not bit for bit.
 *
 * Interface: as matvec.c's entries (x [M, K], `count` weights [ns[g], K] int8, y [M, sum ns] fp32, a thread
 * count), which calls this past its row bound; returns 0, or -1 without touching y when the buffers cannot be
 * allocated or y is too wide for 32-bit scatter offsets (the caller then runs the matvec kernel).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TARGET_F32 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define INLINE static inline __attribute__((always_inline))
#define TILE_N 12              /* weight rows per micro-kernel tile, one broadcast each per k (8: 3-10% slower) */
#define BLOCK_M 32             /* x rows per packed block: two vectors of 16 */
#define PANEL_BYTES (96 << 10) /* widened weight rows a thread keeps at once (L2 is 512 KB-2 MB on AVX-512 CPUs) */

/* rows [m0, m0 + rows) of x, transposed to [K][BLOCK_M] with zeros in the missing rows */
static void pack_block(const float *x, long K, long m0, long rows, float *out) {
    if (rows < BLOCK_M)
        memset(out, 0, sizeof(float) * K * BLOCK_M);
    for (long j = 0; j < rows; j++)
        for (long k = 0; k < K; k++) out[k * BLOCK_M + j] = x[(m0 + j) * K + k];
}

/* `rows` int8 weight rows -> fp32, rows `rows`..`padded` zero */
TARGET_F32 static void widen_rows(const int8_t *w, long rows, long padded, long K, float *out) {
    for (long r = 0; r < rows; r++)
        for (long k = 0; k < K; k += 16) {
            __mmask16 mask = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
            __m512i wide = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + r * K + k));
            _mm512_mask_storeu_ps(out + r * K + k, mask, _mm512_cvtepi32_ps(wide));
        }
    memset(out + rows * K, 0, sizeof(float) * (padded - rows) * K);
}

/* y[m, i] = sum_k xp[k][m] * wp[i * K + k] for m < m_rows (<= 16 * vectors), i < n_rows (<= TILE_N); `vectors`
 * (1 or 2) is a constant after inlining. acc[i][v] holds y[16 v + lane, i]: it goes out as a masked scatter. */
INLINE TARGET_F32 void tile(const float *xp, const float *wp, long K, float *y, long ldy, long m_rows, long n_rows,
                            int vectors) {
    __m512 acc[TILE_N][2];
    for (int i = 0; i < TILE_N; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (long k = 0; k < K; k++) {
        __m512 a0 = _mm512_load_ps(xp + k * BLOCK_M);
        __m512 a1 = vectors == 2 ? _mm512_load_ps(xp + k * BLOCK_M + 16) : a0;
        for (int i = 0; i < TILE_N; i++) {
            __m512 b = _mm512_set1_ps(wp[i * K + k]);
            acc[i][0] = _mm512_fmadd_ps(a0, b, acc[i][0]);
            if (vectors == 2)
                acc[i][1] = _mm512_fmadd_ps(a1, b, acc[i][1]);
        }
    }
    __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)ldy));
    for (int v = 0; v < vectors; v++) {
        long valid = m_rows - 16 * v;
        __mmask16 mask = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
        for (long i = 0; i < n_rows; i++)
            _mm512_mask_i32scatter_ps(y + 16 * v * ldy + i, mask, offsets, acc[i][v], 4);
    }
}

TARGET_F32 int astrai_gemm_i8_f32(const float *x, long M, long K, const int8_t *const *ws, const long *ns, long count,
                                  float *y, int threads) {
    long ldy = 0;
    for (long g = 0; g < count; g++) ldy += ns[g];
    if (M <= 0 || K <= 0 || ldy <= 0)
        return 0;
    if (ldy > INT32_MAX / 16) /* the scatter's offsets are 32-bit: 15 rows of y must fit */
        return -1;
    long blocks = (M + BLOCK_M - 1) / BLOCK_M;
    long panel_rows = PANEL_BYTES / (K * (long)sizeof(float)) / TILE_N * TILE_N;
    panel_rows = panel_rows < TILE_N ? TILE_N : panel_rows;
    size_t panel_bytes = (sizeof(float) * panel_rows * K + 63) / 64 * 64; /* each thread's panel on its own lines */
    threads = threads < 1 ? 1 : threads;
    float *packed = aligned_alloc(64, sizeof(float) * blocks * K * BLOCK_M);
    float *panels = aligned_alloc(64, panel_bytes * threads);
    if (packed == NULL || panels == NULL) {
        free(packed);
        free(panels);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long b = 0; b < blocks; b++) {
            long rows = M - b * BLOCK_M < BLOCK_M ? M - b * BLOCK_M : BLOCK_M;
            pack_block(x, K, b * BLOCK_M, rows, packed + b * K * BLOCK_M);
        }
        /* the barrier above: every block is packed. Each thread takes an even share of each weight's tiles. */
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *panel = panels + t * (panel_bytes / sizeof(float));
        long offset = 0;
        for (long g = 0; g < count; g++) {
            long N = ns[g], tiles = (N + TILE_N - 1) / TILE_N;
            long first = tiles * t / nt * TILE_N, last = tiles * (t + 1) / nt * TILE_N;
            last = last < N ? last : N;
            for (long n0 = first; n0 < last; n0 += panel_rows) {
                long rows = last - n0 < panel_rows ? last - n0 : panel_rows;
                widen_rows(ws[g] + n0 * K, rows, (rows + TILE_N - 1) / TILE_N * TILE_N, K, panel);
                for (long b = 0; b < blocks; b++) {
                    long m_rows = M - b * BLOCK_M < BLOCK_M ? M - b * BLOCK_M : BLOCK_M;
                    const float *xp = packed + b * K * BLOCK_M;
                    float *out = y + b * BLOCK_M * ldy + offset + n0;
                    for (long i = 0; i < rows; i += TILE_N) {
                        long n_rows = rows - i < TILE_N ? rows - i : TILE_N;
                        if (m_rows > 16)
                            tile(xp, panel + i * K, K, out + i, ldy, m_rows, n_rows, 2);
                        else
                            tile(xp, panel + i * K, K, out + i, ldy, m_rows, n_rows, 1);
                    }
                }
            }
            offset += N;
        }
    }
    free(packed);
    free(panels);
    return 0;
}
