"""The CUDA backward against the float64 reference backward over a randomized grid of families,
options, head sizes, dtypes and varlen batches, with poisoned gradient buffers; its determinism;
autograd through the public entries on CUDA. Skipped without a CUDA device."""

import numpy as np
import pytest
from conftest import rel

import cula

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available() or cula._lib.LIB.cula_cuda_device_count() == 0:
    pytest.skip("no CUDA device visible to torch and cula", allow_module_level=True)

from cases import FAMILIES, chunk_inputs, draw_chunk_config, family_arrays  # noqa: E402

# The recurrent kernel ("cuda") computes in fp32 from the same (rounded) inputs the float64
# reference reads: what remains is fp32 accumulation over the sequence, far inside FLA's own backward
# tolerances. The chunk form ("cuda_chunk") multiplies on TF32 tensor cores (10-bit mantissa) and
# reads the forward's states: FLA's own tolerances, per gradient.
TOL = 2e-3
CHUNK_TOL = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "d_initial_state": 8e-3, "dg": 2e-2, "dbeta": 2e-2, "dA_log": 3e-3,
             "ddt_bias": 8e-3}


_GRAD_OF = {"dq": "q", "dk": "k", "dv": "v", "dg": "g", "dbeta": "beta", "dA_log": "A_log", "ddt_bias": "dt_bias",
            "d_initial_state": "initial_state"}
LEAF_TOL = {src: CHUNK_TOL[n] for n, src in _GRAD_OF.items()}  # by the leaf (autograd)
_BWD_OPTIONS = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "lower_bound", "safe_gate",
                "use_beta_sigmoid_in_kernel", "state_layout")


def _tolerance(kernel, grad):
    assert kernel in ("cuda", "cuda_chunk"), kernel
    return TOL if kernel == "cuda" else CHUNK_TOL[grad]


def _failing(errs, kernel):
    """The gradients whose error passes the tolerance of the kernel that ran (none: all within)."""
    return {n: e for n, e in errs.items() if not e < _tolerance(kernel, n)}


def _errors(got, ref):
    """Relative errors per gradient; a reference that is zero (a gate's gradient on one token from a
    zero state) is measured against an absolute floor of 1e-6 per element, the rounding noise of
    terms that cancel exactly in exact arithmetic."""
    return {n: rel(got[n].cpu().double().numpy(), r.double().numpy(), floor=1e-6) for n, r in ref.items()}


def _problem(rng, family):
    c = draw_chunk_config(rng, family)
    c["inter"] = False
    c["V"] = int(rng.choice([48, 64, 100, 128, 256]))  # any V: rows past V are masked
    if family not in ("kda", "gdn", "gla"):
        c["K"] = int(rng.choice([64, 128, 256]))
    c["idt"] = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    d, cu, kw = chunk_inputs(rng, c)
    kw = {n: x for n, x in kw.items() if n in _BWD_OPTIONS}
    B, T, HV, V = d["v"].shape
    N = B if cu is None else len(cu) - 1
    d["d_out"] = torch.from_numpy(rng.standard_normal((B, T, HV, V)).astype(np.float32)).to(
        rng.choice([torch.bfloat16, torch.float32]))
    if rng.random() < 0.6:
        K = d["q"].shape[-1]
        shape = (N, HV, V, K) if kw["state_layout"] == "k_last" else (N, HV, K, V)
        d["d_final_state"] = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    return d, cu, kw


def _poisoned(d):
    return {n: torch.full(d[src].shape, float("nan"), dtype=torch.float32, device="cuda")
            for n, src in _GRAD_OF.items() if src in d}


def _run(family, d, cu, kw, grads=None):
    dev = {n: x.cuda() for n, x in d.items()}
    q, k, v, do = (dev.pop(n) for n in ("q", "k", "v", "d_out"))
    g, beta = dev.pop("g", None), dev.pop("beta", None)
    return cula.chunk_bwd(family, q, k, v, g, beta, do, cu_seqlens=None if cu is None else cu.cuda(), grads=grads,
                          **dev, **kw)


def _reference(family, d, cu, kw):
    host = {n: x.double() for n, x in d.items()}
    q, k, v, do = (host.pop(n) for n in ("q", "k", "v", "d_out"))
    g, beta = host.pop("g", None), host.pop("beta", None)
    return cula.chunk_bwd(family, q, k, v, g, beta, do, cu_seqlens=cu, backend="reference", **host, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_backward_matches_the_float64_reference(rng, family):
    for _ in range(6):
        d, cu, kw = _problem(rng, family)
        ref = _reference(family, d, cu, kw)
        grads = _poisoned(d)
        got = _run(family, d, cu, kw, grads)
        torch.cuda.synchronize()
        kernel = cula.last_kernel()
        assert set(got) == set(ref)
        errs = _errors(got, ref)
        shapes = {n: tuple(d[n].shape) for n in ("q", "v")}
        assert not _failing(errs, kernel), (family, kernel, kw, shapes, None if cu is None else cu.tolist(), errs)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_chunk_form_takes_training_shapes_and_matches_the_reference(rng, family):
    """bf16 inputs, K = 128, 64 and 256 (FLA's default GatedDeltaNet head), GVA for the delta rule,
    varlen with a sequence below one chunk and an empty one, states in and out: the chunk form runs
    (not the recurrent kernel) and matches."""
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    varlen = torch.tensor([0, 30, 30, 200, 333], dtype=torch.int32)
    for K, V, cu in ((128, 128, None), (64, 128, varlen), (256, 128, varlen)):
        B, T = (2, 150) if cu is None else (1, 333)
        N = B if cu is None else len(cu) - 1
        H, HV = (2, 4) if family in ("kda", "gdn") else (2, 2)
        kda = family == "kda"  # KDA with its unbounded gate (no lower bound) and beta sigmoid in kernel
        arrays = family_arrays(rng, family, B, T, H, HV, K, V, gate_in_kernel=kda, beta_sigmoid=kda, l2norm=True)
        d = {n: torch.from_numpy(x) for n, x in arrays.items() if x is not None}
        for n in ("q", "k", "v"):
            d[n] = d[n].bfloat16()
        d.update(d_out=t(B, T, HV, V).bfloat16(), initial_state=t(N, HV, V, K) * 0.3, d_final_state=t(N, HV, V, K))
        kw = dict(use_qk_l2norm_in_kernel=True)
        if kda:
            kw.update(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        ref = _reference(family, d, cu, kw)
        got = _run(family, d, cu, kw, _poisoned(d))
        torch.cuda.synchronize()
        assert cula.last_kernel() == "cuda_chunk", family
        errs = _errors(got, ref)
        assert not _failing(errs, "cuda_chunk"), (family, K, errs)


@pytest.mark.sanitize
@pytest.mark.parametrize("family", FAMILIES)
def test_small_backward_matches_the_reference(rng, family):
    """Small shapes for compute-sanitizer: a varlen batch with an empty sequence and one over a chunk,
    V = 48 (the recurrent kernel; rows past V masked) and V = 64 (the chunk form), K = 64, 128 and
    256 (the chunk form's factor kernel in two channel slices), states in and out."""
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    cu = torch.tensor([0, 17, 17, 110], dtype=torch.int32)
    kernels = set()
    for K, V in ((64, 48), (256, 48), (64, 64), (128, 64), (256, 64)):
        d = dict(q=t(1, 110, 2, K).bfloat16(), k=(t(1, 110, 2, K) * K ** -0.5).bfloat16(), v=t(1, 110, 4, V).bfloat16(),
                 d_out=t(1, 110, 4, V), initial_state=t(3, 4, V, K), d_final_state=t(3, 4, V, K))
        kw = dict(use_qk_l2norm_in_kernel=True)
        if family == "kda":
            d.update(g=t(1, 110, 4, K), beta=t(1, 110, 4), A_log=t(4), dt_bias=t(4 * K))
            kw.update(use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
        elif family == "gdn":
            d.update(g=-t(1, 110, 4).abs(), beta=torch.sigmoid(t(1, 110, 4)))
        elif family == "lightning":
            d["decay"] = torch.rand(2)
        else:
            d["g"] = -t(1, 110, 4, K).abs() if family == "gla" else -t(1, 110, 4).abs()
        ref = _reference(family, d, cu, kw)
        got = _run(family, d, cu, kw, _poisoned(d))
        kernels.add(cula.last_kernel())
        errs = _errors(got, ref)
        assert not _failing(errs, cula.last_kernel()), (K, V, cula.last_kernel(), errs)
    assert kernels == {"cuda", "cuda_chunk"}, kernels


@pytest.mark.sanitize
@pytest.mark.parametrize("family", ["gla", "simple_gla", "lightning"])
def test_wide_scans_of_the_families_without_the_delta_rule_match_the_reference(rng, family):
    """Enough value heads that the chunk form's scans run 32 columns per CTA (the grid at that width
    at least 1.5 CTAs per SM of this device): K = 64 and 128, states in and out, against the float64
    reference."""
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    B, T, V = 2, 150, 128
    H = -(-3 * sms // (4 * B * (V // 32)))  # 2 roles x B x H x V/32 CTAs >= 1.5 sms
    for K in (64, 128):
        d = dict(q=t(B, T, H, K).bfloat16(), k=(t(B, T, H, K) * K ** -0.5).bfloat16(), v=t(B, T, H, V).bfloat16(),
                 d_out=t(B, T, H, V).bfloat16(), initial_state=t(B, H, V, K) * 0.3, d_final_state=t(B, H, V, K))
        if family == "lightning":
            d["decay"] = torch.rand(H)
        else:
            d["g"] = (-t(B, T, H, K).abs() if family == "gla" else -t(B, T, H).abs()) * 0.1
        kw = dict(state_layout="k_last")
        ref = _reference(family, d, None, kw)
        got = _run(family, d, None, kw, _poisoned(d))
        torch.cuda.synchronize()
        assert cula.last_kernel() == "cuda_chunk", (family, K)
        errs = _errors(got, ref)
        assert not _failing(errs, "cuda_chunk"), (family, K, H, errs)


@pytest.mark.sanitize
@pytest.mark.parametrize("family", ["kda", "gdn", "gla", "simple_gla"])
def test_one_token_from_a_zero_state_has_no_gate_gradient(rng, family):
    """One token per sequence, no initial state, a final-state gradient: the decay multiplies only the
    zero state, so the gate's gradient is exactly 0 and the chunk form must not turn the terms that
    cancel (the diagonal pair, the chunk end's) into noise. bf16 inputs take the one-TF32 products
    (the gate outside the kernel), float32 inputs three; V = 256, two value slices."""
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    B, H, K, V = 3, 2, 128, 256
    for dtype in (torch.bfloat16, torch.float32):
        d = dict(q=t(B, 1, H, K).to(dtype), k=t(B, 1, H, K).to(dtype), v=t(B, 1, H, V).to(dtype),
                 d_out=t(B, 1, H, V).to(dtype), d_final_state=t(B, H, V, K))
        d["g"] = -t(*((B, 1, H, K) if family in ("kda", "gla") else (B, 1, H))).abs()
        if family in ("kda", "gdn"):
            d["beta"] = torch.sigmoid(t(B, 1, H))
        kw = dict(use_qk_l2norm_in_kernel=True, state_layout="k_last")
        ref = _reference(family, d, None, kw)
        assert float(ref["dg"].abs().max()) == 0.0
        got = _run(family, d, None, kw, _poisoned(d))
        torch.cuda.synchronize()
        assert cula.last_kernel() == "cuda_chunk", family
        errs = _errors(got, ref)
        assert not _failing(errs, "cuda_chunk"), (family, dtype, errs)


@pytest.mark.sanitize
@pytest.mark.parametrize("family", ["simple_gla", "lightning"])
def test_lean_form_matches_the_reference_and_the_general_form(rng, family, monkeypatch):
    """The lean chunk backward (no delta rule, one decay per token, K <= 128) against the float64
    reference and against the general form (CULA_BWD_LEAN=0): a varlen batch with an empty sequence,
    one below a chunk and one ending mid-chunk, K = 64 and 128, V = 64 to 192 (up to three value
    slices), states in and out, both state layouts; each of its paths: bf16 inputs as they lie (the
    direct path: no prepare or chain kernels), bf16 with the L2 norm or a float32 d_out (prepared
    inputs, bf16 operands), float32 inputs (three TF32 products)."""
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    cu = torch.tensor([0, 40, 40, 170, 300], dtype=torch.int32)
    for K, V, dtype, do_dtype, layout, l2 in ((64, 64, torch.bfloat16, torch.bfloat16, "k_last", False),
                                             (128, 128, torch.bfloat16, torch.bfloat16, "k_first", False),
                                             (128, 192, torch.float32, torch.float32, "k_first", False),
                                             (128, 64, torch.bfloat16, torch.bfloat16, "k_first", True),
                                             (64, 128, torch.bfloat16, torch.float32, "k_last", False)):
        N, T, H = len(cu) - 1, int(cu[-1]), 2
        sshape = (N, H, V, K) if layout == "k_last" else (N, H, K, V)
        d = dict(q=t(1, T, H, K).to(dtype), k=(t(1, T, H, K) * K ** -0.5).to(dtype), v=t(1, T, H, V).to(dtype),
                 d_out=t(1, T, H, V).to(do_dtype), initial_state=t(*sshape) * 0.3, d_final_state=t(*sshape))
        if family == "lightning":
            d["decay"] = torch.rand(H)
        else:
            d["g"] = -t(1, T, H).abs() * 0.3
        kw = dict(state_layout=layout, use_qk_l2norm_in_kernel=l2)
        ref = _reference(family, d, cu, kw)
        got = {}
        for lean in ("1", "0"):
            monkeypatch.setenv("CULA_BWD_LEAN", lean)
            got[lean] = _run(family, d, cu, kw, _poisoned(d))
            torch.cuda.synchronize()
            assert cula.last_kernel() == "cuda_chunk", (family, K, V)
            errs = _errors(got[lean], ref)
            assert not _failing(errs, "cuda_chunk"), (family, K, V, dtype, l2, lean, errs)
        between = {n: rel(got["1"][n].cpu().double().numpy(), got["0"][n].cpu().double().numpy(), floor=1e-6)
                   for n in ref}
        assert not _failing(between, "cuda_chunk"), (family, K, V, dtype, l2, between)


@pytest.mark.sanitize
def test_lean_direct_path_gives_one_token_from_a_zero_state_no_gate_gradient(rng):
    """Simple GLA, bf16 inputs as they lie (the lean form's direct path), one token per sequence, no
    initial state, a final-state gradient: the gate's gradient is exactly 0, and the terms that cancel
    (the diagonal pair, the chunk end's) must not leave noise."""
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    B, H, K, V = 3, 2, 128, 128
    d = dict(q=t(B, 1, H, K).bfloat16(), k=t(B, 1, H, K).bfloat16(), v=t(B, 1, H, V).bfloat16(),
             d_out=t(B, 1, H, V).bfloat16(), d_final_state=t(B, H, K, V), g=-t(B, 1, H).abs())
    kw = dict(state_layout="k_first")
    ref = _reference("simple_gla", d, None, kw)
    assert float(ref["dg"].abs().max()) == 0.0
    got = _run("simple_gla", d, None, kw, _poisoned(d))
    torch.cuda.synchronize()
    errs = _errors(got, ref)
    assert not _failing(errs, "cuda_chunk"), errs


@pytest.mark.parametrize("family", ["kda", "gdn", "lightning"])
def test_cuda_backward_is_bitwise_deterministic(rng, family):
    d, cu, kw = _problem(rng, family)
    first = {n: x.clone() for n, x in _run(family, d, cu, kw).items()}
    for _ in range(2):
        again = _run(family, d, cu, kw)
        for n, x in first.items():
            assert torch.equal(x, again[n]), n


@pytest.mark.parametrize("family,neg", [("kda", False), ("kda", True), ("gdn", True)])
def test_beta_sigmoid_in_kernel_is_the_float32_sigmoid_outside(rng, family, neg):
    """use_beta_sigmoid_in_kernel on raw b computes, bit for bit, what the same call with beta =
    sigmoid(b) in float32 (times 2 with allow_neg_eigval) computes: outputs, final states and the
    gradients of q, k, v, g and the initial state, through FLA's drop-ins (FLA's test_kda.py holds the
    two to 1e-4; one-TF32 products turn any difference in beta into noise at that level)."""
    from cula.gated_delta_rule import chunk_gated_delta_rule
    from cula.kda import chunk_kda

    B, T, H, K = 1, 700, 3, 128
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32)).cuda()  # noqa: E731
    q, k = (torch.nn.functional.normalize(t(B, T, H, K), dim=-1).bfloat16() for _ in range(2))
    v = t(B, T, H, K).bfloat16()
    g = -torch.rand(B, T, H, K, device="cuda") * 0.2 if family == "kda" else -torch.rand(B, T, H, device="cuda") * 0.2
    b_raw, h0, do, dht = t(B, T, H).bfloat16(), t(B, H, K, K) * 0.3, t(B, T, H, K).bfloat16(), t(B, H, K, K)
    fn = chunk_kda if family == "kda" else chunk_gated_delta_rule
    results = []
    for in_kernel in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]
        beta = b_raw if in_kernel else b_raw.float().sigmoid() * (2 if neg else 1)
        o, ht = fn(*leaves[:4], beta=beta, initial_state=leaves[4], output_final_state=True,
                   use_beta_sigmoid_in_kernel=in_kernel, allow_neg_eigval=neg and in_kernel)
        ((o * do).sum() + (ht * dht).sum()).backward()
        results.append([o, ht] + [x.grad for x in leaves])
    for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dh0"), *results):
        assert torch.equal(a, b), (name, float((a.float() - b.float()).abs().max()))


def test_long_steep_sequence_gradients_are_finite_and_match(rng):
    """32k tokens of Kimi-Linear's unbounded gate with log-decays down to -30 per token, against the
    float64 reference (one head: the reference is sequential)."""
    T, K, V = 32768, 128, 64
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    d = dict(q=t(1, T, 1, K).bfloat16(), k=t(1, T, 1, K).bfloat16(), v=t(1, T, 1, V).bfloat16(), g=t(1, T, 1, K) * 3,
             beta=t(1, T, 1), A_log=torch.tensor([1.5]), dt_bias=t(K) * 0.5, d_out=t(1, T, 1, V).bfloat16(),
             initial_state=t(1, 1, V, K) * 0.3, d_final_state=t(1, 1, V, K))
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    got = _run("kda", d, None, kw, _poisoned(d))
    kernel = cula.last_kernel()
    ref = _reference("kda", d, None, kw)
    for n in ref:
        assert torch.isfinite(got[n]).all(), n
    errs = _errors(got, ref)
    assert kernel == "cuda_chunk" and not _failing(errs, kernel), (kernel, errs)


def _dropin_calls():
    """(name, leaves(B, T, H, K, V, t), call(x) -> (o, final state)) for each public entry."""
    from cula import api
    from cula.kda import chunk_kda
    from cula.gated_delta_rule import chunk_gated_delta_rule
    from cula.gla import chunk_gla
    from cula.lightning_attn import chunk_lightning_attn
    from cula.simple_gla import chunk_simple_gla

    def kda_leaves(B, T, H, K, V, t):
        return dict(q=t(B, T, H, K), k=t(B, T, H, K), v=t(B, T, H, V), g=t(B, T, H, K), beta=t(B, T, H),
                    A_log=t(H) * 0.5, dt_bias=t(H * K) * 0.5, initial_state=t(B, H, K, V) * 0.3)

    def plain_leaves(gate_shape):
        def make(B, T, H, K, V, t):
            x = dict(q=t(B, T, H, K), k=t(B, T, H, K) * K ** -0.5, v=t(B, T, H, V),
                     initial_state=t(B, H, K, V) * 0.3)
            if gate_shape:
                x["g"] = -torch.nn.functional.softplus(t(B, T, H, *gate_shape[3:]))
            return x
        return make

    kda_opts = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True)
    return [
        ("chunk_kda", kda_leaves, lambda x: chunk_kda(
            x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
            initial_state=x["initial_state"], **kda_opts)),
        ("cula_kda", kda_leaves, lambda x: api.cula_kda(
            x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
            initial_state=x["initial_state"].transpose(-1, -2).contiguous(), lower_bound=-5.0, **kda_opts)),
        ("chunk_gated_delta_rule", lambda B, T, H, K, V, t: dict(
            q=t(B, T, H, K), k=t(B, T, H, K), v=t(B, T, H, V),
            g=-torch.nn.functional.softplus(t(B, T, H)), beta=torch.sigmoid(t(B, T, H)),
            initial_state=t(B, H, K, V) * 0.3), lambda x: chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True,
            use_qk_l2norm_in_kernel=True)),
        ("chunk_gla", plain_leaves((0, 0, 0, 1)), lambda x: chunk_gla(
            x["q"], x["k"], x["v"], x["g"], initial_state=x["initial_state"], output_final_state=True)),
        ("chunk_simple_gla", plain_leaves((0, 0, 0)), lambda x: chunk_simple_gla(
            x["q"], x["k"], x["v"], x["g"], initial_state=x["initial_state"], output_final_state=True)),
        ("chunk_lightning_attn", plain_leaves(None), lambda x: chunk_lightning_attn(
            x["q"], x["k"], x["v"], layer_idx=1, num_layers=4, initial_state=x["initial_state"],
            output_final_state=True)),
    ]


@pytest.mark.parametrize("K", [64, 100, 40, 320])
@pytest.mark.parametrize("entry", range(6))
def test_autograd_through_the_public_entries_on_cuda_matches_the_host(rng, entry, K):
    """Outputs and gradients of a CUDA call through torch autograd (bf16 q/k/v) against the same call
    on host float64 tensors, the same values on both sides. Head sizes the kernels are not built for
    (40, 100; 320 without the delta rule) and a V that is not a multiple of 64 (48) run zero-padded
    and sliced (_front._fit_head_size)."""
    name, leaves, call = _dropin_calls()[entry]
    B, T, H = 2, 70, 2
    V = 48 if K == 40 else 64  # (48: value columns zero-padded to 64 for the tensor-core engines)
    if K > 256 and name in ("chunk_kda", "cula_kda", "chunk_gated_delta_rule"):
        t = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
        with pytest.raises(cula.CulaUnsupportedError, match=f"K up to 256.*K = {K}"):
            call(leaves(B, T, H, K, V, t))
        return
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    base = leaves(B, T, H, K, V, t)
    if name == "chunk_gla":  # per-channel gate [B, T, H, K]
        base["g"] = -torch.nn.functional.softplus(t(B, T, H, K))
    dev = {n: (x.cuda().bfloat16() if n in ("q", "k", "v") else x.cuda()).requires_grad_() for n, x in base.items()}
    # the same values on the host in float64 (Level 1 takes float32 states only)
    host = {n: x.detach().cpu().to(torch.float32 if name == "cula_kda" and n == "initial_state" else torch.float64)
            .requires_grad_() for n, x in dev.items()}
    grads, outs = {}, {}
    for side, x in (("cuda", dev), ("host", host)):
        o, s = call(x)
        outs[side] = (o, s)
        # loss weights representable in bf16: the CUDA side's o is bf16, and the gradient it passes
        # back is rounded so; the host's float64 o would take unrounded weights (dA_log, a cancelling
        # sum, shows the difference)
        do = torch.from_numpy(np.random.default_rng(7).standard_normal(tuple(o.shape))).bfloat16().to(o.device).double()
        ds = torch.from_numpy(np.random.default_rng(8).standard_normal(tuple(s.shape))).bfloat16().to(s.device).double()
        loss = (o.double() * do).sum() + (s.double() * ds).sum()
        grads[side] = torch.autograd.grad(loss, list(x.values()))
    for od, oh in zip(outs["cuda"], outs["host"]):
        assert od.shape == oh.shape and rel(od.detach().double().cpu().numpy(), oh.detach().numpy()) < 1e-2, name
    for n, gd, gh in zip(dev, grads["cuda"], grads["host"]):
        assert gd.device.type == "cuda" and gd.dtype == dev[n].dtype, n
        tol = 1e-2 if dev[n].dtype == torch.bfloat16 else LEAF_TOL[n]  # bf16 gradients of bf16 leaves
        assert rel(gd.double().cpu().numpy(), gh.numpy()) < tol, (name, n)


def test_training_step_captured_in_a_cuda_graph_replays_the_eager_gradients(rng):
    """Forward and backward of chunk_kda captured whole in a CUDA graph (workspace from the stream-ordered
    pool, no host synchronisation): a replay on new inputs gives the gradients of an eager step."""
    from cula.kda import chunk_kda

    B, T, H, K, V = 2, 100, 2, 64, 64
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32)).cuda()  # noqa: E731
    make = lambda: dict(q=t(B, T, H, K).bfloat16(), k=t(B, T, H, K).bfloat16(), v=t(B, T, H, V).bfloat16(),  # noqa: E731
                        g=t(B, T, H, K), beta=t(B, T, H))
    static = {n: x.requires_grad_() for n, x in make().items()}
    wo = t(B, T, H, V)

    def step(x):
        o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, A_log=torch.zeros(H, device="cuda"), lower_bound=-5.0,
                         safe_gate=True, use_beta_sigmoid_in_kernel=True)
        return torch.autograd.grad((o.float() * wo).sum(), list(x.values()))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static)  # warm-up outside the capture (allocator pools, kernel attributes)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static)
    fresh = make()
    with torch.no_grad():
        for n, x in fresh.items():
            static[n].copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    eager = step({n: x.clone().requires_grad_() for n, x in fresh.items()})
    for n, c, e in zip(static, captured, eager):
        assert torch.equal(c, e), n
