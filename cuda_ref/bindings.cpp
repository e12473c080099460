// Torch bindings of the CUDA reference kernels: the ops astrai_cuda_ref::{rotary, decode_attention,
// extend_attention} (TORCH_LIBRARY, so they are torch ops with CUDA and Meta kernels; the Meta kernels give
// shapes to FakeTensor / torch.compile).
//
// Each CUDA kernel checks its inputs (TORCH_CHECK), sets the device with an OptionalCUDAGuard, launches on
// the current stream of that device, and checks the launch: the launchers (launch.cuh) return the result of
// cudaGetLastError() after every kernel launch and C10_CUDA_CHECK raises on anything but cudaSuccess (the
// same check as C10_CUDA_KERNEL_LAUNCH_CHECK, which reads cudaGetLastError() once more). The stream comes
// from c10/cuda/CUDAStream.h (at::cuda::getCurrentCUDAStream is the same function re-exported by ATen),
// which keeps this file free of the cuBLAS headers that ATen/cuda/CUDAContext.h pulls in.
// The Python wrappers in cuda_ref/__init__.py run the same checks first and raise ValueError.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "launch.cuh"

namespace astrai_cuda_ref {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "cuda_ref: unsupported dtype ", t.scalar_type(), " (float32, float16, bfloat16)");
  }
}

void check_on(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), "cuda_ref: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), "cuda_ref: ", name, " is on ", t.device(), ", q on ", like.device());
}

void check_index(const at::Tensor& t, const char* name, int64_t dim, const at::Tensor& q) {
  check_on(t, name, q);
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == dim && t.stride(-1) == 1, "cuda_ref: ", name,
              " must be int32 with ", dim, " dims and a contiguous last dim");
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Checks q [*, H, D] against the pool [S, K, D] and the block table, and describes the pool.
PagedKV check_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_table, int64_t page_size) {
  check_on(q, "q", q);
  check_on(k_cache, "k_cache", q);
  check_on(v_cache, "v_cache", q);
  check_index(block_table, "block_table", 2, q);
  dtype_of(q);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3, "cuda_ref: q and k_cache must have 3 dims");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "cuda_ref: k_cache and v_cache must have the same shape and strides");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "cuda_ref: q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(supported_head_dim(q.size(2)) && k_cache.size(2) == q.size(2),
              "cuda_ref: head dim must be 64, 128 or 256 and match between q and the caches");
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0, "cuda_ref: H must be a multiple of K");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1, "cuda_ref: q and caches need a contiguous last dim");
  TORCH_CHECK(page_size > 0, "cuda_ref: page_size must be positive");
  return PagedKV{k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                 block_table.data_ptr<int32_t>(), block_table.stride(0), page_size};
}

at::Tensor decode_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t page_size,
                                 double scale, int64_t window, bool allow_mma) {
  const PagedKV kv = check_paged(q, k_cache, v_cache, block_table, page_size);
  check_index(seq_lens, "seq_lens", 1, q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(seq_lens.size(0) == B && block_table.size(0) == B, "cuda_ref: seq_lens / block_table need B rows");
  TORCH_CHECK(window >= 0, "cuda_ref: window must be >= 0");
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  at::Tensor out = at::empty({B, H, D}, q.options());
  DecodeParams p{};
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.kv = kv;
  p.batch = B;
  p.num_q_heads = H;
  p.num_kv_heads = k_cache.size(1);
  p.head_dim = D;
  p.stride_q_b = q.stride(0);
  p.stride_q_h = q.stride(1);
  p.max_len = block_table.size(1) * page_size;
  p.window = window;
  p.scale = static_cast<float>(scale);
  p.dtype = dtype_of(q);
  const bool use_mma = allow_mma && decode_can_use_mma(p);
  p.num_splits = decode_num_splits(p, use_mma);
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor o_part = at::empty({p.num_splits, B, H, D}, f32);  // fully written by stage 1
  at::Tensor ml_part = at::empty({p.num_splits, B, H, 2}, f32);
  p.o_part = o_part.data_ptr<float>();
  p.ml_part = ml_part.data_ptr<float>();
  C10_CUDA_CHECK(launch_decode_attention(p, use_mma, current_stream()));
  return out;
}

at::Tensor extend_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                 const at::Tensor& block_table, int64_t page_size, double scale, int64_t window,
                                 bool allow_mma) {
  const PagedKV kv = check_paged(q, k_cache, v_cache, block_table, page_size);
  check_index(cu_seqlens_q, "cu_seqlens_q", 1, q);
  check_index(seq_lens, "seq_lens", 1, q);
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(cu_seqlens_q.size(0) == B + 1 && block_table.size(0) == B,
              "cuda_ref: cu_seqlens_q needs B + 1 entries and block_table B rows");
  TORCH_CHECK(window >= 0, "cuda_ref: window must be >= 0");
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  at::Tensor out = at::zeros(q.sizes(), q.options());  // rows owned by no request stay zero
  ExtendParams p{};
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.kv = kv;
  p.num_tokens = q.size(0);
  p.batch = B;
  p.num_q_heads = q.size(1);
  p.num_kv_heads = k_cache.size(1);
  p.head_dim = q.size(2);
  p.stride_q_t = q.stride(0);
  p.stride_q_h = q.stride(1);
  p.window = window;
  p.scale = static_cast<float>(scale);
  p.dtype = dtype_of(q);
  const bool use_mma = allow_mma && extend_can_use_mma(p);
  C10_CUDA_CHECK(launch_extend_attention(p, use_mma, current_stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                               const at::Tensor& sin, const std::optional<at::Tensor>& positions,
                                               bool interleaved) {
  check_on(q, "q", q);
  check_on(k, "k", q);
  check_on(cos, "cos", q);
  check_on(sin, "sin", q);
  dtype_of(q);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "cuda_ref: q [T, H, D] and k [T, K, D] must share T and D");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "cuda_ref: q and k must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "cuda_ref: q and k need a contiguous last dim");
  const int64_t D = q.size(2);
  TORCH_CHECK(D % 2 == 0, "cuda_ref: head dim must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == D / 2,
              "cuda_ref: cos and sin must be contiguous float32 [R, D / 2]");
  if (positions.has_value()) {
    check_on(*positions, "positions", q);
    TORCH_CHECK(positions->scalar_type() == at::kLong && positions->dim() == 1 && positions->size(0) == q.size(0) &&
                    positions->is_contiguous(),
                "cuda_ref: positions must be contiguous int64 [T]");
  } else {
    TORCH_CHECK(cos.size(0) == q.size(0), "cuda_ref: without positions, cos / sin need one row per token");
  }
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  at::Tensor q_out = at::empty(q.sizes(), q.options());
  at::Tensor k_out = at::empty(k.sizes(), k.options());
  const RotaryParams p{q.data_ptr(),
                       k.data_ptr(),
                       q_out.data_ptr(),
                       k_out.data_ptr(),
                       cos.data_ptr<float>(),
                       sin.data_ptr<float>(),
                       positions.has_value() ? positions->data_ptr<int64_t>() : nullptr,
                       q.size(0),
                       q.size(1),
                       k.size(1),
                       D,
                       cos.size(0),
                       q.stride(0),
                       q.stride(1),
                       k.stride(0),
                       k.stride(1),
                       cos.stride(0),
                       interleaved,
                       dtype_of(q)};
  C10_CUDA_CHECK(launch_rotary(p, current_stream()));
  return {q_out, k_out};
}

// Meta kernels: output shapes and dtypes only.
at::Tensor decode_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, int64_t, double, int64_t, bool) {
  return at::empty(q.sizes(), q.options());
}

at::Tensor extend_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, int64_t, double, int64_t, bool) {
  return at::empty(q.sizes(), q.options());
}

std::tuple<at::Tensor, at::Tensor> rotary_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor&,
                                               const at::Tensor&, const std::optional<at::Tensor>&, bool) {
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options())};
}

}  // namespace
}  // namespace astrai_cuda_ref

TORCH_LIBRARY(astrai_cuda_ref, m) {
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? positions, bool interleaved) -> (Tensor, Tensor)");
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
      "int page_size, float scale, int window, bool allow_mma) -> Tensor");
  m.def(
      "extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor seq_lens, "
      "Tensor block_table, int page_size, float scale, int window, bool allow_mma) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cuda_ref, CUDA, m) {
  m.impl("rotary", &astrai_cuda_ref::rotary_cuda);
  m.impl("decode_attention", &astrai_cuda_ref::decode_attention_cuda);
  m.impl("extend_attention", &astrai_cuda_ref::extend_attention_cuda);
}

TORCH_LIBRARY_IMPL(astrai_cuda_ref, Meta, m) {
  m.impl("rotary", &astrai_cuda_ref::rotary_meta);
  m.impl("decode_attention", &astrai_cuda_ref::decode_attention_meta);
  m.impl("extend_attention", &astrai_cuda_ref::extend_attention_meta);
}
