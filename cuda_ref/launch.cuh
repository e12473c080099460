// Host-side launcher API of the CUDA reference kernels (decode_attention.cu, extend_attention.cu, rotary.cu).
//
// Plain C++ over raw pointers, element strides and a cudaStream_t: no torch headers, so the kernels compile
// (and can be compile-checked) with nvcc alone, and bindings.cpp is the only file that sees torch. Every
// launcher launches on the stream it is given, checks cudaGetLastError() after each kernel launch and returns
// the first error (cudaSuccess otherwise); the bindings turn that into a C10 error. Launchers never
// synchronise and never read device memory on the host, so the ops can be captured in CUDA graphs.
//
// Layouts and semantics are the kernel contract of docs/kernels.md; the designs are in docs/cuda_ref.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace astrai_cuda_ref {

// Element type of q / k / v / caches / outputs. Softmax, rotary and accumulation are fp32 for all three.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// q, k: [T, H, D], [T, K, D] with unit stride in the last dim; q_out, k_out contiguous; cos, sin: [R, D/2]
// fp32 with unit stride in the last dim; positions: [T] int64 rows of the table, or null (row t for token t).
struct RotaryParams {
  const void* q;
  const void* k;
  void* q_out;
  void* k_out;
  const float* cos;
  const float* sin;
  const int64_t* positions;
  int64_t num_tokens;    // T
  int64_t num_q_heads;   // H
  int64_t num_kv_heads;  // K
  int64_t head_dim;      // D, even
  int64_t num_rows;      // R, rows of cos / sin
  int64_t stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cs;
  bool interleaved;
  DType dtype;
};

// The paged pool of one layer: k_cache / v_cache [S, K, D] (unit stride in D), block_table [B, P] int32.
struct PagedKV {
  const void* k_cache;
  const void* v_cache;
  int64_t stride_s;  // elements between slots
  int64_t stride_h;  // elements between kv heads
  const int32_t* block_table;
  int64_t stride_bt;  // elements between block-table rows
  int64_t page_size;  // N
};

// Decode: q [B, H, D] (unit stride in D) -> out [B, H, D] contiguous. o_part [splits, B, H, D] and
// ml_part [splits, B, H, 2] are fp32 scratch that stage 1 fills completely (allocate them uninitialised).
struct DecodeParams {
  const void* q;
  void* out;
  float* o_part;
  float* ml_part;
  const int32_t* seq_lens;
  PagedKV kv;
  int64_t batch;         // B
  int64_t num_q_heads;   // H
  int64_t num_kv_heads;  // K
  int64_t head_dim;      // D: 64, 128 or 256
  int64_t stride_q_b, stride_q_h;
  int64_t max_len;  // P * N, bounds every seq_lens[b] (used only to size the split count)
  int64_t window;   // 0: none
  int64_t num_splits;
  float scale;
  DType dtype;
};

// Extend: q [T, H, D] (unit stride in D), request b owns rows cu_seqlens_q[b] : cu_seqlens_q[b+1];
// out [T, H, D] contiguous and zero-filled by the caller (rows owned by no request stay zero).
struct ExtendParams {
  const void* q;
  void* out;
  const int32_t* cu_seqlens_q;
  const int32_t* seq_lens;
  PagedKV kv;
  int64_t num_tokens;  // T
  int64_t batch;       // B
  int64_t num_q_heads;
  int64_t num_kv_heads;
  int64_t head_dim;  // 64, 128 or 256
  int64_t stride_q_t, stride_q_h;
  int64_t window;
  float scale;
  DType dtype;
};

// Whether a head dim has compiled kernels (the attention kernels are templated on it).
inline bool supported_head_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

// Whether the tensor-core path can run for these inputs on the current device: fp16/bf16, K/V rows 16-byte
// aligned (vector loads), and the kernel binary built for sm_80+ (checked on the loaded binary, so a PTX
// fallback for an older arch JIT-compiled on a newer GPU still takes the scalar path) and no ASTRAI_NO_MMA.
bool decode_can_use_mma(const DecodeParams& p);
bool extend_can_use_mma(const ExtendParams& p);

// Split-KV count for a decode launch (shapes only, never device data): enough blocks to fill the GPU.
int64_t decode_num_splits(const DecodeParams& p, bool use_mma);

// Launchers. `use_mma` must come from *_can_use_mma (the scalar fp32-FMA path runs otherwise);
// for decode, p.num_splits must equal decode_num_splits(p, use_mma) and size o_part / ml_part.
cudaError_t launch_rotary(const RotaryParams& p, cudaStream_t stream);
cudaError_t launch_decode_attention(const DecodeParams& p, bool use_mma, cudaStream_t stream);
cudaError_t launch_extend_attention(const ExtendParams& p, bool use_mma, cudaStream_t stream);

}  // namespace astrai_cuda_ref
