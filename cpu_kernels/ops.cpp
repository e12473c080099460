/* The CPU kernels of the `astrai::cpu_decode_attention`, `astrai::cpu_matvec` and `astrai::cpu_lora_delta` ops, in C++ against torch's
 * stable ABI: the dispatcher calls the C kernels of this folder with no Python in between.
 *
 * Why: compiled decode steps call these ops from inductor's Python wrapper once per layer (attention) or once per
 * group of products (matvec, 2-8 rows), ~30-120 calls a token. Through the Python implementations
 * (`decode_attention.py`, `matvec.py`) a call cost ~13 us of dispatch, checks and ctypes against ~5 us for the
 * bare kernel call at 16 tokens; here it costs about the bare call (docs/benchmarks.md, "CPU ops in C++"). The
 * Python implementations stay registered under CompositeExplicitAutograd and serve wherever this file cannot be
 * built; a CPU kernel registered here takes precedence over them on CPU tensors.
 *
 * The stable headers compile in about a second (the full ATen ones take tens). The C kernels are not linked in:
 * `library.py` builds them with the C compiler and hands their addresses to `astrai_ops_bind` after loading this
 * library. The checks are those of the Python implementations; a failed one raises a RuntimeError naming it.
 */
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

namespace {

/* the C kernels' signatures (decode_attention.c, matvec.c); element pointers are untyped here */
using AttentionFn = int (*)(const void *q, long B, long H, long D, const void *k, const void *v, long Kh, long k_s0,
                            long k_s1, long v_s0, long v_s1, long pool_rows, const int32_t *table, long table_s0,
                            long width, const int32_t *lens, long page_size, float scale, long window, void *out,
                            int threads);
using MatvecFn = void (*)(const void *x, long M, long K, const void *const *ws, const long *ns, long count, float *y,
                          int threads);

using LoraFn = int (*)(const void *x, long M, long K, const void *a, long S, long R, const void *b, long N,
                      const float *scaling, const int64_t *slots, float *y, int threads);

/* null where this CPU lacks the dtype's instructions (set once by `astrai_ops_bind`, before any call) */
AttentionFn attention_f32 = nullptr, attention_bf16 = nullptr;
MatvecFn matvec_f32 = nullptr, matvec_bf16 = nullptr, matvec_i8_f32 = nullptr, matvec_i8_bf16 = nullptr;
LoraFn lora_f32 = nullptr, lora_bf16 = nullptr;

constexpr int64_t kMaxGroup = 16, kMaxDim = 256; /* decode_attention.c's MAX_GROUP and MAX_DIM */

int threads() {
    uint32_t n = 1;
    STABLE_TORCH_ERROR_CODE_CHECK(torch_get_num_threads(&n));
    return n < 1 ? 1 : static_cast<int>(n);
}

/* `t` itself when contiguous (a dispatcher call less, ~1 us), else a contiguous copy */
Tensor dense(const Tensor &t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

const char *dtype_name(ScalarType t) {
    return t == ScalarType::Float ? "float32" : t == ScalarType::BFloat16 ? "bfloat16" : "another dtype";
}

Tensor cpu_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens,
                            int64_t page_size, double scale, int64_t window) {
    STD_TORCH_CHECK(q.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu() && block_table.is_cpu() && seq_lens.is_cpu(),
                    "every tensor must be on the CPU");
    ScalarType dtype = q.scalar_type();
    STD_TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
                    "q and the caches must share one dtype, got ", dtype_name(dtype), "/",
                    dtype_name(k_cache.scalar_type()), "/", dtype_name(v_cache.scalar_type()));
    AttentionFn kernel = dtype == ScalarType::Float ? attention_f32 : dtype == ScalarType::BFloat16 ? attention_bf16
                                                                                                    : nullptr;
    STD_TORCH_CHECK(dtype == ScalarType::Float || dtype == ScalarType::BFloat16,
                    "dtype ", dtype_name(dtype), " (wanted float32 or bfloat16)");
    STD_TORCH_CHECK(kernel != nullptr, "this CPU lacks ",
                    dtype == ScalarType::BFloat16 ? "AVX512-BF16" : "AVX-512 (F, BW, VL)");
    STD_TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
                    "q [B, H, D] and caches [S, Kh, D] must be 3-d, got ", q.dim(), "-d and ",
                    k_cache.dim(), "-d / ", v_cache.dim(), "-d");
    int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
    STD_TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && kv_heads == v_cache.size(1) &&
                        k_cache.size(2) == v_cache.size(2) && k_cache.size(2) == dim,
                    "the caches' shapes differ from each other or from q's head dim ", dim);
    STD_TORCH_CHECK(dim % 16 == 0 && dim <= kMaxDim && kv_heads > 0 && heads % kv_heads == 0 &&
                        heads / kv_heads <= kMaxGroup,
                    "head dim ", dim, " / heads ", heads, " over ", kv_heads,
                    " (wanted dim % 16 == 0, <= 256; <= 16 per KV head)");
    STD_TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
                    "the caches' last dim must be contiguous");
    STD_TORCH_CHECK(block_table.scalar_type() == ScalarType::Int && seq_lens.scalar_type() == ScalarType::Int &&
                        block_table.dim() == 2 && seq_lens.dim() == 1,
                    "block_table [B, P] and seq_lens [B] must be int32");
    STD_TORCH_CHECK(block_table.size(0) == batch && seq_lens.size(0) == batch && page_size >= 1,
                    "", batch, " queries, block_table rows ", block_table.size(0),
                    ", seq_lens ", seq_lens.size(0), ", page size ", page_size);
    if (batch == 0 || k_cache.size(0) < page_size) return torch::stable::new_zeros(q, {batch, heads, dim});
    Tensor out = torch::stable::new_empty(q, {batch, heads, dim});
    Tensor query = dense(q), lens = dense(seq_lens);
    Tensor table = block_table.stride(1) == 1 ? block_table : torch::stable::contiguous(block_table);
    int status = kernel(query.data_ptr(), batch, heads, dim, k_cache.data_ptr(), v_cache.data_ptr(), kv_heads,
                        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), k_cache.size(0),
                        static_cast<const int32_t *>(table.data_ptr()), table.stride(0), table.size(1),
                        static_cast<const int32_t *>(lens.data_ptr()), page_size, static_cast<float>(scale), window,
                        out.data_ptr(), threads());
    STD_TORCH_CHECK(status == 0, "could not allocate its split buffers");
    return out;
}

Tensor cpu_matvec(Tensor x, std::vector<Tensor> weights) {
    STD_TORCH_CHECK(x.dim() == 2 && !weights.empty(),
                    "takes x [M, K] and at least one weight, got a ", x.dim(), "-d x and ",
                    weights.size(), " weights");
    ScalarType dtype = x.scalar_type();
    /* weights of x's dtype, or all int8 (weight-only quantization: the product with their integer values) */
    bool int8 = weights[0].scalar_type() == ScalarType::Char;
    ScalarType kind = int8 ? ScalarType::Char : dtype;
    int64_t rows = x.size(0), depth = x.size(1), total = 0;
    for (const Tensor &w : weights) {
        STD_TORCH_CHECK(w.dim() == 2 && w.size(1) == depth && w.scalar_type() == kind && w.is_cpu() && x.is_cpu(),
                        "weight (", w.dim(), "-d, ", w.dim() == 2 ? w.size(1) : -1, " columns, ",
                        w.scalar_type() == ScalarType::Char ? "int8" : dtype_name(w.scalar_type()),
                        ") does not fit x [", rows, ", ", depth, "] ", dtype_name(dtype), " (wanted [N, ", depth,
                        "], every weight of x's dtype or every one int8, all on the CPU)");
        total += w.size(0);
    }
    MatvecFn kernel = dtype == ScalarType::Float      ? (int8 ? matvec_i8_f32 : matvec_f32)
                      : dtype == ScalarType::BFloat16 ? (int8 ? matvec_i8_bf16 : matvec_bf16)
                                                      : nullptr;
    STD_TORCH_CHECK(kernel != nullptr, "cannot run ", dtype_name(dtype), " here (",
                    dtype == ScalarType::BFloat16 ? "this CPU lacks AVX512-BF16"
                    : dtype == ScalarType::Float  ? "this CPU lacks AVX-512"
                                                  : "float32 and bfloat16 are supported",
                    "); astrai.cpu_kernels.matvec.matvec falls back to plain torch");
    if (depth == 0) return torch::stable::new_zeros(x, {rows, total}, ScalarType::Float);
    Tensor out = torch::stable::new_empty(x, {rows, total}, ScalarType::Float);
    if (rows == 0 || total == 0) return out;
    Tensor input = dense(x);
    std::vector<Tensor> held; /* contiguous copies of strided weights live until the kernel returns */
    std::vector<const void *> pointers;
    std::vector<long> counts;
    for (const Tensor &w : weights) {
        pointers.push_back(w.is_contiguous() ? w.data_ptr() : held.emplace_back(dense(w)).data_ptr());
        counts.push_back(w.size(0));
    }
    kernel(input.data_ptr(), rows, depth, pointers.data(), counts.data(), static_cast<long>(weights.size()),
           static_cast<float *>(out.data_ptr()), threads());
    return out;
}

/* lora.c's batched multi-LoRA update: x [M, K], a [S, R, K], b [N, S, R] of one dtype, scaling [S] float32,
 * slot_ids [M] int64 (-1: no adapter) -> [M, N] float32 */
Tensor cpu_lora_delta(Tensor x, Tensor a, Tensor b, Tensor scaling, Tensor slot_ids) {
    ScalarType dtype = x.scalar_type();
    STD_TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && b.dim() == 3 && scaling.dim() == 1 && slot_ids.dim() == 1,
                    "takes x [M, K], a [S, R, K], b [N, S, R], scaling [S] and slot_ids [M]");
    int64_t rows = x.size(0), depth = x.size(1), slots = a.size(0), rank = a.size(1), width = b.size(0);
    STD_TORCH_CHECK(a.size(2) == depth && b.size(1) == slots && b.size(2) == rank && scaling.size(0) == slots &&
                        slot_ids.size(0) == rows,
                    "shapes do not fit: x [", rows, ", ", depth, "], a [", slots, ", ", rank, ", ", a.size(2),
                    "], b [", width, ", ", b.size(1), ", ", b.size(2), "]");
    STD_TORCH_CHECK(a.scalar_type() == dtype && b.scalar_type() == dtype && scaling.scalar_type() == ScalarType::Float &&
                        slot_ids.scalar_type() == ScalarType::Long,
                    "x, a and b must share one dtype, scaling be float32 and slot_ids int64");
    STD_TORCH_CHECK(x.is_cpu() && a.is_cpu() && b.is_cpu() && scaling.is_cpu() && slot_ids.is_cpu(),
                    "every tensor must be on the CPU");
    LoraFn kernel = dtype == ScalarType::Float ? lora_f32 : dtype == ScalarType::BFloat16 ? lora_bf16 : nullptr;
    STD_TORCH_CHECK(kernel != nullptr, "cannot run ", dtype_name(dtype),
                    " here; astrai.cpu_kernels.lora.lora_delta falls back to plain torch");
    Tensor out = torch::stable::new_empty(x, {rows, width}, ScalarType::Float);
    if (rows == 0 || width == 0) return out;
    Tensor xs = dense(x), as = dense(a), bs = dense(b), ss = dense(scaling), ids = dense(slot_ids);
    int status = kernel(xs.data_ptr(), rows, depth, as.data_ptr(), slots, rank, bs.data_ptr(), width,
                        static_cast<const float *>(ss.data_ptr()), static_cast<const int64_t *>(ids.data_ptr()),
                        static_cast<float *>(out.data_ptr()), threads());
    STD_TORCH_CHECK(status == 0, "rank ", rank, " is above the kernel's 256");
    return out;
}

}  // namespace

extern "C" void astrai_ops_bind(void *attention_f32_fn, void *attention_bf16_fn, void *matvec_f32_fn,
                                void *matvec_bf16_fn, void *matvec_i8_f32_fn, void *matvec_i8_bf16_fn,
                                void *lora_f32_fn, void *lora_bf16_fn) {
    lora_f32 = reinterpret_cast<LoraFn>(lora_f32_fn);
    lora_bf16 = reinterpret_cast<LoraFn>(lora_bf16_fn);
    attention_f32 = reinterpret_cast<AttentionFn>(attention_f32_fn);
    attention_bf16 = reinterpret_cast<AttentionFn>(attention_bf16_fn);
    matvec_f32 = reinterpret_cast<MatvecFn>(matvec_f32_fn);
    matvec_bf16 = reinterpret_cast<MatvecFn>(matvec_bf16_fn);
    matvec_i8_f32 = reinterpret_cast<MatvecFn>(matvec_i8_f32_fn);
    matvec_i8_bf16 = reinterpret_cast<MatvecFn>(matvec_i8_bf16_fn);
}

STABLE_TORCH_LIBRARY_IMPL(astrai, CPU, m) {
    m.impl("cpu_decode_attention", TORCH_BOX(&cpu_decode_attention));
    m.impl("cpu_matvec", TORCH_BOX(&cpu_matvec));
    m.impl("cpu_lora_delta", TORCH_BOX(&cpu_lora_delta));
}
