// Host and device pieces shared by the chunk engines (chunk_common.cuh): the varlen chunk numbering
// and the workspace pool.
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include <initializer_list>

#include "common/error.h"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/runtime/runtime.h"

namespace cula {

namespace chunk {
namespace {
// One CTA of 1024 threads: a block scan over the sequences' chunk counts.
__global__ void __launch_bounds__(1024) chunk_base_kernel(const FwdParams p, int32_t* chunk_base) {
  using Scan = cub::BlockScan<int32_t, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  int32_t carry = 0;
  for (int base = 0; base < p.N; base += 1024) {
    const int n = base + static_cast<int>(threadIdx.x);
    int32_t c = 0;
    if (n < p.N) {
      const Seq s = seq_of(p, n);
      c = static_cast<int32_t>((s.eos - s.bos + kChunk - 1) / kChunk);
    }
    int32_t excl, total;
    Scan(tmp).ExclusiveSum(c, excl, total);
    if (n < p.N) chunk_base[n] = carry + excl;
    carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) chunk_base[p.N] = carry;
}

}  // namespace

void launch_chunk_base(const FwdParams& p, int32_t* chunk_base, cudaStream_t stream) {
  chunk_base_kernel<<<1, 1024, 0, stream>>>(p, chunk_base);
}
}  // namespace chunk

cudaMemPool_t chunk_workspace_pool(int device) {
  static cudaMemPool_t pools[64] = {};
  static std::once_flag once[64];
  if (device < 0 || device >= 64) throw_unsupported("chunk_fwd", "device index >= 64");
  std::call_once(once[device], [&] {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    chunk::check(cudaMemPoolCreate(&pools[device], &props), "workspace pool");
    uint64_t keep = UINT64_MAX;
    chunk::check(cudaMemPoolSetAttribute(pools[device], cudaMemPoolAttrReleaseThreshold, &keep), "workspace pool");
  });
  return pools[device];
}

int64_t cuda_workspace_peak_bytes(int device, bool reset) {
  if (device < 0 || device >= cuda_device_count()) return 0;
  const cudaMemPool_t pool = chunk_workspace_pool(device);
  uint64_t high = 0;
  chunk::check(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high), "workspace pool");
  if (reset) {
    uint64_t zero = 0;
    chunk::check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero), "workspace pool");
  }
  return static_cast<int64_t>(high);
}

const char* chunk::tensor_core_declines(const cula_chunk_fwd_args& a, bool half) {
  // both engines cut V into 32- or 64-column slices, one CTA each
  const int64_t V = a.v->shape[3];
  if (V < 64 || V % 64 != 0) return "value head size V not a multiple of 64";
  if (a.chunk_size != 0 && a.chunk_size != kChunk) return "chunk_size other than 64 (intermediate states are per 64 tokens)";
  const int dt = half && a.q->dtype == CULA_FLOAT16 ? CULA_FLOAT16 : CULA_BFLOAT16;
  for (const cula_tensor* t : std::initializer_list<const cula_tensor*>{a.q, a.k, a.v, a.out})
    if ((t->dtype != dt && !(t == a.out && t->dtype == CULA_FLOAT32)) || !aligned16(t))
      return half ? "q, k, v are not all 16-byte aligned bfloat16 (or all float16), out the same or float32"
                  : "q, k, v are not all 16-byte aligned bfloat16, out bfloat16 or float32";
  if (first_unreadable_input(a).name) return "an input the CUDA kernels cannot read (host offsets or slots, a strided parameter)";
  if (cuda_device_arch(a.q->device_id) < 80) return "a device below sm_80 (mma.sync bf16, ldmatrix, cp.async)";
  return nullptr;
}

}  // namespace cula
