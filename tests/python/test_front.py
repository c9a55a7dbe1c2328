"""The Python front: Level 1 (cula.api), the FLA drop-ins, the FlashKDA entry, autograd."""

import contextlib
import inspect

import numpy as np
import pytest
from conftest import rel

import cula
import cula.delta_rule
import cula.flash_kda
import cula.gated_delta_rule
import cula.gla
import cula.kda
import cula.lightning_attn
import cula.retention
import cula.simple_gla

f32 = np.float32


def qkv(rng, B=1, T=24, H=2, K=16, V=8, HV=None):
    HV = HV or H
    return (rng.standard_normal((B, T, H, K)).astype(f32), rng.standard_normal((B, T, H, K)).astype(f32),
            rng.standard_normal((B, T, HV, V)).astype(f32))


def test_level1_kda_scalar_gate_is_gdn_and_offsets_normalised(rng):
    q, k, v = qkv(rng, T=30)
    g = -rng.uniform(0.01, 0.5, (1, 30, 2)).astype(f32)
    beta = rng.uniform(0.1, 0.9, (1, 30, 2)).astype(f32)
    cu = np.array([0, 11, 30], np.int64)
    h0 = rng.standard_normal((2, 2, 8, 16)).astype(f32)  # K-last [N, H, V, K]
    o1, s1 = cula.cula_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                           use_qk_l2norm_in_kernel=True)
    o2, s2 = cula.chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                            cu_seqlens=cu.astype(np.int32), use_qk_l2norm_in_kernel=True, state_layout="k_last")
    assert rel(o1, o2) == 0 and rel(s1, s2) == 0 and s1.shape == (2, 2, 8, 16)


def test_level1_enforces_state_and_rejects_unknown_kwargs(rng):
    q, k, v = qkv(rng)
    g = -rng.uniform(0.01, 0.5, (1, 24, 2, 16)).astype(f32)
    beta = rng.uniform(0.1, 0.9, (1, 24, 2)).astype(f32)
    with pytest.raises(cula.CulaError, match="initial_state.*float32 K-last"):
        cula.cula_kda(q, k, v, g, beta, initial_state=np.zeros((1, 2, 16, 8), f32) + 1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        cula.cula_kda(q, k, v, g, beta, not_an_option=1)
    o, _ = cula.cula_kda(q, k, v, g, beta, A_log=None, chunk_size=32)
    assert np.isfinite(o).all()
    assert cula.api.backend_for("kda", "cpu") == "cpu"


def test_level1_lightning_pool_equals_initial_state(rng):
    q, k, v = qkv(rng, T=20)
    decay = rng.uniform(0.01, 0.5, 2).astype(f32)
    cu = np.array([0, 7, 20], np.int32)
    h0 = rng.standard_normal((2, 2, 8, 16)).astype(f32)
    o1, s1 = cula.cula_lightning(q, k, v, decay, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    pool = np.full((5, 2, 8, 16), 3.0, f32)
    pool[4], pool[1] = h0[0], h0[1]
    o2, p2 = cula.cula_lightning(q, k, v, decay, cu_seqlens=cu, state_pool=pool,
                                 initial_state_indices=np.array([4, 1], np.int32))
    assert rel(o1, o2) == 0 and rel(p2[4], s1[0]) == 0 and rel(p2[1], s1[1]) == 0 and (p2[0] == 3).all()


def test_level1_decode_packed_layout(rng):
    N, H, K, V = 5, 2, 16, 8
    q, k, v = qkv(rng, B=1, T=N, H=H, K=K, V=V)  # packed: [1, N, H, .], one token per sequence
    g = -rng.uniform(0.01, 0.5, (1, N, H, K)).astype(f32)
    beta = rng.uniform(0.1, 0.9, (1, N, H)).astype(f32)
    pool = rng.standard_normal((N + 2, H, V, K)).astype(f32)
    idx = np.array([6, 0, 3, 2, 5], np.int32)
    p1, p2 = pool.copy(), pool.copy()
    o1, _ = cula.cula_decode(q, k, v, p1, state_indices=idx, g=g, beta=beta)
    o2, _ = cula.decode(q.reshape(N, 1, H, K), k.reshape(N, 1, H, K), v.reshape(N, 1, H, V), p2, g=g.reshape(N, 1, H, K),
                        beta=beta.reshape(N, 1, H), state_indices=idx)
    assert o1.shape == v.shape and rel(o1.reshape(N, 1, H, V), o2) == 0 and rel(p1, p2) == 0


def test_flash_kda_entry_writes_caller_buffers(rng):
    q, k, v = qkv(rng, H=2, K=16, V=16)
    g = rng.standard_normal((1, 24, 2, 16)).astype(f32)
    beta = rng.standard_normal((1, 24, 2)).astype(f32)
    A_log = rng.uniform(-1, 0.5, 2).astype(f32)
    dt_bias = rng.standard_normal((2, 16)).astype(f32)
    out = np.full((1, 24, 2, 16), np.nan, f32)
    fin = np.full((1, 2, 16, 16), np.nan, f32)
    assert cula.flash_kda.fwd(q, k, v, g, beta, 0.25, out, A_log, dt_bias, -5.0, final_state=fin) is None
    o, s = cula.chunk_kda(q, k, v, g, beta, scale=0.25, A_log=A_log, dt_bias=dt_bias.reshape(-1), lower_bound=-5.0,
                          use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                          output_final_state=True)
    assert rel(out, o) == 0 and rel(fin, s) == 0
    with pytest.raises(cula.CulaError, match="lower_bound"):
        cula.flash_kda.fwd(q, k, v, g, beta, 0.25, out, A_log, dt_bias, -6.0)


def test_fused_recurrent_gdn_dropin_defaults_follow_fla(rng):
    # FLA: no g means no decay, no beta means beta = 1; a gate computed in the kernel needs g.
    q, k, v = qkv(rng, T=5)
    B, T, H, _ = v.shape
    g = -rng.uniform(0.01, 0.5, (B, T, H)).astype(f32)
    beta = rng.uniform(0.1, 0.9, (B, T, H)).astype(f32)
    f = cula.gated_delta_rule.fused_recurrent_gated_delta_rule
    o1, s1 = f(q, k, v, beta=beta, output_final_state=True)
    o2, s2 = f(q, k, v, g=np.zeros_like(g), beta=beta, output_final_state=True)
    assert rel(o1, o2) == 0 and rel(s1, s2) == 0
    o3, _ = f(q, k, v, g=g)
    o4, _ = f(q, k, v, g=g, beta=np.ones_like(beta))
    assert rel(o3, o4) == 0 and rel(o1, o3) > 1e-3  # the gate is applied when given
    with pytest.raises(ValueError, match="'g'"):
        f(q, k, v, beta=beta, use_gate_in_kernel=True, A_log=np.zeros(H, f32))


def test_fused_recurrent_lightning_dropin_is_the_chunked_function(rng):
    q, k, v = qkv(rng, T=9)
    h0 = rng.standard_normal((1, 2, 16, 8)).astype(f32)  # K-first [N, H, K, V]
    la = cula.lightning_attn
    o1, s1 = la.fused_recurrent_lightning_attn(q, k, v, 2, 8, initial_state=h0, output_final_state=True)
    o2, s2 = la.chunk_lightning_attn(q, k, v, 2, 8, initial_state=h0, output_final_state=True)
    assert rel(o1, o2) == 0 and rel(s1, s2) == 0 and s1.shape == h0.shape
    with pytest.raises(NotImplementedError, match="reverse"):
        la.fused_recurrent_lightning_attn(q, k, v, 2, 8, reverse=True)


def test_dropins_reject_what_they_cannot_honour(rng):
    q, k, v = qkv(rng)
    g = -rng.uniform(0.01, 0.5, (1, 24, 2, 16)).astype(f32)
    beta = rng.uniform(0.1, 0.9, (1, 24, 2)).astype(f32)
    class Zigzag:  # FLA's other context-parallel layout
        layout = "zigzag"

    with pytest.raises(NotImplementedError, match="zigzag"):
        cula.kda.chunk_kda(q, k, v, g, beta, cp_context=Zigzag())
    with pytest.raises(TypeError, match="unexpected keyword"):
        cula.kda.chunk_kda(q, k, v, g, beta, head_first=True)
    with pytest.raises(NotImplementedError, match="gk/gv"):
        cula.gated_delta_rule.fused_recurrent_gated_delta_rule(q, k, v, gk=g, beta=beta)


DROPINS = [
    ("fla.ops.kda", "chunk_kda", cula.kda.chunk_kda),
    ("fla.ops.kda", "fused_recurrent_kda", cula.kda.fused_recurrent_kda),
    ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", cula.gated_delta_rule.chunk_gated_delta_rule),
    ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule",
     cula.gated_delta_rule.fused_recurrent_gated_delta_rule),
    ("fla.ops.kda.gate", "fused_kda_gate", cula.kda.fused_kda_gate),
    ("fla.ops.gated_delta_rule.gate", "fused_gdn_gate", cula.gated_delta_rule.fused_gdn_gate),
    ("fla.ops.delta_rule", "chunk_delta_rule", cula.delta_rule.chunk_delta_rule),
    ("fla.ops.delta_rule", "fused_recurrent_delta_rule", cula.delta_rule.fused_recurrent_delta_rule),
    ("fla.ops.retention", "chunk_retention", cula.retention.chunk_retention),
    ("fla.ops.retention", "fused_chunk_retention", cula.retention.fused_chunk_retention),
    ("fla.ops.retention", "fused_recurrent_retention", cula.retention.fused_recurrent_retention),
    ("fla.ops.retention", "parallel_retention", cula.retention.parallel_retention),
    ("fla.ops.gla", "chunk_gla", cula.gla.chunk_gla),
    ("fla.ops.gla", "fused_recurrent_gla", cula.gla.fused_recurrent_gla),
    ("fla.ops.simple_gla", "chunk_simple_gla", cula.simple_gla.chunk_simple_gla),
    ("fla.ops.simple_gla", "fused_recurrent_simple_gla", cula.simple_gla.fused_recurrent_simple_gla),
    ("fla.ops.simple_gla", "fused_chunk_simple_gla", cula.simple_gla.fused_chunk_simple_gla),
    ("fla.ops.simple_gla", "parallel_simple_gla", cula.simple_gla.parallel_simple_gla),
    ("fla.ops.lightning_attn", "chunk_lightning_attn", cula.lightning_attn.chunk_lightning_attn),
    ("fla.ops.lightning_attn", "fused_recurrent_lightning_attn", cula.lightning_attn.fused_recurrent_lightning_attn),
]


@pytest.mark.parametrize("module,name,ours", DROPINS, ids=[d[1] for d in DROPINS])
def test_dropin_signatures_match_fla(module, name, ours):
    pytest.importorskip("torch", reason="torch is not installed")
    pytest.importorskip("fla", reason="fla-core is not installed")
    import importlib

    import torch

    theirs = inspect.signature(inspect.unwrap(getattr(importlib.import_module(module), name)))
    mine = inspect.signature(ours)
    t = [(p.name, p.default) for p in theirs.parameters.values() if p.kind != p.VAR_KEYWORD]
    # (an output_dtype of None is FLA's torch.float32: cula's modules import torch only when called)
    m = [(p.name, torch.float32 if p.name == "output_dtype" and p.default is None else p.default)
         for p in mine.parameters.values() if p.kind != p.VAR_KEYWORD]
    assert m == t


def test_dropins_read_a_float16_initial_state_as_float32(rng):
    """FLA's kernels take a float16 initial state (its op tests pass one) and return a float32 final
    state; so do cula's drop-ins, with the state's gradient in float16."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    B, T, H, K, V = 2, 24, 2, 8, 4
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    q, k, v = t(B, T, H, K), torch.nn.functional.normalize(t(B, T, H, K), dim=-1), t(B, T, H, V)
    g, beta = -torch.rand(B, T, H), torch.rand(B, T, H)
    h0 = t(B, H, K, V).half()
    calls = [lambda h: cula.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h,
                                                                    output_final_state=True),
             lambda h: cula.lightning_attn.fused_recurrent_lightning_attn(q, k, v, 1, 4, initial_state=h,
                                                                          output_final_state=True)]
    for call in calls:
        o16, s16 = call(h0)
        o32, s32 = call(h0.float())
        assert s16.dtype == torch.float32 and torch.equal(o16, o32) and torch.equal(s16, s32)
        leaf = h0.clone().requires_grad_()
        o, s = call(leaf)
        (o.sum() + s.sum()).backward()
        assert leaf.grad.dtype == torch.float16 and bool(torch.isfinite(leaf.grad).all()) and leaf.grad.abs().sum() > 0


def _torch_kda_reference(q, k, v, g, beta, h0):
    """KDA in float64 torch ops, differentiable by torch autograd (K-first states)."""
    import torch

    B, T, H, K = q.shape
    S, outs = h0, []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        u = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * u)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, S))
    return torch.stack(outs, 1), S


def test_dropin_chunk_kda_autograd_matches_torch_autograd(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    B, T, H, K, V = 2, 20, 2, 8, 4
    mk = lambda *s: torch.from_numpy(rng.standard_normal(s)).double().requires_grad_()  # noqa: E731
    q, k, v = mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, V)
    graw, braw = mk(B, T, H, K), mk(B, T, H)
    h0 = mk(B, H, K, V)
    o, s = cula.kda.chunk_kda(q, k, v, graw, braw, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                              A_log=torch.zeros(H, dtype=torch.float64), dt_bias=torch.zeros(H * K, dtype=torch.float64))
    l2 = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    o_ref, s_ref = _torch_kda_reference(l2(q), l2(k), v, -torch.nn.functional.softplus(graw), braw.sigmoid(), h0)
    assert rel(o.detach().numpy(), o_ref.detach().numpy()) < 1e-12  # float64 inputs run the float64 reference
    do, ds = torch.randn_like(o), torch.randn_like(s)
    grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), (q, k, v, graw, braw, h0))
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), (q, k, v, graw, braw, h0))
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads, grads_ref):
        assert rel(a.numpy(), b.numpy()) < 1e-10, name


@pytest.mark.parametrize("entry", ["chunk_kda", "cula_kda_gdn", "chunk_gla", "chunk_simple_gla", "chunk_lightning_attn"])
def test_autograd_gradcheck_in_float64_on_the_reference(rng, entry):
    """torch.autograd.gradcheck (finite differences against the backward, every differentiable
    input at once, the gate parameters included) through the public entries on float64 host tensors."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula.gla import chunk_gla
    from cula.lightning_attn import chunk_lightning_attn
    from cula.simple_gla import chunk_simple_gla

    B, T, H, K, V = 1, 9, 2, 4, 3
    mk = lambda *s: torch.from_numpy(rng.standard_normal(s) * 0.5).requires_grad_()  # noqa: E731
    log_decay = lambda *s: (-torch.from_numpy(rng.uniform(0.05, 1.0, s))).requires_grad_()  # noqa: E731
    q, k, v, h0 = mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, V), mk(B, H, K, V)
    if entry == "chunk_kda":
        args = (q, k, v, mk(B, T, H, K), mk(B, T, H), mk(H), mk(H * K), h0)
        fn = lambda q, k, v, g, b, A, dt, h: cula.kda.chunk_kda(  # noqa: E731
            q, k, v, g, b, A_log=A, dt_bias=dt, initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    elif entry == "cula_kda_gdn":  # Level 1, scalar gate (Gated DeltaNet); its states are float32: o only
        args = (q, k, v, log_decay(B, T, H), mk(B, T, H))
        fn = lambda q, k, v, g, b: cula.cula_kda(q, k, v, g, b, use_qk_l2norm_in_kernel=True,  # noqa: E731
                                                 use_beta_sigmoid_in_kernel=True)[0]
    elif entry == "chunk_gla":
        args = (q, k, v, log_decay(B, T, H, K), h0)
        fn = lambda q, k, v, g, h: chunk_gla(q, k, v, g, initial_state=h, output_final_state=True)  # noqa: E731
    elif entry == "chunk_simple_gla":
        args = (q, k, v, log_decay(B, T, H), h0)
        fn = lambda q, k, v, g, h: chunk_simple_gla(q, k, v, g, initial_state=h, output_final_state=True)  # noqa: E731
    else:
        args = (q, k, v, h0)
        fn = lambda q, k, v, h: chunk_lightning_attn(q, k, v, layer_idx=1, num_layers=4, initial_state=h,  # noqa: E731
                                                     output_final_state=True)
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gdn_dropin_gate_in_kernel_equals_precomputed_log_gate(rng):
    """FLA's chunk_gated_delta_rule takes use_gate_in_kernel/A_log/dt_bias through its keywords."""
    from cula.gated_delta_rule import chunk_gated_delta_rule

    B, T, H, K = 1, 70, 2, 32
    q, k, v = (rng.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(3))
    g = rng.standard_normal((B, T, H)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32)
    A_log = rng.uniform(-1, 0.5, H).astype(np.float32)
    dt_bias = (rng.standard_normal(H) * 0.1).astype(np.float32)
    o1, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   A_log=A_log, dt_bias=dt_bias)
    x = (g + dt_bias).astype(np.float64)
    a = -np.exp(A_log.astype(np.float64)) * np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    o2, _ = chunk_gated_delta_rule(q, k, v, a.astype(np.float32), beta, use_qk_l2norm_in_kernel=True)
    assert rel(o1, o2) < 1e-5


def test_dropins_read_the_offsets_where_q_lives(rng):
    """FLA callers pass cu_seqlens on q's device and may add cu_seqlens_cpu: the host copy for host
    tensors, the device copy for CUDA tensors (the CUDA kernels take no host offsets)."""
    from cula._fla_common import offsets_for

    cu, cu_cpu = np.array([0, 5, 24], np.int32), np.array([0, 5, 24], np.int64)
    assert offsets_for(np.zeros(1), cu, cu_cpu) is cu_cpu
    assert offsets_for(np.zeros(1), cu, None) is cu and offsets_for(np.zeros(1), None, cu_cpu) is cu_cpu
    assert offsets_for(np.zeros(1), None, None) is None
    q, k, v = qkv(rng, T=24)
    g = -rng.uniform(0.01, 0.5, (1, 24, 2, 16)).astype(f32)
    beta = rng.uniform(0.1, 0.9, (1, 24, 2)).astype(f32)
    one = cula.kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    both = cula.kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, output_final_state=True)
    assert rel(one[0], both[0]) == 0 and rel(one[1], both[1]) == 0 and one[1].shape[0] == 2
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the device offsets' pick can only be run on a GPU machine")
    q, k, v = qkv(rng, T=24, K=64, V=64)  # head sizes the CUDA kernels take
    g = -rng.uniform(0.01, 0.5, (1, 24, 2, 64)).astype(f32)
    dev = dict(q=torch.from_numpy(q).cuda().bfloat16(), k=torch.from_numpy(k).cuda().bfloat16(),
               v=torch.from_numpy(v).cuda().bfloat16(), g=torch.from_numpy(g).cuda(), beta=torch.from_numpy(beta).cuda())
    assert offsets_for(dev["q"], torch.from_numpy(cu).cuda(), torch.from_numpy(cu_cpu)).is_cuda
    one = cula.kda.chunk_kda(**dev, cu_seqlens=torch.from_numpy(cu).cuda(), use_qk_l2norm_in_kernel=True)
    both = cula.kda.chunk_kda(**dev, cu_seqlens=torch.from_numpy(cu).cuda(), cu_seqlens_cpu=torch.from_numpy(cu_cpu),
                              use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(one[0].float()).all() and torch.equal(one[0], both[0])


def test_fused_recurrent_inplace_decode_checks_host_offsets(rng):
    """fused_recurrent_kda's serving form (ssm_state_indices, in-place pool) reshapes the packed
    tokens into equal sequences: host offsets of unequal lengths are refused, equal ones match
    the per-sequence decode."""
    N, t, H, K, V, P = 3, 2, 2, 8, 4, 5
    q, k, v = qkv(rng, T=N * t, H=H, K=K, V=V)
    g = -rng.uniform(0.01, 0.5, (1, N * t, H, K)).astype(f32)
    beta = rng.uniform(0.1, 0.9, (1, N * t, H)).astype(f32)
    pool = rng.standard_normal((P, H, K, V)).astype(f32)
    idx = np.array([4, 0, 2], np.int32)
    kw = dict(ssm_state_indices=idx, inplace_final_state=True)
    with pytest.raises(NotImplementedError, match="same number of tokens"):
        cula.kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool.copy(), cu_seqlens=np.array([0, 1, 4, 6]), **kw)
    got_pool = pool.copy()
    o, _ = cula.kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=got_pool, cu_seqlens=np.array([0, 2, 4, 6]), **kw)
    ref_pool = pool.copy()
    ref, _ = cula.decode(q.reshape(N, t, H, K), k.reshape(N, t, H, K), v.reshape(N, t, H, V), ref_pool, mode="kda",
                         g=g.reshape(N, t, H, K), beta=beta.reshape(N, t, H), state_indices=idx, state_layout="k_first")
    assert rel(o.reshape(N, t, H, V), ref) == 0 and rel(got_pool, ref_pool) == 0


def test_decode_to_op_passes_opcheck_and_leaves_the_pool(rng):
    """torch.ops.cula.decode_to (the fused_recurrent drop-ins' decode without in-place update): the
    op checks pass, the pool is untouched, o and the final states are the in-place op's."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import cula.torch_ops

    N, H, K = 3, 2, 16
    q, k, v = (torch.from_numpy(rng.standard_normal((N, 2, H, K)).astype(np.float32)) for _ in range(3))
    g = -torch.from_numpy(rng.uniform(0.01, 0.3, (N, 2, H, K)).astype(np.float32))
    beta = torch.from_numpy(rng.uniform(0.1, 0.9, (N, 2, H)).astype(np.float32))
    pool = torch.from_numpy(rng.standard_normal((N, H, K, K)).astype(np.float32))
    args = (q, k, v, pool, g, beta, None, None, None, None, None, "kda", *cula.Options().values())
    torch.library.opcheck(torch.ops.cula.decode_to.default, args)
    keep, in_place = pool.clone(), pool.clone()
    o, final = cula.torch_ops.decode_to(q, k, v, pool, mode="kda", g=g, beta=beta)
    o2, _ = cula.torch_ops.decode(q, k, v, in_place, mode="kda", g=g, beta=beta)
    assert torch.equal(pool, keep) and torch.equal(final, in_place) and torch.equal(o, o2)


def test_eager_calls_skip_the_registered_ops_and_traced_calls_keep_them(rng):
    """torch_ops: plain tensors in eager mode run cula.ops directly (the same results as the ops), with
    gradients through _EagerChunk (the op's autograd formula without the op: the same gradients); under a
    torch dispatch mode (as fake tensors and flop counters use) and for tensor subclasses the registered
    ops run."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from torch.utils._python_dispatch import TorchDispatchMode

    import cula.torch_ops as tops

    class Seen(TorchDispatchMode):  # records the ops that reach the dispatcher
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    N, H, K = 2, 2, 16
    q, k, v = (torch.from_numpy(rng.standard_normal((N, 3, H, K)).astype(np.float32)) for _ in range(3))
    g = -torch.from_numpy(rng.uniform(0.01, 0.3, (N, 3, H, K)).astype(np.float32))
    beta = torch.from_numpy(rng.uniform(0.1, 0.9, (N, 3, H)).astype(np.float32))
    pool = torch.from_numpy(rng.standard_normal((N, H, K, K)).astype(np.float32))
    assert tops._eager(q, k, v, pool, None)
    assert tops._eager(q.clone().requires_grad_())

    class Sub(torch.Tensor):
        pass

    assert not tops._eager(q.as_subclass(Sub)) and not tops._eager(q.to("meta"))
    meta = tops.chunk_fwd("kda", *(x.to("meta") for x in (q, k, v, g, beta)), initial_state=pool.to("meta"))
    assert meta[0].is_meta and meta[0].shape == v.shape and meta[1].shape == pool.shape  # (the op's fake implementation)
    eager = [tops.decode_to(q, k, v, pool, mode="kda", g=g, beta=beta),
             tops.chunk_fwd("kda", q, k, v, g, beta, initial_state=pool)]
    with Seen() as mode:
        assert not tops._eager(q)
        traced = [tops.decode_to(q, k, v, pool, mode="kda", g=g, beta=beta),
                  tops.chunk_fwd("kda", q, k, v, g, beta, initial_state=pool)]
    assert "cula.decode_to.default" in mode.ops and "cula.chunk_fwd.default" in mode.ops, mode.ops
    for a, b in zip(eager, traced):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    # with gradients: eagerly through _EagerChunk, under the mode through the op and its autograd formula
    def step(through_mode):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, pool)]
        if through_mode:
            with Seen() as seen:
                o, s = tops.chunk_fwd("kda", *leaves[:5], initial_state=leaves[5])
            assert "cula.chunk_fwd.default" in seen.ops
        else:
            o, s = tops.chunk_fwd("kda", *leaves[:5], initial_state=leaves[5])
            assert type(o.grad_fn).__name__ == "_EagerChunkBackward"
        loss = (o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() + s.square().sum()
        return o, s, torch.autograd.grad(loss, leaves)

    (o1, s1, g1), (o2, s2, g2) = step(False), step(True)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    # one output alone reaching the loss: the other's gradient is not materialised, and the gradients are the op's
    for use_o in (True, False):
        got = []
        for through_mode in (False, True):
            leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, pool)]
            with (Seen() if through_mode else contextlib.nullcontext()):
                o, s = tops.chunk_fwd("kda", *leaves[:5], initial_state=leaves[5])
            got.append(torch.autograd.grad((o if use_o else s).square().sum(), leaves))
        for a, b in zip(*got):
            assert torch.equal(a, b)


def test_chunk_op_passes_opcheck_on_host_tensors(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import cula.torch_ops

    B, T, H, K, V = 1, 33, 2, 16, 8
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V)
    g = -torch.rand(B, T, H, K) * 0.3
    beta = torch.rand(B, T, H)
    args = ("kda", q, k, v, g, beta, None, None, None, None, None, None, True, False, False, False, False, None,
            "k_last", 64)
    for final in (True, False):  # output_final_state, then state_dtype
        torch.library.opcheck(torch.ops.cula.chunk_fwd.default, args + (final, None))
    torch.library.opcheck(torch.ops.cula.chunk_fwd.default, args + (True, "bfloat16"))
    torch.library.opcheck(torch.ops.cula.chunk_fwd.default, args + (True, None, "cpu"))  # a backend named
    o, s = cula.torch_ops.chunk_fwd("kda", q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    o2, s2 = cula.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(s, s2)


# (family, K, gate kind, options): the head sizes the CUDA kernels are not built for, run padded to the
# next one (and, without the delta rule, in slices of at most 256).
_FIT_CASES = [
    ("kda", 60, "key", dict(use_qk_l2norm_in_kernel=True)),
    ("kda", 100, "raw_key", dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)),
    ("kda", 40, "raw_key", dict(use_gate_in_kernel=True, lower_bound=-5.0, state_layout="k_first")),
    ("gdn", 32, "head", dict(state_layout="k_first")),
    ("gla", 320, "key", dict(state_layout="k_first")),
    ("gla", 100, "key", {}),
    ("simple_gla", 520, "head", {}),
    ("lightning", 60, None, {}),
]


def _fit_inputs(torch, rng, family, K, gate, B=2, T=37, H=2, V=12):
    mk = lambda *s: torch.from_numpy(rng.standard_normal(s) * 0.5).requires_grad_()  # noqa: E731
    log_decay = lambda *s: (-torch.from_numpy(rng.uniform(0.05, 1.0, s))).requires_grad_()  # noqa: E731
    x = dict(q=mk(B, T, H, K), k=mk(B, T, H, K), v=mk(B, T, H, V), g=None, beta=None, decay=None, A_log=None,
             dt_bias=None)
    if gate == "key":
        x["g"] = log_decay(B, T, H, K)
    elif gate == "raw_key":
        x.update(g=mk(B, T, H, K), A_log=mk(H), dt_bias=mk(H * K))
    elif gate == "head":
        x["g"] = log_decay(B, T, H)
    if family in ("kda", "gdn"):
        x["beta"] = torch.from_numpy(rng.uniform(0.1, 0.9, (B, T, H))).requires_grad_()
    if family == "lightning":
        x["decay"] = torch.from_numpy(rng.uniform(0.05, 0.5, H))
    return x


@pytest.mark.parametrize("family,K,gate,opts", _FIT_CASES, ids=[f"{c[0]}-K{c[1]}" for c in _FIT_CASES])
def test_head_size_fit_is_exact_on_the_reference(rng, family, K, gate, opts):
    """The padded (and sliced) run that CUDA calls with other head sizes take computes the same
    function, forward and gradients: forced here on float64 host tensors, against the direct call."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula import _front

    x = _fit_inputs(torch, rng, family, K, gate)
    layout = opts.get("state_layout", "k_last")
    h0 = torch.from_numpy(rng.standard_normal((2, 2, K, 12) if layout == "k_first" else (2, 2, 12, K)))
    h0.requires_grad_()
    kw = dict(output_final_state=True, **opts)
    direct = _front.chunk(family, x["q"], x["k"], x["v"], x["g"], x["beta"], x["decay"], A_log=x["A_log"],
                          dt_bias=x["dt_bias"], initial_state=h0, **kw)
    fitted = _front._fit_head_size(family, x["q"], x["k"], x["v"], x["g"], x["beta"], x["decay"], x["A_log"],
                                   x["dt_bias"], h0, kw)
    assert fitted[1].shape == direct[1].shape and fitted[0].shape == direct[0].shape
    for a, b in zip(fitted, direct):
        assert rel(a.detach().numpy(), b.detach().numpy()) < 1e-12
    leaves = [t for t in (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], h0)
              if t is not None and t.requires_grad]
    do, ds = torch.randn_like(direct[0]), torch.randn_like(direct[1])
    g_direct = torch.autograd.grad((direct[0] * do).sum() + (direct[1] * ds).sum(), leaves)
    g_fitted = torch.autograd.grad((fitted[0] * do).sum() + (fitted[1] * ds).sum(), leaves)
    for a, b in zip(g_fitted, g_direct):
        assert rel(a.numpy(), b.numpy()) < 1e-10


@pytest.mark.parametrize("family,K,layout,group", [("simple_gla", 256, "k_last", 1), ("lightning", 256, "k_first", 1),
                                                     ("simple_gla", 192, "k_first", 1), ("simple_gla", 384, "k_last", 2),
                                                     ("lightning", 256, "k_last", 2)])
def test_fused_families_run_wide_keys_as_slices(rng, monkeypatch, family, K, layout, group):
    """Simple GLA and Lightning on CUDA take K over 256 as slices of 256 (the widest K of every engine),
    run as heads of one call: the sliced run computes the same function, forward and gradients
    (forced here on float64 host tensors with slices of 128, so that small K exercise it), with
    grouped value heads too (group value heads per q/k head; Lightning's decay then per q/k head)."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula import _front

    for fam in (family, "gla"):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            assert _front._key_slice(fam, torch.zeros(1, dtype=dt)) == 256
    monkeypatch.setattr(_front, "_key_slice", lambda fam, q: 128)
    x = _fit_inputs(torch, rng, family, K, "head" if family == "simple_gla" else None)
    HV = 2 * group
    if group > 1:
        x["v"] = torch.from_numpy(rng.standard_normal((2, 37, HV, 12)) * 0.5).requires_grad_()
        if family == "simple_gla":
            x["g"] = (-torch.from_numpy(rng.uniform(0.05, 1.0, (2, 37, HV)))).requires_grad_()
    h0 = torch.from_numpy(rng.standard_normal((2, HV, K, 12) if layout == "k_first" else (2, HV, 12, K)))
    h0.requires_grad_()
    kw = dict(output_final_state=True, state_layout=layout)
    direct = _front.chunk(family, x["q"], x["k"], x["v"], x["g"], x["beta"], x["decay"], initial_state=h0, **kw)
    calls = []
    chunk = _front.chunk
    monkeypatch.setattr(_front, "chunk", lambda fam, q, *a, **kw: calls.append(q.shape[-2:]) or chunk(fam, q, *a, **kw))
    fitted = _front._fit_head_size(family, x["q"], x["k"], x["v"], x["g"], x["beta"], x["decay"], None, None, h0, kw)
    assert calls == [(2 * -(-K // 128), 128)], calls  # one call, the slices as heads
    for a, b in zip(fitted, direct):
        assert a.shape == b.shape and rel(a.detach().numpy(), b.detach().numpy()) < 1e-12
    leaves = [t for t in (x["q"], x["k"], x["v"], x["g"], h0) if t is not None]
    do, ds = torch.randn_like(direct[0]), torch.randn_like(direct[1])
    g_direct = torch.autograd.grad((direct[0] * do).sum() + (direct[1] * ds).sum(), leaves)
    g_fitted = torch.autograd.grad((fitted[0] * do).sum() + (fitted[1] * ds).sum(), leaves)
    for a, b in zip(g_fitted, g_direct):
        assert rel(a.numpy(), b.numpy()) < 1e-10


@pytest.mark.parametrize("family", ["simple_gla", "lightning"])
def test_wide_key_slices_as_heads_keep_varlen(rng, monkeypatch, family):
    """The slices-as-heads run of a packed batch (an empty sequence, one over a chunk) with initial
    and final states: the same outputs and gradients as the direct call (float64 host tensors,
    slices of 128 forced)."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula import _front

    monkeypatch.setattr(_front, "_key_slice", lambda fam, q: 128)
    x = _fit_inputs(torch, rng, family, 256, "head" if family == "simple_gla" else None, B=1, T=90)
    cu = torch.tensor([0, 70, 70, 90], dtype=torch.int32)
    h0 = torch.from_numpy(rng.standard_normal((3, 2, 12, 256))).requires_grad_()
    kw = dict(output_final_state=True, cu_seqlens=cu)
    direct = _front.chunk(family, x["q"], x["k"], x["v"], x["g"], None, x["decay"], initial_state=h0, **kw)
    fitted = _front._fit_head_size(family, x["q"], x["k"], x["v"], x["g"], None, x["decay"], None, None, h0, kw)
    for a, b in zip(fitted, direct):
        assert a.shape == b.shape and rel(a.detach().numpy(), b.detach().numpy()) < 1e-12
    leaves = [t for t in (x["q"], x["k"], x["v"], x["g"], h0) if t is not None]
    do = torch.randn_like(direct[0])
    g_direct = torch.autograd.grad((direct[0] * do).sum() + direct[1].sum(), leaves)
    g_fitted = torch.autograd.grad((fitted[0] * do).sum() + fitted[1].sum(), leaves)
    for a, b in zip(g_fitted, g_direct):
        assert rel(a.numpy(), b.numpy()) < 1e-10


def test_head_size_fit_refuses_delta_rule_over_256(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula import _front

    x = _fit_inputs(torch, rng, "gdn", 320, "head")
    with pytest.raises(cula.CulaUnsupportedError, match="K up to 256.*'gdn'.*K = 320"):
        _front._fit_head_size("gdn", x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, None, None, {})


def test_omitted_gates_and_betas_follow_float64_calls(rng):
    """FLA's defaults for an omitted gate or beta keep a float64 call on the float64 reference: the
    result equals the call given the same defaults explicitly in float64."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula.delta_rule import fused_recurrent_delta_rule
    from cula.gla import chunk_gla, fused_recurrent_gla
    from cula.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

    B, T, H, K, V = 1, 19, 2, 8, 5
    q, k, v = (torch.from_numpy(x.astype(np.float64)) for x in qkv(rng, B, T, H, K, V))
    zeros_k, zeros_h, ones_h = torch.zeros(B, T, H, K, dtype=torch.float64), torch.zeros(
        B, T, H, dtype=torch.float64), torch.ones(B, T, H, dtype=torch.float64)
    pairs = [
        (fused_recurrent_gla(q, k, v)[0], chunk_gla(q, k, v, zeros_k)[0]),
        (fused_recurrent_simple_gla(q, k, v)[0], chunk_simple_gla(q, k, v, g=zeros_h)[0]),
        (fused_recurrent_simple_gla(q, k, v, g=zeros_h - 0.1, g_gamma=torch.full((H,), -0.2, dtype=torch.float64))[0],
         chunk_simple_gla(q, k, v, g=(zeros_h - 0.1) + torch.full((H,), -0.2, dtype=torch.float64))[0]),
        (fused_recurrent_delta_rule(q, k, v)[0], fused_recurrent_delta_rule(q, k, v, beta=ones_h)[0]),
    ]
    for got, want in pairs:
        assert got.dtype == torch.float64 and rel(got.numpy(), want.numpy()) == 0


@pytest.mark.parametrize("family,K,layout", [("kda", 48, "k_first"), ("gla", 300, "k_last")])
def test_head_size_fit_keeps_varlen_and_intermediate_states(rng, family, K, layout):
    """The fitted run with packed sequences and return_intermediate_states: the same outputs, final
    states and per-chunk states as the direct call (float64 host tensors, the fit forced)."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula import _front

    x = _fit_inputs(torch, rng, family, K, "key", B=1, T=150)
    cu = torch.tensor([0, 40, 40, 150], dtype=torch.int32)
    h0 = torch.from_numpy(rng.standard_normal((3, 2, K, 12) if layout == "k_first" else (3, 2, 12, K)))
    kw = dict(output_final_state=True, return_intermediate_states=True, chunk_size=32, cu_seqlens=cu,
              state_layout=layout, intermediate_dtype="float64")
    with torch.no_grad():
        direct = _front.chunk(family, x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0, **kw)
        fitted = _front._fit_head_size(family, x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, None, h0, kw)
    assert len(fitted) == len(direct) == 3
    for a, b in zip(fitted, direct):
        assert a.shape == b.shape and rel(a.numpy(), b.numpy()) < 1e-12


@pytest.mark.parametrize("family,K,V,layout", [("kda", 64, 40, "k_last"), ("gdn", 100, 100, "k_first"),
                                               ("simple_gla", 64, 100, "k_last"), ("lightning", 60, 36, "k_last")])
def test_value_head_size_fit_on_16_bit_inputs(rng, family, K, V, layout):
    """16-bit calls whose V is not a multiple of 64 run with the value columns zero-padded (the
    tensor-core engines' column slices): on host bf16 tensors, the fitted run against the direct one,
    outputs and gradients, and the caller's shapes, dense, on the way out. The padded call may sum in
    another order (K padded too, or the host kernel's blocking over V), which can move a bf16 output
    by one unit in the last place here and there: 1e-3 where a misplaced column would give ~1."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula import _front

    x = _fit_inputs(torch, rng, family, K, {"kda": "key", "gdn": "head", "simple_gla": "head"}.get(family), V=V)
    for n in ("q", "k", "v"):
        x[n] = x[n].detach().bfloat16().requires_grad_()
    h0 = torch.from_numpy(rng.standard_normal((2, 2, V, K) if layout == "k_last" else (2, 2, K, V))).float()
    h0.requires_grad_()
    kw = dict(output_final_state=True, state_layout=layout)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "decay")]
    direct = _front.chunk(family, *args, initial_state=h0, **kw)
    fitted = _front._fit_head_size(family, *args, None, None, h0, kw)
    for a, b in zip(fitted, direct):
        assert a.shape == b.shape and a.is_contiguous()
        assert rel(a.detach().double().numpy(), b.detach().double().numpy()) < 1e-3
    leaves = [t for t in (*args[:5], h0) if t is not None and t.requires_grad]
    w = torch.from_numpy(rng.standard_normal(tuple(direct[0].shape)))
    g_direct = torch.autograd.grad((direct[0].double() * w).sum() + direct[1].sum(), leaves)
    g_fitted = torch.autograd.grad((fitted[0].double() * w).sum() + fitted[1].sum(), leaves)
    for a, b in zip(g_fitted, g_direct):
        assert rel(a.double().numpy(), b.double().numpy()) < 1e-3


_SEGMENT_CASES = [
    ("kda", "raw_key", dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)),
    ("kda", "key", dict(state_layout="k_first", use_qk_l2norm_in_kernel=True)),  # (contractive: L2-normed keys)
    ("gdn", "head", dict(use_qk_l2norm_in_kernel=True)),
    ("gla", "key", dict(state_layout="k_first")),
    ("simple_gla", "head", dict(scale=0.3)),
    ("lightning", None, {}),
]


@pytest.mark.parametrize("shape", ["dense", "varlen", "single"])
@pytest.mark.parametrize("family,gate,opts", _SEGMENT_CASES, ids=[f"{c[0]}-{c[1]}" for c in _SEGMENT_CASES])
def test_parallel_segments_compute_the_same_function(rng, monkeypatch, family, gate, opts, shape):
    """CULA_SEGMENT_TOKENS (_segments: one call over all segments, the summaries folded per sequence):
    o and the final states of the direct call, dense (2 rows of 3 segments), packed (an empty
    sequence, one of one token, one shorter than a segment, two of several) and one sequence of 5
    segments (the fold on views), with initial states."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula import _front, _segments

    K = 32
    varlen = shape == "varlen"
    seqlens = [70, 0, 1, 40, 200] if varlen else None
    B, T = (1, sum(seqlens)) if varlen else (2, 150) if shape == "dense" else (1, 300)
    x = _fit_inputs(torch, rng, family, K, gate, B=B, T=T)
    x = {n: (t.detach().float() if t is not None else None) for n, t in x.items()}
    if gate in ("key", "head"):  # slow decays: the state entering a segment weighs in its outputs
        x["g"] = x["g"] * 0.05
    if x["decay"] is not None:
        x["decay"] = x["decay"] * 0.05
    N = len(seqlens) if varlen else B
    layout = opts.get("state_layout", "k_last")
    h0 = torch.from_numpy(rng.standard_normal((N, 2, K, 12) if layout == "k_first" else (N, 2, 12, K))).float()
    cu = torch.tensor(np.cumsum([0] + seqlens), dtype=torch.int32) if varlen else None
    kw = dict(output_final_state=True, cu_seqlens=cu, **opts)

    def run():
        return _front.chunk(family, x["q"], x["k"], x["v"], x["g"], x["beta"], x["decay"], A_log=x["A_log"],
                            dt_bias=x["dt_bias"], initial_state=h0, **kw)

    direct = run()
    monkeypatch.setenv(_segments.SEGMENT_TOKENS, "64")
    segmented = run()
    for a, b in zip(segmented, direct):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel(a.numpy(), b.numpy()) < 2e-5, (family, rel(a.numpy(), b.numpy()))
    monkeypatch.setenv(_segments.SEGMENT_TOKENS, "100")
    with pytest.raises(cula.CulaError, match="CULA_SEGMENT_TOKENS: expected 0 or a positive multiple of 64, got '100'"):
        run()


def test_segment_planner_cuts_only_where_most_sms_would_idle():
    """_segments.plan. KDA and GDN: segments that fill the SMs twice in the summary pass (N HV (V + K)
    / 64 CTAs per segment), at least 4 of at least 2048 tokens (up to 8 of 1024 where that leaves fewer
    than 8). GLA: segments that fill them once, at least 8 of at least 4096 tokens, sequences from 32768
    tokens. The measured rows (bench/results/h200/segments.md) land where they paid."""
    from cula import _segments

    plan = _segments.plan
    assert plan(1, 32768, 4, 128, 128, 132) == 2048  # KDA 1x32768 H4: 16 segments (measured 1.13 -> 0.34 ms)
    assert plan(1, 131072, 4, 128, 128, 132) == 8192  # 16 segments of the longer sequence (4.41 -> 1.04 ms)
    assert plan(1, 16384, 4, 128, 128, 132) == 2048  # 8 segments capped by the 2048-token minimum (0.57 -> 0.21)
    assert plan(1, 8192, 4, 128, 128, 132) == 1024  # short: 8 segments of 1024 tokens (0.29 -> 0.13; 0.16 in 4)
    assert plan(1, 8192, 16, 128, 128, 132) == 2048  # 4 segments fill the SMs twice (0.35 -> 0.31)
    assert plan(1, 32768, 8, 128, 128, 132) == 4096  # 8 segments (1.16 -> 0.55)
    assert plan(2, 16384, 8, 128, 128, 132) == 4096  # 4 segments a sequence (0.67 -> 0.54)
    assert plan(1, 32768, 32, 128, 128, 132) is None  # 2 segments fill the SMs twice
    assert plan(1, 100000, 4, 128, 128, 132) == 6272  # 16 segments, the length rounded up to whole chunks
    assert plan(1, 4096, 1, 128, 128, 132) is None  # too short
    assert plan(1, 32768, 4, 256, 512, 132) is None  # 24 CTAs of 32 columns a head and segment (K = 256)
    assert plan(1, 65536, 1, 256, 256, 132) == 4096  # 16 CTAs a segment: 16 segments fill the SMs twice
    assert plan(3, 32768, 2, 64, 64, 132) == 2048  # 16 segments capped by the 2048-token minimum
    # without the delta rule (GLA) the summary pass covers V columns, not V + K
    assert plan(1, 131072, 4, 128, 128, 132, delta=False) == 8192  # 16 segments
    assert plan(1, 65536, 8, 128, 128, 132, delta=False) == 8192  # 8 segments
    assert plan(1, 65536, 16, 128, 128, 132, delta=False) is None  # 4 segments: GLA needs 8 (measured a loss)
    assert plan(1, 16384, 4, 128, 128, 132, delta=False) is None  # too short for GLA


def test_front_plans_only_dense_bf16_kda_gdn_gla_calls_on_cuda(monkeypatch):
    """_front's planner routing, with stand-ins for CUDA tensors and the device (CI has no GPU): a
    dense bf16 KDA / GDN / GLA call of one long sequence and few heads is cut as _segments.plan says;
    another family, dtype, device or backend, cu_seqlens, a short sequence, a head size the engines
    lack, or (GLA) a CUDA-graph capture in progress leaves it uncut."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula import _front

    class Stand:  # the attributes the planner reads from a tensor
        def __init__(self, shape, dtype=torch.bfloat16, cuda=True):
            self.shape, self.dtype, self.is_cuda, self.device = tuple(shape), dtype, cuda, "cuda:0"

        def dim(self):
            return len(self.shape)

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"multi_processor_count": 132}))

    def planned(family="kda", T=32768, H=4, K=128, V=128, dtype=torch.bfloat16, cuda=True, **opts):
        q = Stand((1, T, H, K), dtype, cuda)
        return _front._planned_segment_len(family, q, q, Stand((1, T, H, V), dtype, cuda), opts)

    assert planned() == 2048 and planned("gdn") == 2048 and planned(T=131072) == 8192
    assert planned(K=64, V=64) == 2048
    assert planned("gla") == 4096 and planned("gla", T=131072) == 8192
    assert planned("simple_gla") is None and planned("lightning") is None
    assert planned(dtype=torch.float16) is None and planned(dtype=torch.float32) is None
    assert planned(cuda=False) is None and planned(backend="cuda") is None
    assert planned(cu_seqlens=object()) is None
    assert planned(T=4096) is None and planned(H=64) is None and planned("gla", T=16384) is None
    assert planned(K=96) is None and planned(V=100) is None
    capturing[0] = True  # the engine's own segments (KDA, GDN) are capturable; GLA's two calls are not
    assert planned() == 2048 and planned("gdn") == 2048 and planned("gla") is None


def test_segment_tokens_zero_turns_the_planner_off(monkeypatch):
    from cula import _segments

    monkeypatch.delenv(_segments.SEGMENT_TOKENS, raising=False)
    assert _segments.segment_tokens() is None
    monkeypatch.setenv(_segments.SEGMENT_TOKENS, "0")
    assert _segments.segment_tokens() == 0
    monkeypatch.setenv(_segments.SEGMENT_TOKENS, "128")
    assert _segments.segment_tokens() == 128


def test_segment_plan_cuts_each_sequence_from_its_start():
    from cula import _cp_summary

    assert _cp_summary.cut([0, 130, 130, 131], 64) == [(0, 0, 64, True), (0, 64, 128, False), (0, 128, 130, False),
                                                       (1, 130, 130, True), (2, 130, 131, True)]


@pytest.mark.parametrize("family", ["gla", "simple_gla", "lightning"])
@pytest.mark.parametrize("B,T", [(2, 150), (1, 128), (3, 40)])
def test_uniform_diagonal_decays_are_the_pieces_decays(rng, family, B, T):
    """The per-piece reduction the dense segments use gives diagonal_decays' running-sum differences
    over cut()'s pieces (whole pieces, a shorter last one, and a sequence shorter than one piece)."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula import _cp_summary

    HV, K, L = 3, 8, 64
    g = decay = None
    if family == "lightning":
        decay = torch.from_numpy(rng.uniform(0.001, 0.2, HV)).float()
    else:
        shape = (B * T, HV, K) if family == "gla" else (B * T, HV)
        g = torch.from_numpy(-rng.uniform(0.0, 0.3, shape)).float()
        g.view(-1)[::17] = -100.0  # below the kernels' floor of a token's log-decay: clamped in both
    pieces = _cp_summary.cut([b * T for b in range(B + 1)], L)
    starts, ends = [p[1] for p in pieces], [p[2] for p in pieces]
    want = _cp_summary.diagonal_decays(family, g, decay, B * T, HV, K, starts, ends, "cpu")
    got = _cp_summary.uniform_diagonal_decays(family, g, decay, B, T, HV, K, L, "cpu")
    assert got.shape == want.shape == (len(pieces), HV, K) and got.dtype == torch.float64
    assert rel(got.numpy(), want.numpy()) < 1e-12


def test_parallel_segments_take_empty_calls(monkeypatch):
    """CULA_SEGMENT_TOKENS with no tokens (T = 0) or no sequences (B = 0): the direct call's shapes,
    and a zero final state where a sequence had no token."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula import _front, _segments

    monkeypatch.setenv(_segments.SEGMENT_TOKENS, "64")
    for B, T in ((0, 10), (1, 0)):
        q, v = torch.randn(B, T, 2, 32), torch.randn(B, T, 2, 16)
        o, s = _front.chunk("gdn", q, q, v, -torch.rand(B, T, 2), torch.rand(B, T, 2), output_final_state=True)
        assert tuple(o.shape) == (B, T, 2, 16) and tuple(s.shape) == (B, 2, 16, 32)
        assert not s.abs().sum()
