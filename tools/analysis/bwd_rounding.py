"""Which products of the chunked backward tolerate bf16 operands: a float64 model of its roundings
for KDA with Kimi-Linear's gate (softplus, no bound), one head, K = V = 128.

The CUDA backward (csrc/cuda/backward/) runs every product on 3xTF32 (about float32) and is ~2.4x
slower than FLA's bf16 Triton backward; a 1xTF32 A/B measured 10-15% faster and put dA_log (FLA's
tolerance 3e-3) at 1.05x its tolerance on 16k tokens with the per-chunk kernels on 1xTF32, 1.30x
with the scans too (csrc/cuda/backward/DESIGN.md). dA_log = sum over tokens and channels of
da * a (a the log-decay) sums terms that cancel, so it is the gradient that limits the precision.

The model is the chunk algebra of tests/python/chunked_bwd_numpy.py with every product's operands
rounded: the per-chunk products (the factor, value, key and pair kernels: P, KEK, T, W, the dq/dk/
dG terms) by `op`, the factor block as stored (T, Kg, Qg, Kr, P) by `fac`, and the chunk-start
states S0 and state gradients dS where the per-chunk products read them by `state` (the scans
themselves accumulate in float64 here). Errors are FLA's ratio (rms of the difference over rms of
the float64 values).

Run: python3 tools/analysis/bwd_rounding.py [--gdn] [--only=TEXT ...] [T ...] (default 4096 16384;
--only keeps the variants whose name holds TEXT). Read it for which roundings matter and how they
grow with T, calibrated against the 1xTF32 measurement above.
--gdn: Gated DeltaNet as Qwen3-Next runs it instead: one log-decay per token (the same softplus gate,
scalar), its gradient dg the sum of da over the channels, and no dA_log (FLA's GDN takes g computed
outside the kernel, so A_log's gradient comes from dg through autograd, at dg's tolerance).
--family=simple_gla | lightning | gla: the families without the delta rule in the lean form their
backward could take (csrc/cuda/backward/DESIGN.md, Next): chunk-start states S0 and end-state
gradients dS from the scans, stored as `state` rounds them, then per chunk dq = e^G (dO S0^T) +
(dP o E) k, dk = e^{G_C - G} (v dS^T) + (dP o E)^T q, dv = (P o E)^T dO + Kr dS and the gate's terms,
each product's operands rounded by `op`. Gates: simple GLA a log-sigmoid per token and head, GLA one
per channel, Lightning a constant per head (no gate gradient); q and k bf16, unnormalised.
"""

import sys

import numpy as np
from rounding import bf16, bf16x2, exact, f32, tf32

K = V = 128
C = 64


def problem(T, seed, scalar=False):
    """Kimi-Linear's KDA as the backward sees it: q, k L2-normalised (bf16 inputs), v bf16, beta after
    its sigmoid, a = -exp(A_log) softplus(raw + dt_bias)."""
    rng = np.random.default_rng(seed)
    norm = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q, k = norm(bf16(rng.standard_normal((T, K)))), norm(bf16(rng.standard_normal((T, K))))
    v = bf16(rng.standard_normal((T, V)))
    beta = 1 / (1 + np.exp(-rng.standard_normal(T)))
    raw, dt_bias, A_log = rng.standard_normal((T, K)), 0.5 * rng.standard_normal(K), 0.5 * rng.standard_normal()
    if scalar:  # one decay per token, repeated over the channels
        raw, dt_bias = np.repeat(raw[:, :1], K, axis=1), np.full(K, dt_bias[0])
    a = -np.exp(A_log) * np.logaddexp(0.0, raw + dt_bias)
    dO, dST = bf16(rng.standard_normal((T, V))), rng.standard_normal((K, V))
    return q * K ** -0.5, k, v, beta, a, dO, dST


def states(q, k, v, beta, a, delta=True):
    """Chunk-start states of the forward (float64 token recurrence); without the delta rule S <-
    e^a S + k v^T (q and beta unused)."""
    starts, S = [], np.zeros((K, V))
    for t in range(k.shape[0]):
        if t % C == 0:
            starts.append(S.copy())
        S = np.exp(a[t])[:, None] * S
        S = S + np.outer(k[t], beta[t] * (v[t] - S.T @ k[t]) if delta else v[t])
    return starts


def by_chunks(T, like, dST, starts, chunk):
    """The chunk form over a sequence: from the last chunk to the first, chunk(sl, S0, dS_C) gives the
    chunk's gradients (by name, as in `like`) and dS0 for the chunk before."""
    out = {n: np.zeros_like(x) for n, x in like.items()}
    dS = dST.copy()
    for c in reversed(range(len(starts))):
        sl = slice(c * C, min(T, (c + 1) * C))
        g, dS = chunk(sl, starts[c], dS)
        for n in out:
            out[n][sl] = g[n]
    return out


def chunk_backward(q, k, v, beta, a, S0, dO, dSC, op, fac, state):
    """chunked_bwd_numpy.chunk_backward (delta rule) with its products' operands rounded. op: one
    rounding for every product, or a dict by the kernel that runs the product (factors: P and KEK;
    value: B, Delta, dB, dA; key: dQg, dKr, dKg; pair: the dP terms and the dA terms of dk, dG)."""
    ops = op if isinstance(op, dict) else dict.fromkeys(("factors", "value", "key", "pair"), op)
    opf, opv, opk, opp = ops["factors"], ops["value"], ops["key"], ops["pair"]
    n = q.shape[0]
    S0r, dSr = state(S0), state(dSC)
    G = np.cumsum(a, axis=0)
    E = np.exp(G[:, None, :] - G[None, :, :])
    low, tri = np.tril(np.ones((n, n)), -1), np.tril(np.ones((n, n)))
    kek = np.einsum("tc,tsc,sc->ts", opf(k), E, opf(k))
    A = beta[:, None] * kek * low
    Tm = fac(np.linalg.inv(np.eye(n) + f32(A)))
    Kg, Qg, Kr = fac(np.exp(G) * k), fac(np.exp(G) * q), fac(np.exp(G[-1] - G) * k)
    B = beta[:, None] * (v - opv(Kg) @ S0r)
    Delta = opv(Tm) @ opv(B)
    P = fac(np.einsum("tc,tsc,sc->ts", opf(q), E, opf(k)) * tri)
    dq, dk, dG = np.zeros_like(q), np.zeros_like(k), np.zeros((n, K))
    dDelta = opv(P).T @ opv(dO) + opv(Kr) @ dSr
    dQg = opk(dO) @ S0r.T
    dq += np.exp(G) * dQg
    dG += Qg * dQg
    dP = (opp(dO) @ opp(Delta).T) * tri
    dq += np.einsum("ts,tsc,sc->tc", opp(dP), E, opp(k))
    dk += np.einsum("ts,tsc,tc->sc", opp(dP), E, opp(q))
    pe = np.einsum("ts,tc,tsc,sc->tsc", opp(dP), opp(q), E, opp(k))
    dG += pe.sum(axis=1) - pe.sum(axis=0)
    dG[-1] += np.exp(G[-1]) * np.einsum("cv,cv->c", S0r, dSr)
    dKr = opk(Delta) @ dSr.T
    dk += np.exp(G[-1] - G) * dKr
    kr = Kr * dKr
    dG[-1] += kr.sum(axis=0)
    dG -= kr
    dB = opv(Tm).T @ opv(dDelta)
    dA = -(opv(Tm).T @ opv(dDelta) @ opv(B).T @ opv(Tm).T) * low
    dv = beta[:, None] * dB
    dbeta = np.einsum("tv,tv->t", dB, v - opv(Kg) @ S0r)
    dKg = -opk(beta[:, None] * dB) @ S0r.T
    dk += np.exp(G) * dKg
    dG += Kg * dKg
    dbeta += (dA * kek).sum(axis=1)
    w = dA * beta[:, None]
    dk += np.einsum("ts,tsc,sc->tc", opp(w), E, opp(k)) + np.einsum("ts,tsc,tc->sc", opp(w), E, opp(k))
    ae = np.einsum("ts,tc,tsc,sc->tsc", opp(w), opp(k), E, opp(k))
    dG += ae.sum(axis=1) - ae.sum(axis=0)
    da = np.cumsum(dG[::-1], axis=0)[::-1]
    # dS0 for the scan, in float64 from exact factors (the scans are modelled exact)
    W = np.linalg.inv(np.eye(n) + A) @ (beta[:, None] * np.exp(G) * k)
    dS0 = (np.exp(G) * q).T @ dO + np.exp(G[-1])[:, None] * dSC - W.T @ (
        np.einsum("tc,tsc,sc->ts", q, E, k).T * tri.T @ dO + (np.exp(G[-1] - G) * k) @ dSC)
    return dict(dq=dq, dk=dk, dv=dv, dbeta=dbeta, da=da), dS0


def backward(q, k, v, beta, a, dO, dST, starts, op=exact, fac=exact, state=exact):
    out = by_chunks(q.shape[0], dict(dq=q, dk=k, dv=v, dbeta=beta, da=a), dST, starts, lambda sl, S0, dS: chunk_backward(
        q[sl], k[sl], v[sl], beta[sl], a[sl], S0, dO[sl], dS, op, fac, state))
    out["dA_log"] = np.array([(out["da"] * a).sum()])  # a = -exp(A_log) softplus(.): da/dA_log = a
    return out


_F32 = dict(factors=f32, value=f32, key=f32, pair=f32)
VARIANTS = [
    ("float32 operands (the 3xTF32 kernels)", dict(op=f32, fac=f32, state=f32)),
    ("1xTF32 per-chunk products, float32 states", dict(op=tf32, fac=f32, state=f32)),
    ("1xTF32 everywhere (states as TF32 operands)", dict(op=tf32, fac=f32, state=tf32)),
    ("bf16 operands, float32 factor block and states", dict(op=bf16, fac=f32, state=f32)),
    ("bf16 operands and factor block, float32 states", dict(op=bf16, fac=bf16, state=f32)),
    ("bf16 everywhere, states bf16 (FLA's layout)", dict(op=bf16, fac=bf16, state=bf16)),
    ("float32 operands, states bf16 only", dict(op=f32, fac=f32, state=bf16)),
    ("bf16 in the factor kernel's products only", dict(op=dict(_F32, factors=bf16), fac=f32, state=f32)),
    ("bf16 in the value kernel's products only", dict(op=dict(_F32, value=bf16), fac=f32, state=f32)),
    ("bf16 in the key kernel's products only", dict(op=dict(_F32, key=bf16), fac=f32, state=f32)),
    ("bf16 in the pair kernel's products only", dict(op=dict(_F32, pair=bf16), fac=f32, state=f32)),
    ("bf16x3 per-chunk products, float32 states", dict(op=bf16x2, fac=f32, state=f32)),
    ("bf16x3 everywhere (states as hi/lo operands)", dict(op=bf16x2, fac=f32, state=bf16x2)),
    ("bf16x3 everywhere, factor block as hi/lo", dict(op=bf16x2, fac=bf16x2, state=bf16x2)),
]
TOL = dict(dq=8e-3, dk=8e-3, dv=8e-3, dbeta=2e-2, da=2e-2, dA_log=3e-3)
TOL_GDN = dict(dq=8e-3, dk=8e-3, dv=8e-3, dbeta=2e-2, dg=2e-2)


def with_dg(grads):
    """GDN's gradients: dg of its one decay per token, the sum of da over the channels, added."""
    grads["dg"] = grads["da"].sum(axis=1)
    return grads


def error(got, ref, n):
    """FLA's error ratio of gradient n: rms of the difference over rms of the reference."""
    return np.sqrt(((got[n] - ref[n]) ** 2).mean() / (ref[n] ** 2).mean())


def lean_problem(T, seed, family):
    """A family without the delta rule as its layers feed it: bf16 q, k (k scaled by K^-1/2), v, dO;
    simple GLA's gate logsigmoid(x) per token, GLA's per channel, Lightning's a constant decay."""
    rng = np.random.default_rng(seed)
    q, k = bf16(rng.standard_normal((T, K))), bf16(rng.standard_normal((T, K)) * K ** -0.5)
    v, dO = bf16(rng.standard_normal((T, V))), bf16(rng.standard_normal((T, V)))
    if family == "lightning":
        a = np.full((T, K), -0.05)
    else:
        raw = rng.standard_normal((T, K) if family == "gla" else (T, 1)) + 2.0
        a = np.broadcast_to(-np.logaddexp(0.0, -raw), (T, K)).copy()  # logsigmoid
    return q * K ** -0.5, k, v, a, dO, rng.standard_normal((K, V))


def lean_chunk_backward(q, k, v, a, S0, dO, dSC, op, state):
    """One chunk of the lean form (no delta rule): its gradients and dS0 (exact, the scans modelled
    exact)."""
    n = q.shape[0]
    S0r, dSr = state(S0), state(dSC)
    G = np.cumsum(a, axis=0)
    E = np.exp(G[:, None, :] - G[None, :, :])
    tri = np.tril(np.ones((n, n)))
    Qg, Kr = np.exp(G) * q, np.exp(G[-1] - G) * k
    P = np.einsum("tc,tsc,sc->ts", op(q), E, op(k)) * tri
    dP = (op(dO) @ op(v).T) * tri
    dQg, dKr = op(dO) @ op(S0r).T, op(v) @ op(dSr).T
    dq = np.exp(G) * dQg + np.einsum("ts,tsc,sc->tc", op(dP), E, op(k))
    dk = np.exp(G[-1] - G) * dKr + np.einsum("ts,tsc,tc->sc", op(dP), E, op(q))
    dv = op(P).T @ op(dO) + op(Kr) @ op(dSr)
    pe = np.einsum("ts,tc,tsc,sc->tsc", dP, q, E, k)
    dG = Qg * dQg + pe.sum(axis=1) - pe.sum(axis=0)
    kr = Kr * dKr
    dG -= kr
    dG[-1] += kr.sum(axis=0) + np.exp(G[-1]) * np.einsum("cv,cv->c", S0r, dSr)
    da = np.cumsum(dG[::-1], axis=0)[::-1]
    dS0 = Qg.T @ dO + np.exp(G[-1])[:, None] * dSC
    return dict(dq=dq, dk=dk, dv=dv, da=da), dS0


def lean_backward(q, k, v, a, dO, dST, starts, op=exact, state=exact):
    return by_chunks(q.shape[0], dict(dq=q, dk=k, dv=v, da=a), dST, starts, lambda sl, S0, dS: lean_chunk_backward(
        q[sl], k[sl], v[sl], a[sl], S0, dO[sl], dS, op, state))


LEAN_VARIANTS = [
    ("float32 operands and states (3xTF32)", dict(op=f32, state=f32)),
    ("1xTF32 products, float32 states", dict(op=tf32, state=f32)),
    ("1xTF32 products, states bf16", dict(op=tf32, state=bf16)),
    ("bf16 operands, float32 states", dict(op=bf16, state=f32)),
    ("bf16 operands and states (FLA's layout)", dict(op=bf16, state=bf16)),
    ("bf16x3 operands, states bf16", dict(op=bf16x2, state=bf16)),
]


def lean_main(family, lengths):
    grads = ("dq", "dk", "dv") + (() if family == "lightning" else ("dg",))

    def finish(g):  # dg: GLA's per channel, simple GLA's the sum over the channels
        g["dg"] = g["da"] if family == "gla" else g["da"].sum(axis=1)
        return g

    for T in lengths:
        q, k, v, a, dO, dST = lean_problem(T, T, family)
        starts = states(q, k, v, None, a, delta=False)
        ref = finish(lean_backward(q, k, v, a, dO, dST, starts))
        print(f"{family}, T = {T}: error / FLA's tolerance ({' '.join(grads)})")
        for name, kw in LEAN_VARIANTS:
            got = finish(lean_backward(q, k, v, a, dO, dST, starts, **kw))
            print(f"  {name:48s} " + " ".join(f"{error(got, ref, n) / TOL_GDN[n]:6.3f}" for n in grads), flush=True)


def main():
    lengths = [int(x) for x in sys.argv[1:] if not x.startswith("--")] or [4096, 16384]
    family = next((x.split("=", 1)[1] for x in sys.argv[1:] if x.startswith("--family=")), None)
    if family is not None:
        return lean_main(family, lengths)
    scalar = "--gdn" in sys.argv
    only = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--only=")]
    tol = TOL_GDN if scalar else TOL
    finish = with_dg if scalar else (lambda grads: grads)
    for T in lengths:
        q, k, v, beta, a, dO, dST = problem(T, seed=T, scalar=scalar)
        starts = states(q, k, v, beta, a)
        ref = finish(backward(q, k, v, beta, a, dO, dST, starts))
        print(f"T = {T}: error / FLA's tolerance ({' '.join(tol)})")
        for name, kw in VARIANTS:
            if only and not any(o in name for o in only):
                continue
            got = finish(backward(q, k, v, beta, a, dO, dST, starts, **kw))
            ratios = [error(got, ref, n) / t for n, t in tol.items()]
            print(f"  {name:48s} " + " ".join(f"{r:6.3f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
