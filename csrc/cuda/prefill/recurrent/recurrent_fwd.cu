// Forward of every family on CUDA tensors, token by token (the recurrent form of SPEC §2).
//
// The GPU path for every call the chunk engines decline (the dispatch table tries them first):
// every option (varlen with device-side cu_seqlens, GVA, gates in kernel, states in either layout
// and dtype, state pools, intermediate states) in one kernel, no workspace, no host
// synchronisation. Today that is key head sizes other than 64, 128 and 256 and value head sizes
// not a multiple of 64 at Level 0 (the front pads both), and float32 state arithmetic on request
// (backend "cuda_fp32"); it is sequential in T, so those calls are many times slower than the
// chunk engines.
//
// Design: one CTA per (sequence n, value head hv, tile of 16 state rows along V); 4 warps, each
// owning 4 rows; lane l holds elements [l*EPL, (l+1)*EPL) of each row (EPL = K/32) in registers
// for the whole sequence. Per token every warp loads q, k, the gate, beta and its 4 values of v
// (the next token's are requested before the current one is computed), normalises q/k with warp
// reductions, and updates its rows: S' = S*exp(a), the delta rule's S'^T k and the output S^T q
// are warp reductions interleaved over the 4 rows. No shared memory, no block barrier. States go
// out at chunk boundaries (intermediate states) and at the end (final state or pool slot).
//
// Where the time goes: FLA's fused_recurrent GDN drop-in runs float32 inputs here (FLA computes them
// in float32); on an H100 that is 0.51-0.53x FLA's fused_recurrent (2x1024 H4/HV8: 1.63 ms against
// 0.84, about 1.6 us per token on a chain of 128 CTAs of 4 warps). Not profiled yet; the per-token
// chain (the q/k norms recomputed by every warp, two reductions per row, the exponential) is where
// to look first.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <utility>

#include "common/error.h"
#include "cuda/runtime/check.h"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/common/fwd_params.cuh"
#include "cuda/prefill/recurrent/recurrent_fwd.h"

namespace cula {
namespace {

using dev::ld;
using dev::st;

constexpr int kWarps = 4;
constexpr int kRows = 4;  // rows per warp
constexpr int kTileRows = kWarps * kRows;

template <int EPL>
struct Raw {
  float q[EPL], k[EPL], g[EPL], beta, v[kRows];
};

template <int EPL>
__global__ void __launch_bounds__(kWarps * 32) recurrent_fwd_kernel(const FwdParams p) {
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
  const Seq sq = seq_of(p, n);
  const int64_t bos = sq.bos, eos = sq.eos;
  const int b_row = sq.b_row;  // batch row of the tokens
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
  if (p.gate_in_kernel && p.A_log) eA = __expf(ld(p.A_log, p.A_log_dt, hv));
#pragma unroll
  for (int e = 0; e < EPL; ++e)
    bias[e] = (p.gate_in_kernel && p.dt_bias) ? ld(p.dt_bias, p.dt_bias_dt, p.dt_bias_per_channel ? hv * K + k0 + e : hv)
                                              : 0.0f;
  const float const_decay = p.gate_kind == GateKind::Constant ? -ld(p.decay, p.decay_dt, p.decay_heads == p.HV ? hv : h) : 0.0f;

  auto load_raw = [&](Raw<EPL>& w, int64_t t) {
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      w.q[e] = ld(p.q, p.q_dt, b_row * p.q_s[0] + t * p.q_s[1] + h * p.q_s[2] + (k0 + e) * p.q_s[3]);
      w.k[e] = ld(p.k, p.k_dt, b_row * p.k_s[0] + t * p.k_s[1] + h * p.k_s[2] + (k0 + e) * p.k_s[3]);
      w.g[e] = p.gate_kind == GateKind::PerChannel   ? ld(p.g, p.g_dt, b_row * p.g_s[0] + t * p.g_s[1] + hv * p.g_s[2] + (k0 + e) * p.g_s[3])
               : p.gate_kind == GateKind::Scalar ? ld(p.g, p.g_dt, b_row * p.g_s[0] + t * p.g_s[1] + hv * p.g_s[2])
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
        a = dev::activate_gate(a + bias[e], eA, p.has_lb, p.lb);
      }
      dv[e] = __expf(a);
      qv[e] = cur.q[e] * qs;
      kv[e] = cur.k[e] * ks;
    }
    float b = cur.beta;
    if (p.beta_sigmoid) b = dev::beta_sigmoid(b, p.beta_mult);
    float u[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) u[r] = cur.v[r];
    const float o = dev::update_rows<EPL, kRows>(s, qv, kv, dv, u, b, p.delta, lane);
    const int ob = dev::scatter_index<kRows>(lane), o_row = j0 + ob;  // the row whose output o is
    if (dev::scatter_leader<kRows>(lane) && o_row < p.V)
      st(p.out, p.out_dt, b_row * p.out_s[0] + t * p.out_s[1] + hv * p.out_s[2] + o_row * p.out_s[3], o);
    if (t + 1 < eos) cur = nxt;
  }
  if (p.ht) store_state(p.ht, p.ht_dt, [&](int j, int kk) { return state_elem(p, n, hv, j, kk); });
  if (slot >= 0) store_state(p.pool, p.pool_dt, [&](int j, int kk) { return state_elem(p, slot, hv, j, kk); });
}

void check(cudaError_t e, const char* what) { cuda_check(e, "chunk_fwd", what); }

}  // namespace

Refusal cuda_recurrent_fwd_declines(const Recurrence& r, const cula_chunk_fwd_args& a) {
  if (r.K != 64 && r.K != 128 && r.K != 256)
    return Refusal::unsupported("the CUDA forward takes K in {64, 128, 256}, got K = " + std::to_string(r.K) +
                                "; use host tensors (the CPU backend) for other head sizes");
  if (const UnreadableInput u = first_unreadable_input(a); u.name) return Refusal::bad_argument(u.name, u.expected, u.given);
  return Refusal::takes();
}

void cuda_recurrent_fwd(const Recurrence& r, const cula_chunk_fwd_args& a) {
  const char* op = "chunk_fwd";
  const FwdParams p = make_fwd_params(r, a);
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
