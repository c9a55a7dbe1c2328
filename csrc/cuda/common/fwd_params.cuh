// Launch parameters shared by the CUDA forward kernels (recurrent and chunked): raw pointers,
// DLPack dtype codes, element strides and the options of SPEC §2, filled from a validated call.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "common/problem.h"

namespace cula {

struct FwdParams {
  const void *q, *k, *v, *g, *beta;
  const void *decay, *A_log, *dt_bias;
  int q_dt, k_dt, v_dt, g_dt, beta_dt, decay_dt, A_log_dt, dt_bias_dt;  // DLPack dtype codes
  const void* cu;  // device cu_seqlens or null
  int cu64;
  const void* h0;
  int h0_dt;
  void* ht;
  int ht_dt;
  void* pool;
  int pool_dt;
  const int32_t* pool_idx;
  int P;
  void* inter;
  int inter_dt;
  int chunk;
  void* out;
  int out_dt;
  int N, T, H, HV, K, V;
  int k_last;
  GateKind gate_kind;
  int delta, l2norm, gate_in_kernel, has_lb, beta_sigmoid, decay_heads, dt_bias_per_channel;
  float lb, beta_mult, scale;
  // strides (elements) of the tensors read per token: [B, T, H|HV, ...] may be strided
  int64_t q_s[4], k_s[4], v_s[4], g_s[4], beta_s[3], out_s[4];
  int v_cols;  // columns of v read (value_dim: those in [v_cols, V) are zeros)
  // Segments (dense calls, chunk-walking kernels only): each of the N sequences runs as
  // ceil(T / seg) segments of seg tokens (a multiple of the chunk), task n being segment n % that
  // of sequence n / that; the state tensors are indexed by segment. 0: whole sequences.
  int seg;
};

// Segments per sequence of T tokens cut every seg tokens (seg > 0): the one count the launch
// grid, the slice tasks and the segments' state buffers share.
__host__ __device__ __forceinline__ int segments_per_sequence(int64_t T, int64_t seg) {
  return static_cast<int>((T + seg - 1) / seg);
}

__device__ __forceinline__ int64_t state_elem(const FwdParams& p, int64_t slot, int hv, int j, int kk) {
  const int64_t base = (slot * p.HV + hv) * static_cast<int64_t>(p.K) * p.V;
  return p.k_last ? base + static_cast<int64_t>(j) * p.K + kk : base + static_cast<int64_t>(kk) * p.V + j;
}

__device__ __forceinline__ int64_t cu_at(const FwdParams& p, int i) {
  return p.cu64 ? static_cast<const int64_t*>(p.cu)[i] : static_cast<const int32_t*>(p.cu)[i];
}

// Sequence bounds as the kernels see them: device offsets are clamped so nothing is read out of
// bounds (they are not checked on the host).
struct Seq {
  int64_t bos, eos;
  int b_row;
};
__device__ __forceinline__ Seq seq_of(const FwdParams& p, int n) {
  if (!p.cu) return Seq{0, p.T, n};
  const int64_t bos = min(max(cu_at(p, n), int64_t{0}), static_cast<int64_t>(p.T));
  return Seq{bos, min(max(cu_at(p, n + 1), bos), static_cast<int64_t>(p.T)), 0};
}

// What every CUDA forward kernel needs beyond validation: offsets and slot indices on the device
// (no host synchronisation), and the tensors it indexes without strides contiguous. The first
// argument that misses this, with what was expected and given (name null when none): the chunked
// rows decline such a call, so the recurrent row, which refuses it with this, takes it.
struct UnreadableInput {
  const char* name = nullptr;
  const char* expected = nullptr;
  std::string given;
};
inline UnreadableInput first_unreadable_input(const cula_chunk_fwd_args& a) {
  using Named = std::pair<const cula_tensor*, const char*>;
  for (auto [t, name] : {Named{a.cu_seqlens, "cu_seqlens"}, Named{a.state_indices, "state_indices"}})
    if (t && t->device_type != CULA_CUDA)
      return {name, "a tensor on the device of q for the CUDA kernel (no host synchronisation)", describe(t)};
  for (auto [t, name] : {Named{a.initial_state, "initial_state"}, Named{a.state_indices, "state_indices"},
                         Named{a.cu_seqlens, "cu_seqlens"}, Named{a.dt_bias, "dt_bias"}, Named{a.A_log, "A_log"},
                         Named{a.decay, "decay"}})
    if (t && !is_contiguous(*t)) return {name, "a contiguous tensor for the CUDA kernel", "a strided view"};
  return {};
}

inline void strides4(const cula_tensor* t, int64_t (&s)[4]) {
  for (int i = 0; i < 4; ++i) s[i] = t && i < t->ndim ? t->strides[i] : 0;
}

inline FwdParams make_fwd_params(const Recurrence& r, const cula_chunk_fwd_args& a) {
  FwdParams p{};
  p.q = a.q->data, p.q_dt = a.q->dtype;
  p.k = a.k->data, p.k_dt = a.k->dtype;
  p.v = a.v->data, p.v_dt = a.v->dtype;
  if (a.g) p.g = a.g->data, p.g_dt = a.g->dtype;
  if (a.beta) p.beta = a.beta->data, p.beta_dt = a.beta->dtype;
  if (a.decay) p.decay = a.decay->data, p.decay_dt = a.decay->dtype;
  if (a.A_log) p.A_log = a.A_log->data, p.A_log_dt = a.A_log->dtype;
  if (a.dt_bias) p.dt_bias = a.dt_bias->data, p.dt_bias_dt = a.dt_bias->dtype;
  if (a.cu_seqlens) p.cu = a.cu_seqlens->data, p.cu64 = a.cu_seqlens->dtype == CULA_INT64;
  if (a.initial_state) p.h0 = a.initial_state->data, p.h0_dt = a.initial_state->dtype;
  if (a.final_state) p.ht = a.final_state->data, p.ht_dt = a.final_state->dtype;
  if (a.state_pool) {
    p.pool = a.state_pool->data, p.pool_dt = a.state_pool->dtype;
    p.P = static_cast<int>(a.state_pool->shape[0]);
    p.pool_idx = a.state_indices ? static_cast<const int32_t*>(a.state_indices->data) : nullptr;
  }
  if (a.intermediate_states) p.inter = a.intermediate_states->data, p.inter_dt = a.intermediate_states->dtype;
  p.chunk = a.chunk_size ? a.chunk_size : 64;
  p.out = a.out->data, p.out_dt = a.out->dtype;
  p.N = static_cast<int>(r.N), p.T = static_cast<int>(r.T), p.H = static_cast<int>(r.H);
  p.HV = static_cast<int>(r.HV), p.K = static_cast<int>(r.K), p.V = static_cast<int>(r.V);
  p.v_cols = static_cast<int>(r.v_cols);
  p.k_last = r.state_layout == CULA_STATE_K_LAST;
  p.gate_kind = r.tr.gate;
  p.delta = r.tr.delta, p.l2norm = r.l2norm, p.gate_in_kernel = r.gate_in_kernel, p.has_lb = r.has_lb;
  p.beta_sigmoid = r.beta_sigmoid, p.decay_heads = static_cast<int>(r.decay_heads);
  p.dt_bias_per_channel = r.dt_bias_per_channel;
  p.lb = static_cast<float>(r.lb), p.beta_mult = r.neg_eig ? 2.0f : 1.0f, p.scale = static_cast<float>(r.scale);
  strides4(a.q, p.q_s), strides4(a.k, p.k_s), strides4(a.v, p.v_s), strides4(a.g, p.g_s), strides4(a.out, p.out_s);
  for (int i = 0; i < 3; ++i) p.beta_s[i] = a.beta ? a.beta->strides[i] : 0;
  return p;
}

}  // namespace cula
