"""The backward of the gated delta rule in chunk form, in float64 numpy: the algorithm the chunked
tensor-core backward follows, checked against the float64 reference backward
(test_chunked_backward_algebra.py). One sequence, one head, state S [K, V] (K-first), per-channel
log-decays a [T, K] (a scalar gate is a row of equal values), q and k as the recurrence sees them
(scaled, normalised), beta after its sigmoid.

Forward of one chunk of C tokens from the state S0 at its start, with G_t = sum_{s<=t} a_s (inside
the chunk) and E_ts = diag(exp(G_t - G_s)):
    A_ts  = beta_t k_t^T E_ts k_s  (s < t)        T = (I + A)^-1     (delta rule; else A = 0)
    Kg    = rows (e^{G_t} k_t)^T, Qg = rows (e^{G_t} q_t)^T, Kr = rows (e^{G_C - G_s} k_s)^T
    B     = diag(beta) (V - Kg S0)                Delta = T B        (else Delta = V)
    P_ts  = q_t^T E_ts k_s  (s <= t)
    O     = Qg S0 + P Delta                       S_C = e^{G_C} S0 + Kr^T Delta
Backward, given dO and dS_C:
    dDelta = P^T dO + Kr dS_C
    dS0    = Qg^T dO + e^{G_C} dS_C - W^T dDelta,  W = T diag(beta) Kg   (the state-gradient scan:
             dS0 = Qg^T dO - W^T P^T dO + (e^{G_C} - W^T Kr) dS_C, sequential over chunks only)
    dB     = T^T dDelta, dA = -(T^T dDelta B^T T^T) on the strict lower triangle
    then every factor's gradient by the product rule (below), and da from dG by a reverse cumsum.
The scan over chunks runs first (each chunk's S0 from the forward, each chunk's dS_C from the
chunk after it); every chunk's gradients are then independent of the others.
"""

import numpy as np


def chunk_forward_states(q, k, v, beta, a, S0, C, delta=True):
    """The state at the start of every chunk and the final state (the token recurrence)."""
    T = q.shape[0]
    starts, S = [], S0.copy()
    for t in range(T):
        if t % C == 0:
            starts.append(S.copy())
        S = np.exp(a[t])[:, None] * S
        u = beta[t] * (v[t] - S.T @ k[t]) if delta else v[t]
        S = S + np.outer(k[t], u)
    return starts, S


def _chunk_factors(q, k, v, beta, a, S0, delta):
    C, K = k.shape
    G = np.cumsum(a, axis=0)
    E = np.exp(G[:, None, :] - G[None, :, :])  # E[t, s, c] = exp(G_tc - G_sc)
    lower = np.tril(np.ones((C, C)), -1)
    A = beta[:, None] * np.einsum("tc,tsc,sc->ts", k, E, k) * lower if delta else np.zeros((C, C))
    Tinv = np.linalg.inv(np.eye(C) + A)
    Kg, Qg = np.exp(G) * k, np.exp(G) * q
    Kr = np.exp(G[-1] - G) * k
    B = beta[:, None] * (v - Kg @ S0) if delta else v
    Delta = Tinv @ B
    P = np.einsum("tc,tsc,sc->ts", q, E, k) * np.tril(np.ones((C, C)))
    return dict(G=G, E=E, A=A, T=Tinv, Kg=Kg, Qg=Qg, Kr=Kr, B=B, Delta=Delta, P=P)


def chunk_backward(q, k, v, beta, a, S0, dO, dSC, delta=True):
    """One chunk's gradients (dq, dk, dv, dbeta, da) and dS0, given its start state S0, the output
    gradient dO and the gradient dSC of its end state."""
    f = _chunk_factors(q, k, v, beta, a, S0, delta)
    G, E, Tm, Kg, Qg, Kr, B, Delta, P = (f[n] for n in ("G", "E", "T", "Kg", "Qg", "Kr", "B", "Delta", "P"))
    C, K = k.shape
    dq, dk, dv, dbeta, dG = (np.zeros_like(q), np.zeros_like(k), np.zeros_like(v), np.zeros(C), np.zeros((C, K)))
    dDelta = P.T @ dO + Kr @ dSC
    dS0 = Qg.T @ dO + np.exp(G[-1])[:, None] * dSC
    # O = Qg S0 + P Delta
    dQg = dO @ S0.T
    dq += np.exp(G) * dQg
    dG += Qg * dQg
    dP = (dO @ Delta.T) * np.tril(np.ones((C, C)))
    dq += np.einsum("ts,tsc,sc->tc", dP, E, k)
    dk += np.einsum("ts,tsc,tc->sc", dP, E, q)
    pe = np.einsum("ts,tc,tsc,sc->tsc", dP, q, E, k)
    dG += pe.sum(axis=1) - pe.sum(axis=0)
    # S_C = e^{G_C} S0 + Kr^T Delta
    dG[-1] += np.exp(G[-1]) * np.einsum("cv,cv->c", S0, dSC)
    dKr = Delta @ dSC.T
    dk += np.exp(G[-1] - G) * dKr
    kr = Kr * dKr
    dG[-1] += kr.sum(axis=0)
    dG -= kr
    if delta:
        # Delta = T B, B = diag(beta) (V - Kg S0), T = (I + A)^-1
        dB = Tm.T @ dDelta
        dA = -(Tm.T @ dDelta @ B.T @ Tm.T) * np.tril(np.ones((C, C)), -1)
        dv += beta[:, None] * dB
        dbeta += np.einsum("tv,tv->t", dB, v - Kg @ S0)
        dKg = -(beta[:, None] * dB) @ S0.T
        dS0 += -Kg.T @ (beta[:, None] * dB)
        dk += np.exp(G) * dKg
        dG += Kg * dKg
        # A_ts = beta_t k_t^T E_ts k_s
        kek = np.einsum("tc,tsc,sc->ts", k, E, k)
        dbeta += (dA * kek).sum(axis=1)
        w = dA * beta[:, None]
        dk += np.einsum("ts,tsc,sc->tc", w, E, k) + np.einsum("ts,tsc,tc->sc", w, E, k)
        ae = np.einsum("ts,tc,tsc,sc->tsc", w, k, E, k)
        dG += ae.sum(axis=1) - ae.sum(axis=0)
    else:
        dv += dDelta
    da = np.cumsum(dG[::-1], axis=0)[::-1]  # G_t = sum_{s<=t} a_s
    return dict(dq=dq, dk=dk, dv=dv, dbeta=dbeta, da=da), dS0


def backward(q, k, v, beta, a, S0, dO, dST, C=64, delta=True):
    """The whole sequence: the forward states at chunk starts, the state-gradient scan from the last
    chunk, then each chunk's gradients. Returns ({dq, dk, dv, dbeta, da}, dS0)."""
    T = q.shape[0]
    starts, _ = chunk_forward_states(q, k, v, beta, a, S0, C, delta)
    out = {n: np.zeros_like(x) for n, x in (("dq", q), ("dk", k), ("dv", v), ("dbeta", beta), ("da", a))}
    dS = dST.copy()
    for c in reversed(range(len(starts))):
        sl = slice(c * C, min(T, (c + 1) * C))
        g, dS = chunk_backward(q[sl], k[sl], v[sl], beta[sl], a[sl], starts[c], dO[sl], dS, delta)
        for n in out:
            out[n][sl] = g[n]
    return out, dS
