// Shared-memory barriers (mbarrier, sm_80+) for kernels whose warp groups hand buffers to each
// other without stopping the whole block: a producer arrives when it filled a buffer (or when its
// cp.async copies land), the consumers wait on the phase's parity and arrive when they are done.
// Phases alternate 0, 1, 0, ...: use u of a ring of D buffers waits for parity (u / D) & 1.
#pragma once

#include <cstdint>

#include "cuda/kerutils/mma.cuh"

namespace cula {
namespace mbar {

// Before any use; the block must synchronize once after the inits (__syncthreads).
__device__ __forceinline__ void init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(mma::smem_addr(bar)), "r"(count) : "memory");
}

// Makes the inits before it visible to the copy engine (bulk copies completing on the barriers).
__device__ __forceinline__ void fence_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// One arrival that also expects `bytes` more transaction bytes (bulk copies) before the phase can
// complete (sm_90+).
__device__ __forceinline__ void arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(mma::smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

// One arrival (release: this thread's earlier shared-memory accesses happen before the phase
// completes). One lane per warp after __syncwarp() arrives for the whole warp.
__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared.b64 state, [%0];\n}\n" ::"r"(mma::smem_addr(bar)) : "memory");
}

// An arrival made when all of this thread's earlier cp.async copies have landed (the barrier's
// count includes it: .noinc).
__device__ __forceinline__ void arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(mma::smem_addr(bar)) : "memory");
}

// Waits until the phase with this parity has completed (acquire).
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = mma::smem_addr(bar);
  uint32_t done;
  do {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
#else
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
#endif
  } while (!done);
}

// Barrier `id` (1..15; 0 is __syncthreads) among `threads` threads of the block (whole warps).
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrival at barrier `id` without waiting for it (the producer side of named_sync).
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace mbar

namespace mma {
// 16-byte copy that writes zeros instead when `fill` is false (nothing is read then).
__device__ __forceinline__ void cp_async16_or_zero(uint32_t smem, const void* gmem, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(fill ? 16 : 0));
}
}  // namespace mma
}  // namespace cula
