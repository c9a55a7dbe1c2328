// Pieces both CUDA backwards share (recurrent_bwd.cu, chunk_bwd.cu): each token's inputs as the
// recurrence uses them, prepared once before the main kernels, and the chain rule after them, from
// the main kernels' per-token partial sums to dq, dk, dbeta, dg, dA_log and ddt_bias.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/problem.h"
#include "cuda/common/fwd_params.cuh"
#include "cuda/runtime/check.h"

namespace cula {
namespace bwd {

inline int64_t align256(int64_t b) { return (b + 255) / 256 * 256; }

// One workspace in consecutive parts of these sizes (bytes): their total, and where each starts.
template <int N>
int64_t total_bytes(const int64_t (&sizes)[N]) {
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  return total;
}
template <int N>
void carve(void* base, const int64_t (&sizes)[N], char* (&at)[N]) {
  char* w = static_cast<char*>(base);
  for (int i = 0; i < N; ++i) at[i] = w, w += sizes[i];
}

// A CUDA error of the backward raised as the op's error.
inline void check(cudaError_t e, const char* what) { cuda_check(e, "chunk_bwd", what); }

// The forward's arguments from the backward's inputs (out, final state and pools unused): the
// forward's parameters and its rules for inputs the CUDA kernels read.
inline cula_chunk_fwd_args forward_args(const cula_chunk_bwd_args& a) {
  cula_chunk_fwd_args fa{};
  fa.struct_size = sizeof(fa);
  fa.opt = a.opt;
  fa.q = a.q, fa.k = a.k, fa.v = a.v, fa.g = a.g, fa.beta = a.beta, fa.decay = a.decay;
  fa.A_log = a.A_log, fa.dt_bias = a.dt_bias, fa.cu_seqlens = a.cu_seqlens, fa.initial_state = a.initial_state;
  fa.out = const_cast<cula_tensor*>(a.d_out);  // read only: its strides, not written
  return fa;
}

// The gradient tensors the main kernels read or write themselves (the chain kernels write the
// rest): d_out, d_final_state (dht), d_initial_state (dh0) and dv, null where not given.
struct GradIO {
  const void* dO;
  int dO_dt;
  int64_t dO_s[4];
  const void* dht;
  int dht_dt;
  void* dh0;
  int dh0_dt;
  void* dv;
  int dv_dt;
  int64_t dv_s[4];
};
inline GradIO grad_io(const cula_chunk_bwd_args& a) {
  GradIO io{};
  io.dO = a.d_out->data, io.dO_dt = a.d_out->dtype;
  strides4(a.d_out, io.dO_s);
  if (a.d_final_state) io.dht = a.d_final_state->data, io.dht_dt = a.d_final_state->dtype;
  if (a.d_initial_state) io.dh0 = a.d_initial_state->data, io.dh0_dt = a.d_initial_state->dtype;
  if (a.dv) io.dv = a.dv->data, io.dv_dt = a.dv->dtype, strides4(a.dv, io.dv_s);
  return io;
}

// Each token's inputs as the recurrence uses them (SPEC §2): q^ = scale (l2norm?)(q) and
// k^ = (l2norm?)(k) [B*T, H, K]; the decay [B*T, HV, K] as e^a (or the log-decay a), a after the
// gate activation (per channel; a scalar or constant gate repeated over K); beta [B*T, HV] after
// its sigmoid (1 without the delta rule).
struct TokenInputs {
  float *qh, *kh, *dec, *beta;
};
int64_t token_inputs_bytes(const Recurrence& r);
TokenInputs token_inputs_at(void* base, const Recurrence& r);
void launch_token_inputs(const FwdParams& p, const TokenInputs& x, bool log_decay, cudaStream_t stream);

// The main kernels' per-token partial sums, [tiles, B*T, HV, 3K + 1] fp32: the gradients of q^ (K),
// k^ (K) and the log-decay a (K), and of beta after its sigmoid (1). The chain kernels add the tiles
// and the value heads of each q/k group in order (deterministic), then apply the L2 norm's, the
// scale's, the sigmoid's and the gate activation's chain rules. chain_bytes: their workspace.
constexpr int64_t part_width(int64_t K) { return 3 * K + 1; }
int64_t chain_bytes(const Recurrence& r);
void launch_chain(const Recurrence& r, const cula_chunk_bwd_args& a, const FwdParams& p, const float* part, int tiles,
                  void* chain_ws, cudaStream_t stream);

}  // namespace bwd
}  // namespace cula
