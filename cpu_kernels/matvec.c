/* Few-row products y = x @ w.T on AVX-512 CPUs: the matrix-vector work of batch-1..8 decode.
 *
 * Decode on CPU streams every weight once per step, so it runs at memory speed or not at all. Each output row
 * n of y is one dot product of a weight row against each x row; a thread walks its weight rows in order, so it
 * reads the weight as one contiguous stream (the hardware prefetcher's best case), and the few x rows stay in
 * L1. On the 2-core AMD EPYC development box, 60 weights of 1536 x 576 (bf16), one x row: 30-38 GB/s; reading
 * 4-8 weight rows at once, as GEMM micro-kernels do, ran at 15-22 GB/s (docs/benchmarks.md).
 *
 * bf16 multiplies pairs with AVX512-BF16's `vdpbf16ps` (products exact in fp32, fp32 accumulation; the
 * instruction treats subnormal inputs as zero), fp32 with FMA. Threads: OpenMP, through the process's own
 * libgomp (torch's, already loaded), with the count the caller passes (torch.get_num_threads()).
 *
 * int8 weights (weight-only quantization, `astrai.ops.quant`) are widened in registers, 16 at a time, to fp32 for an
 * fp32 x, or to bf16 pairs for `vdpbf16ps` with a bf16 x (exact either way: |w| <= 127). The kernel returns the
 * product with the integer weights; the caller multiplies each column by its weight row's scale. With an fp32 x and
 * 22 rows or more, the int8 entry hands the product to gemm_i8.c's blocked GEMM.
 *
 * Interface (ctypes, astrai.cpu_kernels.matvec): `count` weights w[g] of shape [ns[g], K], all multiplying
 * the same x [M, K] (q/k/v, gate/up in one call); y [M, sum ns] fp32, weight g's columns after weight g-1's.
 * Rows of x, w and y are contiguous; no alignment is assumed.
 */
#include <immintrin.h>
#include <stdint.h>

/* x rows per pass over one weight row (each weight chunk loaded once for them). 2 measured best: at 4 rows, a
 * pass issues 10 loads per 128 weight bytes and M = 4 ran at 20 GB/s (bf16) against 25-33 GB/s in two passes */
#define ROWS 2
/* Each dot product asks for the weight bytes this far ahead of its loads (`_mm_prefetch`, one per 64-byte line). The
 * weight is one stream per thread, but rows end every 0.5-3 KB and the hardware prefetcher alone kept too few
 * lines in flight: over SmolLM2-135M's projections at one row on the 2-core AMX Xeon (ad hoc ctypes pass, median of
 * 9), bf16 19.7-20.0 -> 21.6-21.9 GB/s, fp32 22.2 -> 23.8, int8 weights with an fp32 x 13.9 -> 19.9 (the widening
 * was not the limit: a VNNI version with x quantized per block of 32 read 17.1 without prefetches, 20.4 with); 4096
 * bytes measured no better, and worse for bf16. A prefetch past the end of a weight reads nothing and cannot fault */
#define PREFETCH_BYTES 2048
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PREFETCH_BYTES, _MM_HINT_T0)
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TARGET_F32 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define INLINE static inline __attribute__((always_inline))

int astrai_amx_ready(void); /* amx.c */

/* bit 0: AVX-512 (F, BW, VL) for the fp32 kernel; bit 1: AVX512-BF16 as well, for the bf16 kernel; bit 2: AMX as
 * well (amx.c: bf16 products from AMX_MIN_ROWS rows) */
int astrai_cpu_features(void) {
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl");
    int bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
    return avx512 | bf16 << 1 | (bf16 && astrai_amx_ready()) << 2;
}

/* y[r * ldy] = dot(x[r * K : (r + 1) * K], w[0 : K]) for r < rows; rows is a constant after inlining */
INLINE TARGET_BF16 void dot_bf16(const uint16_t *x, const uint16_t *w, long K, float *y, long ldy, int rows) {
    __m512 even[ROWS], odd[ROWS];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 64 <= K; k += 64) {
        PREFETCH(w + k);
        PREFETCH(w + k + 32);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
        for (int r = 0; r < rows; r++) {
            even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_loadu_si512(x + r * K + k), w0);
            odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_loadu_si512(x + r * K + k + 32), w1);
        }
    }
    for (; k < K; k += 32) { /* tail: masked loads read nothing past the row */
        __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
        __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
        for (int r = 0; r < rows; r++)
            even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * K + k), w0);
    }
    for (int r = 0; r < rows; r++) y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

INLINE TARGET_F32 void dot_f32(const float *x, const float *w, long K, float *y, long ldy, int rows) {
    __m512 even[ROWS], odd[ROWS];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        PREFETCH(w + k);
        PREFETCH(w + k + 16);
        __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k + 16);
        for (int r = 0; r < rows; r++) {
            even[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), w0, even[r]);
            odd[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k + 16), w1, odd[r]);
        }
    }
    for (; k < K; k += 16) {
        __mmask16 mask = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        __m512 w0 = _mm512_maskz_loadu_ps(mask, w + k);
        for (int r = 0; r < rows; r++)
            even[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + r * K + k), w0, even[r]);
    }
    for (int r = 0; r < rows; r++) y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

/* 16 int8 weights widened to fp32 (masked-off lanes read nothing and give 0) */
INLINE TARGET_F32 __m512 widen16_i8(const int8_t *w, __mmask16 mask) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w)));
}

/* 32 int8 weights as bf16 (exact for |w| <= 256), in memory order: lane j of the result is w[j] */
INLINE TARGET_BF16 __m512bh widen32_i8_bf16(const int8_t *w, __mmask32 mask) {
    __m256i bytes = _mm256_maskz_loadu_epi8(mask, w);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

INLINE TARGET_F32 void dot_i8_f32(const float *x, const int8_t *w, long K, float *y, long ldy, int rows) {
    __m512 even[ROWS], odd[ROWS];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        if ((k & 63) == 0) /* one line per two passes */
            PREFETCH(w + k);
        __m512 w0 = widen16_i8(w + k, 0xffff), w1 = widen16_i8(w + k + 16, 0xffff);
        for (int r = 0; r < rows; r++) {
            even[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), w0, even[r]);
            odd[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k + 16), w1, odd[r]);
        }
    }
    for (; k < K; k += 16) {
        __mmask16 mask = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        __m512 w0 = widen16_i8(w + k, mask);
        for (int r = 0; r < rows; r++)
            even[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + r * K + k), w0, even[r]);
    }
    for (int r = 0; r < rows; r++) y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

INLINE TARGET_BF16 void dot_i8_bf16(const uint16_t *x, const int8_t *w, long K, float *y, long ldy, int rows) {
    __m512 even[ROWS], odd[ROWS];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 64 <= K; k += 64) {
        PREFETCH(w + k);
        __m512bh w0 = widen32_i8_bf16(w + k, 0xffffffffu), w1 = widen32_i8_bf16(w + k + 32, 0xffffffffu);
        for (int r = 0; r < rows; r++) {
            even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_loadu_si512(x + r * K + k), w0);
            odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_loadu_si512(x + r * K + k + 32), w1);
        }
    }
    for (; k < K; k += 32) {
        __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
        __m512bh w0 = widen32_i8_bf16(w + k, mask);
        for (int r = 0; r < rows; r++)
            even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * K + k), w0);
    }
    for (int r = 0; r < rows; r++) y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

/* one weight row against all M x rows, ROWS at a time (each block size gets its own unrolled copy) */
#define ROW_AGAINST_X(DOT, x, w, M, K, y, ldy)                                                     \
    for (long m = 0; m < (M); m += ROWS) {                                                           \
        switch ((M) - m >= ROWS ? ROWS : (int)((M) - m)) {                                         \
        case 2: DOT((x) + m * (K), w, K, (y) + m * (ldy), ldy, 2); break;                            \
        default: DOT((x) + m * (K), w, K, (y) + m * (ldy), ldy, 1); break;                           \
        }                                                                                            \
    }

/* an exported entry: each weight's rows split evenly across the threads, each thread's share read in order */
#define DEFINE_MATVEC(NAME, TARGET, TX, TW, DOT)                                                             \
    TARGET void NAME(const TX *x, long M, long K, const TW *const *ws, const long *ns, long count, float *y,  \
                     int threads) {                                                                           \
        long ldy = 0;                                                                                         \
        for (long g = 0; g < count; g++) ldy += ns[g];                                                        \
        _Pragma("omp parallel num_threads(threads)") {                                                        \
            long offset = 0;                                                                                  \
            for (long g = 0; g < count; g++) {                                                                \
                const TW *w = ws[g];                                                                          \
                _Pragma("omp for schedule(static) nowait")                                                    \
                for (long n = 0; n < ns[g]; n++) ROW_AGAINST_X(DOT, x, w + n * K, M, K, y + offset + n, ldy)  \
                offset += ns[g];                                                                              \
            }                                                                                                 \
        }                                                                                                     \
    }

DEFINE_MATVEC(astrai_matvec_bf16_rows, TARGET_BF16, uint16_t, uint16_t, dot_bf16)
DEFINE_MATVEC(astrai_matvec_f32_rows, TARGET_F32, float, float, dot_f32)
DEFINE_MATVEC(astrai_matvec_i8_bf16, TARGET_BF16, uint16_t, int8_t, dot_i8_bf16)
static DEFINE_MATVEC(matvec_i8_f32_rows, TARGET_F32, float, int8_t, dot_i8_f32)

/* int8 weights with an fp32 x: from GEMM_MIN_ROWS rows, gemm_i8.c's blocked GEMM (each panel of weight rows widened
 * once for every x row). Measured over SmolLM2-135M's projections on the 2-core box, ms per pass, this kernel
 * against the GEMM: 16 rows 18.2 vs 20.1, 19 rows 22.1 vs 28.0, 21 rows 25.3 vs 28.2, 22 rows 37.4 vs 28.3, 32 rows
 * 58.5 vs 31.0. The GEMM returns -1 when it cannot allocate its buffers, and this kernel runs instead.
 *
 * The GEMM works in vectors of 16 rows, so a last vector of a few rows costs as much as a full one: from 32 rows up,
 * the last M % 16 rows go through this kernel when there are at most TAIL_ROWS of them. Measured the same way, GEMM
 * alone against GEMM + tail: 33 rows 34.9 vs 28.7, 36 rows 35.0 vs 30.3, 38 rows 35.7 vs 31.6, 40 rows 35.6 vs 34.2,
 * 49 rows 42.2 vs 38.0. */
#define GEMM_MIN_ROWS 22
#define TAIL_ROWS 8
int astrai_gemm_i8_f32(const float *x, long M, long K, const int8_t *const *ws, const long *ns, long count, float *y,
                       int threads);

void astrai_matvec_i8_f32(const float *x, long M, long K, const int8_t *const *ws, const long *ns, long count,
                          float *y, int threads) {
    long ldy = 0, tail = M % 16 <= TAIL_ROWS && M - M % 16 >= 32 ? M % 16 : 0;
    for (long g = 0; g < count; g++) ldy += ns[g];
    if (M < GEMM_MIN_ROWS || astrai_gemm_i8_f32(x, M - tail, K, ws, ns, count, y, threads) != 0)
        matvec_i8_f32_rows(x, M, K, ws, ns, count, y, threads);
    else if (tail)
        matvec_i8_f32_rows(x + (M - tail) * K, tail, K, ws, ns, count, y + (M - tail) * ldy, threads);
}

/* bf16 from AMX_MIN_ROWS rows, on CPUs with AMX: amx.c's tile kernel (it returns -1 without AMX, for an odd K or
 * without its buffers, and the row kernel runs instead). Over SmolLM2-135M's 121 projections on the 2-core AMX Xeon
 * (ad hoc ctypes pass, median of 5, ms), row kernel against tiles: 2 rows 16.6 / 15.9 vs 14.5 / 13.5, 3 rows 17.8 /
 * 17.5 vs 14.1 / 13.6, 8 rows 22.0-24.3 vs 14.6-16.9, 16 rows 34.1-36.2 vs 15.5-16.5; one row 13.5 vs 13.6. */
#define AMX_MIN_ROWS 2
int astrai_amx_bf16(const uint16_t *x, long M, long K, const uint16_t *const *ws, const long *ns, long count, float *y,
                    int threads);

void astrai_matvec_bf16(const uint16_t *x, long M, long K, const uint16_t *const *ws, const long *ns, long count,
                        float *y, int threads) {
    if (M < AMX_MIN_ROWS || astrai_amx_bf16(x, M, K, ws, ns, count, y, threads) != 0)
        astrai_matvec_bf16_rows(x, M, K, ws, ns, count, y, threads);
}

/* fp32 from GEMM_F32_MIN_ROWS rows: gemm_f32.c's blocked kernel (weight rows in L1 against blocks of x rows); it
 * returns -1 without its buffers, and the row kernel runs instead. Over SmolLM2-135M's 121 projections on the 2-core
 * Xeon (ad hoc ctypes pass, median of 7, ms), row kernel against the blocked one: see gemm_f32.c and
 * docs/kernels.md, "CPU fp32 batched products". */
#define GEMM_F32_MIN_ROWS 3
int astrai_gemm_f32(const float *x, long M, long K, const float *const *ws, const long *ns, long count, float *y,
                    int threads);

void astrai_matvec_f32(const float *x, long M, long K, const float *const *ws, const long *ns, long count, float *y,
                       int threads) {
    if (M < GEMM_F32_MIN_ROWS || astrai_gemm_f32(x, M, K, ws, ns, count, y, threads) != 0)
        astrai_matvec_f32_rows(x, M, K, ws, ns, count, y, threads);
}
