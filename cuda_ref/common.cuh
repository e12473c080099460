// Device helpers shared by the CUDA reference kernels: dtype conversion, warp reductions, paged-slot math,
// the m16n8k16 tensor-core MMA (inline PTX) with its fragment helpers, the online-softmax update on MMA
// accumulators, and the scalar one-row attention loop.
//
// ASTRAI_NO_MMA: defined for device passes below sm_80 (mma.sync with bf16 needs sm_80) or by the build
// (-DASTRAI_NO_MMA). The MMA kernels then compile to a trap, and the host never selects them: it checks the
// loaded binary's PTX version (launch.cuh, *_can_use_mma) and the host-side define.
//
// Conversions use the explicit intrinsics only, because torch builds extensions with
// __CUDA_NO_HALF_OPERATORS__ / __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "launch.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 800) && !defined(ASTRAI_NO_MMA)
#define ASTRAI_NO_MMA 1
#endif

namespace astrai_cuda_ref {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kWarp = 32;

// ---- dtype conversion --------------------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return x;
  }
}

// Two floats -> one 32-bit register of two 16-bit values, `lo` in the low half (the lower-index element of
// an MMA fragment pair).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  static_assert(!std::is_same_v<T, float>, "pack2 packs 16-bit types");
  uint32_t a, b;
  if constexpr (std::is_same_v<T, __half>) {
    a = __half_as_ushort(__float2half_rn(lo));
    b = __half_as_ushort(__float2half_rn(hi));
  } else {
    a = __bfloat16_as_ushort(__float2bfloat16_rn(lo));
    b = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
  }
  return a | (b << 16);
}

// Two raw 16-bit values -> one register, `lo` in the low half.
__device__ __forceinline__ uint32_t pack_raw(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// ---- reductions and paging ---------------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Reductions over the 4 lanes of an MMA quad (lanes 4g .. 4g+3 hold one accumulator row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Element offset of (position pos, kv head offset head_off) of a request whose block-table row is bt_row.
__device__ __forceinline__ int64_t kv_offset(const PagedKV& kv, const int32_t* bt_row, int64_t pos,
                                             int64_t head_off) {
  const int64_t slot = static_cast<int64_t>(bt_row[pos / kv.page_size]) * kv.page_size + pos % kv.page_size;
  return slot * kv.stride_s + head_off;
}

// ---- tensor cores: mma.sync.aligned.m16n8k16, fp32 accumulate ----------------------------------------------
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 * g + t (g = lane / 4, t = lane % 4):
//   A 16x16 row-major, 4 regs:  a[0] = A[g][2t..2t+1]    a[1] = A[g+8][2t..2t+1]
//                               a[2] = A[g][2t+8..2t+9]  a[3] = A[g+8][2t+8..2t+9]
//   B 16x8 (k x n), 2 regs:     b[0] = B[2t..2t+1][g]    b[1] = B[2t+8..2t+9][g]
//   C 16x8 fp32, 4 floats:      c[0..1] = C[g][2t..2t+1] c[2..3] = C[g+8][2t..2t+1]
// Each register holds two 16-bit values, the lower column / k index in the low half.

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(ASTRAI_CUDA_SIM)
  astrai_sim_mma_16816<T>(c, a, b0, b1);  // CPU emulation used by tests/cuda_ref/test_cuda_sim.py
#elif defined(ASTRAI_NO_MMA)
  __trap();
#else
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "mma_16816 takes fp16 or bf16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// A fragment of rows [row0, row0 + 16) and columns [col0, col0 + 16) of a row-major shared tile with row
// stride `ld` (16-bit elements; ld and col0 even so the 32-bit reads are aligned).
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const uint16_t* tile, int ld, int row0, int col0,
                                            int g, int t) {
  const uint16_t* p = tile + (row0 + g) * ld + col0 + 2 * t;
  a[0] = *reinterpret_cast<const uint32_t*>(p);
  a[1] = *reinterpret_cast<const uint32_t*>(p + 8 * ld);
  a[2] = *reinterpret_cast<const uint32_t*>(p + 8);
  a[3] = *reinterpret_cast<const uint32_t*>(p + 8 * ld + 8);
}

// Scores S = Q K^T of one warp: B[k][n] = K[n][k] is K's row n itself, so each B register is two adjacent
// head-dim elements of one key row: b0 = K[tok0 + g][col0 + 2t ..], b1 = K[tok0 + g][col0 + 2t + 8 ..].
__device__ __forceinline__ void load_kt_frag(uint32_t& b0, uint32_t& b1, const uint16_t* k_tile, int ld, int tok0,
                                             int col0, int g, int t) {
  const uint16_t* p = k_tile + (tok0 + g) * ld + col0 + 2 * t;
  b0 = *reinterpret_cast<const uint32_t*>(p);
  b1 = *reinterpret_cast<const uint32_t*>(p + 8);
}

// Output O += P V: B[k][n] = V[tok0 + k][col0 + n], so a register pairs two *different* key rows of one
// column: b0 = (V[tok0 + 2t][col0 + g], V[tok0 + 2t + 1][col0 + g]), b1 the same 8 rows further down.
__device__ __forceinline__ void load_v_frag(uint32_t& b0, uint32_t& b1, const uint16_t* v_tile, int ld, int tok0,
                                            int col0, int g, int t) {
  const uint16_t* p = v_tile + (tok0 + 2 * t) * ld + col0 + g;
  b0 = pack_raw(p[0], p[ld]);
  b1 = pack_raw(p[8 * ld], p[9 * ld]);
}

// One online-softmax step of a warp over a tile of NT * 8 keys. `s` holds the (already scaled, log2-domain,
// masked with -inf) scores as NT C fragments: rows g and g+8 of this lane. Updates the running max `m` and
// this lane's partial row sums `l` (summed over the quad at the end), rescales the accumulator `acc`
// (ND n-tiles of the output) and overwrites `s` with the probabilities exp2(s - m).
template <int NT, int ND>
__device__ __forceinline__ void online_softmax_mma(float (&s)[NT][4], float (&m)[2], float (&l)[2],
                                                   float (&acc)[ND][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int n = 0; n < NT; ++n) tile_max = fmaxf(tile_max, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
    const float m_new = fmaxf(m[r], quad_max(tile_max));
    // A row with no visible key so far keeps m = -inf; subtracting 0 instead keeps p = 0 and corr = 0
    // rather than NaN from (-inf) - (-inf).
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    const float corr = exp2f(m[r] - m_use);
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = exp2f(s[n][2 * r + e] - m_use);
        s[n][2 * r + e] = p;
        sum += p;
      }
    }
    l[r] = l[r] * corr + sum;
#pragma unroll
    for (int j = 0; j < ND; ++j) {
      acc[j][2 * r] *= corr;
      acc[j][2 * r + 1] *= corr;
    }
    m[r] = m_new;
  }
}

// P (the C fragments of two consecutive 8-key n-tiles, 16 keys) as the A operand of the P V product: the C
// layout of columns 0-7 and 8-15 is exactly the A layout of a 16x16 tile (FlashAttention-2's register reuse).
template <typename T>
__device__ __forceinline__ void p_to_a_frag(uint32_t (&a)[4], const float (&s0)[4], const float (&s1)[4]) {
  a[0] = pack2<T>(s0[0], s0[1]);
  a[1] = pack2<T>(s0[2], s0[3]);
  a[2] = pack2<T>(s1[0], s1[1]);
  a[3] = pack2<T>(s1[2], s1[3]);
}

// S = Q K^T for one warp: 16 query rows starting at q_row0 of the Q tile, NT * 8 keys of the K tile.
template <typename T, int NT, int D>
__device__ __forceinline__ void warp_qk(float (&s)[NT][4], const uint16_t* q_tile, const uint16_t* k_tile, int ld,
                                        int q_row0, int g, int t) {
#pragma unroll
  for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    load_a_frag(a, q_tile, ld, q_row0, kk * 16, g, t);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      uint32_t b0, b1;
      load_kt_frag(b0, b1, k_tile, ld, n * 8, kk * 16, g, t);
      mma_16816<T>(s[n], a, b0, b1);
    }
  }
}

// O += P V for one warp: P holds the probabilities of NT * 8 keys (NT even) as C fragments, V tile rows match.
template <typename T, int NT, int D>
__device__ __forceinline__ void warp_pv(float (&acc)[D / 8][4], const float (&p)[NT][4], const uint16_t* v_tile,
                                        int ld, int g, int t) {
  static_assert(NT % 2 == 0, "P V consumes keys 16 at a time");
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t a[4];
    p_to_a_frag<T>(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      uint32_t b0, b1;
      load_v_frag(b0, b1, v_tile, ld, kk * 16, j * 8, g, t);
      mma_16816<T>(acc[j], a, b0, b1);
    }
  }
}

// Copies `rows` key/value rows at positions [pos0, pos0 + rows) of a request into shared tiles (row stride
// ld), 16 bytes per thread-load; rows at positions >= end are zero-filled (a zero V row can never inject NaN
// through a p = 0 product). Caller guarantees 16-byte aligned K/V rows (see *_can_use_mma).
template <int D>
__device__ __forceinline__ void load_kv_tile(uint16_t* k_tile, uint16_t* v_tile, int ld, int rows,
                                             const PagedKV& kv, const int32_t* bt_row, int64_t head_off,
                                             int64_t pos0, int64_t end, int tid, int nthreads) {
  constexpr int kVecs = D / 8;  // 16-byte vectors per row
  const uint16_t* kc = static_cast<const uint16_t*>(kv.k_cache);
  const uint16_t* vc = static_cast<const uint16_t*>(kv.v_cache);
  for (int i = tid; i < rows * kVecs; i += nthreads) {
    const int r = i / kVecs, c = (i % kVecs) * 8;
    const int64_t pos = pos0 + r;
    uint4 kval = make_uint4(0, 0, 0, 0), vval = make_uint4(0, 0, 0, 0);
    if (pos < end) {
      const int64_t off = kv_offset(kv, bt_row, pos, head_off) + c;
      kval = *reinterpret_cast<const uint4*>(kc + off);
      vval = *reinterpret_cast<const uint4*>(vc + off);
    }
    *reinterpret_cast<uint4*>(k_tile + r * ld + c) = kval;
    *reinterpret_cast<uint4*>(v_tile + r * ld + c) = vval;
  }
}

// ---- scalar path: one warp attends one query row -----------------------------------------------------------
//
// Lane `lane` owns head-dim elements lane + 32 j (coalesced loads). `q` is pre-multiplied by scale * log2(e);
// keys at positions [lo, hi) are visited one at a time with an online softmax in base 2. Every visited key
// is visible, so scores are finite and the first one sets m (corr = exp2(-inf) = 0).
template <typename T, int D>
__device__ __forceinline__ void attend_row_scalar(const float (&q)[D / kWarp], const PagedKV& kv,
                                                  const int32_t* bt_row, int64_t head_off, int64_t lo,
                                                  int64_t hi, int lane, float& m, float& l,
                                                  float (&acc)[D / kWarp]) {
  constexpr int E = D / kWarp;
  const T* kc = static_cast<const T*>(kv.k_cache);
  const T* vc = static_cast<const T*>(kv.v_cache);
  for (int64_t pos = lo; pos < hi; ++pos) {
    const int64_t off = kv_offset(kv, bt_row, pos, head_off) + lane;
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) dot += q[j] * to_float(kc[off + j * kWarp]);
    const float s = warp_sum(dot);
    const float m_new = fmaxf(m, s);
    const float corr = exp2f(m - m_new);
    const float p = exp2f(s - m_new);
    l = l * corr + p;
#pragma unroll
    for (int j = 0; j < E; ++j) acc[j] = acc[j] * corr + p * to_float(vc[off + j * kWarp]);
    m = m_new;
  }
}

// ---- host: choosing the MMA path ---------------------------------------------------------------------------

// Whether K/V rows are 16-byte aligned, as the MMA kernels' vector loads (load_kv_tile) need.
inline bool kv_rows_aligned(const PagedKV& kv) {
  return reinterpret_cast<uintptr_t>(kv.k_cache) % 16 == 0 && reinterpret_cast<uintptr_t>(kv.v_cache) % 16 == 0 &&
         kv.stride_s % 8 == 0 && kv.stride_h % 8 == 0;
}

// Whether the loaded binary of `kernel` for the current device was compiled for sm_80+, i.e. holds the
// mma.sync code rather than the ASTRAI_NO_MMA trap (a compute_75 PTX JIT-compiled on a newer GPU does not).
inline bool binary_has_mma(const void* kernel) {
#ifdef ASTRAI_NO_MMA
  (void)kernel;
  return false;
#else
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error: the caller takes the scalar path instead
    return false;
  }
  return attr.ptxVersion >= 80;
#endif
}

// Memo of binary_has_mma per device for one probe kernel, so launches after the first make no driver call
// (a CUDA-graph capture then sees only the kernel launches).
class MmaProbe {
 public:
  explicit MmaProbe(const void* kernel) : kernel_(kernel) {}

  bool get() {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    if (device < 0 || device >= kMaxDevices) return binary_has_mma(kernel_);
    int state = state_[device].load(std::memory_order_relaxed);  // 0 unknown, 1 no, 2 yes
    if (state == 0) {
      state = binary_has_mma(kernel_) ? 2 : 1;
      state_[device].store(state, std::memory_order_relaxed);
    }
    return state == 2;
  }

 private:
  static constexpr int kMaxDevices = 64;
  const void* kernel_;
  std::atomic<int> state_[kMaxDevices] = {};
};

}  // namespace astrai_cuda_ref
