// A small CUDA-on-CPU emulator, just enough to run the cuda_ref kernels on a machine without a GPU.
//
// Why: the kernels' index math, masking, split bookkeeping and MMA fragment usage can then be checked
// against the plain-torch references in CI (tests/cuda_ref/test_cuda_sim.py). What it is not: a model of
// timing, the memory model or numerics beyond fp32 accumulation.
//
// How: tests/cuda_ref/_cuda_sim.py rewrites each .cu file (kernel<<<grid, block, smem, stream>>>(args) ->
// sim::launch(...), __shared__ arrays -> per-block buffers poisoned with 0xFF bytes, a NaN in fp16/bf16/fp32)
// and compiles it with g++ after this header. Each block runs as one ucontext fiber per thread, scheduled
// round-robin on one OS thread; __syncthreads and the per-warp exchanges behind __shfl_xor_sync and
// mma.m16n8k16 are generation barriers, and a full pass without progress is reported as a deadlock.
// Threads that exit drop out of their barriers (as on Volta+). mma.m16n8k16 is emulated from the PTX ISA
// fragment tables (written out independently below), selected in common.cuh by ASTRAI_CUDA_SIM.
// Launch checks: <= 1024 threads, grid.y/z <= 65535, static shared <= 48 KiB, dynamic <= 99 KiB (sm_86).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <setjmp.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __align__
#undef __shared__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define ASTRAI_CUDA_SIM 1

namespace sim {

struct Barrier {
  int expected = 0;
  int arrived = 0;
  uint64_t generation = 0;
};

struct Fiber {
  ucontext_t start;  // entry context (makecontext); later switches use _setjmp / _longjmp
  jmp_buf resume;
  std::unique_ptr<char[]> stack;
  uint3 tid;
  bool started = false;
  bool done = false;
};

struct MmaSlot {
  uint32_t a[4];
  uint32_t b[2];
};

struct Block {
  std::vector<Fiber> fibers;
  ucontext_t scheduler_ctx;
  jmp_buf scheduler;
  int current = 0;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  // Double-buffered by the warp barrier's generation parity, so one barrier per exchange suffices: a lane
  // can only write a buffer again after every lane of the warp has passed the barrier that follows its reads.
  std::vector<uint32_t> exchange[2];  // one 32-bit slot per thread (shuffles)
  std::vector<MmaSlot> mma[2];        // one slot per thread (mma fragments)
  std::map<std::string, std::vector<unsigned char>> shared;
  size_t static_bytes = 0;
  std::vector<unsigned char> dynamic;
  std::function<void()> body;
  uint3 block_idx;
  uint64_t progress = 0;
  bool failed = false;
};

constexpr size_t kStack = 128 * 1024;
constexpr size_t kMaxStaticShared = 48 * 1024;
constexpr size_t kMaxDynamicShared = 99 * 1024;

inline Block* g_block = nullptr;
inline dim3 g_grid, g_block_dim;
inline cudaError_t g_error = cudaSuccess;
inline std::string g_message;

inline void fail(cudaError_t err, const std::string& msg) {
  if (g_error == cudaSuccess) {
    g_error = err;
    g_message = msg;
  }
}

// The running fiber gives control back to the scheduler. _setjmp / _longjmp instead of swapcontext: no
// signal-mask system calls, which would dominate the run time.
inline void yield() {
  if (_setjmp(g_block->fibers[g_block->current].resume) == 0) _longjmp(g_block->scheduler, 1);
}

// A fatal error inside a kernel: mark the block failed and never resume this fiber.
[[noreturn]] inline void abort_block(const std::string& msg) {
  fail(cudaErrorLaunchFailure, msg);
  g_block->failed = true;
  yield();
  std::abort();  // unreachable: a failed block is never resumed
}

inline void wait(Barrier& b) {
  ++g_block->progress;
  if (++b.arrived >= b.expected) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  const uint64_t gen = b.generation;
  while (b.generation == gen) yield();
}

inline void drop(Barrier& b) {
  --b.expected;
  if (b.arrived > 0 && b.arrived >= b.expected) {
    b.arrived = 0;
    ++b.generation;
  }
}

inline int linear_tid() { return g_block->current; }

inline void trampoline() {
  Block& blk = *g_block;
  blk.body();
  const int t = blk.current;
  blk.fibers[t].done = true;
  drop(blk.block_barrier);
  drop(blk.warp_barriers[t / 32]);
  ++blk.progress;
  _longjmp(blk.scheduler, 1);  // never return through uc_link: the scheduler's ucontext is stale by now
}

// Runs (or resumes) fiber i until it yields or finishes.
inline void switch_to(Block& blk, int i) {
  blk.current = i;
  Fiber& f = blk.fibers[i];
  if (_setjmp(blk.scheduler) != 0) return;
  if (!f.started) {
    f.started = true;
    swapcontext(&blk.scheduler_ctx, &f.start);
  } else {
    _longjmp(f.resume, 1);
  }
}

inline void run_block(Block& blk) {
  const int n = static_cast<int>(blk.fibers.size());
  for (int i = 0; i < n; ++i) {
    Fiber& f = blk.fibers[i];
    getcontext(&f.start);
    f.start.uc_stack.ss_sp = f.stack.get();
    f.start.uc_stack.ss_size = kStack;
    f.start.uc_link = &blk.scheduler_ctx;
    makecontext(&f.start, trampoline, 0);
    f.started = false;
  }
  while (!blk.failed) {
    bool any = false;
    const uint64_t before = blk.progress;
    for (int i = 0; i < n && !blk.failed; ++i) {
      if (blk.fibers[i].done) continue;
      any = true;
      switch_to(blk, i);
    }
    if (!any) return;
    if (blk.progress == before && !blk.failed) {
      fail(cudaErrorLaunchFailure, "deadlock: every live thread waits on a barrier that cannot complete");
      return;
    }
  }
}

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t, Args&&... args) {
  const size_t threads = size_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
      grid.z > 65535 || smem > kMaxDynamicShared) {
    fail(cudaErrorInvalidConfiguration, "invalid launch configuration");
    return;
  }
  g_grid = grid;
  g_block_dim = block;
  Block blk;
  blk.fibers.resize(threads);
  for (size_t i = 0; i < threads; ++i) {
    blk.fibers[i].stack.reset(new char[kStack]);
    blk.fibers[i].tid = make_uint3(i % block.x, (i / block.x) % block.y, i / (size_t(block.x) * block.y));
  }
  for (int i = 0; i < 2; ++i) {
    blk.exchange[i].resize(threads);
    blk.mma[i].resize(threads);
  }
  blk.body = [&] { kernel(args...); };
  g_block = &blk;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blk.block_idx = make_uint3(x, y, z);
        blk.block_barrier = Barrier{static_cast<int>(threads)};
        blk.warp_barriers.assign((threads + 31) / 32, Barrier{});
        for (size_t i = 0; i < threads; ++i) {
          ++blk.warp_barriers[i / 32].expected;
          blk.fibers[i].done = false;
        }
        blk.shared.clear();
        blk.static_bytes = 0;
        blk.dynamic.assign(smem, 0xFF);
        blk.progress = 0;
        run_block(blk);
        if (blk.failed || g_error != cudaSuccess) {
          g_block = nullptr;
          return;
        }
      }
  g_block = nullptr;
}

// A __shared__ array: one buffer per (block, name), poisoned with 0xFF bytes.
template <typename T>
T* shared_array(size_t count, const char* name) {
  auto [it, inserted] = g_block->shared.try_emplace(name);
  if (inserted) {
    it->second.assign(count * sizeof(T), 0xFF);
    g_block->static_bytes += count * sizeof(T);
    if (g_block->static_bytes > kMaxStaticShared) abort_block("static shared memory over 48 KiB");
  }
  return reinterpret_cast<T*>(it->second.data());
}

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(g_block->dynamic.data());
}

inline uint3 thread_idx() { return g_block->fibers[g_block->current].tid; }
inline uint3 block_idx() { return g_block->block_idx; }

inline void syncthreads() { wait(g_block->block_barrier); }

template <typename V>
V shfl_xor(V v, int lane_mask) {
  static_assert(sizeof(V) == 4, "32-bit shuffles only");
  Block& blk = *g_block;
  const int t = linear_tid(), w = t / 32, lane = t % 32;
  std::vector<uint32_t>& buf = blk.exchange[blk.warp_barriers[w].generation % 2];
  std::memcpy(&buf[t], &v, 4);
  wait(blk.warp_barriers[w]);
  V r;
  std::memcpy(&r, &buf[w * 32 + (lane ^ lane_mask)], 4);
  return r;
}

template <typename T>
float raw_to_float(uint32_t reg, int half) {
  const unsigned short bits = static_cast<unsigned short>(half ? reg >> 16 : reg & 0xFFFFu);
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(bits));
  } else {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D = A B + C for the whole warp, per the PTX ISA tables
// (groupID = lane >> 2, threadID_in_group = lane % 4; element i of a lane's fragment, two per register):
//   A (a0..a7): row = groupID for i in {0,1,4,5}, else groupID + 8; col = 2 * tig + (i & 1) + (i >= 4 ? 8 : 0)
//   B (b0..b3): row (k) = 2 * tig + (i & 1) + (i >= 2 ? 8 : 0); col (n) = groupID
//   C (c0..c3): row = groupID + (i >= 2 ? 8 : 0); col = 2 * tig + (i & 1)
template <typename T>
void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Block& blk = *g_block;
  const int t = linear_tid(), w = t / 32, lane = t % 32;
  std::vector<MmaSlot>& slots = blk.mma[blk.warp_barriers[w].generation % 2];
  MmaSlot& mine = slots[t];
  std::memcpy(mine.a, a, sizeof mine.a);
  mine.b[0] = b0;
  mine.b[1] = b1;
  wait(blk.warp_barriers[w]);
  float A[16][16], B[16][8];
  for (int src = 0; src < 32; ++src) {
    const MmaSlot& s = slots[w * 32 + src];
    const int gid = src >> 2, tig = src & 3;
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (i >= 4 && i < 6)) ? gid : gid + 8;
      const int col = 2 * tig + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = raw_to_float<T>(s.a[i / 2], i % 2);
    }
    for (int i = 0; i < 4; ++i) {
      const int k = 2 * tig + (i & 1) + (i >= 2 ? 8 : 0);
      B[k][gid] = raw_to_float<T>(s.b[i / 2], i % 2);
    }
  }
  const int gid = lane >> 2, tig = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = gid + (i >= 2 ? 8 : 0), col = 2 * tig + (i & 1);
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
    c[i] += sum;
  }
}

}  // namespace sim

#define threadIdx (::sim::thread_idx())
#define blockIdx (::sim::block_idx())
#define blockDim (::sim::g_block_dim)
#define gridDim (::sim::g_grid)
#define __syncthreads() ::sim::syncthreads()
#define __trap() ::sim::abort_block("__trap")

template <typename V>
V __shfl_xor_sync(unsigned, V v, int lane_mask, int = 32) {
  return ::sim::shfl_xor(v, lane_mask);
}

template <typename T>
void astrai_sim_mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  ::sim::mma_16816<T>(c, a, b0, b1);
}

// Runtime calls the launchers make: attributes are accepted, probes report no MMA binary (the harness picks
// the path itself), and the last error is the first one the emulator recorded.
#define cudaFuncSetAttribute(...) cudaSuccess
#define cudaFuncGetAttributes(...) cudaErrorInvalidDeviceFunction
#define cudaGetLastError() (::sim::g_error)
#define cudaGetDevice(device) (*(device) = 0, cudaSuccess)
