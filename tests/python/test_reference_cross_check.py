"""The engine's float64 reference and its fast CPU path against an independent numpy-loop
implementation, over families and options."""

import numpy as np
import pytest
from cases import family_arrays, offsets, state_shape
from conftest import rel
from naive_numpy import recurrence

import cula

CASES = [
    # family, options
    ("kda", dict()),
    ("kda", dict(l2norm=True, gate_in_kernel=True, beta_sigmoid=True)),
    ("kda", dict(l2norm=True, gate_in_kernel=True, lower_bound=-5.0, beta_sigmoid=True, neg_eig=True, gva=True)),
    ("kda", dict(gate_in_kernel=True, lower_bound=-3.0, no_A_log=True, varlen=True)),
    ("gdn", dict(l2norm=True)),
    ("gdn", dict(gate_in_kernel=True, beta_sigmoid=True, varlen=True, gva=True)),
    ("gla", dict(l2norm=True, gva=True)),
    ("simple_gla", dict(varlen=True)),
    ("lightning", dict(l2norm=True)),
    ("lightning", dict(gva=True, varlen=True)),
]


def make(rng, family, opts, B=2, T=19, H=2, K=8, V=6):
    HV = 2 * H if opts.get("gva") else H
    seqlens = [7, 0, 11, 1] if opts.get("varlen") else None
    if seqlens:
        B, T = 1, sum(seqlens)
    kw = family_arrays(rng, family, B, T, H, HV, K, V, gate_in_kernel=opts.get("gate_in_kernel", False),
                       beta_sigmoid=opts.get("beta_sigmoid", False), l2norm=opts.get("l2norm", False),
                       no_A_log=opts.get("no_A_log", False))
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    N = len(seqlens) if seqlens else B
    h0 = rng.standard_normal(state_shape(N, HV, K, V, "k_first")).astype(np.float32) * 0.5
    cu = offsets(seqlens) if seqlens else None
    return q, k, v, kw, h0, cu


@pytest.mark.parametrize("family,opts", CASES, ids=[f"{f}-{'-'.join(sorted(o)) or 'plain'}" for f, o in CASES])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_engine_matches_numpy_loops(rng, family, opts, backend):
    q, k, v, kw, h0, cu = make(rng, family, opts)
    lb = opts.get("lower_bound")
    o_ref, s_ref = recurrence(family, q, k, v, g=kw.get("g"), beta=kw.get("beta"), decay=kw.get("decay"), h0=h0,
                              l2norm=opts.get("l2norm", False), gate_in_kernel=opts.get("gate_in_kernel", False),
                              A_log=kw.get("A_log"), dt_bias=kw.get("dt_bias"), lower_bound=lb,
                              beta_sigmoid=opts.get("beta_sigmoid", False), neg_eig=opts.get("neg_eig", False),
                              cu_seqlens=cu)
    o, s = cula.chunk_fwd(family, q, k, v, kw.get("g"), kw.get("beta"), kw.get("decay"), initial_state=h0,
                          output_final_state=True, use_qk_l2norm_in_kernel=opts.get("l2norm", False),
                          use_gate_in_kernel=opts.get("gate_in_kernel", False), lower_bound=lb,
                          safe_gate=lb is not None, A_log=kw.get("A_log"), dt_bias=kw.get("dt_bias"),
                          use_beta_sigmoid_in_kernel=opts.get("beta_sigmoid", False),
                          allow_neg_eigval=opts.get("neg_eig", False), cu_seqlens=cu, state_layout="k_first",
                          state_dtype="float64" if backend == "reference" else None, backend=backend)
    assert np.isfinite(o).all()
    tol = 1e-6 if backend == "reference" else 1e-4  # reference: only the float32 output rounds
    assert rel(o, o_ref) < tol
    assert rel(s, s_ref) < tol


@pytest.mark.parametrize("family", ["kda", "gdn", "gla", "simple_gla"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_gate_of_minus_infinity_is_a_reset(rng, family, backend):
    """A log-decay of -inf (log 0: forget everything) at some tokens, twice in a row at a chunk
    boundary and at the last token: the state restarts there, as the numpy loops compute it;
    the chunked CPU path sums log-decays and must not turn -inf - (-inf) into NaN."""
    q, k, v, kw, h0, _ = make(rng, family, {}, B=1, T=150, H=2, K=8, V=6)
    kw["g"][:, [3, 63, 64, 100, 149]] = -np.inf
    o_ref, s_ref = recurrence(family, q, k, v, g=kw["g"], beta=kw.get("beta"), h0=h0)
    o, s = cula.chunk_fwd(family, q, k, v, kw["g"], kw.get("beta"), initial_state=h0, output_final_state=True,
                          state_layout="k_first", state_dtype="float64" if backend == "reference" else None,
                          backend=backend)
    assert np.isfinite(o).all() and np.isfinite(s).all()
    assert rel(o, o_ref) < (1e-6 if backend == "reference" else 1e-4)
    assert rel(s, s_ref) < (1e-6 if backend == "reference" else 1e-4)
