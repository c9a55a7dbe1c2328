// Host and device pieces shared by the chunk engines (chunk_common.cuh): the varlen chunk numbering
// and the workspace pool.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include <initializer_list>

#include "common/error.h"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/prefill/half_inputs.cuh"
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

const char* chunk::tensor_core_declines(const cula_chunk_fwd_args& a) {
  // both engines cut V into 32- or 64-column slices, one CTA each
  const int64_t V = a.value_dim ? a.value_dim : a.v->shape[3];
  if (V < 64 || V % 64 != 0) return "value head size V not a multiple of 64";
  if (a.v->shape[3] != V && a.v->shape[3] % 64 != 0)
    return "v's columns not a multiple of 64 under a larger value_dim (slices of v read whole or as zeros)";
  if (a.chunk_size != 0 && a.chunk_size != kChunk) return "chunk_size other than 64 (intermediate states are per 64 tokens)";
  const int dt = a.q->dtype;
  const bool typed = dt == CULA_BFLOAT16 || dt == CULA_FLOAT16 || dt == CULA_FLOAT32;
  for (const cula_tensor* t : std::initializer_list<const cula_tensor*>{a.q, a.k, a.v, a.out})
    if (!typed || (t->dtype != dt && !(t == a.out && t->dtype == CULA_FLOAT32)) || !aligned16(t))
      return "q, k, v are not all 16-byte aligned bfloat16, float16 or float32 of one type, out the same or float32";
  if (first_unreadable_input(a).name) return "an input the CUDA kernels cannot read (host offsets or slots, a strided parameter)";
  if (cuda_device_arch(a.q->device_id) < 80) return "a device below sm_80 (mma.sync bf16, ldmatrix, cp.async)";
  return nullptr;
}

namespace chunk {
namespace {
// One thread per 8 elements of a float32 row [b, t, h, :] (D a multiple of 8, 16-byte aligned rows:
// tensor_core_declines) into a contiguous bf16 [B, T, H, D].
__global__ void __launch_bounds__(256) to_bf16_kernel(const float* src, int64_t s0, int64_t s1, int64_t s2, int64_t T,
                                                      int64_t H, int64_t D, int64_t items, __nv_bfloat16* dst) {
  const int64_t per_row = D / 8;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < items; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / per_row, c8 = (i - row * per_row) * 8;
    const int64_t b = row / (T * H), t = (row / H) % T, h = row % H;
    const float* x = src + b * s0 + t * s1 + h * s2 + c8;
    const float4 lo = reinterpret_cast<const float4*>(x)[0], hi = reinterpret_cast<const float4*>(x)[1];
    *reinterpret_cast<uint4*>(dst + i * 8) =
        make_uint4(mma::pack(lo.x, lo.y), mma::pack(lo.z, lo.w), mma::pack(hi.x, hi.y), mma::pack(hi.z, hi.w));
  }
}

bool copied(const cula_tensor* t) { return t->dtype == CULA_FLOAT32; }
int64_t copy_bytes(const cula_tensor* t) { return (numel(*t) * 2 + 255) / 256 * 256; }
}  // namespace

int64_t EngineInputs::bytes_needed(const cula_chunk_fwd_args& a) {
  if (!copied(a.q)) return 0;
  return copy_bytes(a.q) + copy_bytes(a.k) + copy_bytes(a.v);
}

EngineInputs::EngineInputs(const cula_chunk_fwd_args& a, int device, cudaStream_t stream)
    : args_(a), copies_{}, ws_(bytes_needed(a), device, stream, "chunk_fwd") {
  if (!copied(a.q)) return;
  unsigned char* at = static_cast<unsigned char*>(ws_.get());
  const cula_tensor* given[3] = {a.q, a.k, a.v};
  const cula_tensor** slots[3] = {&args_.q, &args_.k, &args_.v};
  const int sms = cuda_sm_count(device);
  for (int i = 0; i < 3; ++i) {
    const cula_tensor& x = *given[i];
    cula_tensor& c = copies_[i];
    c = x;
    c.dtype = CULA_BFLOAT16;
    c.data = at;
    c.strides[3] = 1, c.strides[2] = x.shape[3], c.strides[1] = x.shape[2] * x.shape[3];
    c.strides[0] = x.shape[1] * c.strides[1];
    const int64_t items = numel(x) / 8;
    if (items > 0) {
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((items + 255) / 256, int64_t{sms} * 32));
      to_bf16_kernel<<<blocks, 256, 0, stream>>>(static_cast<const float*>(x.data), x.strides[0], x.strides[1],
                                                 x.strides[2], x.shape[1], x.shape[2], x.shape[3], items,
                                                 static_cast<__nv_bfloat16*>(c.data));
      check(cudaGetLastError(), "input conversion launch");
    }
    *slots[i] = &c;
    at += copy_bytes(&x);
  }
}
}  // namespace chunk

}  // namespace cula
