// Fused rotary embedding of q and k in one launch.
//
// One thread per (token t, head of q or k, pair i < D/2), grid-stride. The angle row is r = positions[t]
// (or t when positions is null); with c = cos[r, i], s = sin[r, i] and the pair (x1, x2) taken as
//   half (HF / NeoX):  x1 = x[i],     x2 = x[i + D/2]
//   interleaved:       x1 = x[2i],    x2 = x[2i + 1]
// the outputs are x1 * c - x2 * s and x2 * c + x1 * s, computed in fp32 and rounded to the input dtype.
// Inputs may be strided views (unit stride in D); outputs are new contiguous tensors. A position outside
// [0, R) cannot be reported without a host sync, so it yields NaN in that token's outputs instead of an
// out-of-bounds read.
#include "common.cuh"

namespace astrai_cuda_ref {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

template <typename T>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const RotaryParams p) {
  const int64_t half = p.head_dim / 2;
  const int64_t heads = p.num_q_heads + p.num_kv_heads;
  const int64_t total = p.num_tokens * heads * half;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
    const int64_t i = idx % half;
    const int64_t head = (idx / half) % heads;
    const int64_t tok = idx / (half * heads);
    const T* src;
    T* dst;
    if (head < p.num_q_heads) {
      src = static_cast<const T*>(p.q) + tok * p.stride_q_t + head * p.stride_q_h;
      dst = static_cast<T*>(p.q_out) + (tok * p.num_q_heads + head) * p.head_dim;
    } else {
      const int64_t kh = head - p.num_q_heads;
      src = static_cast<const T*>(p.k) + tok * p.stride_k_t + kh * p.stride_k_h;
      dst = static_cast<T*>(p.k_out) + (tok * p.num_kv_heads + kh) * p.head_dim;
    }
    const int64_t row = p.positions != nullptr ? p.positions[tok] : tok;
    float c = NAN, s = NAN;
    if (row >= 0 && row < p.num_rows) {
      c = p.cos[row * p.stride_cs + i];
      s = p.sin[row * p.stride_cs + i];
    }
    const int64_t i1 = p.interleaved ? 2 * i : i;
    const int64_t i2 = p.interleaved ? 2 * i + 1 : i + half;
    const float x1 = to_float(src[i1]), x2 = to_float(src[i2]);
    dst[i1] = from_float<T>(x1 * c - x2 * s);
    dst[i2] = from_float<T>(x2 * c + x1 * s);
  }
}

template <typename T>
cudaError_t launch_typed(const RotaryParams& p, cudaStream_t stream) {
  const int64_t total = p.num_tokens * (p.num_q_heads + p.num_kv_heads) * (p.head_dim / 2);
  if (total == 0) return cudaSuccess;
  int64_t blocks = (total + kThreads - 1) / kThreads;
  blocks = blocks < kMaxBlocks ? blocks : kMaxBlocks;
  rotary_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rotary(const RotaryParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float>(p, stream);
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace astrai_cuda_ref
