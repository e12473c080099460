// Paged split-KV decode attention (flash-decoding): one query token per request over its cached keys.
//
//   out[b, h] = softmax_j(scale * q[b, h] . K[j, h / G]) V[j, h / G],  L - window <= j < L  (L = seq_lens[b])
//
// Stage 1, one block per (request, kv head, head pass, split): the split covers a contiguous run of 16-token
// tiles of the request's visible range and writes an unnormalised fp32 partial output plus (m, l), its
// running max (log2 domain) and softmax denominator. Empty splits write m = -inf, l = 0, o = 0.
//   - MMA path (fp16/bf16, sm_80+): one warp; the G query heads of the kv head are packed as the M = 16 rows
//     of mma.m16n8k16 (passes of 16 heads when G > 16, zero rows when G < 16), so each K/V tile is read
//     once per group. S = Q K^T and O += P V both run on tensor cores; Q, K, V tiles sit in padded shared
//     memory (row stride D + 8 halves: conflict-free fragment reads).
//   - Scalar path (fp32 inputs, sm < 80, or allow_mma=False): four warps, each attends one head of the group
//     at a time with a per-key online softmax (attend_row_scalar); K/V rows are shared through L1.
// Stage 2, one block of D threads per (request, query head): log-sum-exp merge of the splits.
//
// Split count (decode_num_splits): enough stage-1 blocks (~512) to fill the GPU, at most 32 splits and at
// least 2 tiles per split, from shapes only (B, K, P * N, window), so the launch never syncs.
// Not pipelined (no cp.async): this is a readable reference and a fallback, not the fast path.
#include "common.cuh"

namespace astrai_cuda_ref {
namespace {

constexpr int kTile = 16;         // keys per tile (one k-step of the P V product)
constexpr int kMmaRows = 16;      // query heads per MMA pass
constexpr int kScalarWarps = 4;   // warps per scalar stage-1 block
constexpr int kTargetBlocks = 512;
constexpr int kMaxSplits = 32;
constexpr int kMinTilesPerSplit = 2;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Key range [start, end) of split `split` for a request of length L (visible range [lo, L)).
__device__ __forceinline__ void split_range(int64_t L, int64_t window, int64_t num_splits, int64_t split,
                                            int64_t& start, int64_t& end) {
  L = L > 0 ? L : 0;
  const int64_t lo = (window > 0 && L > window) ? L - window : 0;
  const int64_t tiles = (L - lo + kTile - 1) / kTile;
  const int64_t per_split = (tiles + num_splits - 1) / num_splits;
  start = lo + split * per_split * kTile;
  end = start + per_split * kTile < L ? start + per_split * kTile : L;
}

// Partial row (split, b, h): index into o_part / ml_part (divide by D / 2 respectively).
__device__ __forceinline__ int64_t part_row(const DecodeParams& p, int64_t split, int64_t b, int64_t h) {
  return (split * p.batch + b) * p.num_q_heads + h;
}

// Writes the MMA warp's partial results: accumulator rows g and g + 8 (query heads h0 + row, if row < rows)
// unnormalised into o_part, and (m, l) with l summed over the quad into ml_part.
template <int D>
__device__ __forceinline__ void store_partials(const DecodeParams& p, const float (&acc)[D / 8][4],
                                               const float (&m)[2], const float (&l)[2], int64_t split, int64_t b,
                                               int64_t h0, int rows, int g, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    const float row_l = quad_sum(l[r]);  // every lane joins the shuffle before the row filter below
    if (row >= rows) continue;
    const int64_t pr = part_row(p, split, b, h0 + row);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<float2*>(p.o_part + pr * D + j * 8 + 2 * t) = make_float2(acc[j][2 * r], acc[j][2 * r + 1]);
    }
    if (t == 0) *reinterpret_cast<float2*>(p.ml_part + pr * 2) = make_float2(m[r], row_l);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kWarp) decode_mma_kernel(const DecodeParams p) {
  constexpr int LD = D + 8;  // padded row: 8-lane groups hit distinct banks
  __shared__ __align__(16) uint16_t q_s[kMmaRows * LD];
  __shared__ __align__(16) uint16_t k_s[kTile * LD];
  __shared__ __align__(16) uint16_t v_s[kTile * LD];
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t passes = (group + kMmaRows - 1) / kMmaRows;
  const int64_t pass = blockIdx.x % passes;
  const int64_t kh = (blockIdx.x / passes) % p.num_kv_heads;
  const int64_t b = blockIdx.x / (passes * p.num_kv_heads);
  const int64_t split = blockIdx.y;
  const int64_t h0 = kh * group + pass * kMmaRows;
  const int rows = static_cast<int>(group - pass * kMmaRows < kMmaRows ? group - pass * kMmaRows : kMmaRows);

  int64_t start, end;
  split_range(p.seq_lens[b], p.window, p.num_splits, split, start, end);
  const int32_t* bt_row = p.kv.block_table + b * p.kv.stride_bt;
  const int64_t head_off = kh * p.kv.stride_h;

  const uint16_t* q = static_cast<const uint16_t*>(p.q) + b * p.stride_q_b;
  for (int i = lane; i < kMmaRows * D; i += kWarp) {
    const int r = i / D, c = i % D;
    q_s[r * LD + c] = r < rows ? q[(h0 + r) * p.stride_q_h + c] : uint16_t(0);
  }

  float acc[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float qk_scale = p.scale * kLog2e;
  for (int64_t pos0 = start; pos0 < end; pos0 += kTile) {
    __syncthreads();  // the previous tile's fragments are read before the tiles are overwritten
    load_kv_tile<D>(k_s, v_s, LD, kTile, p.kv, bt_row, head_off, pos0, end, lane, kWarp);
    __syncthreads();
    float s[2][4];
    warp_qk<T, 2, D>(s, q_s, k_s, LD, 0, g, t);
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool visible = pos0 + n * 8 + 2 * t + (e & 1) < end;
        s[n][e] = visible ? s[n][e] * qk_scale : -INFINITY;
      }
    online_softmax_mma<2, D / 8>(s, m, l, acc);
    warp_pv<T, 2, D>(acc, s, v_s, LD, g, t);
  }
  store_partials<D>(p, acc, m, l, split, b, h0, rows, g, t);
}

template <typename T, int D>
__global__ void __launch_bounds__(kScalarWarps * kWarp) decode_scalar_kernel(const DecodeParams p) {
  constexpr int E = D / kWarp;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t kh = blockIdx.x % p.num_kv_heads;
  const int64_t b = blockIdx.x / p.num_kv_heads;
  const int64_t split = blockIdx.y;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  int64_t start, end;
  split_range(p.seq_lens[b], p.window, p.num_splits, split, start, end);
  const int32_t* bt_row = p.kv.block_table + b * p.kv.stride_bt;
  const float qk_scale = p.scale * kLog2e;

  for (int64_t h = kh * group + warp; h < (kh + 1) * group; h += kScalarWarps) {
    const T* q = static_cast<const T*>(p.q) + b * p.stride_q_b + h * p.stride_q_h;
    float qr[E], acc[E];
#pragma unroll
    for (int j = 0; j < E; ++j) {
      qr[j] = to_float(q[lane + j * kWarp]) * qk_scale;
      acc[j] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    attend_row_scalar<T, D>(qr, p.kv, bt_row, kh * p.kv.stride_h, start, end, lane, m, l, acc);
    const int64_t pr = part_row(p, split, b, h);
#pragma unroll
    for (int j = 0; j < E; ++j) p.o_part[pr * D + lane + j * kWarp] = acc[j];
    if (lane == 0) {
      p.ml_part[pr * 2] = m;
      p.ml_part[pr * 2 + 1] = l;
    }
  }
}

// Stage 2: out[b, h, d] = sum_s 2^(m_s - M) o_s[d] / sum_s 2^(m_s - M) l_s, M = max_s m_s; zero when every
// split was empty (seq_lens[b] == 0).
template <typename T>
__global__ void decode_combine_kernel(const DecodeParams p) {
  const int64_t b = blockIdx.x / p.num_q_heads, h = blockIdx.x % p.num_q_heads;
  const int d = threadIdx.x;
  float m_max = -INFINITY;
  for (int64_t s = 0; s < p.num_splits; ++s) m_max = fmaxf(m_max, p.ml_part[part_row(p, s, b, h) * 2]);
  float num = 0.f, den = 0.f;
  if (m_max != -INFINITY) {
    for (int64_t s = 0; s < p.num_splits; ++s) {
      const int64_t pr = part_row(p, s, b, h);
      const float w = exp2f(p.ml_part[pr * 2] - m_max);  // 0 for empty splits (m = -inf)
      num += w * p.o_part[pr * p.head_dim + d];
      den += w * p.ml_part[pr * 2 + 1];
    }
  }
  T* out = static_cast<T*>(p.out) + (b * p.num_q_heads + h) * p.head_dim;
  out[d] = from_float<T>(den > 0.f ? num / den : 0.f);
}

template <typename T, int D>
cudaError_t launch_typed(const DecodeParams& p, bool use_mma, cudaStream_t stream) {
  if (use_mma) {
    if constexpr (std::is_same_v<T, float>) {
      return cudaErrorInvalidValue;  // no fp32 tensor-core path; *_can_use_mma never selects it
    } else {
      const int64_t passes = ceil_div(p.num_q_heads / p.num_kv_heads, kMmaRows);
      const dim3 grid(static_cast<unsigned>(p.batch * p.num_kv_heads * passes), static_cast<unsigned>(p.num_splits));
      decode_mma_kernel<T, D><<<grid, kWarp, 0, stream>>>(p);
    }
  } else {
    const dim3 grid(static_cast<unsigned>(p.batch * p.num_kv_heads), static_cast<unsigned>(p.num_splits));
    decode_scalar_kernel<T, D><<<grid, kScalarWarps * kWarp, 0, stream>>>(p);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  decode_combine_kernel<T><<<static_cast<unsigned>(p.batch * p.num_q_heads), D, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dim(const DecodeParams& p, bool use_mma, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_typed<T, 64>(p, use_mma, stream);
    case 128: return launch_typed<T, 128>(p, use_mma, stream);
    case 256: return launch_typed<T, 256>(p, use_mma, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool decode_can_use_mma(const DecodeParams& p) {
  if (p.dtype == DType::kFloat32 || !supported_head_dim(p.head_dim)) return false;
  if (!kv_rows_aligned(p.kv)) return false;
  // Every instantiation is compiled for the same archs, so one probe stands for all of them.
  static MmaProbe probe(reinterpret_cast<const void*>(&decode_mma_kernel<__half, 64>));
  return probe.get();
}

int64_t decode_num_splits(const DecodeParams& p, bool use_mma) {
  const int64_t passes = use_mma ? ceil_div(p.num_q_heads / p.num_kv_heads, kMmaRows) : 1;
  const int64_t base = p.batch * p.num_kv_heads * passes;
  const int64_t len = p.window > 0 && p.window < p.max_len ? p.window : p.max_len;
  int64_t limit = ceil_div(len, kTile) / kMinTilesPerSplit;
  limit = limit < 1 ? 1 : (limit > kMaxSplits ? kMaxSplits : limit);
  const int64_t want = base > 0 ? ceil_div(kTargetBlocks, base) : 1;
  return want < 1 ? 1 : (want > limit ? limit : want);
}

cudaError_t launch_decode_attention(const DecodeParams& p, bool use_mma, cudaStream_t stream) {
  if (p.batch == 0 || p.num_q_heads == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat32: return launch_dim<float>(p, false, stream);
    case DType::kFloat16: return launch_dim<__half>(p, use_mma, stream);
    case DType::kBFloat16: return launch_dim<__nv_bfloat16>(p, use_mma, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace astrai_cuda_ref
