/* Batched multi-LoRA update on AVX-512 CPUs: each row adds its own adapter's low-rank update (Punica's BGMV).
 *
 *     y[t] = scaling[s] * (x[t] @ a[s].T) @ b[:, s, :].T     with s = slots[t]; y[t] = 0 when s < 0
 *
 * Why a kernel: the plain-torch form (`astrai.ops.lora.lora_delta_masked`) multiplies every row by every slot's
 * factors at once ([rows, S*R] products), which oneDNN runs fast but with S times the arithmetic: with 8 slots at
 * rank 16 it added ~37% to a 16-row SmolLM2-135M decode step's products and 66% to its time. Here a row touches
 * only its own slot's factors: R dot products of length K (the shrink), then N dot products of length R (the
 * expand), so the cost no longer grows with the number of slots. Rows that share a slot read its factors from
 * cache after the first.
 *
 * Layouts (`astrai.nn.lora_slots`): x [M, K], a [S, R, K], b [N, S, R], scaling [S] fp32, slots [M] int64, y [M, N]
 * fp32; every tensor contiguous, no alignment assumed. x, a and b share one dtype: fp32 (FMA), or bf16 widened to
 * fp32 in registers (a shift); fp32 accumulation either way. Threads: OpenMP over rows, through the process's
 * libgomp (torch's), with the count the caller passes; one thread below 64 KiFLOP of work.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define INLINE static inline __attribute__((always_inline))
#define MAX_RANK 256

/* 16 lanes from p (fp32 or bf16 widened), the first `n` of them (the rest 0) */
INLINE TARGET __m512 load_f32(const float *p, long n) {
    return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
INLINE TARGET __m512 load_bf16(const uint16_t *p, long n) {
    __m256i h = n >= 16 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* lane i = the sum of v[i]'s 16 lanes: a transpose-and-add tree (45 shuffles and adds against 16 reductions' ~130) */
INLINE TARGET __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of x = v[2i], y = v[2i+1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; j++) /* per 128-bit lane: the lane's sums of v[4j .. 4j+3] */
        b[j] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int j = 0; j < 2; j++) /* [b0 lanes 0+1, b0 lanes 2+3, b1 lanes 0+1, b1 lanes 2+3] */
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

/* the shrink and expand of one row, for one element type (LOAD widens 16 of them to fp32) */
#define LORA_ROW(T, LOAD)                                                                                           \
    INLINE TARGET void lora_row_##T(const T *x, long K, const T *a, long R, const T *b, long N, long S, long s,     \
                                    float scale, float *y) {                                                      \
        float h[MAX_RANK];                                                                                        \
        for (long r = 0; r < R; r++) { /* h = scale * a[s] @ x */                                                 \
            const T *w = a + (s * R + r) * K;                                                                     \
            __m512 acc = _mm512_setzero_ps();                                                                     \
            for (long k = 0; k < K; k += 16) acc = _mm512_fmadd_ps(LOAD(x + k, K - k), LOAD(w + k, K - k), acc); \
            h[r] = scale * _mm512_reduce_add_ps(acc);                                                             \
        }                                                                                                         \
        __m512 hv[MAX_RANK / 16], acc[16];                                                                       \
        for (long r = 0; r < R; r += 16) hv[r / 16] = load_f32(h + r, R - r);                                     \
        long n = 0;                                                                                               \
        for (; n + 16 <= N; n += 16) { /* y[n .. n+15] = b[n .. n+15, s, :] @ h, summed 16 at a time */           \
            for (int i = 0; i < 16; i++) {                                                                        \
                const T *w = b + ((n + i) * S + s) * R;                                                           \
                acc[i] = _mm512_setzero_ps();                                                                     \
                for (long r = 0; r < R; r += 16) acc[i] = _mm512_fmadd_ps(hv[r / 16], LOAD(w + r, R - r), acc[i]); \
            }                                                                                                     \
            _mm512_storeu_ps(y + n, sum16(acc));                                                                  \
        }                                                                                                         \
        for (; n < N; n++) { /* the last N % 16 */                                                                \
            const T *w = b + (n * S + s) * R;                                                                     \
            __m512 one = _mm512_setzero_ps();                                                                     \
            for (long r = 0; r < R; r += 16) one = _mm512_fmadd_ps(hv[r / 16], LOAD(w + r, R - r), one);          \
            y[n] = _mm512_reduce_add_ps(one);                                                                     \
        }                                                                                                         \
    }
LORA_ROW(float, load_f32)
LORA_ROW(uint16_t, load_bf16)

/* y [M, N] = every row's update; returns 0, or -1 when R exceeds MAX_RANK (nothing written) */
#define LORA_ENTRY(NAME, T)                                                                                         \
    TARGET int NAME(const void *x_, long M, long K, const void *a_, long S, long R, const void *b_, long N,        \
                    const float *scaling, const int64_t *slots, float *y, int threads) {                           \
        const T *x = (const T *)x_, *a = (const T *)a_, *b = (const T *)b_;                                        \
        if (R > MAX_RANK) return -1;                                                                              \
        int team = (double)M * R * (K + N) < 65536.0 ? 1 : threads;                                               \
        _Pragma("omp parallel for num_threads(team) schedule(static)")                                           \
        for (long t = 0; t < M; t++) {                                                                            \
            long s = (long)slots[t];                                                                              \
            if (s < 0 || s >= S || scaling[s] == 0.0f)                                                            \
                memset(y + t * N, 0, (size_t)N * sizeof(float));                                                  \
            else                                                                                                  \
                lora_row_##T(x + t * K, K, a, R, b, N, S, s, scaling[s], y + t * N);                              \
        }                                                                                                         \
        return 0;                                                                                                 \
    }
LORA_ENTRY(astrai_lora_f32, float)
LORA_ENTRY(astrai_lora_bf16, uint16_t)
