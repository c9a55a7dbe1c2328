// Forward of every family on CUDA tensors, token by token (the recurrent form of SPEC §2).
//
// This is the correctness-first GPU path for cula_chunk_fwd: every option (varlen with
// device-side cu_seqlens, GVA, gates in kernel, states in either layout and dtype, state pools,
// intermediate states) in one kernel, no workspace, no host synchronisation. The tensor-core
// chunked kernels will take the common configurations from it through the dispatch table.
//
// Design: one CTA per (sequence n, value head hv, tile of 16 state rows along V); 4 warps, each
// owning 4 rows; lane l holds elements [l*EPL, (l+1)*EPL) of each row (EPL = K/32) in registers
// for the whole sequence. Per token every warp loads q, k, the gate, beta and its 4 values of v
// (the next token's are requested before the current one is computed), normalises q/k with warp
// reductions, and updates its rows: S' = S*exp(a), the delta rule's S'^T k and the output S^T q
// are warp reductions interleaved over the 4 rows. No shared memory, no block barrier. States go
// out at chunk boundaries (intermediate states) and at the end (final state or pool slot).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <utility>

#include "common/error.h"
#include "cuda/device_helpers.cuh"
#include "prefill/cuda/recurrent_fwd.h"

namespace cula {
namespace {

using dev::ld;
using dev::st;

constexpr int kWarps = 4;
constexpr int kRows = 4;  // rows per warp
constexpr int kTileRows = kWarps * kRows;

struct Params {
  const void *q, *k, *v, *g, *beta;
  const void *decay, *A_log, *dt_bias;
  int q_dt, k_dt, v_dt, g_dt, beta_dt, decay_dt, A_dt, bias_dt;
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
  int gate_kind, delta, l2norm, gate_in_kernel, has_lb, beta_sigmoid, decay_heads, dt_bias_per_channel;
  float lb, beta_mult, scale;
  // strides (elements) of the tensors read per token: [B, T, H|HV, ...] may be strided
  int64_t q_s[4], k_s[4], v_s[4], g_s[4], beta_s[3], out_s[4];
};

__device__ __forceinline__ int64_t state_elem(const Params& p, int64_t slot, int hv, int j, int kk) {
  const int64_t base = (slot * p.HV + hv) * static_cast<int64_t>(p.K) * p.V;
  return p.k_last ? base + static_cast<int64_t>(j) * p.K + kk : base + static_cast<int64_t>(kk) * p.V + j;
}

__device__ __forceinline__ int64_t cu_at(const Params& p, int i) {
  return p.cu64 ? static_cast<const int64_t*>(p.cu)[i] : static_cast<const int32_t*>(p.cu)[i];
}

template <int EPL>
struct Raw {
  float q[EPL], k[EPL], g[EPL], beta, v[kRows];
};

template <int EPL>
__global__ void __launch_bounds__(kWarps * 32) recurrent_fwd_kernel(const Params p) {
  constexpr int K = EPL * 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tiles = (p.V + kTileRows - 1) / kTileRows;
  const int64_t bid = blockIdx.x;
  const int tile = static_cast<int>(bid % tiles);
  const int hv = static_cast<int>((bid / tiles) % p.HV);
  const int n = static_cast<int>(bid / (static_cast<int64_t>(tiles) * p.HV));
  const int h = hv / (p.HV / p.H);
  const int j0 = tile * kTileRows + warp * kRows;
  if (j0 >= p.V) return;
  const int k0 = lane * EPL;
  int64_t bos, eos;
  int b_row;  // batch row of the tokens
  if (p.cu) {  // device-side offsets are not checked on the host: clamp them so nothing is read out of bounds
    bos = min(max(cu_at(p, n), int64_t{0}), static_cast<int64_t>(p.T));
    eos = min(max(cu_at(p, n + 1), bos), static_cast<int64_t>(p.T));
    b_row = 0;
  } else {
    bos = 0;
    eos = p.T;
    b_row = n;
  }
  int64_t chunk_base = 0;  // first intermediate-state index of this sequence
  if (p.inter && p.cu)
    for (int m = 0; m < n; ++m) chunk_base += (cu_at(p, m + 1) - cu_at(p, m) + p.chunk - 1) / p.chunk;

  // initial state
  float s[kRows][EPL];
  int64_t slot = -1;
  if (p.pool) slot = p.pool_idx ? p.pool_idx[n] : n;
  if (slot >= p.P) slot = -1;
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int j = min(j0 + r, p.V - 1);
      float x = 0.0f;
      if (p.h0) x = ld(p.h0, p.h0_dt, state_elem(p, n, hv, j, k0 + e));
      else if (slot >= 0) x = ld(p.pool, p.pool_dt, state_elem(p, slot, hv, j, k0 + e));
      s[r][e] = x;
    }

  float eA = 1.0f, bias[EPL];
  if (p.gate_in_kernel && p.A_log) eA = __expf(ld(p.A_log, p.A_dt, hv));
#pragma unroll
  for (int e = 0; e < EPL; ++e)
    bias[e] = (p.gate_in_kernel && p.dt_bias) ? ld(p.dt_bias, p.bias_dt, p.dt_bias_per_channel ? hv * K + k0 + e : hv)
                                              : 0.0f;
  const float const_decay = p.gate_kind == 2 ? -ld(p.decay, p.decay_dt, p.decay_heads == p.HV ? hv : h) : 0.0f;

  auto load_raw = [&](Raw<EPL>& w, int64_t t) {
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      w.q[e] = ld(p.q, p.q_dt, b_row * p.q_s[0] + t * p.q_s[1] + h * p.q_s[2] + (k0 + e) * p.q_s[3]);
      w.k[e] = ld(p.k, p.k_dt, b_row * p.k_s[0] + t * p.k_s[1] + h * p.k_s[2] + (k0 + e) * p.k_s[3]);
      w.g[e] = p.gate_kind == 0   ? ld(p.g, p.g_dt, b_row * p.g_s[0] + t * p.g_s[1] + hv * p.g_s[2] + (k0 + e) * p.g_s[3])
               : p.gate_kind == 1 ? ld(p.g, p.g_dt, b_row * p.g_s[0] + t * p.g_s[1] + hv * p.g_s[2])
                                  : const_decay;
    }
    w.beta = p.delta ? ld(p.beta, p.beta_dt, b_row * p.beta_s[0] + t * p.beta_s[1] + hv * p.beta_s[2]) : 1.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      w.v[r] = ld(p.v, p.v_dt, b_row * p.v_s[0] + t * p.v_s[1] + hv * p.v_s[2] + min(j0 + r, p.V - 1) * p.v_s[3]);
  };
  auto store_state = [&](void* dst, int dt, auto&& index_of) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (j0 + r >= p.V) continue;
#pragma unroll
      for (int e = 0; e < EPL; ++e) st(dst, dt, index_of(j0 + r, k0 + e), s[r][e]);
    }
  };

  Raw<EPL> cur, nxt;
  if (bos < eos) load_raw(cur, bos);
  for (int64_t t = bos; t < eos; ++t) {
    if (t + 1 < eos) load_raw(nxt, t + 1);
    if (p.inter && (t - bos) % p.chunk == 0) {
      // [B, NT] flattened: varlen packs every sequence's chunks in one row (B = 1)
      const int64_t c = chunk_base + (t - bos) / p.chunk;
      const int64_t row = p.cu ? c : static_cast<int64_t>(n) * ((p.T + p.chunk - 1) / p.chunk) + c;
      store_state(p.inter, p.inter_dt, [&](int j, int kk) { return state_elem(p, row, hv, j, kk); });
    }
    // token preprocessing
    float qq = 0, kk2 = 0;
#pragma unroll
    for (int e = 0; e < EPL; ++e) qq += cur.q[e] * cur.q[e], kk2 += cur.k[e] * cur.k[e];
    float qs = p.scale, ks = 1.0f;
    if (p.l2norm) {
      qs *= rsqrtf(dev::warp_sum(qq) + 1e-6f);
      ks = rsqrtf(dev::warp_sum(kk2) + 1e-6f);
    }
    float qv[EPL], kv[EPL], dv[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      float a = cur.g[e];
      if (p.gate_in_kernel) {
        a += bias[e];
        a = p.has_lb ? p.lb / (1.0f + __expf(-eA * a)) : -eA * (a > 20.0f ? a : log1pf(__expf(a)));
      }
      dv[e] = __expf(a);
      qv[e] = cur.q[e] * qs;
      kv[e] = cur.k[e] * ks;
    }
    float b = cur.beta;
    if (p.beta_sigmoid) b = p.beta_mult / (1.0f + __expf(-b));
    float u[kRows], o[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) u[r] = cur.v[r];
    dev::update_rows<EPL, kRows>(s, qv, kv, dv, u, b, p.delta, o);
    if (lane < kRows && j0 + lane < p.V)
      st(p.out, p.out_dt, b_row * p.out_s[0] + t * p.out_s[1] + hv * p.out_s[2] + (j0 + lane) * p.out_s[3],
         dev::pick_lane<kRows>(o, lane));
    if (t + 1 < eos) cur = nxt;
  }
  if (p.ht) store_state(p.ht, p.ht_dt, [&](int j, int kk) { return state_elem(p, n, hv, j, kk); });
  if (slot >= 0) store_state(p.pool, p.pool_dt, [&](int j, int kk) { return state_elem(p, slot, hv, j, kk); });
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(CULA_ERROR_CUDA, std::string("chunk_fwd: ") + what + ": " + cudaGetErrorString(e));
}

void strides4(const cula_tensor* t, int64_t (&s)[4]) {
  for (int i = 0; i < 4; ++i) s[i] = t && i < t->ndim ? t->strides[i] : 0;
}

}  // namespace

void cuda_recurrent_fwd(const Recurrence& r, const cula_chunk_fwd_args& a) {
  const char* op = "chunk_fwd";
  if (r.K != 64 && r.K != 128 && r.K != 256)
    throw_unsupported(op, "the CUDA forward takes K in {64, 128, 256}, got K = " + std::to_string(r.K) +
                              "; use host tensors (the CPU backend) for other head sizes");
  if (a.cu_seqlens && a.cu_seqlens->device_type != CULA_CUDA)
    throw_arg(op, "cu_seqlens", "a tensor on the device of q for the CUDA kernel (no host synchronisation)",
              describe(a.cu_seqlens));
  if (a.state_indices && a.state_indices->device_type != CULA_CUDA)
    throw_arg(op, "state_indices", "a tensor on the device of q for the CUDA kernel", describe(a.state_indices));
  for (auto [t, name] : {std::pair<const cula_tensor*, const char*>{a.initial_state, "initial_state"},
                         {a.state_indices, "state_indices"}, {a.cu_seqlens, "cu_seqlens"}, {a.dt_bias, "dt_bias"}})
    if (t && !is_contiguous(*t)) throw_arg(op, name, "a contiguous tensor for the CUDA kernel", "a strided view");
  Params p{};
  p.q = a.q->data, p.q_dt = a.q->dtype;
  p.k = a.k->data, p.k_dt = a.k->dtype;
  p.v = a.v->data, p.v_dt = a.v->dtype;
  if (a.g) p.g = a.g->data, p.g_dt = a.g->dtype;
  if (a.beta) p.beta = a.beta->data, p.beta_dt = a.beta->dtype;
  if (a.decay) p.decay = a.decay->data, p.decay_dt = a.decay->dtype;
  if (a.A_log) p.A_log = a.A_log->data, p.A_dt = a.A_log->dtype;
  if (a.dt_bias) p.dt_bias = a.dt_bias->data, p.bias_dt = a.dt_bias->dtype;
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
  p.k_last = r.state_layout == CULA_STATE_K_LAST;
  p.gate_kind = r.tr.gate == GateKind::PerChannel ? 0 : r.tr.gate == GateKind::Scalar ? 1 : 2;
  p.delta = r.tr.delta, p.l2norm = r.l2norm, p.gate_in_kernel = r.gate_in_kernel, p.has_lb = r.has_lb;
  p.beta_sigmoid = r.beta_sigmoid, p.decay_heads = static_cast<int>(r.decay_heads);
  p.dt_bias_per_channel = r.dt_bias_per_channel;
  p.lb = static_cast<float>(r.lb), p.beta_mult = r.neg_eig ? 2.0f : 1.0f, p.scale = static_cast<float>(r.scale);
  strides4(a.q, p.q_s), strides4(a.k, p.k_s), strides4(a.v, p.v_s), strides4(a.g, p.g_s), strides4(a.out, p.out_s);
  for (int i = 0; i < 3; ++i) p.beta_s[i] = a.beta ? a.beta->strides[i] : 0;
  if (r.N == 0) return;
  check(cudaSetDevice(a.q->device_id), "cudaSetDevice");
  const int64_t blocks = r.N * r.HV * ((r.V + kTileRows - 1) / kTileRows);
  if (blocks >= (int64_t{1} << 31)) throw_unsupported(op, "too many sequences x heads for one launch");
  const cudaStream_t stream = static_cast<cudaStream_t>(a.opt.stream);
  const unsigned grid = static_cast<unsigned>(blocks);
  switch (r.K) {
    case 64: recurrent_fwd_kernel<2><<<grid, kWarps * 32, 0, stream>>>(p); break;
    case 128: recurrent_fwd_kernel<4><<<grid, kWarps * 32, 0, stream>>>(p); break;
    default: recurrent_fwd_kernel<8><<<grid, kWarps * 32, 0, stream>>>(p); break;
  }
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace cula
