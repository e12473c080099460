/* A prototype, not astrai's decode path: one bf16 single-stream decode step of a llama-shaped model (every layer
 * and the LM head) as ONE call with ONE OpenMP region, for `bench_step_bound.py` to time against astrai's compiled
 * decode step (issue 16 item 4: bf16 decode at >= 60% of its read roofline).
 *
 * It does the step's work in the step's order: per layer RMSNorm, the q/k/v product, a rotation of q and k, the
 * K/V row stored at the new position, attention of every query head over `ctx + 1` positions (online softmax),
 * the o product and residual add, RMSNorm, gate/up, SiLU * up, down and the residual add; then the LM head. Every
 * product streams its weight once, split into contiguous row ranges per thread (matvec.c's `vdpbf16ps` dot),
 * and the phases are separated by barriers. What it leaves out, on purpose: Python, Dynamo, inductor's wrapper,
 * per-product op dispatch and thread-team start-up, which is what the comparison measures. The rotation uses a
 * fixed angle and the result is not checked against a model: it is a timing bound, with the same bytes and about
 * the same arithmetic as the real step.
 *
 * Layout: row-major bf16 weights, q/k/v stacked as one [(H + 2 KH) D, E] matrix and gate/up as one [2 F, E];
 * caches [positions, KH, D]; E, F and D multiples of 32, D <= 256.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const uint16_t *qkv, *o, *gate_up, *down, *attn_norm, *mlp_norm;
    uint16_t *k_cache, *v_cache;
} Layer;

INLINE TARGET float dot(const uint16_t *x, const uint16_t *w, long K) {
    __m512 acc = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
    return _mm512_reduce_add_ps(acc);
}

static inline uint16_t to_bf16(float f) { /* round to nearest even */
    union { float f; uint32_t u; } v = {f};
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}
static inline float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* y[n] = x . w[n] over this thread's contiguous share of the N rows */
INLINE TARGET void product(const uint16_t *x, const uint16_t *w, long N, long K, float *y, int t, int nt) {
    for (long n = N * t / nt; n < N * (t + 1) / nt; n++) y[n] = dot(x, w + n * K, K);
}

static void rms_norm(const float *x, const uint16_t *gain, long E, uint16_t *out) {
    double sum = 0;
    for (long i = 0; i < E; i++) sum += x[i] * x[i];
    float r = 1.0f / sqrtf((float)(sum / E) + 1e-5f);
    for (long i = 0; i < E; i++) out[i] = to_bf16(x[i] * r * from_bf16(gain[i]));
}

/* scratch: fp32 [(H + 2 KH) D + 2 F + E]; half: bf16 [max(E, H D, F)] twice */
TARGET void whole_step(const Layer *layers, int num_layers, const uint16_t *head, long vocab, float *x, long E,
                       long F, int H, int KH, int D, long ctx, float *logits, float *scratch, uint16_t *half,
                       int threads) {
    long width = (long)(H + 2 * KH) * D;
    float *qkv = scratch, *gate_up = scratch + width, *out = gate_up + 2 * F;
    uint16_t *normed = half, *mixed = half + (E > F ? E : F) + (long)H * D;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int l = 0; l < num_layers; l++) {
            const Layer *p = &layers[l];
#pragma omp single
            rms_norm(x, p->attn_norm, E, normed);
            product(normed, p->qkv, width, E, qkv, t, nt);
#pragma omp barrier
#pragma omp single
            {
                for (long i = 0; i < (long)(H + KH) * D; i += 2) { /* rotate q and k (fixed angle) */
                    float a = qkv[i], b = qkv[i + 1];
                    qkv[i] = a * 0.8f - b * 0.6f, qkv[i + 1] = a * 0.6f + b * 0.8f;
                }
                for (long i = 0; i < (long)KH * D; i++) {
                    p->k_cache[ctx * KH * D + i] = to_bf16(qkv[(long)H * D + i]);
                    p->v_cache[ctx * KH * D + i] = to_bf16(qkv[(long)(H + KH) * D + i]);
                }
            }
            for (int h = t; h < H; h += nt) { /* query heads round-robin over the threads */
                int kh = h / (H / KH);
                float m = -INFINITY, l_sum = 0, acc[256] = {0};
                uint16_t q[256];
                for (int d = 0; d < D; d++) q[d] = to_bf16(qkv[(long)h * D + d] * 0.125f);
                for (long j = 0; j <= ctx; j++) {
                    float s = dot(q, p->k_cache + (j * KH + kh) * D, D), top = s > m ? s : m;
                    float rescale = expf(m - top), e = expf(s - top);
                    const uint16_t *v = p->v_cache + (j * KH + kh) * D;
                    for (int d = 0; d < D; d++) acc[d] = acc[d] * rescale + e * from_bf16(v[d]);
                    l_sum = l_sum * rescale + e, m = top;
                }
                for (int d = 0; d < D; d++) mixed[(long)h * D + d] = to_bf16(acc[d] / l_sum);
            }
#pragma omp barrier
            product(mixed, p->o, E, (long)H * D, out, t, nt);
#pragma omp barrier
#pragma omp single
            {
                for (long i = 0; i < E; i++) x[i] += out[i];
                rms_norm(x, p->mlp_norm, E, normed);
            }
            product(normed, p->gate_up, 2 * F, E, gate_up, t, nt);
#pragma omp barrier
            for (long i = F * t / nt; i < F * (t + 1) / nt; i++)
                mixed[i] = to_bf16(gate_up[i] / (1.0f + expf(-gate_up[i])) * gate_up[F + i]);
#pragma omp barrier
            product(mixed, p->down, E, F, out, t, nt);
#pragma omp barrier
#pragma omp single
            for (long i = 0; i < E; i++) x[i] += out[i];
        }
#pragma omp single
        for (long i = 0; i < E; i++) normed[i] = to_bf16(x[i]);
        product(normed, head, vocab, E, logits, t, nt);
    }
}
