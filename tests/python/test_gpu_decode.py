"""CUDA decode against the float64 reference and FLA: random inputs, fresh seeds, poisoned outputs
and a poisoned pool whose unnamed slots must stay bit-identical. Skipped without a CUDA device."""

import numpy as np
import pytest
from cases import family_arrays
from conftest import rel, worst

import cula
import cula.gated_delta_rule
import cula.kda
import cula.lightning_attn

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available() or cula._lib.LIB.cula_cuda_device_count() == 0:
    pytest.skip("no CUDA device visible to torch and cula", allow_module_level=True)


def make(rng, mode, N, T, H, HV, K, V, gate_in_kernel, dtype=torch.bfloat16):
    """Decode inputs (cases.family_arrays) as torch tensors, q, k, v in dtype; q/k L2 norm and beta
    sigmoid in the kernel, KDA's in-kernel gate with lower bound -5."""
    gate = gate_in_kernel and mode != "lightning"
    a = family_arrays(rng, mode, N, T, H, HV, K, V, gate_in_kernel=gate, beta_sigmoid=True, l2norm=True)
    d = {n: torch.from_numpy(x).to(dtype) if n in ("q", "k", "v") else torch.from_numpy(x) for n, x in a.items()}
    kw = dict(use_qk_l2norm_in_kernel=True)
    if mode in ("kda", "gdn"):
        kw["use_beta_sigmoid_in_kernel"] = True
        if gate:
            kw.update(use_gate_in_kernel=True, lower_bound=-5.0 if mode == "kda" else None)
    return d, kw


CASES = [
    # mode, T (draft tokens), K, V, GVA, gate in kernel, state dtype, layout
    ("kda", 1, 128, 128, False, True, torch.float32, "k_last"),
    ("kda", 1, 128, 128, True, True, torch.bfloat16, "k_last"),
    ("kda", 3, 128, 64, False, False, torch.float32, "k_last"),
    ("kda", 2, 64, 128, True, True, torch.bfloat16, "k_first"),
    ("kda", 3, 128, 64, False, True, torch.bfloat16, "k_last"),
    ("gdn", 1, 128, 128, False, True, torch.float32, "k_last"),
    ("gdn", 4, 64, 64, True, True, torch.bfloat16, "k_last"),
    ("gdn", 1, 128, 128, False, False, torch.float32, "k_first"),
    ("kda", 1, 128, 128, True, True, torch.bfloat16, "k_first"),
    ("gdn", 2, 128, 128, True, True, torch.bfloat16, "k_last"),
    ("lightning", 1, 128, 128, False, False, torch.float32, "k_last"),
    ("lightning", 2, 64, 128, True, False, torch.bfloat16, "k_last"),
    # K-first shares of the channels per column: 2 (K = 64, R = 64), 4 (K = 256, R = 32); no delta
    # rule (one block sum per token); V not whole 16-byte pieces (the scalar tile copy)
    ("kda", 1, 64, 64, False, True, torch.float32, "k_first"),
    ("gdn", 3, 256, 128, True, True, torch.float32, "k_first"),
    ("lightning", 2, 128, 96, False, False, torch.float32, "k_first"),
    ("gdn", 2, 128, 60, False, True, torch.bfloat16, "k_first"),
    ("kda", 1, 64, 4, False, True, torch.float32, "k_first"),  # 4 columns: the shares stop at 8 channels
    # K-last K = 256: two rows a warp per step
    ("gdn", 2, 256, 128, True, True, torch.float32, "k_last"),
    ("kda", 1, 256, 64, False, True, torch.bfloat16, "k_last"),
]


SIZES = {
    # name: (N, H, pool slots): small, a few dozen CTAs; wide, thousands of (sequence, value head,
    # tile) CTAs, several waves on any current GPU; few, hundreds of CTAs per sequence, where the
    # kernel reads each slot index once per CTA.
    "small": (7, 2, lambda N, T: 3 * N * T + 5),
    "wide": (192, 4, lambda N, T: N * T + 5),
    "few": (2, 32, lambda N, T: 3 * N * T + 5),
}


def run_both(d, kw, pool, mode, idx, acc=None, layout="k_last", dev=None):
    """The float64 reference on the host and the CUDA kernel (output poisoned) on the same inputs;
    dev: the device inputs, where a test wants particular views of them. Returns the CUDA output
    (checked written and finite), the reference output, the CUDA pool and the reference pool."""
    pool_ref = pool.clone()
    o_ref, _ = cula.decode(**{n: (x.float() if x.dtype == torch.bfloat16 and n in ("q", "k", "v") else x) for n, x in d.items()},
                           state_pool=pool_ref, mode=mode, state_indices=idx, num_accepted_tokens=acc,
                           state_layout=layout, backend="reference", **kw)
    dev = dev or {n: x.cuda() for n, x in d.items()}
    pool_gpu = pool.cuda()
    N, T, HV, V = d["v"].shape
    out = torch.full((N, T, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    cula.decode(**dev, state_pool=pool_gpu, mode=mode, state_indices=idx.cuda(),
                num_accepted_tokens=acc.cuda() if acc is not None else None, state_layout=layout, out=out, **kw)
    torch.cuda.synchronize()
    o = out.float().cpu()
    assert torch.isfinite(o).all(), "unwritten or non-finite output"
    return o, o_ref.float(), pool_gpu.cpu(), pool_ref


def assert_as_reference(o, o_ref, pg, pool_ref, pool, idx, pad):
    """What every comparison with the reference checks: outputs within 5e-3, the padding
    sequences' outputs zero, slots not named by idx bit-identical, the named ones within the state
    dtype's tolerance."""
    assert rel(o.numpy(), o_ref.numpy()) < 5e-3
    assert (o[pad] == 0).all(), "padding sequence must output zeros"
    named = set(int(x) for x in idx.flatten().tolist() if x >= 0)
    untouched = [s for s in range(pool.shape[0]) if s not in named]
    assert torch.equal(pg[untouched], pool[untouched]), "slots not named by state_indices changed"
    tol = 5e-3 if pool.dtype == torch.bfloat16 else 1e-4
    assert rel(pg.float().numpy(), pool_ref.float().numpy()) < tol


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[1]}-K{c[2]}V{c[3]}-{'gva' if c[4] else 'mha'}-"
                                            f"{'gate' if c[5] else 'g'}-{str(c[6])[6:]}-{c[7]}" for c in CASES])
@pytest.mark.sanitize
@pytest.mark.parametrize("size", list(SIZES))
def test_cuda_decode_matches_reference(rng, case, size):
    mode, T, K, V, gva, gate, sdt, layout = case
    N, H, slots = SIZES[size]
    HV = 2 * H if gva else H
    P = slots(N, T)
    d, kw = make(rng, mode, N, T, H, HV, K, V, gate)
    shape = (P, HV, V, K) if layout == "k_last" else (P, HV, K, V)
    pool = (torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) * 0.5).to(sdt)
    perm = torch.from_numpy(rng.permutation(P)[: N * T].astype(np.int32))
    pad = min(2, N - 1)  # a padding sequence
    if T == 1:
        idx = perm.clone()
        idx[pad] = -1
        acc = None
    else:
        idx = perm.view(N, T).clone()
        idx[pad] = -1
        idx[4 if N > 4 else 0, T - 1] = -1  # a draft token whose state is not kept
        acc = torch.from_numpy((np.arange(N) % (T + 1)).astype(np.int32))  # every count, 0 included
    assert_as_reference(*run_both(d, kw, pool, mode, idx, acc, layout), pool, idx, pad)


@pytest.mark.parametrize("mode", ["kda", "gdn"])
def test_cuda_decode_at_4096_sequences(rng, mode):
    # The largest batch a decode step takes (N = 4096), with padding sequences spread through it.
    N, H, K, V = 4096, 1, 64, 64
    d, kw = make(rng, mode, N, 1, H, H, K, V, True)
    P = N + 37
    pool = (torch.from_numpy(rng.standard_normal((P, H, V, K)).astype(np.float32)) * 0.5).to(torch.bfloat16)
    idx = torch.from_numpy(rng.permutation(P)[:N].astype(np.int32))
    pad = torch.from_numpy(rng.choice(N, 64, replace=False))
    idx[pad] = -1
    assert_as_reference(*run_both(d, kw, pool, mode, idx), pool, idx, pad)


@pytest.mark.parametrize("mode", ["kda", "gdn", "lightning"])
def test_level1_cula_decode_on_gpu_runs_the_level0_kernel(rng, mode):
    # cula_decode (Level 1, through the registered torch op) and cula.decode (Level 0): one kernel.
    N, H, K, V = 5, 2, 128, 128
    d, kw = make(rng, mode, N, 1, H, H, K, V, mode != "lightning")
    dev = {n: x.cuda() for n, x in d.items()}
    pool = torch.from_numpy(rng.standard_normal((N + 3, H, V, K)).astype(np.float32)).cuda()
    idx = torch.from_numpy(rng.permutation(N + 3)[:N].astype(np.int32)).cuda()
    p0, p1 = pool.clone(), pool.clone()
    o0, _ = cula.decode(**dev, state_pool=p0, mode=mode, state_indices=idx, **kw)
    rest = {n: x for n, x in dev.items() if n not in ("q", "k", "v")}
    o1, _ = cula.cula_decode(dev["q"], dev["k"], dev["v"], p1, mode=mode, state_indices=idx, **rest, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(o1).all() and not torch.equal(p1, pool)
    assert torch.equal(o0, o1) and torch.equal(p0, p1)


@pytest.mark.parametrize("which", ["q", "k", "g", "dt_bias"])
def test_cuda_decode_takes_inputs_at_odd_offsets(rng, which):
    """A view one element into its buffer cannot take the serving kernel's vector loads: the launch
    picks the generic instantiation, and the answer is the same."""
    N, H, K, V = 9, 2, 128, 128
    d, kw = make(rng, "kda", N, 1, H, H, K, V, True)
    dev = {n: x.cuda() for n, x in d.items()}
    x = dev[which]
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
    buf[1:].copy_(x.flatten())
    dev[which] = buf[1:].view(x.shape)
    assert dev[which].data_ptr() % 8 != 0
    pool = (torch.from_numpy(rng.standard_normal((2 * N, H, V, K)).astype(np.float32)) * 0.5).to(torch.bfloat16)
    idx = torch.from_numpy(rng.permutation(2 * N)[:N].astype(np.int32))
    o, o_ref, pg, pool_ref = run_both(d, kw, pool, "kda", idx, dev=dev)
    assert rel(o.numpy(), o_ref.numpy()) < 5e-3
    assert rel(pg.float().numpy(), pool_ref.float().numpy()) < 5e-3


def test_cuda_decode_matches_fla_fused_recurrent_kda(rng):
    pytest.importorskip("fla", reason="fla-core is not installed")
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    N, H, K, V = 33, 4, 128, 128
    d, kw = make(rng, "kda", N, 1, H, H, K, V, True)
    dev = {n: x.cuda() for n, x in d.items()}
    pool = (torch.randn(2 * N, H, V, K, device="cuda") * 0.5)
    idx = torch.randperm(2 * N, device="cuda")[:N].to(torch.int32)
    p1, p2 = pool.clone(), pool.clone()
    o, _ = cula.decode(**dev, state_pool=p1, mode="kda", state_indices=idx, **kw)
    o_fla, _ = fused_recurrent_kda_fwd(
        q=dev["q"].view(1, N, H, K), k=dev["k"].view(1, N, H, K), v=dev["v"].view(1, N, H, V), g=dev["g"].view(1, N, H, K),
        beta=dev["beta"].view(1, N, H), A_log=dev["A_log"], dt_bias=dev["dt_bias"], initial_state=p2,
        inplace_final_state=True, ssm_state_indices=idx, cu_seqlens=torch.arange(N + 1, device="cuda", dtype=torch.int32),
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
        state_v_first=True)
    torch.cuda.synchronize()
    e = (rel(o.float().cpu().numpy(), o_fla.view(N, 1, H, V).float().cpu().numpy()), rel(p1.cpu().numpy(), p2.cpu().numpy()))
    print("cula decode vs FLA fused_recurrent_kda (o, pool):", e)
    assert worst(e) < 5e-3


def test_cuda_decode_in_a_cuda_graph(rng):
    N, H, K, V = 16, 2, 128, 128
    d, kw = make(rng, "kda", N, 1, H, H, K, V, True)
    dev = {n: x.cuda() for n, x in d.items()}
    pool = torch.randn(N, H, V, K, device="cuda")
    idx = torch.randperm(N, device="cuda").to(torch.int32)
    out = torch.empty(N, 1, H, V, dtype=torch.bfloat16, device="cuda")
    eager_pool = pool.clone()
    o_eager, _ = cula.decode(**dev, state_pool=eager_pool, state_indices=idx, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        warm = pool.clone()
        cula.decode(**dev, state_pool=warm, state_indices=idx, out=out, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph_pool = pool.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cula.decode(**dev, state_pool=graph_pool, state_indices=idx, out=out, **kw)
    graph_pool.copy_(pool)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, o_eager) and torch.equal(graph_pool, eager_pool)


def test_fla_backend_registration_serves_fla_decode_calls(rng, monkeypatch):
    pytest.importorskip("fla", reason="fla-core is not installed")
    import cula.fla_backend
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    cula.fla_backend.register()
    N, H, K, V = 9, 2, 128, 128
    d, kw = make(rng, "kda", N, 1, H, H, K, V, True)
    dev = {n: x.cuda() for n, x in d.items()}
    pool = torch.randn(2 * N, H, V, K, device="cuda")
    idx = torch.randperm(2 * N, device="cuda")[:N].to(torch.int32)
    args = dict(q=dev["q"].view(1, N, H, K), k=dev["k"].view(1, N, H, K), v=dev["v"].view(1, N, H, V),
                g=dev["g"].view(1, N, H, K), beta=dev["beta"].view(1, N, H), A_log=dev["A_log"], dt_bias=dev["dt_bias"],
                ssm_state_indices=idx, cu_seqlens=torch.arange(N + 1, device="cuda", dtype=torch.int32),
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=-5.0, state_v_first=True)
    before = cula.fla_backend.calls["fused_recurrent_kda_fwd"]
    p_cula = pool.clone()
    o_cula, _ = fused_recurrent_kda_fwd(initial_state=p_cula, inplace_final_state=True, **args)
    assert cula.fla_backend.calls["fused_recurrent_kda_fwd"] == before + 1, "FLA did not dispatch to cula"
    monkeypatch.setenv("FLA_CULA", "0")
    p_fla = pool.clone()
    o_fla, _ = fused_recurrent_kda_fwd(initial_state=p_fla, inplace_final_state=True, **args)
    assert cula.fla_backend.calls["fused_recurrent_kda_fwd"] == before + 1
    torch.cuda.synchronize()
    assert rel(o_cula.float().cpu().numpy(), o_fla.float().cpu().numpy()) < 5e-3
    assert rel(p_cula.cpu().numpy(), p_fla.cpu().numpy()) < 1e-4


def test_fla_chunk_kda_on_host_tensors_runs_cula_when_registered(rng):
    pytest.importorskip("fla", reason="fla-core is not installed")
    import cula.fla_backend
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.naive import naive_recurrent_kda

    cula.fla_backend.register()
    B, T, H, K, V = 1, 40, 2, 16, 8
    q, k, v = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in
               ((B, T, H, K), (B, T, H, K), (B, T, H, V)))
    k = torch.nn.functional.normalize(k, dim=-1)
    g = -torch.from_numpy(rng.uniform(0.01, 0.5, (B, T, H, K)).astype(np.float32))
    beta = torch.rand(B, T, H)
    before = cula.fla_backend.calls["chunk_kda"]
    with torch.inference_mode():
        o, s = chunk_kda(q, k, v, g, beta, output_final_state=True)
    assert cula.fla_backend.calls["chunk_kda"] == before + 1
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert rel(o.numpy(), o_ref.numpy()) < 1e-5 and rel(s.numpy(), s_ref.numpy()) < 1e-5


def test_decode_op_passes_opcheck_and_compiles_fullgraph(rng):
    import cula.torch_ops

    N, H, K, V = 6, 2, 128, 128
    d, kw = make(rng, "kda", N, 1, H, H, K, V, True)
    dev = {n: x.cuda() for n, x in d.items()}
    pool = torch.randn(N + 3, H, V, K, device="cuda")
    idx = torch.randperm(N + 3, device="cuda")[:N].to(torch.int32)
    opts = cula.Options(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                        lower_bound=-5.0)
    args = (dev["q"], dev["k"], dev["v"], pool.clone(), dev["g"], dev["beta"], None, idx, None, dev["A_log"],
            dev["dt_bias"], "kda", *opts.values())  # the schema's options: cula.Options's fields in order
    torch.library.opcheck(torch.ops.cula.decode.default, args)

    def step(q, k, v, g, beta, pool):
        o, _ = cula.cula_decode(q, k, v, pool, state_indices=idx, g=g, beta=beta, A_log=dev["A_log"],
                                dt_bias=dev["dt_bias"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
        return o * 2

    p_eager, p_comp = pool.clone(), pool.clone()
    eager = step(dev["q"], dev["k"], dev["v"], dev["g"], dev["beta"], p_eager)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(dev["q"], dev["k"], dev["v"], dev["g"], dev["beta"], p_comp)
    torch.cuda.synchronize()
    assert torch.equal(got, eager) and torch.equal(p_comp, p_eager)


def dropin_pair(family):
    """cula's FLA drop-in for the recurrent form of a family and FLA's own function."""
    pytest.importorskip("fla", reason="fla-core is not installed")
    if family == "kda":
        from fla.ops.kda import fused_recurrent_kda as theirs

        return cula.kda.fused_recurrent_kda, theirs
    if family == "lightning":
        from fla.ops.lightning_attn import fused_recurrent_lightning_attn as theirs

        return cula.lightning_attn.fused_recurrent_lightning_attn, theirs
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as theirs

    return cula.gated_delta_rule.fused_recurrent_gated_delta_rule, theirs


def dropin_inputs(rng, family, B, T, H, HV, K, V):
    """FLA-layout inputs on the GPU: KDA with its gate computed in the kernel (lower bound), GDN
    with a log-space scalar gate; q/k L2 norm and beta sigmoid in the kernel for both."""
    d, kw = make(rng, family, B, T, H, HV, K, V, family == "kda")
    kw.update(use_beta_sigmoid_in_kernel=True)
    return {n: x.cuda() for n, x in d.items()}, kw


def packed(dev):
    """The inputs of make() as one row of tokens ([1, N T, ...], FLA's varlen layout with cu_seqlens)."""
    return {n: (x if n in ("A_log", "dt_bias") else x.reshape(1, -1, *x.shape[2:])) for n, x in dev.items()}


def assert_close_to_fla(label, got, want):
    """got, want: (o, final state) from cula's drop-in and from FLA's function: equal shapes, each
    within 5e-3 (relative L2)."""
    (o, ht), (o_fla, ht_fla) = got, want
    torch.cuda.synchronize()
    e = (rel(o.float().cpu().numpy(), o_fla.float().cpu().numpy()), rel(ht.cpu().numpy(), ht_fla.cpu().numpy()))
    print(f"{label} (o, final state):", e)
    assert o.shape == o_fla.shape and ht.shape == ht_fla.shape
    assert worst(e) < 5e-3


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["k_first", "v_first"])
def test_dropin_fused_recurrent_matches_fla(rng, family, state_v_first):
    ours, theirs = dropin_pair(family)
    B, T, H, HV, K, V = 3, 4, 2, 4, 128, 128
    dev, kw = dropin_inputs(rng, family, B, T, H, HV, K, V)
    shape = (B, HV, V, K) if state_v_first else (B, HV, K, V)
    h0 = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).cuda() * 0.5
    call = dict(output_final_state=True, state_v_first=state_v_first, **dev, **kw)
    assert_close_to_fla(f"{family} drop-in vs FLA", ours(initial_state=h0.clone(), **call),
                        theirs(initial_state=h0.clone(), **call))


@pytest.mark.sanitize
@pytest.mark.parametrize("layout", ["k_first", "k_last"])
@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 3])
def test_decode_final_state_out_leaves_the_pool_and_matches_in_place(rng, layout, sdt, T):
    """final_state_out: the states read from the pool (row n) and written to out[n], bit for bit what
    the in-place update writes, every element of out written (poisoned first), the pool unchanged."""
    N, H, HV, K, V = 5, 2, 4, 128, 96
    d, kw = make(rng, "kda", N, T, H, HV, K, V, True)
    dev = {n: x.cuda() for n, x in d.items()}
    shape = (N, HV, V, K) if layout == "k_last" else (N, HV, K, V)
    pool = (torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) * 0.5).to(sdt).cuda()
    in_place = pool.clone()
    o_in, _ = cula.decode(**dev, state_pool=in_place, mode="kda", state_layout=layout, **kw)
    out = torch.full_like(pool, float("nan"))
    keep = pool.clone()
    o, final = cula.decode(**dev, state_pool=pool, mode="kda", state_layout=layout, final_state_out=out, **kw)
    torch.cuda.synchronize()
    assert final is out and torch.equal(pool, keep), "the pool changed"
    assert torch.equal(out, in_place) and torch.equal(o, o_in)
    with pytest.raises(cula.CulaError, match="argument 'final_state_out'.*None with state_indices"):
        cula.decode(**dev, state_pool=pool, mode="kda", state_layout=layout, final_state_out=out,
                    state_indices=torch.arange(N, dtype=torch.int32, device="cuda"), **kw)


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["k_first", "v_first"])
def test_dropin_fused_recurrent_one_token_runs_the_decode_kernel(rng, family, state_v_first, monkeypatch):
    """fused_recurrent_* at T = 1 with a float32 state per row and no gradient: the decode kernel
    (no chunk engine), initial_state left as it was, o and the final state as FLA's; with a
    gradient wanted the chunked path takes the call and autograd reaches initial_state."""
    ours, theirs = dropin_pair(family)
    B, T, H, HV, K, V = 6, 1, 2, 4, 128, 128
    dev, kw = dropin_inputs(rng, family, B, T, H, HV, K, V)
    shape = (B, HV, V, K) if state_v_first else (B, HV, K, V)
    h0 = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).cuda() * 0.5
    keep = h0.clone()
    call = dict(output_final_state=True, state_v_first=state_v_first, **dev, **kw)
    import cula._fla_common as common

    chunked = common.chunk

    def no_chunk(*a, **k):
        raise AssertionError("the chunked path took a one-token call")

    monkeypatch.setattr(common, "chunk", no_chunk)
    got = ours(initial_state=h0, **call)
    assert cula.last_kernel() == "cuda", cula.last_kernel()
    assert torch.equal(h0, keep), "initial_state changed"
    monkeypatch.setattr(common, "chunk", chunked)
    assert_close_to_fla(f"{family} T=1 drop-in vs FLA", got, theirs(initial_state=h0.clone(), **call))
    h0g = h0.clone().requires_grad_()
    o, ht = ours(initial_state=h0g, **call)
    (o.float().sum() + ht.sum()).backward()
    assert h0g.grad is not None and torch.isfinite(h0g.grad).all()


@pytest.mark.parametrize("T", [1, 5])
def test_dropin_fused_recurrent_lightning_matches_fla(rng, T):
    ours, theirs = dropin_pair("lightning")
    B, H, K, V = 4, 8, 128, 128
    q, k, v = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(torch.bfloat16).cuda()
               for s in ((B, T, H, K), (B, T, H, K), (B, T, H, V)))
    h0 = torch.from_numpy(rng.standard_normal((B, H, K, V)).astype(np.float32)).cuda() * 0.5
    assert_close_to_fla(f"lightning drop-in vs FLA, T = {T}",
                        ours(q, k, v, 3, 8, initial_state=h0.clone(), output_final_state=True),
                        theirs(q, k, v, 3, 8, initial_state=h0.clone(), output_final_state=True))


@pytest.mark.sanitize
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_dropin_fused_recurrent_serves_a_pool_in_a_cuda_graph(rng, family):
    """The serving form (one token per sequence through cu_seqlens, ssm_state_indices into a bf16
    pool updated in place) against FLA's function on the gathered states, then the same call
    captured in a CUDA graph and replayed."""
    ours, theirs = dropin_pair(family)
    N, H, HV, K, V, P = 12, 2, 4, 128, 128, 30
    dev, kw = dropin_inputs(rng, family, N, 1, H, HV, K, V)
    flat = packed(dev)
    cu = torch.arange(N + 1, device="cuda", dtype=torch.int32)
    pool = (torch.from_numpy(rng.standard_normal((P, HV, V, K)).astype(np.float32)) * 0.5).to(torch.bfloat16).cuda()
    idx = torch.from_numpy(rng.permutation(P)[:N].astype(np.int32)).cuda()
    serve = dict(cu_seqlens=cu, ssm_state_indices=idx, inplace_final_state=True, state_v_first=True, **kw)

    p_eager = pool.clone()
    o, _ = ours(**flat, initial_state=p_eager, **serve)
    o_fla, ht_fla = theirs(**flat, initial_state=pool[idx.long()].float(), output_final_state=True, cu_seqlens=cu,
                           state_v_first=True, **kw)
    torch.cuda.synchronize()
    e = (rel(o.float().cpu().numpy(), o_fla.float().cpu().numpy()),
         rel(p_eager[idx.long()].float().cpu().numpy(), ht_fla.cpu().numpy()))
    print(f"{family} serving drop-in vs FLA (o, states):", e)
    assert worst(e) < 5e-3
    untouched = torch.ones(P, dtype=torch.bool, device="cuda")
    untouched[idx.long()] = False
    assert torch.equal(p_eager[untouched], pool[untouched]), "slots not named by ssm_state_indices changed"

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ours(**flat, initial_state=pool.clone(), **serve)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    p_graph = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, _ = ours(**flat, initial_state=p_graph, **serve)
    p_graph.copy_(pool)
    o_graph.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o) and torch.equal(p_graph, p_eager)


def test_dropin_fused_recurrent_kda_speculative_matches_fla(rng):
    """Draft tokens: T tokens per sequence, a slot per token ([N, T] ssm_state_indices) and
    num_accepted_tokens choosing the state to start from, against FLA's fused_recurrent_kda_fwd."""
    pytest.importorskip("fla", reason="fla-core is not installed")
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    N, T, H, K, V = 6, 3, 2, 128, 128
    P = N * T + 7
    dev, kw = dropin_inputs(rng, "kda", N, T, H, H, K, V)
    flat = packed(dev)
    cu = torch.arange(0, N * T + 1, T, device="cuda", dtype=torch.int32)
    pool = torch.from_numpy(rng.standard_normal((P, H, V, K)).astype(np.float32)).cuda() * 0.5
    idx = torch.from_numpy(rng.permutation(P)[:N * T].reshape(N, T).astype(np.int32)).cuda()
    acc = torch.from_numpy((np.arange(N) % T + 1).astype(np.int32)).cuda()  # 1..T accepted
    serve = dict(cu_seqlens=cu, ssm_state_indices=idx, num_accepted_tokens=acc, inplace_final_state=True,
                 state_v_first=True, **kw)
    p_cula, p_fla = pool.clone(), pool.clone()
    o, _ = cula.kda.fused_recurrent_kda(**flat, initial_state=p_cula, **serve)
    o_fla, _ = fused_recurrent_kda_fwd(**flat, initial_state=p_fla, **serve)
    torch.cuda.synchronize()
    e = (rel(o.float().cpu().numpy(), o_fla.float().cpu().numpy()), rel(p_cula.cpu().numpy(), p_fla.cpu().numpy()))
    print("KDA drop-in with draft tokens vs FLA (o, pool):", e)
    assert e[0] < 5e-3 and e[1] < 1e-4


def test_dropin_serving_decode_takes_strided_inputs_as_fla_does(rng):
    """q, k, v as slices of one fused projection and a strided A_log: the drop-in makes them
    contiguous as FLA's input_guard does (the CUDA decode kernel reads them so), with the bits of
    the contiguous call; chunk_kda likewise for a strided A_log."""
    N, H, K, V, P = 5, 2, 128, 128, 9
    dev, kw = dropin_inputs(rng, "kda", N, 1, H, H, K, V)
    flat = packed(dev)
    qkv = torch.empty(1, N, 3, H, K, device="cuda", dtype=torch.bfloat16)
    for i, n in enumerate("qkv"):
        qkv[:, :, i] = flat[n]
    fused = dict(flat, q=qkv[:, :, 0], k=qkv[:, :, 1], v=qkv[:, :, 2])
    wide = torch.zeros(2 * H, device="cuda")
    wide[::2] = flat["A_log"]
    fused["A_log"] = wide[::2]
    assert not any(fused[n].is_contiguous() for n in ("q", "k", "v", "A_log"))
    cu = torch.arange(N + 1, device="cuda", dtype=torch.int32)
    pool = torch.from_numpy(rng.standard_normal((P, H, V, K)).astype(np.float32)).cuda() * 0.5
    idx = torch.from_numpy(rng.permutation(P)[:N].astype(np.int32)).cuda()
    serve = dict(cu_seqlens=cu, ssm_state_indices=idx, inplace_final_state=True, state_v_first=True, **kw)
    p_dense, p_fused = pool.clone(), pool.clone()
    o_dense, _ = cula.kda.fused_recurrent_kda(**flat, initial_state=p_dense, **serve)
    o_fused, _ = cula.kda.fused_recurrent_kda(**fused, initial_state=p_fused, **serve)
    torch.cuda.synchronize()
    assert torch.equal(o_dense, o_fused) and torch.equal(p_dense, p_fused)
    chunk_kw = dict(kw, safe_gate=True, output_final_state=True)
    a = cula.kda.chunk_kda(**flat, **chunk_kw)
    b = cula.kda.chunk_kda(**dict(flat, A_log=fused["A_log"]), **chunk_kw)
    torch.cuda.synchronize()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_device_slot_indices_checked_on_request(rng, monkeypatch):
    """CULA_CHECK_DEVICE_INDICES: device slot indices get the host checks (one synchronisation), in
    decode and in the chunked forward's state pool, through Level 0 and Level 1: a slot named by two
    sequences or past the pool is refused before anything runs (pool untouched); valid indices give
    the unchecked call's bits."""
    N, H, K, V = 4, 2, 128, 128
    d, kw = make(rng, "kda", N, 1, H, H, K, V, True)
    dev = {n: x.cuda() for n, x in d.items()}
    rest = {n: x for n, x in dev.items() if n not in ("q", "k", "v")}
    pool = torch.from_numpy(rng.standard_normal((N + 2, H, V, K)).astype(np.float32)).cuda()
    good = torch.tensor([3, 0, 5, -1], dtype=torch.int32, device="cuda")
    twice = torch.tensor([3, 0, 3, -1], dtype=torch.int32, device="cuda")
    past = torch.tensor([3, 0, 6, -1], dtype=torch.int32, device="cuda")
    plain_pool = pool.clone()
    o_plain, _ = cula.decode(**dev, state_pool=plain_pool, mode="kda", state_indices=good, **kw)
    monkeypatch.setenv("CULA_CHECK_DEVICE_INDICES", "1")
    p = pool.clone()
    o, _ = cula.decode(**dev, state_pool=p, mode="kda", state_indices=good, **kw)
    torch.cuda.synchronize()
    assert torch.equal(o, o_plain) and torch.equal(p, plain_pool)
    for bad, msg in ((twice, "slot 3 named by sequences 0 and 2"), (past, "slot indices < pool size P = 6")):
        for call in (lambda p, i: cula.decode(**dev, state_pool=p, mode="kda", state_indices=i, **kw),
                     lambda p, i: cula.cula_decode(dev["q"], dev["k"], dev["v"], p, mode="kda", state_indices=i,
                                                   **rest, **kw)):
            p = pool.clone()
            with pytest.raises(cula.CulaError, match=msg):
                call(p, bad)
            assert torch.equal(p, pool), "a refused call wrote the pool"
    # the chunked forward with a state pool: one token per sequence of a varlen batch
    cu = torch.arange(N + 1, dtype=torch.int32, device="cuda")
    flat = {n: x.reshape(1, N, *x.shape[2:]) if x.dim() >= 3 else x for n, x in dev.items()}
    p = pool.clone()
    with pytest.raises(cula.CulaError, match="slot 3 named by sequences 0 and 2"):
        cula.chunk_fwd("kda", flat["q"], flat["k"], flat["v"], flat["g"], flat["beta"], cu_seqlens=cu, state_pool=p,
                       state_indices=twice, A_log=dev.get("A_log"), dt_bias=dev.get("dt_bias"), **kw)
    assert torch.equal(p, pool)
