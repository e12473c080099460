// C entry points of the emulated cuda_ref kernels, called through ctypes by tests/cuda_ref/_cuda_sim.py.
//
// They fill the launcher structs of cuda_ref/launch.cuh the way cuda_ref/bindings.cpp does (caches and
// outputs contiguous, scratch for decode poisoned with NaN because the real one is uninitialised) and run
// the launcher under the emulator. Each returns 0 on success, else the cudaError_t, with the emulator's
// message available from sim_message().
#include <limits>
#include <vector>

#include "launch.cuh"

using namespace astrai_cuda_ref;

namespace {

int finish(cudaError_t launch_err) {
  if (sim::g_error != cudaSuccess) return static_cast<int>(sim::g_error);
  return static_cast<int>(launch_err);
}

void reset() {
  sim::g_error = cudaSuccess;
  sim::g_message.clear();
}

PagedKV paged(const void* k_cache, const void* v_cache, const int32_t* block_table, int64_t num_kv_heads,
              int64_t head_dim, int64_t max_pages, int64_t page_size) {
  return PagedKV{k_cache, v_cache, num_kv_heads * head_dim, head_dim, block_table, max_pages, page_size};
}

}  // namespace

extern "C" {

const char* sim_message() { return sim::g_message.c_str(); }

int sim_rotary(const void* q, const void* k, void* q_out, void* k_out, const float* cos, const float* sin,
               const int64_t* positions, int64_t T, int64_t H, int64_t K, int64_t D, int64_t R, int64_t sqt,
               int64_t sqh, int64_t skt, int64_t skh, int interleaved, int dtype) {
  reset();
  const RotaryParams p{q, k, q_out, k_out, cos, sin, positions, T, H, K, D, R, sqt, sqh, skt, skh, D / 2,
                       interleaved != 0, static_cast<DType>(dtype)};
  return finish(launch_rotary(p, nullptr));
}

int sim_decode(const void* q, const void* k_cache, const void* v_cache, const int32_t* block_table,
               const int32_t* seq_lens, void* out, int64_t B, int64_t H, int64_t K, int64_t D, int64_t P,
               int64_t page_size, int64_t sqb, int64_t sqh, int64_t window, float scale, int dtype, int use_mma,
               int64_t* num_splits) {
  reset();
  DecodeParams p{};
  p.q = q;
  p.out = out;
  p.seq_lens = seq_lens;
  p.kv = paged(k_cache, v_cache, block_table, K, D, P, page_size);
  p.batch = B;
  p.num_q_heads = H;
  p.num_kv_heads = K;
  p.head_dim = D;
  p.stride_q_b = sqb;
  p.stride_q_h = sqh;
  p.max_len = P * page_size;
  p.window = window;
  p.scale = scale;
  p.dtype = static_cast<DType>(dtype);
  p.num_splits = decode_num_splits(p, use_mma != 0);
  *num_splits = p.num_splits;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> o_part(p.num_splits * B * H * D, nan), ml_part(p.num_splits * B * H * 2, nan);
  p.o_part = o_part.data();
  p.ml_part = ml_part.data();
  return finish(launch_decode_attention(p, use_mma != 0, nullptr));
}

int sim_extend(const void* q, const void* k_cache, const void* v_cache, const int32_t* cu_seqlens_q,
               const int32_t* seq_lens, const int32_t* block_table, void* out, int64_t T, int64_t B, int64_t H,
               int64_t K, int64_t D, int64_t P, int64_t page_size, int64_t sqt, int64_t sqh, int64_t window,
               float scale, int dtype, int use_mma) {
  reset();
  ExtendParams p{};
  p.q = q;
  p.out = out;
  p.cu_seqlens_q = cu_seqlens_q;
  p.seq_lens = seq_lens;
  p.kv = paged(k_cache, v_cache, block_table, K, D, P, page_size);
  p.num_tokens = T;
  p.batch = B;
  p.num_q_heads = H;
  p.num_kv_heads = K;
  p.head_dim = D;
  p.stride_q_t = sqt;
  p.stride_q_h = sqh;
  p.window = window;
  p.scale = scale;
  p.dtype = static_cast<DType>(dtype);
  return finish(launch_extend_attention(p, use_mma != 0, nullptr));
}

}  // extern "C"
