"""The chunk form of the backward (chunked_bwd_numpy.py: the state-gradient scan over chunks, then
each chunk's gradients from its start state and end-state gradient) against the float64 reference
backward of the library, for the delta rule with per-channel and scalar gates and without the delta
rule: the algebra the chunked tensor-core backward implements."""

import numpy as np
import pytest
from chunked_bwd_numpy import backward
from conftest import rel, worst

import cula


@pytest.mark.parametrize("family", ["kda", "gdn", "gla", "simple_gla"])
@pytest.mark.parametrize("C", [16, 64])
def test_chunk_form_backward_matches_the_reference(rng, family, C):
    T, K, V = 75, 8, 6
    f = np.float64
    q = rng.standard_normal((1, T, 1, K))
    k = rng.standard_normal((1, T, 1, K)) / np.sqrt(K)
    v = rng.standard_normal((1, T, 1, V))
    per_channel = family in ("kda", "gla")
    delta = family in ("kda", "gdn")
    a = -rng.uniform(0.01, 0.6, (1, T, 1, K) if per_channel else (1, T, 1))
    beta = rng.uniform(0.1, 0.9, (1, T, 1)) if delta else None
    h0 = rng.standard_normal((1, 1, K, V)) * 0.5
    dO = rng.standard_normal((1, T, 1, V))
    dST = rng.standard_normal((1, 1, K, V))
    ref = cula.chunk_bwd(family, q, k, v, a, beta, dO, d_final_state=dST, initial_state=h0, scale=1.0,
                         state_layout="k_first", backend="reference")
    a_tok = a[0, :, 0] if per_channel else np.repeat(a[0, :, 0, None], K, axis=1)
    b_tok = beta[0, :, 0] if delta else np.ones(T, f)
    got, dS0 = backward(q[0, :, 0], k[0, :, 0], v[0, :, 0], b_tok, a_tok, h0[0, 0], dO[0, :, 0], dST[0, 0], C=C,
                        delta=delta)
    errs = {"dq": rel(got["dq"], ref["dq"][0, :, 0]), "dk": rel(got["dk"], ref["dk"][0, :, 0]),
            "dv": rel(got["dv"], ref["dv"][0, :, 0]), "dh0": rel(dS0, ref["d_initial_state"][0, 0]),
            "dg": rel(got["da"] if per_channel else got["da"].sum(axis=1), ref["dg"][0, :, 0])}
    if delta:
        errs["dbeta"] = rel(got["dbeta"], ref["dbeta"][0, :, 0])
    assert worst(errs.values()) < 1e-9, errs


def test_state_gradient_scan_is_the_forward_scans_adjoint(rng):
    """The state-gradient step in the forward scan's operands (backward/DESIGN.md): with W' = -beta
    Kg, AM = P Minv and Kt = Minv^T Kr, dY = AM^T dO + Kt dS_C and dS0 = Qg^T dO + e^{G_C} dS_C +
    W'^T dY equal the chunk form's dS0, and beta dY is its dv."""
    from chunked_bwd_numpy import _chunk_factors, chunk_backward

    C, K, V = 64, 16, 12
    q, k = rng.standard_normal((C, K)), rng.standard_normal((C, K)) / np.sqrt(K)
    v, beta = rng.standard_normal((C, V)), rng.uniform(0.1, 0.9, C)
    a, S0 = -rng.uniform(0.01, 0.6, (C, K)), rng.standard_normal((K, V))
    dO, dSC = rng.standard_normal((C, V)), rng.standard_normal((K, V))
    f = _chunk_factors(q, k, v, beta, a, S0, True)
    Minv, Kg, Qg, Kr, P, G = (f[n] for n in ("T", "Kg", "Qg", "Kr", "P", "G"))
    Wp, AM, Kt = -beta[:, None] * Kg, P @ Minv, Minv.T @ Kr
    dY = AM.T @ dO + Kt @ dSC
    dS0 = Qg.T @ dO + np.exp(G[-1])[:, None] * dSC + Wp.T @ dY
    grads, want = chunk_backward(q, k, v, beta, a, S0, dO, dSC, True)
    assert rel(dS0, want) < 1e-12 and rel(beta[:, None] * dY, grads["dv"]) < 1e-12
