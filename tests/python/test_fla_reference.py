"""Conventions pinned against FLA: the engine's float64 reference against FLA's own pure-torch
naive references (fla/ops/*/naive.py) on the same inputs. Skipped where torch or fla-core is
not importable (CI has neither; tools/gpu_check.sh runs it on the GPU machine)."""

import numpy as np
import pytest
from conftest import rel, worst

import cula
import cula.simple_gla

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("fla", reason="fla-core is not installed")


def _np(x):
    return x.detach().double().cpu().numpy()


def _inputs(rng, B, T, H, K, V, HV=None):
    HV = HV or H
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    q, k, v = t(B, T, H, K), t(B, T, H, K), t(B, T, HV, V)
    k = torch.nn.functional.normalize(k, dim=-1)
    return q, k, v


def test_kda_matches_fla_naive_recurrent_and_chunk(rng):
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

    B, T, H, HV, K, V = 2, 128, 2, 4, 32, 16
    q, k, v = _inputs(rng, B, T, H, K, V, HV)
    g = -torch.from_numpy(rng.uniform(0.01, 0.5, (B, T, HV, K)).astype(np.float32))
    beta = torch.from_numpy(rng.uniform(0.1, 0.9, (B, T, HV)).astype(np.float32))
    h0 = torch.from_numpy(rng.standard_normal((B, HV, K, V)).astype(np.float32))
    o_fla, s_fla = naive_recurrent_kda(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                      initial_state=h0.double(), output_final_state=True)
    o_fc, s_fc = naive_chunk_kda(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                 initial_state=h0.double(), output_final_state=True)
    o, s = cula.chunk_kda(q, k, v, g, beta, initial_state=h0.double(), output_final_state=True,
                          state_layout="k_first", backend="reference")
    e = [rel(o, _np(o_fla)), rel(s, _np(s_fla)), rel(o, _np(o_fc)), rel(s, _np(s_fc))]
    print("KDA vs FLA naive (recurrent o, state; chunk o, state):", e)
    assert worst(e) < 1e-6


def test_kda_gate_and_options_match_fla_formulas(rng):
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    B, T, H, K, V = 1, 64, 2, 16, 8
    q, k, v = _inputs(rng, B, T, H, K, V)
    graw = torch.from_numpy(rng.standard_normal((B, T, H, K)).astype(np.float32))
    A_log = torch.from_numpy(rng.uniform(-1, 0.5, H).astype(np.float32))
    dt_bias = torch.from_numpy(rng.standard_normal(H * K).astype(np.float32))
    braw = torch.from_numpy(rng.standard_normal((B, T, H)).astype(np.float32))
    for lb in (None, -5.0):
        if lb is None:
            g = naive_kda_gate(graw.double(), A_log.double(), dt_bias.double())
        else:
            g = naive_kda_lowerbound_gate(graw.double(), A_log.double(), dt_bias.double(), lower_bound=lb)
        qn = torch.nn.functional.normalize(q.double(), dim=-1, eps=0)
        o_fla, s_fla = naive_recurrent_kda(qn, k.double(), v.double(), g, braw.double().sigmoid(), output_final_state=True)
        o, s = cula.chunk_kda(q, k, v, graw, braw, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lb,
                              safe_gate=lb is not None, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True,
                              output_final_state=True, state_layout="k_first", state_dtype="float64", backend="reference")
        e = (rel(o, _np(o_fla)), rel(s, _np(s_fla)))
        print(f"KDA gate-in-kernel lb={lb} vs FLA:", e)
        assert worst(e) < 1e-5  # FLA's l2norm has eps inside the sqrt as well; its q here is pre-normalised


def test_gdn_matches_fla_naive(rng):
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    B, T, H, K, V = 2, 50, 2, 16, 8
    q, k, v = _inputs(rng, B, T, H, K, V)
    g = -torch.from_numpy(rng.uniform(0.01, 0.5, (B, T, H)).astype(np.float32))
    beta = torch.from_numpy(rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32))
    h0 = torch.from_numpy(rng.standard_normal((B, H, K, V)).astype(np.float32))
    o_fla, s_fla = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    o, s = cula.chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True, state_layout="k_first",
                          backend="reference")
    e = (rel(o, _np(o_fla)), rel(s, _np(s_fla)))
    print("GDN vs FLA naive:", e)
    assert worst(e) < 1e-5  # FLA's naive computes in float32


def test_gla_and_simple_gla_and_lightning_match_fla_naive(rng):
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    B, T, H, K, V = 2, 40, 4, 16, 8
    q, k, v = _inputs(rng, B, T, H, K, V)
    gk = -torch.from_numpy(rng.uniform(0.01, 0.5, (B, T, H, K)).astype(np.float32))
    h0 = torch.from_numpy(rng.standard_normal((B, H, K, V)).astype(np.float32))
    o_fla, s_fla = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    o, s = cula.chunk_gla(q, k, v, gk, initial_state=h0, output_final_state=True, state_layout="k_first",
                          backend="reference")
    e_gla = (rel(o, _np(o_fla)), rel(s, _np(s_fla)))
    gs = -torch.from_numpy(rng.uniform(0.01, 0.5, (B, T, H)).astype(np.float32))
    o_fla, s_fla = naive_recurrent_simple_gla(q, k, v, gs, initial_state=h0, output_final_state=True)
    o, s = cula.chunk_simple_gla(q, k, v, gs, initial_state=h0, output_final_state=True, state_layout="k_first",
                                 backend="reference")
    e_sgla = (rel(o, _np(o_fla)), rel(s, _np(s_fla)))
    # Lightning: FLA's chunk_lightning_attn is simple GLA with g_gamma = -(8/H (1 - l/L)) * arange(H);
    # cula's decay is its negation.
    layer, L = 3, 12
    g_gamma = -(8 / H * (1 - layer / L)) * torch.arange(H, dtype=torch.float)
    o_fla, s_fla = naive_recurrent_simple_gla(q, k, v, g_gamma.expand(B, T, H), initial_state=h0, output_final_state=True)
    o, s = cula.chunk_lightning(q, k, v, (-g_gamma).contiguous(), initial_state=h0, output_final_state=True,
                                state_layout="k_first", backend="reference")
    e_light = (rel(o, _np(o_fla)), rel(s, _np(s_fla)))
    print("GLA, simple GLA, Lightning vs FLA naive:", e_gla, e_sgla, e_light)
    assert worst(e_gla + e_sgla + e_light) < 1e-5


def test_fused_recurrent_gla_and_simple_gla_dropins_match_fla_naive(rng):
    """FLA's fused_recurrent_gla / fused_recurrent_simple_gla / fused_chunk_simple_gla /
    parallel_simple_gla on cula: a missing gate means no decay, simple GLA's g and g_gamma together
    add up, parallel_simple_gla's scores are FLA's, gv and reverse are refused by name."""
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    from cula.gla import fused_recurrent_gla
    from cula.simple_gla import fused_chunk_simple_gla, fused_recurrent_simple_gla, parallel_simple_gla

    B, T, H, K, V = 2, 40, 4, 16, 8
    q, k, v = _inputs(rng, B, T, H, K, V)
    gk = -torch.from_numpy(rng.uniform(0.01, 0.5, (B, T, H, K)).astype(np.float32))
    gs = -torch.from_numpy(rng.uniform(0.01, 0.5, (B, T, H)).astype(np.float32))
    g_gamma = -torch.from_numpy(rng.uniform(0.01, 0.3, H).astype(np.float32))
    h0 = torch.from_numpy(rng.standard_normal((B, H, K, V)).astype(np.float32))
    d = lambda *xs: [x.double() for x in xs]  # noqa: E731
    errors = []
    for gate in (gk, None):
        o, s = fused_recurrent_gla(q, k, v, gate, initial_state=h0, output_final_state=True)
        want = naive_recurrent_gla(*d(q, k, v, gk if gate is not None else torch.zeros_like(gk)),
                                   initial_state=h0.double(), output_final_state=True)
        errors += [rel(o, _np(want[0])), rel(s, _np(want[1]))]
    for g, gamma, total in ((gs, None, gs), (None, g_gamma, g_gamma.expand(B, T, H)), (gs, g_gamma, gs + g_gamma),
                            (None, None, torch.zeros_like(gs))):
        o, s = fused_recurrent_simple_gla(q, k, v, g=g, g_gamma=gamma, initial_state=h0, output_final_state=True)
        want = naive_recurrent_simple_gla(*d(q, k, v, total), initial_state=h0.double(), output_final_state=True)
        errors += [rel(o, _np(want[0])), rel(s, _np(want[1]))]
        o, s = fused_chunk_simple_gla(q, k, v, g=g, g_gamma=gamma, initial_state=h0, output_final_state=True)
        errors += [rel(o, _np(want[0])), rel(s, _np(want[1]))]
        if gamma is None:  # (FLA's parallel form takes g only, and no states)
            o, attn = parallel_simple_gla(q, k, v, g=g)
            want = naive_recurrent_simple_gla(*d(q, k, v, total))
            errors.append(rel(o, _np(want[0])))
            assert attn is None
    print("fused_recurrent GLA / simple GLA drop-ins vs FLA naive:", errors)
    assert worst(errors) < 1e-4
    with pytest.raises(NotImplementedError, match="'gv'"):
        fused_recurrent_gla(q, k, v, gk, gv=torch.zeros_like(v))
    with pytest.raises(NotImplementedError, match="reverse"):
        fused_recurrent_simple_gla(q, k, v, gs, reverse=True)
    from fla.ops.simple_gla.naive import naive_parallel_simple_gla

    _, attn = parallel_simple_gla(q, k, v, gs, output_attentions=True)  # the scores FLA materialises
    assert rel(attn, _np(naive_parallel_simple_gla(q, k, v, gs)[1])) < 1e-5
    _, attn = parallel_simple_gla(q, k, v, output_attentions=True)  # no gate (FLA's naive takes none)
    assert rel(attn, _np((q.transpose(1, 2) @ k.permute(0, 2, 3, 1) * K ** -0.5).tril())) < 1e-5
    with pytest.raises(ValueError, match="output_attentions"):
        parallel_simple_gla(q[:1], k[:1], v[:1], gs[:1], output_attentions=True,
                            cu_seqlens=torch.tensor([0, 10, T], dtype=torch.int32))


@pytest.mark.parametrize("form", ["softplus", "lower_bound", "lower_bound_no_A_log", "gdn"])
def test_gate_dropins_match_fla_naive_gates_with_gradients(rng, form):
    """fused_kda_gate / fused_gdn_gate (cula's gate kernel forward, its derivative backward) against
    FLA's naive gates under torch autograd: the output and the gradients of g, A_log and dt_bias."""
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    from cula.gated_delta_rule import fused_gdn_gate
    from cula.kda import fused_kda_gate

    B, T, H, K = 2, 9, 3, 8
    per_head = form == "gdn"
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    g = (t(B, T, H) if per_head else t(B, T, H, K)) * 4
    A_log = None if form == "lower_bound_no_A_log" else torch.log(torch.from_numpy(rng.uniform(1, 16, (1, 1, H, 1))
                                                                                     .astype(np.float32)))
    dt_bias = t(H) if per_head else t(H * K)
    leaves = [x.clone().requires_grad_() if x is not None else None for x in (g, A_log, dt_bias)]
    mine = [x.clone().requires_grad_() if x is not None else None for x in (g, A_log, dt_bias)]
    if form == "gdn":
        ref = naive_gdn_gate(leaves[0], leaves[1].reshape(H), leaves[2])
        got = fused_gdn_gate(mine[0], mine[1].reshape(H), mine[2])
    elif form == "softplus":
        ref = naive_kda_gate(leaves[0], leaves[1], leaves[2])
        got = fused_kda_gate(mine[0], mine[1], mine[2])
    else:
        ref = naive_kda_lowerbound_gate(leaves[0], leaves[1], leaves[2], lower_bound=-3.0)
        got = fused_kda_gate(mine[0], mine[1], mine[2], lower_bound=-3.0)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    do = t(*ref.shape)
    (ref * do).sum().backward()
    (got * do).sum().backward()
    errors = [rel(got.detach(), _np(ref))] + [rel(a.grad, _np(b.grad)) for a, b in zip(mine, leaves) if a is not None]
    print(form, errors)
    assert worst(errors) < 1e-5


def test_delta_rule_dropins_match_fla_naive_with_gradients(rng):
    """chunk_delta_rule / fused_recurrent_delta_rule (DeltaNet: GDN with a log-gate of 0) against FLA's
    naive delta_rule_recurrence (which computes in float32): outputs, final states and every
    gradient (cula's backward against torch autograd through FLA's loop); no beta is 1."""
    from fla.ops.delta_rule.naive import delta_rule_recurrence

    from cula.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule

    B, T, H, K, V = 2, 40, 2, 16, 8
    q, k, v = _inputs(rng, B, T, H, K, V)
    beta = torch.from_numpy(rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32))
    h0 = torch.from_numpy(rng.standard_normal((B, H, K, V)).astype(np.float32))
    heads_first = lambda x: x.transpose(1, 2).double()  # noqa: E731  (FLA's naive loop is [B, H, T, ...])
    errors = []
    for fn, b in ((chunk_delta_rule, beta), (fused_recurrent_delta_rule, None)):
        o, s = fn(q, k, v, b, initial_state=h0, output_final_state=True)
        o_ref, s_ref = delta_rule_recurrence(*map(heads_first, (q, k, v, beta if b is not None else torch.ones_like(beta))),
                                             initial_state=h0.double())
        errors += [rel(o, _np(o_ref.transpose(1, 2))), rel(s, _np(s_ref))]
    leaves = [x.double().requires_grad_() for x in (q, k, v, beta, h0)]
    mine = [x.double().requires_grad_() for x in (q, k, v, beta, h0)]
    o_ref, s_ref = delta_rule_recurrence(*map(lambda x: x.transpose(1, 2), leaves[:4]), initial_state=leaves[4])
    o, s = chunk_delta_rule(*mine[:4], initial_state=mine[4], output_final_state=True)
    do, ds = torch.randn_like(o), torch.randn_like(s)
    ((o_ref.transpose(1, 2) * do).sum() + (s_ref * ds).sum()).backward()
    ((o * do).sum() + (s * ds).sum()).backward()
    grads = [rel(a.grad, _np(b.grad)) for a, b in zip(mine, leaves)]
    print("delta rule drop-ins vs FLA naive:", errors, grads)
    assert worst(errors) < 1e-5 and worst(grads) < 1e-5
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_delta_rule(q, k, v, beta, chunk_size=128)


def test_retention_dropins_match_fla_naive(rng):
    """chunk / fused_chunk / fused_recurrent / parallel_retention (simple GLA with FLA's per-head decay
    log(1 - 2^(-5 - h))) against FLA's naive_retention; with states, the chunk form against simple
    GLA's with that decay; the gradients flow (Lightning's backward)."""
    from fla.ops.retention.naive import naive_retention

    import cula.retention as ret

    B, T, H, K, V = 2, 50, 3, 16, 8
    q, k, v = _inputs(rng, B, T, H, K, V)
    want = naive_retention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    outs = [ret.chunk_retention(q, k, v)[0], ret.fused_chunk_retention(q, k, v)[0],
            ret.fused_recurrent_retention(q, k, v)[0], ret.parallel_retention(q, k, v)[0]]
    errors = [rel(o, _np(want)) for o in outs]
    h0 = torch.from_numpy(rng.standard_normal((B, H, K, V)).astype(np.float32))
    o, s = ret.chunk_retention(q, k, v, initial_state=h0, output_final_state=True)
    gamma = torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float)))
    o_sg, s_sg = cula.simple_gla.chunk_simple_gla(q, k, v, g_gamma=gamma, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o_sg) and torch.equal(s, s_sg)
    leaf = q.clone().requires_grad_()
    ret.chunk_retention(leaf, k, v)[0].sum().backward()
    assert leaf.grad is not None and bool(torch.isfinite(leaf.grad).all()) and leaf.grad.abs().sum() > 0
    print("retention drop-ins vs FLA naive:", errors)
    assert worst(errors) < 1e-5
