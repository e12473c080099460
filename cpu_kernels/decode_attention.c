/* Paged decode attention on AVX-512 CPUs: one new query token per request over its pages of the KV pool.
 *
 * The plain-torch path (triton_kernels/decode_attention.py, `decode_attention_ref`) gathers every request's pages
 * into a padded fp32 copy of its keys and values, builds a mask and calls SDPA: three passes over the context in
 * fp32 for a product that needs one pass over the cache in its own dtype. At 1024 tokens of context it took
 * 0.3-0.4 ms a layer compiled (bf16, one request) on the 2-core development box, about what the layer's weights
 * take to stream; this kernel took ~0.1 ms (docs/benchmarks.md, "CPU decode attention kernel"). It reads
 * each key and value row once, where it lies in the pool, in the cache's dtype.
 *
 * Work: one item per (request, split of its context), over all its KV heads: block by block (32 positions), the
 * rows of every head of a position, adjacent in the pool, are read together, and the next block's rows are
 * prefetched, so each thread streams whole pool rows. Per head, flash-attention's online softmax: the scores of
 * the group's query heads (bf16 pairs by `vdpbf16ps`, fp32 by FMA, fp32 accumulation; 16 positions' dot products
 * reduced together), a vectorised exp, then the values accumulated in fp32. Splits (long contexts of fewer than
 * 16 requests) are merged by their log-sum-exp. The split count depends on the shapes only, never on the thread
 * count, so results do not change with `torch.set_num_threads`.
 *
 * Semantics (those of `decode_attention_ref`): request b attends to positions [max(0, len - window), len) with
 * window 0 meaning all; block-table entries are clamped into the pool; a request with len 0 gets zeros; rows past
 * a request's length (or its table's pages) are never read. Layout: q [B, H, D] and out [B, H, D] contiguous, in
 * the cache's dtype; caches [S, Kh, D] with a contiguous last dim and any row / head strides; D a multiple of 16,
 * at most 256; at most 16 query heads per KV head (the Python side checks, and runs the reference otherwise).
 * Returns 0, or 1 when a buffer could not be allocated.
 */
#include <immintrin.h>

#include "simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32      /* positions per online-softmax step: two zmm of scores */
#define SUB 16        /* positions per zmm of scores */
#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_DIM 256
#define MIN_SPLIT 128 /* positions per split at least: a split's fixed cost (its partials, the merge) stays small */
#define MAX_SPLITS 16
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TARGET_F32 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define INLINE static inline __attribute__((always_inline))

/* exp of 16 floats <= 0 (`cephes_exp_ps`, ~1 ulp); lanes outside `keep` come out 0 */
INLINE TARGET_F32 __m512 exp_ps(__m512 x, __mmask16 keep) {
    return _mm512_maskz_mov_ps(keep, cephes_exp_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))));
}

/* 16 values of a row, widened to fp32 */
INLINE TARGET_F32 __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
INLINE TARGET_F32 __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The 16 lane-wise partial products of a dot product (summed by `sum16` for 16 positions at once) */
INLINE TARGET_F32 __m512 partial_f32(const float *q, const float *k, long D) {
    __m512 acc = _mm512_setzero_ps();
    for (long d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
    return acc;
}

INLINE TARGET __m512 partial_bf16(const uint16_t *q, const uint16_t *k, long D) {
    __m512 acc = _mm512_setzero_ps();
    long d = 0;
    for (; d + 32 <= D; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
    if (d < D) /* D % 32 == 16 */
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(0xffff, q + d),
                               (__m512bh)_mm512_maskz_loadu_epi16(0xffff, k + d));
    return acc;
}

/* lane j of the result = the sum of x[j]'s 16 lanes: a transposing reduction, ~3 instructions per vector instead
 * of a horizontal sum each */
INLINE TARGET_F32 __m512 sum16(const __m512 *x) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: x[2i]'s partials in elements 0, 2; x[2i+1]'s in 1, 3 */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: element e holds x[4i + e]'s partial */
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
        b[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    /* add the four 128-bit lanes of each b[i] and put b[i]'s four sums in lane i */
    __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
    __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xdd));
}

/* One block of n <= 32 positions (pool rows `rows`) of one request and KV head, for its `group` query heads (q rows
 * `q`, `D` apart): updates the running max `m`, sum `l` and unnormalised output `acc` [group][D] of the online
 * softmax. T is the cache element type, PARTIAL its dot product's lane partials, LOAD its 16-value widening load.
 * The scores of each head come out as two vectors of 16 positions, with one max, one rescale of the accumulator
 * and one sum per block: these horizontal steps sit on each head's critical path, and a 32-position block halves
 * them (measured 10-14% faster per call than 16 positions in bf16 at 512-2048 tokens, 2-4% in fp32;
 * docs/benchmarks.md). Then for each 16 columns of D each half's values are widened once (in registers) and added
 * into each head's accumulator. */
#define DEFINE_BLOCK(NAME, TGT, T, PARTIAL, LOAD)                                                                 \
    INLINE TGT void NAME(const T *q, long group, long D, const T *k, const T *v, long k_s0, long v_s0,            \
                         const long *rows, long n, float scale, float *m, float *l, float *acc) {                 \
        long n0 = n < SUB ? n : SUB, n1 = n - n0;                                                                 \
        __mmask16 keep0 = (__mmask16)((1u << n0) - 1), keep1 = (__mmask16)((1u << n1) - 1);                      \
        float p[MAX_GROUP][BLOCK];                                                                                \
        for (long g = 0; g < group; g++) {                                                                        \
            __m512 parts[SUB];                                                                                    \
            for (long j = 0; j < SUB; j++)                                                                        \
                parts[j] = j < n0 ? PARTIAL(q + g * D, k + rows[j] * k_s0, D) : _mm512_setzero_ps();              \
            __m512 s0 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep0,                                      \
                                           _mm512_mul_ps(sum16(parts), _mm512_set1_ps(scale)));                   \
            for (long j = 0; j < SUB; j++)                                                                        \
                parts[j] = j < n1 ? PARTIAL(q + g * D, k + rows[SUB + j] * k_s0, D) : _mm512_setzero_ps();        \
            __m512 s1 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep1,                                      \
                                           _mm512_mul_ps(sum16(parts), _mm512_set1_ps(scale)));                   \
            float m_new = fmaxf(m[g], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));                              \
            float alpha = expf(m[g] - m_new);                                                                     \
            __m512 p0 = exp_ps(_mm512_sub_ps(s0, _mm512_set1_ps(m_new)), keep0);                                  \
            __m512 p1 = exp_ps(_mm512_sub_ps(s1, _mm512_set1_ps(m_new)), keep1);                                  \
            _mm512_storeu_ps(p[g], p0);                                                                           \
            _mm512_storeu_ps(p[g] + SUB, p1);                                                                     \
            l[g] = l[g] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));                                    \
            m[g] = m_new;                                                                                         \
            if (alpha != 1.0f)                                                                                    \
                for (long d = 0; d < D; d += 16)                                                                  \
                    _mm512_storeu_ps(acc + g * D + d,                                                             \
                                     _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + d), _mm512_set1_ps(alpha)));     \
        }                                                                                                         \
        for (long d = 0; d < D; d += 16)                                                                          \
            for (long h = 0; h < BLOCK; h += SUB) {                                                               \
                if (h >= n) break;                                                                                \
                __m512 vv[SUB];                                                                                   \
                for (long j = 0; j < SUB; j++)                                                                    \
                    vv[j] = h + j < n ? LOAD(v + rows[h + j] * v_s0 + d) : _mm512_setzero_ps();                   \
                for (long g = 0; g < group; g++) {                                                                \
                    __m512 sum = _mm512_loadu_ps(acc + g * D + d);                                                \
                    for (long j = 0; j < SUB; j++) sum = _mm512_fmadd_ps(_mm512_set1_ps(p[g][h + j]), vv[j], sum); \
                    _mm512_storeu_ps(acc + g * D + d, sum);                                                       \
                }                                                                                                 \
            }                                                                                                     \
    }

DEFINE_BLOCK(block_f32, TARGET_F32, float, partial_f32, load16_f32)
DEFINE_BLOCK(block_bf16, TARGET, uint16_t, partial_bf16, load16_bf16)

/* an output value in the cache's dtype: bf16 rounds to nearest even, as torch's conversion does */
INLINE float store_f32(float x) { return x; }
INLINE uint16_t store_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (isnan(x)) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* pool rows of positions [t0, t0 + n) of one request (table entries clamped into the pool) */
static void pool_rows_of(const int32_t *table, long num_pages, long page_size, long t0, long n, long *rows) {
    for (long j = 0; j < n; j++) {
        long pos = t0 + j, page = table[pos / page_size];
        page = page < 0 ? 0 : page >= num_pages ? num_pages - 1 : page;
        rows[j] = page * page_size + pos % page_size;
    }
}

/* splits per request: only a few requests with long contexts are split (at least MIN_SPLIT positions each) */
static long num_splits(long batch, long max_len) {
    if (batch >= 16) return 1;
    long splits = max_len / MIN_SPLIT;
    return splits < 1 ? 1 : splits > MAX_SPLITS ? MAX_SPLITS : splits;
}

/* Every KV head's block of the enclosing item (it reads the item's q, b, rows, n, m, l, acc), with the head dim DIM
 * a literal where it can be (64, 128): the inlined block then has fixed trip counts, which the compiler unrolls.
 * Measured 6-9% faster per call at 128-2048 tokens (bf16 and fp32, D 64, 9 over 3 heads), bit-identical
 * (docs/benchmarks.md). */
#define FOR_HEADS(BLOCK_FN, DIM)                                                                                  \
    for (long h = 0; h < Kh; h++)                                                                                 \
    BLOCK_FN(q + (b * H + h * group) * D, group, DIM, k + h * k_s1, v + h * v_s1, k_s0, v_s0, rows, n, scale,    \
             m + h * group, l + h * group, acc + h * group * D)

/* One exported entry per cache dtype. An item is (request b, split s) over all KV heads: block by block, every
 * head's rows of a position (adjacent in the pool) are read together, and the next block's rows are prefetched.
 * Partials of split s of (b, head h) sit at index (b * H + h) * splits + s. */
#define DEFINE_DECODE(NAME, TGT, T, BLOCK_FN, STORE)                                                              \
    TGT int NAME(const T *q, long B, long H, long D, const T *k, const T *v, long Kh, long k_s0, long k_s1,        \
                 long v_s0, long v_s1, long pool_rows, const int32_t *table, long table_s0, long width,           \
                 const int32_t *lens, long page_size, float scale, long window, T *out, int threads) {            \
        long group = H / Kh, num_pages = pool_rows / page_size, max_len = 0, failed = 0;                          \
        for (long b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;                             \
        long splits = num_splits(B, max_len), items = B * splits;                                                 \
        float *part_m = malloc(sizeof(float) * B * H * splits * (D + 2));                                         \
        if (!part_m) return 1;                                                                                    \
        float *part_l = part_m + B * H * splits, *part_acc = part_l + B * H * splits;                             \
        _Pragma("omp parallel for schedule(dynamic) num_threads(threads) reduction(|| : failed)")                 \
        for (long item = 0; item < items; item++) {                                                               \
            long b = item / splits, s = item % splits;                                                            \
            long len = lens[b] < 0 ? 0 : lens[b];                                                                 \
            long start = window > 0 && len > window ? len - window : 0;                                           \
            long end = len < width * page_size ? len : width * page_size; /* the table's pages hold no more */   \
            long chunk = end > start ? (end - start + splits - 1) / splits : 0;                                   \
            long lo = start + s * chunk, hi = lo + chunk < end ? lo + chunk : end;                                \
            float *state = malloc(sizeof(float) * H * (D + 2)); /* m [H], l [H], acc [H][D] */                    \
            if (!state) {                                                                                         \
                failed = 1;                                                                                       \
                continue;                                                                                         \
            }                                                                                                     \
            float *m = state, *l = m + H, *acc = l + H;                                                           \
            for (long h = 0; h < H; h++) m[h] = -INFINITY, l[h] = 0.0f;                                           \
            memset(acc, 0, sizeof(float) * H * D);                                                                \
            const int32_t *pages = table + b * table_s0;                                                          \
            long rows[BLOCK], next[BLOCK];                                                                        \
            if (lo < hi) pool_rows_of(pages, num_pages, page_size, lo, hi - lo < BLOCK ? hi - lo : BLOCK, rows);  \
            for (long t0 = lo; t0 < hi; t0 += BLOCK) {                                                            \
                long n = hi - t0 < BLOCK ? hi - t0 : BLOCK, t1 = t0 + BLOCK;                                      \
                long n1 = hi - t1 < BLOCK ? hi - t1 : BLOCK;                                                      \
                if (n1 > 0) { /* the next block's rows, prefetched while this one computes */                     \
                    pool_rows_of(pages, num_pages, page_size, t1, n1, next);                                      \
                    for (long j = 0; j < n1; j++)                                                                 \
                        for (long h = 0; h < Kh; h++)                                                             \
                            for (long d = 0; d < D; d += 64 / (long)sizeof(T)) {                                  \
                                _mm_prefetch((const char *)(k + next[j] * k_s0 + h * k_s1 + d), _MM_HINT_T0);     \
                                _mm_prefetch((const char *)(v + next[j] * v_s0 + h * v_s1 + d), _MM_HINT_T0);     \
                            }                                                                                     \
                }                                                                                                 \
                if (D == 64)                                                                                      \
                    FOR_HEADS(BLOCK_FN, 64);                                                                      \
                else if (D == 128)                                                                                \
                    FOR_HEADS(BLOCK_FN, 128);                                                                     \
                else                                                                                              \
                    FOR_HEADS(BLOCK_FN, D);                                                                       \
                memcpy(rows, next, sizeof rows);                                                                  \
            }                                                                                                     \
            for (long h = 0; h < H; h++) {                                                                        \
                long at = (b * H + h) * splits + s;                                                               \
                part_m[at] = m[h], part_l[at] = l[h];                                                             \
                memcpy(part_acc + at * D, acc + h * D, sizeof(float) * D);                                        \
            }                                                                                                     \
            free(state);                                                                                          \
        }                                                                                                         \
        if (failed) {                                                                                             \
            free(part_m);                                                                                         \
            return 1;                                                                                             \
        }                                                                                                         \
        for (long bh = 0; bh < B * H; bh++) { /* merge the splits; all empty (len 0): zeros */                    \
            float top = -INFINITY, total = 0.0f, o[MAX_DIM] = {0};                                                \
            for (long s = 0; s < splits; s++) top = fmaxf(top, part_m[bh * splits + s]);                          \
            for (long s = 0; s < splits && top != -INFINITY; s++) {                                               \
                long at = bh * splits + s;                                                                        \
                float w = expf(part_m[at] - top);                                                                 \
                total += w * part_l[at];                                                                          \
                for (long d = 0; d < D; d++) o[d] += w * part_acc[at * D + d];                                    \
            }                                                                                                     \
            for (long d = 0; d < D; d++) out[bh * D + d] = STORE(top == -INFINITY ? 0.0f : o[d] / total);         \
        }                                                                                                         \
        free(part_m);                                                                                             \
        return 0;                                                                                                 \
    }

DEFINE_DECODE(astrai_decode_attention_f32, TARGET_F32, float, block_f32, store_f32)
DEFINE_DECODE(astrai_decode_attention_bf16, TARGET, uint16_t, block_bf16, store_bf16)
