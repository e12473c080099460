/* AVX-512 helpers shared by this folder's kernels (the library's build hashes this header with the sources). */
#ifndef ASTRAI_CPU_KERNELS_SIMD_H
#define ASTRAI_CPU_KERNELS_SIMD_H

#include <immintrin.h>

/* e^x of 16 floats: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by Cephes' degree-6 polynomial (~1 ulp),
 * times 2^n by `vscalefps` (inf past ~88.7, 0 below ~-103). Callers bound x (a huge |x| would lose r). */
static inline __attribute__((always_inline, target("avx512f"))) __m512 cephes_exp_ps(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#endif
