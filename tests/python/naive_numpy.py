"""A deliberately simple, independent float64 implementation of SPEC §2 in numpy loops,
used to cross-check the engine's reference on small shapes. K-first states [N, HV, K, V]."""

import numpy as np


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def recurrence(family, q, k, v, g=None, beta=None, decay=None, scale=None, h0=None, l2norm=False,
               gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, beta_sigmoid=False,
               neg_eig=False, cu_seqlens=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K ** -0.5 if scale is None else scale
    delta = family in ("kda", "gdn")
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(x) for x in cu_seqlens]
        seqs = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    o = np.zeros((B, T, HV, V))
    finals = np.zeros((len(seqs), HV, K, V))
    for n, (b, s, e) in enumerate(seqs):
        for hv in range(HV):
            h = hv // G
            S = np.zeros((K, V)) if h0 is None else np.array(h0[n, hv], np.float64)
            for t in range(s, e):
                qt, kt = q[b, t, h].copy(), k[b, t, h].copy()
                if l2norm:
                    qt = qt / np.sqrt(np.sum(qt * qt) + 1e-6)
                    kt = kt / np.sqrt(np.sum(kt * kt) + 1e-6)
                qt = qt * scale
                if family == "lightning":
                    a = -np.full(K, float(decay[hv if len(decay) == HV else h]))
                else:
                    raw = np.array(g[b, t, hv], np.float64) * np.ones(K)
                    if gate_in_kernel:
                        bias = 0.0
                        if dt_bias is not None:
                            bias = np.asarray(dt_bias, np.float64).reshape(HV, -1)[hv]
                        x = raw + bias
                        if lower_bound is not None:
                            z = np.exp(A_log[hv]) * x if A_log is not None else x
                            a = lower_bound * sigmoid(z)
                        else:
                            a = -np.exp(A_log[hv]) * softplus(x)
                    else:
                        a = raw
                S = np.exp(a)[:, None] * S
                if delta:
                    bt = float(beta[b, t, hv])
                    if beta_sigmoid:
                        bt = (2.0 if neg_eig else 1.0) * sigmoid(bt)
                    u = v[b, t, hv] - S.T @ kt
                    S = S + bt * np.outer(kt, u)
                else:
                    S = S + np.outer(kt, v[b, t, hv])
                o[b, t, hv] = S.T @ qt
            finals[n, hv] = S
    return o, finals
