// Pieces shared by the chunk engines (chunk_prep_scan/, chunk_fused/): the chunk
// length, the varlen chunk numbering, the workspace pool and host-side checks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "common/tensor.h"
#include "cuda/runtime/check.h"
#include "cuda/common/fwd_params.cuh"

namespace cula {

constexpr int kChunk = 64;  // tokens per chunk (intermediate states are per 64 tokens)

// Workspace memory: a pool per device that keeps what it has allocated, so steady-state calls
// neither allocate from the driver nor synchronize (stream-ordered, graph-capturable).
cudaMemPool_t chunk_workspace_pool(int device);

namespace chunk {

__device__ __forceinline__ int chunks_of(const FwdParams& p) { return (p.T + kChunk - 1) / kChunk; }

// chunk_base[n] = sum over m < n of ceil(len_m / 64) for n <= N, on the stream (varlen calls).
void launch_chunk_base(const FwdParams& p, int32_t* chunk_base, cudaStream_t stream);

// What a chunk-walking CTA (the scan and fused kernels) owns: sequence n (segment n with p.seg),
// value head hv and the VB columns from v0, with blockIdx.x = (n * HV + hv) * (V / VB) + V slice;
// its sequence bounds, chunk count and first global chunk.
struct SliceTask {
  int n, hv, v0, nchunks;
  Seq sq;
  int64_t cbase;
};
// (task: the index in that order, blockIdx.x unless a kernel runs several roles per launch;
// kSegments: the kernel honours p.seg, compiled in only where it does: the register it takes cost
// the fused engine a spill)
template <int VB, bool kSegments = false>
__device__ __forceinline__ SliceTask slice_task(const FwdParams& p, const int32_t* chunk_base, unsigned task) {
  SliceTask tk;
  const int nvb = p.V / VB;
  tk.v0 = static_cast<int>(task % nvb) * VB;
  tk.hv = static_cast<int>((task / nvb) % p.HV);
  tk.n = static_cast<int>(task / (static_cast<unsigned>(nvb) * p.HV));
  if (kSegments && p.seg) {  // segment j of sequence b: its chunks are those of the whole sequence from j seg on
    const int per = segments_per_sequence(p.T, p.seg), b = tk.n / per, j = tk.n % per;
    const int64_t bos = static_cast<int64_t>(j) * p.seg;
    tk.sq = Seq{bos, min(bos + p.seg, static_cast<int64_t>(p.T)), b};
    tk.cbase = static_cast<int64_t>(b) * chunks_of(p) + bos / kChunk;
  } else {
    tk.sq = seq_of(p, tk.n);
    tk.cbase = chunk_base ? chunk_base[tk.n] : static_cast<int64_t>(tk.n) * chunks_of(p);
  }
  tk.nchunks = static_cast<int>((tk.sq.eos - tk.sq.bos + kChunk - 1) / kChunk);
  return tk;
}
template <int VB, bool kSegments = false>
__device__ __forceinline__ SliceTask slice_task(const FwdParams& p, const int32_t* chunk_base) {
  return slice_task<VB, kSegments>(p, chunk_base, blockIdx.x);
}

// Sequence n and chunk ci of global chunk cidx; false past the last chunk of a varlen call.
__device__ __forceinline__ bool locate(const FwdParams& p, const int32_t* chunk_base, int cidx, int& n, int& ci) {
  if (chunk_base) {
    if (cidx >= chunk_base[p.N]) return false;
    int lo = 0, hi = p.N - 1;  // last n with chunk_base[n] <= cidx
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (chunk_base[mid] <= cidx) lo = mid;
      else hi = mid - 1;
    }
    n = lo, ci = cidx - chunk_base[lo];
  } else {
    n = cidx / chunks_of(p), ci = cidx % chunks_of(p);
  }
  return true;
}

// The 16-byte pieces of a ROWS x COLS bf16 tile that each of NT threads moves: piece tid % P of
// rows tid / P + j R, j < J. Fixed per thread, so a chunk's copies are a base address plus
// compile-time offsets (index arithmetic per copy was most of the chunk loops' instructions).
template <int ROWS, int COLS, int NT>
struct TileCopy {
  static constexpr int P = COLS / 8, R = NT / P, J = ROWS / R;
  static_assert(NT % P == 0 && ROWS % R == 0 && J > 0, "whole passes of the thread block");
  int r0, c8;
  __device__ explicit TileCopy(int tid) : r0(tid / P), c8((tid % P) * 8) {}
  __device__ int row(int j) const { return r0 + j * R; }
};

// An upper bound on the number of chunks: sum ceil(len / 64) <= T / 64 + N for varlen.
inline int64_t max_chunks(const FwdParams& p) {
  return p.cu ? p.T / kChunk + p.N : static_cast<int64_t>(p.N) * ((p.T + kChunk - 1) / kChunk);
}

// Bytes in front of the per-chunk workspace: the varlen chunk bases, 256-byte aligned.
inline int64_t base_bytes(const FwdParams& p) { return p.cu ? ((p.N + 1) * 4 + 255) / 256 * 256 : 0; }

inline void check(cudaError_t e, const char* what) { cuda_check(e, "chunk_fwd", what); }

// Stream-ordered workspace from the pool (chunk_workspace_pool), released on the stream when it
// leaves scope, also when a launch in between throws: graph-capturable, no host sync. release()
// is the checked release for the normal path (a destructor cannot raise).
class Workspace {
 public:
  Workspace(int64_t bytes, int device, cudaStream_t stream, const char* op) : stream_(stream), op_(op) {
    if (bytes > 0)
      cuda_check(cudaMallocFromPoolAsync(&ptr_, static_cast<size_t>(bytes), chunk_workspace_pool(device), stream), op,
                 "workspace allocation");
  }
  ~Workspace() {
    if (ptr_) cudaFreeAsync(ptr_, stream_);
  }
  void* get() const { return ptr_; }
  void release() {
    void* p = ptr_;
    ptr_ = nullptr;
    if (p) cuda_check(cudaFreeAsync(p, stream_), op_, "workspace release");
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
  const char* op_;
};

// The dynamic shared-memory limit of a kernel belongs to the function in a device's context: it
// is set once per (kernel, device) instead of by a driver call per launch (2-6 us of host time per
// call when the host's caches are cold).
inline void allow_smem_once(const void* kernel, int bytes) {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> limits;
  const std::lock_guard<std::mutex> lock(mu);
  int& have = limits[{kernel, device}];
  if (have >= bytes) return;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "shared memory attribute");
  have = bytes;  // after the call succeeded: a failed one is retried next time
}

template <typename Kernel>
void allow_smem(Kernel kernel, int bytes) {
  allow_smem_once(reinterpret_cast<const void*>(kernel), bytes);
}

// 16-byte aligned base and outer strides, unit last stride (vector loads and cp.async).
inline bool aligned16(const cula_tensor* t) {
  if (reinterpret_cast<uintptr_t>(t->data) % 16) return false;
  const int64_t vec = 16 / dtype_size(t->dtype);
  for (int i = 0; i + 1 < t->ndim; ++i)
    if (t->strides[i] % vec) return false;
  return t->strides[t->ndim - 1] == 1;
}

// Why the tensor-core chunk engines (all of them) decline a call, or nullptr: the rules they share
// (V a multiple of 64, chunk length, 16-byte aligned q, k, v and out, inputs the CUDA kernels can
// read, sm_80). q, k, v are all bfloat16, all float16 or all float32, out the same or float32 (the
// accumulators stored unrounded). Each engine's own rules (families, key head sizes, shared memory)
// come in its declines predicate.
const char* tensor_core_declines(const cula_chunk_fwd_args& a);

// q, k, v as an engine reads them: the caller's 16-bit tensors (bf16 or fp16, which both engines
// load), or contiguous bf16 copies of float32 ones in a workspace. The engines compute on 16-bit
// tiles, so the copy rounds where their own loads would round; it costs one pass over q, k, v. out
// stays the caller's (float32 for float32 inputs: the accumulators unrounded). release() after the
// engine's launches (the copies are freed in stream order).
class EngineInputs {
 public:
  EngineInputs(const cula_chunk_fwd_args& a, int device, cudaStream_t stream);
  const cula_chunk_fwd_args& args() const { return args_; }
  void release() { ws_.release(); }

 private:
  static int64_t bytes_needed(const cula_chunk_fwd_args& a);
  cula_chunk_fwd_args args_;
  cula_tensor copies_[3];
  Workspace ws_;
};

}  // namespace chunk
}  // namespace cula
