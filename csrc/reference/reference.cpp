// The float64 reference: SPEC §2 token by token, with no chunking. Every other path is tested
// against it; it is itself cross-checked against numpy loops and FLA's naive references.
#include "reference/reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace cula {
namespace {

using Mat = std::vector<double>;  // K x V, row i (over K), column j (over V)

struct TokenInputs {
  std::vector<double> q, k, a, v;
  double beta = 1;
  explicit TokenInputs(const Recurrence& r) : q(r.K), k(r.K), a(r.K), v(r.V) {}
  void load(const Recurrence& r, int64_t f, int64_t hv) {
    beta = r.load_token<double>(f, hv, q.data(), k.data(), a.data());
    for (int64_t j = 0; j < r.V; ++j) v[j] = j < r.v_cols ? r.v.at(r.tb(f), r.tt(f), hv, j) : 0.0;
  }
};

void read_state(const Recurrence& r, const cula_tensor& s, int64_t slot, int64_t hv, Mat& S) {
  for (int64_t i = 0; i < r.K; ++i)
    for (int64_t j = 0; j < r.V; ++j) S[i * r.V + j] = load_as_double(s.data, s.dtype, r.state_off(s, slot, hv, i, j));
}

void write_state(const Recurrence& r, const cula_tensor& s, int64_t slot, int64_t hv, const Mat& S) {
  for (int64_t i = 0; i < r.K; ++i)
    for (int64_t j = 0; j < r.V; ++j) store_from_double(s.data, s.dtype, r.state_off(s, slot, hv, i, j), S[i * r.V + j]);
}

// One step of the recurrence; writes o (V) when given. Sp receives S'_t (the decayed state).
void step(const Recurrence& r, const TokenInputs& x, Mat& S, double* o, Mat* Sp = nullptr) {
  const int64_t K = r.K, V = r.V;
  for (int64_t i = 0; i < K; ++i) {
    const double d = std::exp(x.a[i]);
    for (int64_t j = 0; j < V; ++j) S[i * V + j] *= d;
  }
  if (Sp) *Sp = S;
  if (r.tr.delta) {
    std::vector<double> u(x.v);
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) u[j] -= S[i * V + j] * x.k[i];
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) S[i * V + j] += x.beta * x.k[i] * u[j];
  } else {
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) S[i * V + j] += x.k[i] * x.v[j];
  }
  if (o) {
    for (int64_t j = 0; j < V; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < K; ++i) acc += S[i * V + j] * x.q[i];
      o[j] = acc;
    }
  }
}

}  // namespace

void reference_chunk_fwd(const Recurrence& r, const cula_chunk_fwd_args& a) {
  const int64_t C = a.chunk_size ? a.chunk_size : 64;
  const View out(a.out);
  const std::vector<int64_t> chunk_base = chunk_bases(r, C);
  const bool varlen = a.cu_seqlens != nullptr;
  Mat S(r.K * r.V);
  TokenInputs x(r);
  std::vector<double> o(r.V);
  for (int64_t n = 0; n < r.N; ++n) {
    int64_t slot = -1;
    if (a.state_pool) slot = a.state_indices ? load_index(*a.state_indices, n * a.state_indices->strides[0]) : n;
    for (int64_t hv = 0; hv < r.HV; ++hv) {
      std::fill(S.begin(), S.end(), 0.0);
      if (a.state_pool && slot >= 0) read_state(r, *a.state_pool, slot, hv, S);
      if (a.initial_state) read_state(r, *a.initial_state, n, hv, S);
      for (int64_t t = 0; t < r.seq_len(n); ++t) {
        const int64_t f = r.seq_start[n] + t;
        if (a.intermediate_states && t % C == 0) {
          const cula_tensor& h = *a.intermediate_states;
          const int64_t b = varlen ? 0 : n, c = varlen ? chunk_base[n] + t / C : t / C;
          for (int64_t i = 0; i < r.K; ++i)
            for (int64_t j = 0; j < r.V; ++j)
              store_from_double(h.data, h.dtype, intermediate_off(r, h, b, c, hv, i, j), S[i * r.V + j]);
        }
        x.load(r, f, hv);
        step(r, x, S, o.data());
        for (int64_t j = 0; j < r.V; ++j) out.set(o[j], r.tb(f), r.tt(f), hv, j);
      }
      if (a.final_state) write_state(r, *a.final_state, n, hv, S);
      if (a.state_pool && slot >= 0) write_state(r, *a.state_pool, slot, hv, S);
    }
  }
}

void reference_decode(const Recurrence& r, const cula_decode_args& a) {
  const View out(a.out);
  const cula_tensor& pool = *a.state_pool;
  const DecodeSlots slots{a, r.T};
  const bool per_token = slots.per_token();
  // Every read sees the pool as it was before the call.
  std::vector<Mat> init(r.N * r.HV);
  for (int64_t n = 0; n < r.N; ++n) {
    const int64_t s = slots.read(n);
    for (int64_t hv = 0; hv < r.HV; ++hv) {
      init[n * r.HV + hv].assign(r.K * r.V, 0.0);
      if (s >= 0) read_state(r, pool, s, hv, init[n * r.HV + hv]);
    }
  }
  TokenInputs x(r);
  std::vector<double> o(r.V);
  for (int64_t n = 0; n < r.N; ++n) {
    const int64_t s = slots.read(n);
    for (int64_t hv = 0; hv < r.HV; ++hv) {
      if (s < 0) {
        for (int64_t t = 0; t < r.T; ++t)
          for (int64_t j = 0; j < r.V; ++j) out.set(0.0, n, t, hv, j);
        continue;
      }
      Mat& S = init[n * r.HV + hv];
      for (int64_t t = 0; t < r.T; ++t) {
        x.load(r, n * r.T + t, hv);
        step(r, x, S, o.data());
        for (int64_t j = 0; j < r.V; ++j) out.set(o[j], n, t, hv, j);
        if (per_token) {
          const int64_t ws = slots.at(n, t);
          if (ws >= 0) write_state(r, pool, ws, hv, S);
        }
      }
      if (!per_token) write_state(r, pool, s, hv, S);
    }
  }
}

namespace {

// dx of y = x / sqrt(|x|^2 + eps), given dy.
void l2norm_backward(const double* x, const double* dy, double* dx, int64_t n) {
  double ss = 0, xdy = 0;
  for (int64_t i = 0; i < n; ++i) {
    ss += x[i] * x[i];
    xdy += x[i] * dy[i];
  }
  const double rinv = 1.0 / std::sqrt(ss + kL2NormEps);
  for (int64_t i = 0; i < n; ++i) dx[i] = rinv * dy[i] - rinv * rinv * rinv * x[i] * xdy;
}

}  // namespace

void reference_chunk_bwd(const Recurrence& r, const cula_chunk_bwd_args& a) {
  const int64_t K = r.K, V = r.V, HV = r.HV, H = r.H, G = r.group();
  const int64_t BT = r.B * r.T;
  constexpr int64_t kSeg = 64;  // checkpoint interval: states are recomputed per segment
  // Gradients w.r.t. the preprocessed q^, k^ (summed over the value heads of a group), a, b.
  std::vector<double> dqh(BT * H * K, 0.0), dkh(BT * H * K, 0.0), da(BT * HV * K, 0.0), db(BT * HV, 0.0),
      dv(BT * HV * V, 0.0);
  TokenInputs x(r);
  Mat S(K * V), dS(K * V), Sp(K * V);
  std::vector<double> dO(V), u(V), du(V), tmp(V);
  for (int64_t n = 0; n < r.N; ++n) {
    const int64_t len = r.seq_len(n), start = r.seq_start[n];
    for (int64_t hv = 0; hv < HV; ++hv) {
      const int64_t h = hv / G;
      std::fill(S.begin(), S.end(), 0.0);
      if (a.initial_state) read_state(r, *a.initial_state, n, hv, S);
      // Forward: keep the state at the start of every segment.
      std::vector<Mat> ckpt;
      for (int64_t t = 0; t < len; ++t) {
        if (t % kSeg == 0) ckpt.push_back(S);
        x.load(r, start + t, hv);
        step(r, x, S, nullptr);
      }
      std::fill(dS.begin(), dS.end(), 0.0);
      if (a.d_final_state) read_state(r, *a.d_final_state, n, hv, dS);
      for (int64_t seg = static_cast<int64_t>(ckpt.size()) - 1; seg >= 0; --seg) {
        const int64_t t0 = seg * kSeg, t1 = std::min(len, t0 + kSeg);
        std::vector<Mat> prev;  // S_{t-1} for t in [t0, t1)
        Mat cur = ckpt[seg];
        for (int64_t t = t0; t < t1; ++t) {
          prev.push_back(cur);
          x.load(r, start + t, hv);
          step(r, x, cur, nullptr);
        }
        for (int64_t t = t1 - 1; t >= t0; --t) {
          const int64_t f = start + t;
          x.load(r, f, hv);
          Mat Sn = prev[t - t0];
          step(r, x, Sn, nullptr, &Sp);  // Sn = S_t, Sp = S'_t
          for (int64_t j = 0; j < V; ++j) dO[j] = a.d_out ? View(a.d_out).at(r.tb(f), r.tt(f), hv, j) : 0.0;
          // o = S^T q^
          for (int64_t i = 0; i < K; ++i) {
            double acc = 0;
            for (int64_t j = 0; j < V; ++j) {
              dS[i * V + j] += x.q[i] * dO[j];
              acc += Sn[i * V + j] * dO[j];
            }
            dqh[(f * H + h) * K + i] += acc;
          }
          double* dk_row = &dkh[(f * H + h) * K];
          if (r.tr.delta) {
            for (int64_t j = 0; j < V; ++j) {
              double acc = x.v[j];
              for (int64_t i = 0; i < K; ++i) acc -= Sp[i * V + j] * x.k[i];
              u[j] = acc;
            }
            double dbeta = 0;
            for (int64_t j = 0; j < V; ++j) du[j] = 0;
            for (int64_t i = 0; i < K; ++i) {
              double acc = 0;
              for (int64_t j = 0; j < V; ++j) {
                dbeta += dS[i * V + j] * x.k[i] * u[j];
                du[j] += x.beta * dS[i * V + j] * x.k[i];
                acc += dS[i * V + j] * u[j];
              }
              dk_row[i] += x.beta * acc;
            }
            db[f * HV + hv] += dbeta;
            for (int64_t j = 0; j < V; ++j) dv[(f * HV + hv) * V + j] += du[j];
            // dS' = dS - k du^T ; dk += -S' du
            for (int64_t i = 0; i < K; ++i) {
              double acc = 0;
              for (int64_t j = 0; j < V; ++j) {
                dS[i * V + j] -= x.k[i] * du[j];
                acc += Sp[i * V + j] * du[j];
              }
              dk_row[i] -= acc;
            }
          } else {
            for (int64_t i = 0; i < K; ++i) {
              double acc = 0;
              for (int64_t j = 0; j < V; ++j) acc += dS[i * V + j] * x.v[j];
              dk_row[i] += acc;
            }
            for (int64_t j = 0; j < V; ++j) {
              double acc = 0;
              for (int64_t i = 0; i < K; ++i) acc += dS[i * V + j] * x.k[i];
              dv[(f * HV + hv) * V + j] += acc;
            }
          }
          // S' = diag(exp a) S_prev
          for (int64_t i = 0; i < K; ++i) {
            double acc = 0;
            const double d = std::exp(x.a[i]);
            for (int64_t j = 0; j < V; ++j) {
              acc += Sp[i * V + j] * dS[i * V + j];
              dS[i * V + j] *= d;
            }
            da[(f * HV + hv) * K + i] += acc;
          }
        }
      }
      if (a.d_initial_state) write_state(r, *a.d_initial_state, n, hv, dS);
    }
  }

  // Chain rule back to the raw inputs.
  std::vector<double> raw(K), g_hat(K), dx(K);
  // Sized by the gate's kind, not by dt_bias being given: the sum is formed either way.
  std::vector<double> dA_log(HV, 0.0), ddt(r.tr.gate == GateKind::PerChannel ? HV * K : HV, 0.0);
  for (int64_t f = 0; f < BT; ++f) {
    const int64_t b = r.tb(f), t = r.tt(f);
    for (int64_t h = 0; h < H; ++h) {
      for (int which = 0; which < 2; ++which) {
        const View& src = which == 0 ? r.q : r.k;
        cula_tensor* dst = which == 0 ? a.dq : a.dk;
        const double* dy = which == 0 ? &dqh[(f * H + h) * K] : &dkh[(f * H + h) * K];
        if (!dst) continue;
        const double s = which == 0 ? r.scale : 1.0;
        for (int64_t i = 0; i < K; ++i) raw[i] = src.at(b, t, h, i);
        if (r.l2norm) {
          l2norm_backward(raw.data(), dy, dx.data(), K);
        } else {
          for (int64_t i = 0; i < K; ++i) dx[i] = dy[i];
        }
        for (int64_t i = 0; i < K; ++i) View(dst).set(s * dx[i], b, t, h, i);
      }
    }
    for (int64_t hv = 0; hv < HV; ++hv) {
      for (int64_t j = 0; j < V; ++j)
        if (a.dv) View(a.dv).set(dv[(f * HV + hv) * V + j], b, t, hv, j);
      if (r.tr.delta) {
        double d = db[f * HV + hv];
        if (r.beta_sigmoid) {
          const double sg = sigmoid(r.beta.at(b, t, hv));
          d *= (r.neg_eig ? 2.0 : 1.0) * sg * (1 - sg);
        }
        if (a.dbeta) View(a.dbeta).set(d, b, t, hv);
      }
      const bool per_channel = r.tr.gate == GateKind::PerChannel;
      const int64_t ng = per_channel ? K : 1;
      for (int64_t i = 0; i < ng; ++i) {
        double d = 0;
        if (per_channel) {
          d = da[(f * HV + hv) * K + i];
        } else {
          for (int64_t c = 0; c < K; ++c) d += da[(f * HV + hv) * K + c];
        }
        double dg_raw = d;
        if (r.gate_in_kernel) {
          double xg = per_channel ? r.g.at(b, t, hv, i) : r.g.at(b, t, hv);
          if (r.dt_bias) xg += r.dt_bias_per_channel ? r.dt_bias.flat(hv * K + i) : r.dt_bias.at(hv);
          if (r.has_lb) {
            const double e = r.A_log ? std::exp(r.A_log.at(hv)) : 1.0;
            const double z = e * xg, sg = sigmoid(z);
            const double dz = d * r.lb * sg * (1 - sg);
            dg_raw = dz * e;
            if (r.A_log) dA_log[hv] += dz * z;
          } else {
            const double e = std::exp(r.A_log.at(hv));
            dg_raw = -d * e * sigmoid(xg);
            dA_log[hv] += d * (-e * softplus(xg));
          }
          ddt[per_channel ? hv * K + i : hv] += dg_raw;
        }
        if (a.dg) {
          if (per_channel)
            View(a.dg).set(dg_raw, b, t, hv, i);
          else
            View(a.dg).set(dg_raw, b, t, hv);
        }
      }
    }
  }
  if (a.dA_log)
    for (int64_t hv = 0; hv < HV; ++hv) View(a.dA_log).set(dA_log[hv], hv);
  if (a.ddt_bias) {
    const View d(a.ddt_bias);
    for (int64_t i = 0; i < static_cast<int64_t>(ddt.size()); ++i) {
      if (a.ddt_bias->ndim == 2)
        d.set(ddt[i], i / K, i % K);
      else
        d.set(ddt[i], i);
    }
  }
}

}  // namespace cula
