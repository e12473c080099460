// Ragged paged extend attention (prefill, prefix-cache hits, chunked prefill), split-Q.
//
// Request b owns query rows cu_seqlens_q[b] : cu_seqlens_q[b+1] (n new tokens) and seq_lens[b] = prefix + n
// keys in the pool; its i-th new token sits at position p = prefix + i and attends to keys kp with kp <= p
// (full over the prefix, causal among the new tokens) and, when window > 0, kp > p - window.
//
// MMA path (fp16/bf16, sm_80+): one block per (64-row query tile of one request, query head), four warps
// of 16 rows. The grid's x dimension is the bound ceil(T / 64) + B on the total tile count (sum over b of
// ceil(n_b / 64)); each block finds its (request, tile) by a scan over cu_seqlens_q and blocks past the last
// tile exit, so the grid comes from shapes only. Key tiles of 32 positions between the block's lowest
// visible key (window) and its last row's position (causal) are staged in padded shared memory; each warp
// skips tiles outside its own rows' range. S = Q K^T and O += P V run on mma.m16n8k16 with an online softmax
// on the accumulators (FlashAttention-2, arXiv 2307.08691). Shared memory: (64 + 2 * 32) * (D + 8) halves
// (67.5 KB for D = 256, opted in with cudaFuncAttributeMaxDynamicSharedMemorySize).
// Scalar path (fp32 inputs, sm < 80, or allow_mma=False): one warp per (query row, head), the row's request
// found by binary search over cu_seqlens_q, and a per-key online softmax (attend_row_scalar).
// Rows of q outside cu_seqlens_q[0] : cu_seqlens_q[B] are never written (the caller zero-fills out).
// Not pipelined (no cp.async) and no split-KV for long prefixes: a readable reference, not the fast path.
#include "common.cuh"

namespace astrai_cuda_ref {
namespace {

constexpr int kRows = 64;        // query rows per MMA block
constexpr int kWarps = 4;        // 16 rows per warp
constexpr int kKeys = 32;        // keys per shared-memory tile
constexpr int kScalarRows = 4;   // query rows (one per warp) per scalar block

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <int D>
constexpr size_t mma_smem_bytes() {
  return static_cast<size_t>(kRows + 2 * kKeys) * (D + 8) * sizeof(uint16_t);
}

// Maps block `tile` to (request b, first query row qs of the tile within the request); false past the end.
__device__ __forceinline__ bool find_tile(const ExtendParams& p, int64_t tile, int64_t& b, int64_t& qs) {
  for (int64_t i = 0; i < p.batch; ++i) {
    const int64_t n = p.cu_seqlens_q[i + 1] - p.cu_seqlens_q[i];
    const int64_t tiles = n > 0 ? (n + kRows - 1) / kRows : 0;
    if (tile < tiles) {
      b = i;
      qs = tile * kRows;
      return true;
    }
    tile -= tiles;
  }
  return false;
}

// Scales the scores of one warp's key tile (keys pos0 + 8n + 2t + {0, 1}) and masks the invisible ones: a
// key kp is visible to the lane's row r (position row_pos[r]) when the row exists, kp <= row_pos (causal)
// and kp > row_pos - window (when windowed).
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], int64_t pos0, const int64_t (&row_pos)[2],
                                            const bool (&row_ok)[2], int64_t window, float qk_scale, int t) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;
      const int64_t kp = pos0 + n * 8 + 2 * t + (e & 1);
      const bool visible = row_ok[r] && kp <= row_pos[r] && (window <= 0 || kp > row_pos[r] - window);
      s[n][e] = visible ? s[n][e] * qk_scale : -INFINITY;
    }
}

// Normalises and writes the lane's two output rows (global query rows rows[r], head h) of the accumulator.
template <typename T, int D>
__device__ __forceinline__ void store_rows(const ExtendParams& p, const float (&acc)[D / 8][4], const float (&l)[2],
                                           const int64_t (&rows)[2], const bool (&row_ok)[2], int64_t h, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float row_l = quad_sum(l[r]);  // every lane joins the shuffle before the row filter below
    if (!row_ok[r]) continue;
    const float inv = row_l > 0.f ? 1.f / row_l : 0.f;
    T* o = static_cast<T*>(p.out) + (rows[r] * p.num_q_heads + h) * D;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<uint32_t*>(o + j * 8 + 2 * t) = pack2<T>(acc[j][2 * r] * inv, acc[j][2 * r + 1] * inv);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kWarps * kWarp) extend_mma_kernel(const ExtendParams p) {
  constexpr int LD = D + 8;  // padded row: 8-lane groups hit distinct banks
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* q_s = smem;              // [kRows, LD]
  uint16_t* k_s = q_s + kRows * LD;  // [kKeys, LD]
  uint16_t* v_s = k_s + kKeys * LD;  // [kKeys, LD]
  int64_t b, qs;
  if (!find_tile(p, blockIdx.x, b, qs)) return;  // same answer for every thread of the block
  const int tid = threadIdx.x, warp = tid / kWarp, g = (tid % kWarp) >> 2, t = tid & 3;
  const int64_t h = blockIdx.y, kh = h / (p.num_q_heads / p.num_kv_heads);
  const int64_t q0 = p.cu_seqlens_q[b], q_len = p.cu_seqlens_q[b + 1] - q0;
  const int64_t prefix = p.seq_lens[b] - q_len;
  const int64_t qe = qs + kRows < q_len ? qs + kRows : q_len;  // this block: rows [qs, qe) of the request

  const uint16_t* q = static_cast<const uint16_t*>(p.q) + h * p.stride_q_h;
  for (int i = tid; i < kRows * D; i += kWarps * kWarp) {
    const int r = i / D, c = i % D;
    q_s[r * LD + c] = qs + r < qe ? q[(q0 + qs + r) * p.stride_q_t + c] : uint16_t(0);
  }
  // Key ranges: the block's union [kv_lo, kv_hi) and this warp's rows' union [w_lo, w_hi).
  const int64_t ws = qs + warp * 16, we = ws + 16 < qe ? ws + 16 : qe;
  const int64_t kv_lo = p.window > 0 && prefix + qs - p.window + 1 > 0 ? prefix + qs - p.window + 1 : 0;
  const int64_t kv_hi = prefix + qe;
  const int64_t w_lo = p.window > 0 && prefix + ws - p.window + 1 > 0 ? prefix + ws - p.window + 1 : 0;
  const int64_t w_hi = prefix + we;
  const int64_t rows[2] = {q0 + ws + g, q0 + ws + g + 8};  // the lane's accumulator rows (global)
  const int64_t row_pos[2] = {prefix + ws + g, prefix + ws + g + 8};
  const bool row_ok[2] = {ws + g < qe, ws + g + 8 < qe};

  const int32_t* bt_row = p.kv.block_table + b * p.kv.stride_bt;
  float acc[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  for (int64_t pos0 = kv_lo; pos0 < kv_hi; pos0 += kKeys) {
    __syncthreads();  // the previous tile's fragments (and the Q tile on entry) are complete / consumed
    load_kv_tile<D>(k_s, v_s, LD, kKeys, p.kv, bt_row, kh * p.kv.stride_h, pos0, kv_hi, tid, kWarps * kWarp);
    __syncthreads();
    if (ws >= qe || pos0 >= w_hi || pos0 + kKeys <= w_lo) continue;  // warp-uniform; barriers stay matched
    float s[kKeys / 8][4];
    warp_qk<T, kKeys / 8, D>(s, q_s, k_s, LD, warp * 16, g, t);
    mask_scores<kKeys / 8>(s, pos0, row_pos, row_ok, p.window, p.scale * kLog2e, t);
    online_softmax_mma<kKeys / 8, D / 8>(s, m, l, acc);
    warp_pv<T, kKeys / 8, D>(acc, s, v_s, LD, g, t);
  }
  store_rows<T, D>(p, acc, l, rows, row_ok, h, t);
}

template <typename T, int D>
__global__ void __launch_bounds__(kScalarRows * kWarp) extend_scalar_kernel(const ExtendParams p) {
  constexpr int E = D / kWarp;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kScalarRows + warp;  // global query row
  const int64_t h = blockIdx.y;
  const int32_t* cu = p.cu_seqlens_q;
  if (row >= p.num_tokens || row < cu[0] || row >= cu[p.batch]) return;  // warp-uniform; row stays zero
  // Largest b with cu[b] <= row: a non-empty request, since an empty one has cu[b + 1] == cu[b] <= row.
  int64_t lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (cu[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t b = lo;
  const int64_t pos = p.seq_lens[b] - (cu[b + 1] - cu[b]) + (row - cu[b]);
  const int64_t key_lo = p.window > 0 && pos - p.window + 1 > 0 ? pos - p.window + 1 : 0;
  const int64_t kh = h / (p.num_q_heads / p.num_kv_heads);

  const T* q = static_cast<const T*>(p.q) + row * p.stride_q_t + h * p.stride_q_h;
  const float qk_scale = p.scale * kLog2e;
  float qr[E], acc[E];
#pragma unroll
  for (int j = 0; j < E; ++j) {
    qr[j] = to_float(q[lane + j * kWarp]) * qk_scale;
    acc[j] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  attend_row_scalar<T, D>(qr, p.kv, p.kv.block_table + b * p.kv.stride_bt, kh * p.kv.stride_h, key_lo, pos + 1,
                          lane, m, l, acc);
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* o = static_cast<T*>(p.out) + (row * p.num_q_heads + h) * D;
#pragma unroll
  for (int j = 0; j < E; ++j) o[lane + j * kWarp] = from_float<T>(acc[j] * inv);
}

template <typename T, int D>
cudaError_t launch_typed(const ExtendParams& p, bool use_mma, cudaStream_t stream) {
  const unsigned heads = static_cast<unsigned>(p.num_q_heads);
  if (use_mma) {
    if constexpr (std::is_same_v<T, float>) {
      return cudaErrorInvalidValue;  // no fp32 tensor-core path; extend_can_use_mma never selects it
    } else {
      constexpr size_t smem = mma_smem_bytes<D>();
      cudaError_t err =
          cudaFuncSetAttribute(extend_mma_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (err != cudaSuccess) return err;
      const dim3 grid(static_cast<unsigned>(ceil_div(p.num_tokens, kRows) + p.batch), heads);
      extend_mma_kernel<T, D><<<grid, kWarps * kWarp, smem, stream>>>(p);
    }
  } else {
    const dim3 grid(static_cast<unsigned>(ceil_div(p.num_tokens, kScalarRows)), heads);
    extend_scalar_kernel<T, D><<<grid, kScalarRows * kWarp, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dim(const ExtendParams& p, bool use_mma, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_typed<T, 64>(p, use_mma, stream);
    case 128: return launch_typed<T, 128>(p, use_mma, stream);
    case 256: return launch_typed<T, 256>(p, use_mma, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool extend_can_use_mma(const ExtendParams& p) {
  if (p.dtype == DType::kFloat32 || !supported_head_dim(p.head_dim) || !kv_rows_aligned(p.kv)) return false;
  // Every instantiation is compiled for the same archs, so one probe stands for all of them.
  static MmaProbe probe(reinterpret_cast<const void*>(&extend_mma_kernel<__half, 64>));
  return probe.get();
}

cudaError_t launch_extend_attention(const ExtendParams& p, bool use_mma, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.batch == 0 || p.num_q_heads == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat32: return launch_dim<float>(p, false, stream);
    case DType::kFloat16: return launch_dim<__half>(p, use_mma, stream);
    case DType::kBFloat16: return launch_dim<__nv_bfloat16>(p, use_mma, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace astrai_cuda_ref
