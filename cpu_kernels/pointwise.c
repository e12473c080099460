/* The pointwise work of an eager CPU prefill step, one pass each: RMSNorm, SiLU(gate) * up, and rotary with the KV
 * store of a paged layer.
 *
 * Why: the engine runs CPU prefill eagerly (a compiled prefill takes minutes to compile on 2 cores), and there torch
 * runs these as chains of single ops, each a pass over [tokens, width] with an fp32 copy in between: for a 2048-token
 * bf16 prefill of SmolLM2-135M on the 2-core Xeon, RMSNorm took 88 ms, SiLU * up ~180 and rotary + KV store 195 of a
 * 995 ms step (its GEMMs: ~240). Each kernel here reads its inputs once and writes its outputs once.
 *
 * They compute what the torch code they replace computes, rounding where it rounds (bf16 results are rounded to
 * nearest even from the same fp32 values), so they differ from it only where that code's own order is not fixed:
 * - RMSNorm (`astrai.nn.norm.rms_norm`): h = x * (1 / sqrt(mean(x^2) + eps)) in fp32, rounded to x's dtype, times
 *   the gain (bf16 * bf16 rounded). The sum of squares runs in another order than torch's reduction.
 * - SiLU * up (`astrai.nn.mlp`): silu(g) = g / (1 + exp(-g)) in fp32, rounded to the dtype, times up (rounded). exp is
 *   a Cephes-style polynomial within ~1 ulp of torch's (Sleef), so a bf16 result may differ by one unit where the
 *   fp32 value lies that close to a rounding boundary.
 * - Rotary (`triton_kernels.rotary.rotary_ref`, halves form): (x1 c - x2 s, x2 c + x1 s) in fp32, each product
 *   rounded (no FMA), then the rotated keys and the values are written to their pool slots (`kv_store_ref_`; a
 *   negative slot writes nothing) and the rotated queries returned.
 *
 * Layouts: rows of x, gate and up, and each (token, head) of q, k and v, have a stride; the last dim is contiguous.
 * Threads: OpenMP over tokens, the caller's count.
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

/* no fused multiply-adds where the code writes a product and a sum: torch rounds each (rotary's x1 c - x2 s) */
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define TARGET_F32 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define INLINE static inline __attribute__((always_inline))

INLINE __mmask16 lanes(long n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* 16 bf16 (masked lanes 0) as fp32, and 16 fp32 rounded to nearest even as bf16 */
INLINE TARGET_BF16 __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
INLINE TARGET_BF16 void store_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
/* the fp32 value a bf16 rounding of v holds */
INLINE TARGET_BF16 __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* ---- RMSNorm: out[r] = w * round(x[r] / sqrt(mean(x[r]^2) + eps)) ---- */

INLINE TARGET_F32 __m512 load_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
INLINE TARGET_F32 void store_f32(float *p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
INLINE TARGET_F32 __m512 same(__m512 v) { return v; }

/* ROUND: to the dtype and back (bf16), or nothing (fp32) */
#define DEFINE_RMS_NORM(NAME, TARGET, T_, LOAD, ROUND, STORE)                                                      \
    TARGET void NAME(const T_ *x, long rows, long E, long stride, const T_ *w, float eps, T_ *out, int threads) { \
        _Pragma("omp parallel for num_threads(threads) schedule(static)") for (long r = 0; r < rows; r++) {       \
            const T_ *xr = x + r * stride;                                                                         \
            __m512 acc = _mm512_setzero_ps();                                                                      \
            for (long k = 0; k < E; k += 16) {                                                                     \
                __m512 v = LOAD(xr + k, lanes(E - k));                                                             \
                acc = _mm512_fmadd_ps(v, v, acc);                                                                  \
            }                                                                                                      \
            float mean = _mm512_reduce_add_ps(acc) / (float)E + eps;                                               \
            __m512 s = _mm512_set1_ps(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(mean))));                        \
            for (long k = 0; k < E; k += 16) {                                                                     \
                __mmask16 m = lanes(E - k);                                                                        \
                __m512 h = ROUND(_mm512_mul_ps(LOAD(xr + k, m), s));                                               \
                STORE(out + r * E + k, _mm512_mul_ps(LOAD(w + k, m), h), m);                                       \
            }                                                                                                      \
        }                                                                                                          \
    }

DEFINE_RMS_NORM(astrai_rms_norm_bf16, TARGET_BF16, uint16_t, load_bf16, round_bf16, store_bf16)
DEFINE_RMS_NORM(astrai_rms_norm_f32, TARGET_F32, float, load_f32, same, store_f32)

/* ---- SiLU(gate) * up ---- */

/* e^x in fp32 (`cephes_exp_ps`), x bounded to [-100, 100] first: e^+-100 is inf / 0 in fp32 either way */
INLINE TARGET_F32 __m512 exp_ps(__m512 x) {
    return cephes_exp_ps(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.0f)), _mm512_set1_ps(100.0f)));
}

INLINE TARGET_F32 __m512 silu_ps(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

TARGET_BF16 void astrai_silu_mul_bf16(const uint16_t *gate, long gate_stride, const uint16_t *up, long up_stride,
                                      long rows, long I, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; r++)
        for (long k = 0; k < I; k += 16) {
            __mmask16 m = lanes(I - k);
            __m512 s = round_bf16(silu_ps(load_bf16(gate + r * gate_stride + k, m)));
            store_bf16(out + r * I + k, _mm512_mul_ps(s, load_bf16(up + r * up_stride + k, m)), m);
        }
}

TARGET_F32 void astrai_silu_mul_f32(const float *gate, long gate_stride, const float *up, long up_stride, long rows,
                                    long I, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; r++)
        for (long k = 0; k < I; k += 16) {
            __mmask16 m = lanes(I - k);
            __m512 s = silu_ps(_mm512_maskz_loadu_ps(m, gate + r * gate_stride + k));
            _mm512_mask_storeu_ps(out + r * I + k, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up + r * up_stride + k)));
        }
}

/* ---- rotary (halves form) with the KV store ----
 * q [T, H, D] (strides qt, qh), k and v [T, Kh, D] (kt, kh / vt, vh); cos, sin [T, D / 2] fp32 (row stride cs);
 * q_out [T, H, D] contiguous; the pools [S, Kh, D] (strides p0, p1, one pair for both); slots [T] int64 in [-1, S).
 * D is a multiple of 32. Returns -1 (nothing written) when a slot lies past the pool. */

#define ROTATE_HEAD(LOAD, STORE, src, dst, c, s, half)                                                  \
    for (long i = 0; i < (half); i += 16) {                                                              \
        __m512 x1 = LOAD((src) + i, 0xffff), x2 = LOAD((src) + (half) + i, 0xffff);                      \
        __m512 ci = _mm512_loadu_ps((c) + i), si = _mm512_loadu_ps((s) + i);                             \
        STORE((dst) + i, _mm512_sub_ps(_mm512_mul_ps(x1, ci), _mm512_mul_ps(x2, si)), 0xffff);          \
        STORE((dst) + (half) + i, _mm512_add_ps(_mm512_mul_ps(x2, ci), _mm512_mul_ps(x1, si)), 0xffff); \
    }

#define DEFINE_ROTARY_KV_STORE(NAME, TARGET, T_, LOAD, STORE)                                                         \
    TARGET int NAME(const T_ *q, long qt, long qh, const T_ *k, long kt, long kh, const T_ *v, long vt, long vh,      \
                    long T, long H, long Kh, long D, const float *cos, const float *sin, long cs, T_ *q_out,          \
                    T_ *k_pool, T_ *v_pool, long p0, long p1, long pool_rows, const int64_t *slots, int threads) {    \
        for (long t = 0; t < T; t++)                                                                                  \
            if (slots[t] >= pool_rows) return -1;                                                                     \
        long half = D / 2;                                                                                            \
        _Pragma("omp parallel for num_threads(threads) schedule(static)") for (long t = 0; t < T; t++) {              \
            const float *c = cos + t * cs, *s = sin + t * cs;                                                         \
            for (long h = 0; h < H; h++) ROTATE_HEAD(LOAD, STORE, q + t * qt + h * qh, q_out + (t * H + h) * D, c, s, \
                                                     half)                                                            \
            if (slots[t] < 0) continue;                                                                               \
            for (long h = 0; h < Kh; h++) {                                                                           \
                ROTATE_HEAD(LOAD, STORE, k + t * kt + h * kh, k_pool + slots[t] * p0 + h * p1, c, s, half)            \
                for (long i = 0; i < D; i++) v_pool[slots[t] * p0 + h * p1 + i] = v[t * vt + h * vh + i];             \
            }                                                                                                         \
        }                                                                                                             \
        return 0;                                                                                                     \
    }

DEFINE_ROTARY_KV_STORE(astrai_rotary_kv_store_bf16, TARGET_BF16, uint16_t, load_bf16, store_bf16)
DEFINE_ROTARY_KV_STORE(astrai_rotary_kv_store_f32, TARGET_F32, float, load_f32, store_f32)
