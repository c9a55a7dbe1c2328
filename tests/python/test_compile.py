"""torch.compile(fullgraph=True) through every public entry that serving engines call: the FLA
drop-ins and Level 1 trace into the registered torch ops without a graph break, and the compiled
function gives the eager result. Host tensors everywhere torch is installed, CUDA tensors on a GPU
machine."""

import pytest

torch = pytest.importorskip("torch")

import cula  # noqa: E402
from cula.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402
from cula.gla import chunk_gla  # noqa: E402
from cula.kda import chunk_kda, fused_recurrent_kda  # noqa: E402
from cula.lightning_attn import chunk_lightning_attn, fused_recurrent_lightning_attn  # noqa: E402
from cula.simple_gla import chunk_simple_gla  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and cula.backend_for("chunk_fwd", "cuda") != "none" else [])
B, T, H, K = 2, 70, 2, 64


def _inputs(device, T=T, B=B):
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    # unit-norm q and k: the delta rule's state stays bounded (|1 - beta |k|^2| <= 1)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dt) for _ in range(2))
    v = torch.randn(B, T, H, K, device=device).to(dt)
    return dict(q=q, k=k, v=v, g_kda=(-torch.rand(B, T, H, K, device=device) * 0.3), g_raw=torch.randn(B, T, H, K, device=device),
                g_scalar=(-torch.rand(B, T, H, device=device) * 0.3), beta=torch.rand(B, T, H, device=device),
                A_log=torch.rand(H, device=device), dt_bias=torch.randn(H * K, device=device) * 0.1,
                h0=torch.randn(B, H, K, K, device=device))


def _same(eager, compiled):
    eager = eager if isinstance(eager, (tuple, list)) else (eager,)
    compiled = compiled if isinstance(compiled, (tuple, list)) else (compiled,)
    assert len(eager) == len(compiled)
    for e, c in zip(eager, compiled):
        if e is None:
            assert c is None
            continue
        assert c.shape == e.shape and c.dtype == e.dtype
        assert torch.isfinite(e).all(), "non-finite eager result: the inputs are not a fair test"
        assert torch.equal(c, e), float((c.float() - e.float()).abs().max())


def _check(fn, *args):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    _same(fn(*args), compiled(*args))


ENTRIES = {
    "chunk_kda": lambda d: (lambda q, k, v, g, b: chunk_kda(q, k, v, g, b, output_final_state=True), d["g_kda"]),
    "chunk_kda_gate_in_kernel": lambda d: (
        lambda q, k, v, g, b: chunk_kda(q, k, v, g, b, A_log=d["A_log"], dt_bias=d["dt_bias"], use_gate_in_kernel=True,
                                        safe_gate=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=True, initial_state=d["h0"],
                                        output_final_state=True), d["g_raw"]),
    "fused_recurrent_kda": lambda d: (
        lambda q, k, v, g, b: fused_recurrent_kda(q, k, v, g, b, output_final_state=True), d["g_kda"]),
    "chunk_gated_delta_rule": lambda d: (
        lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True), d["g_scalar"]),
    "fused_recurrent_gated_delta_rule": lambda d: (
        lambda q, k, v, g, b: fused_recurrent_gated_delta_rule(q, k, v, g, beta=b, output_final_state=True),
        d["g_scalar"]),
    "chunk_gla": lambda d: (lambda q, k, v, g, b: chunk_gla(q, k, v, g, output_final_state=True), d["g_kda"]),
    "chunk_simple_gla": lambda d: (
        lambda q, k, v, g, b: chunk_simple_gla(q, k, v, g, output_final_state=True), d["g_scalar"]),
    "chunk_lightning_attn": lambda d: (
        lambda q, k, v, g, b: chunk_lightning_attn(q, k, v, layer_idx=1, num_layers=4, output_final_state=True),
        d["g_scalar"]),
    "fused_recurrent_lightning_attn": lambda d: (
        lambda q, k, v, g, b: fused_recurrent_lightning_attn(q, k, v, layer_idx=1, num_layers=4), d["g_scalar"]),
    "cula_kda": lambda d: (lambda q, k, v, g, b: cula.cula_kda(q, k, v, g, b, output_final_state=True), d["g_kda"]),
    "cula_kda_gdn": lambda d: (lambda q, k, v, g, b: cula.cula_kda(q, k, v, g, b), d["g_scalar"]),
    "cula_lightning": lambda d: (
        lambda q, k, v, g, b: cula.cula_lightning(q, k, v, d["A_log"], output_final_state=True), d["g_scalar"]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_entry_compiles_fullgraph_and_matches_eager(rng, device, entry):
    d = _inputs(device)
    fn, g = ENTRIES[entry](d)
    _check(fn, d["q"], d["k"], d["v"], g, d["beta"])


@pytest.mark.skipif("cuda" not in DEVICES, reason="float32 inputs take their own kernel on CUDA only")
@pytest.mark.parametrize("entry", ["fused_recurrent_kda", "fused_recurrent_gated_delta_rule"])
def test_float32_fused_recurrent_compiles_fullgraph_on_cuda(rng, entry):
    """float32 q, k, v in FLA's fused_recurrent drop-ins run the float32 recurrent kernel (backend
    "cuda_fp32") through the registered op: fullgraph, the same as eager."""
    d = _inputs("cuda")
    d.update({n: d[n].float() for n in "qkv"})
    fn, g = ENTRIES[entry](d)
    _check(fn, d["q"], d["k"], d["v"], g, d["beta"])
    assert cula.last_kernel() == "cuda", cula.last_kernel()


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_drop_in_compiles(rng, device):
    d = _inputs(device, B=1, T=150)
    cu = torch.tensor([0, 33, 33, 150], dtype=torch.int32, device=device)
    _check(lambda q, k, v, g, b: chunk_kda(q, k, v, g, b, cu_seqlens=cu, output_final_state=True),
           d["q"], d["k"], d["v"], d["g_kda"], d["beta"])


@pytest.mark.parametrize("device", DEVICES)
def test_one_token_fused_recurrent_compiles_and_leaves_the_state(rng, device):
    """fused_recurrent_kda at T = 1 with initial_state and no in-place update (on CUDA the decode
    kernel through cula::decode_to): fullgraph, the same as eager, initial_state unchanged."""
    N = 3
    d = _inputs(device, B=N, T=1)
    h0 = torch.randn(N, H, K, K, device=device)
    keep = h0.clone()

    def step(q, k, v, g, b, h0):
        return fused_recurrent_kda(q, k, v, g, b, initial_state=h0, output_final_state=True)

    with torch.no_grad():
        o, ht = step(d["q"], d["k"], d["v"], d["g_kda"], d["beta"], h0)
        torch._dynamo.reset()
        oc, htc = torch.compile(step, fullgraph=True, backend="aot_eager")(d["q"], d["k"], d["v"], d["g_kda"],
                                                                           d["beta"], h0)
    _same(o, oc)
    _same(ht, htc)
    assert torch.equal(h0, keep)


@pytest.mark.parametrize("device", DEVICES)
def test_serving_decode_compiles_and_updates_the_pool(rng, device):
    """fused_recurrent_kda's serving form: one token per sequence, a state pool updated in place."""
    N, P = 3, 5
    d = _inputs(device, B=N, T=1)
    pool = torch.randn(P, H, K, K, device=device)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)

    def step(q, k, v, g, b, pool):
        return fused_recurrent_kda(q, k, v, g, b, initial_state=pool, ssm_state_indices=idx,
                                   inplace_final_state=True)[0]

    eager_pool, compiled_pool = pool.clone(), pool.clone()
    o = step(d["q"], d["k"], d["v"], d["g_kda"], d["beta"], eager_pool)
    torch._dynamo.reset()
    oc = torch.compile(step, fullgraph=True, backend="aot_eager")(d["q"], d["k"], d["v"], d["g_kda"], d["beta"],
                                                                   compiled_pool)
    _same(o, oc)
    assert torch.equal(compiled_pool, eager_pool) and not torch.equal(eager_pool, pool)


@pytest.mark.parametrize("device", DEVICES)
def test_inductor_compiles_a_layer_around_chunk_kda(rng, device):
    """The default backend (inductor) around a drop-in, as a serving engine compiles a model."""
    d = _inputs(device)

    def layer(q, k, v, g, b):
        o, s = chunk_kda(q.float().to(q.dtype), k, v, g, b, output_final_state=True)
        return o * 2, s

    torch._dynamo.reset()
    _same(layer(d["q"], d["k"], d["v"], d["g_kda"], d["beta"]),
          torch.compile(layer, fullgraph=True)(d["q"], d["k"], d["v"], d["g_kda"], d["beta"]))


BACKWARD_ENTRIES = ("chunk_kda_gate_in_kernel", "chunk_gated_delta_rule", "chunk_gla", "chunk_simple_gla",
                    "chunk_lightning_attn", "cula_kda")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", BACKWARD_ENTRIES)
def test_training_step_compiles_fullgraph_and_matches_eager(rng, device, entry):
    """Forward and backward traced together: the registered op's autograd formula (cula::chunk_bwd)
    is one more node of the graph, and the compiled gradients are the eager ones, bit for bit."""
    d = _inputs(device)
    fn, g = ENTRIES[entry](d)
    leaves = [x.detach().clone().requires_grad_() for x in (d["q"], d["k"], d["v"], g, d["beta"])]
    wo = torch.randn(d["v"].shape, device=device)

    def loss_of(q, k, v, g, b):
        out = fn(q, k, v, g, b)
        o, s = out if isinstance(out, tuple) else (out, None)
        return (o.float() * wo).sum() + (0 if s is None else s.float().square().sum())

    def grads(f):
        return torch.autograd.grad(f(*leaves), [x for x in leaves], allow_unused=True)

    eager = grads(loss_of)
    torch._dynamo.reset()
    compiled = grads(torch.compile(loss_of, fullgraph=True, backend="aot_eager"))
    assert sum(x is not None for x in eager) >= 3  # q, k, v at least
    assert [x is None for x in eager] == [x is None for x in compiled]
    _same([x for x in eager if x is not None], [x for x in compiled if x is not None])
