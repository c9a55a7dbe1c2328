"""The FLA drop-ins take and refuse FLA's arguments as FLA 0.6.0 does: chunk_size per op (FLA's
exception type and message), A_log / dt_bias in any shape holding their values, T = 0, a NaN scale,
arguments of the wrong kind. Host arrays run everywhere; the CUDA cases skip without a
device."""

import numpy as np
import pytest
from conftest import rel

import cula
import cula.delta_rule
import cula.gated_delta_rule
import cula.gla
import cula.kda
import cula.lightning_attn
import cula.simple_gla

torch = pytest.importorskip("torch", reason="torch is not installed")
HAS_CUDA = torch.cuda.is_available() and cula._lib.LIB.cula_cuda_device_count() > 0
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device"))]


def _kda_inputs(rng, device, B=1, T=40, H=2, K=64, V=64, dtype=None):
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(device)  # noqa: E731
    dt = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    return (t(B, T, H, K).to(dt), (t(B, T, H, K) * K ** -0.5).to(dt), t(B, T, H, V).to(dt), t(B, T, H, K),
            torch.rand(B, T, H, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_size_accepted_and_refused_as_fla(rng, device):
    q, k, v, g, beta = _kda_inputs(rng, device)
    base = cula.kda.chunk_kda(q, k, v, -g.abs(), beta)[0]
    same = cula.kda.chunk_kda(q, k, v, -g.abs(), beta, chunk_size=32)[0]
    assert torch.equal(base, same), "KDA's chunk_size=32 computes the same function (cula runs 64-token chunks)"
    with pytest.raises(ValueError, match=r"^`chunk_size` must be either 32 or 64 for KDA, got 16\.$"):
        cula.kda.chunk_kda(q, k, v, -g.abs(), beta, chunk_size=16)
    gs = -g[..., 0].abs()
    for cs in (16, 32, 64):
        cula.gated_delta_rule.chunk_gated_delta_rule(q, k, v, gs, beta, chunk_size=cs)
    with pytest.raises(ValueError, match=r"^`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got 128\.$"):
        cula.gated_delta_rule.chunk_gated_delta_rule(q, k, v, gs, beta, chunk_size=128)
    cula.simple_gla.chunk_simple_gla(q, k, v, gs, chunk_size=128)
    with pytest.raises(ValueError, match=r"^`chunk_size` must be a power of 2, got 48\.$"):
        cula.simple_gla.chunk_simple_gla(q, k, v, gs, chunk_size=48)
    with pytest.raises(ValueError, match=r"^`chunk_size` must be a power of 2, got 48\.$"):
        cula.lightning_attn.chunk_lightning_attn(q, k, v, 1, 4, chunk_size=48)
    with pytest.raises(TypeError, match="chunk_size"):  # FLA's chunk_gla takes no chunk_size at all
        cula.gla.chunk_gla(q, k, v, -g.abs(), chunk_size=64)


@pytest.mark.parametrize("device", DEVICES)
def test_kda_chunk_size_32_intermediate_states_follow_it(rng, device):
    """Intermediate states are one per chunk: with chunk_size=32 they are FLA's 32-token ones."""
    q, k, v, g, beta = _kda_inputs(rng, device, T=70)
    o, _, inter = cula.kda.chunk_kda(q, k, v, -g.abs(), beta, chunk_size=32, return_intermediate_states=True)
    assert inter.shape[1] == 3, inter.shape
    _, _, inter64 = cula.kda.chunk_kda(q, k, v, -g.abs(), beta, return_intermediate_states=True)
    assert inter64.shape[1] == 2
    # state before chunk 2 of 32 tokens (64 tokens in) = state before chunk 1 of 64 tokens
    assert rel(inter[:, 2].float().cpu().numpy(), inter64[:, 1].float().cpu().numpy()) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_intermediate_states_with_offsets_where_q_lives(rng, device):
    """Packed sequences with return_intermediate_states, offsets on q's device (on CUDA: the count
    from cu_seqlens_cpu, or from one copy to the host): one state per chunk of each sequence, the
    same as the host reference's, and the same with or without cu_seqlens_cpu."""
    seqlens = [70, 0, 5, 64, 130]
    q, k, v, g, beta = _kda_inputs(rng, device, T=sum(seqlens))
    g = -g.abs() * 0.1
    cpu_cu = torch.tensor(np.cumsum([0] + seqlens), dtype=torch.int32)
    cu = cpu_cu.to(device)
    o, s, inter = cula.kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True,
                                     return_intermediate_states=True)
    assert inter.shape[1] == sum((n + 63) // 64 for n in seqlens), inter.shape
    o2, s2, inter2 = cula.kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cpu_cu,
                                        output_final_state=True, return_intermediate_states=True)
    assert torch.equal(o, o2) and torch.equal(s, s2) and torch.equal(inter, inter2)
    ref = cula.chunk_fwd("kda", *(x.float().cpu() for x in (q, k, v, g, beta)), cu_seqlens=cpu_cu,
                         output_final_state=True, return_intermediate_states=True, state_layout="k_first",
                         backend="reference")
    assert rel(inter.float().cpu().numpy(), ref[2].float().numpy()) < 5e-3


@pytest.mark.parametrize("device", DEVICES)
def test_gate_parameters_in_any_shape_holding_their_values(rng, device):
    q, k, v, g, beta = _kda_inputs(rng, device)
    H, K = q.shape[2], q.shape[3]
    A_log = torch.rand(H, device=device)
    dt_bias = torch.randn(H * K, device=device) * 0.1
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
    flat = cula.kda.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, **kw)[0]
    shaped = cula.kda.chunk_kda(q, k, v, g, beta, A_log=A_log.view(1, 1, H, 1), dt_bias=dt_bias.view(H, K), **kw)[0]
    assert torch.equal(flat, shaped)
    gs = g[..., 0]
    gflat = cula.gated_delta_rule.chunk_gated_delta_rule(q, k, v, gs, beta, use_gate_in_kernel=True, A_log=A_log,
                                                         dt_bias=dt_bias[:H])[0]
    gshaped = cula.gated_delta_rule.chunk_gated_delta_rule(q, k, v, gs, beta, use_gate_in_kernel=True,
                                                           A_log=A_log.view(1, H), dt_bias=dt_bias[:H].view(H, 1))[0]
    assert torch.equal(gflat, gshaped)
    with pytest.raises(cula.CulaError, match="A_log"):  # a count that is not HV still fails, naming it
        cula.kda.chunk_kda(q, k, v, g, beta, A_log=torch.rand(H + 1, device=device), **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_sequence_returns_empty_outputs(rng, device):
    """T = 0: an empty o, and the final state is the initial one (zeros without one)."""
    q, k, v, g, beta = _kda_inputs(rng, device, T=0)
    h0 = torch.randn(1, 2, 64, 64, device=device)
    o, s = cula.kda.chunk_kda(q, k, v, -g.abs(), beta, initial_state=h0, output_final_state=True)
    assert o.shape == (1, 0, 2, 64) and torch.equal(s, h0)
    o, s = cula.gated_delta_rule.chunk_gated_delta_rule(q, k, v, -g[..., 0].abs(), beta, output_final_state=True)
    assert o.shape == (1, 0, 2, 64) and s.shape == (1, 2, 64, 64) and not s.abs().any()


def test_nan_scale_is_refused(rng):
    q, k, v, g, beta = _kda_inputs(rng, "cpu")
    with pytest.raises(cula.CulaError, match=r"argument 'scale': expected a finite number.*got nan"):
        cula.kda.chunk_kda(q, k, v, -g.abs(), beta, scale=float("nan"))


def test_arguments_of_the_wrong_kind_are_refused_naming_them(rng):
    """Inputs that used to fail deep inside a call (a torch cast error, an attribute error) or give
    a silently non-finite output are refused up front with the argument named."""
    q, k, v, g, beta = _kda_inputs(rng, "cpu")
    g = -g.abs()
    A_log, dt_bias = torch.rand(2), torch.rand(2 * 64)
    kw = dict(use_gate_in_kernel=True, lower_bound=-5.0)
    refusals = [  # (call, argument named)
        (lambda: cula.kda.chunk_kda(q, k, v, g, beta, scale=1e40), "scale"),  # finite, but not in float32
        (lambda: cula.kda.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                                    lower_bound=float("-inf")), "lower_bound"),
        (lambda: cula.kda.chunk_kda(q, k, v, g, beta, A_log=-5.0, dt_bias=dt_bias, **kw), "A_log"),
        (lambda: cula.kda.chunk_kda(q, k, v, g, beta, A_log=A_log.numpy(), dt_bias=dt_bias, **kw), "A_log"),
        (lambda: cula.kda.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=True, **kw), "dt_bias"),
        (lambda: cula.kda.chunk_kda(q, k, v, g, beta, safe_gate=torch.ones(3)), "safe_gate"),
        (lambda: cula.kda.chunk_kda(q, k, v, g.numpy(), beta), "g"),
        (lambda: cula.lightning_attn.chunk_lightning_attn(None, k, v, 1, 4), "q"),
        (lambda: cula.delta_rule.chunk_delta_rule(q, k, None, beta), "v"),
        (lambda: cula.gla.fused_recurrent_gla(q, None, v), "k"),
    ]
    for call, name in refusals:
        with pytest.raises(cula.CulaError, match=f"argument '{name}'"):
            call()
    with pytest.raises(ValueError, match="`chunk_size` must be a power of 2"):  # FLA's message
        cula.simple_gla.chunk_simple_gla(q, k, v, g[..., 0], chunk_size=torch.tensor(64))
    with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64"):
        cula.kda.chunk_kda(q, k, v, g, beta, chunk_size=64.0)
    # a truth value of another type is taken as FLA takes it
    o1 = cula.kda.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=1)[0]
    o2 = cula.kda.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    assert torch.equal(o1, o2)


def test_level1_arguments_of_the_wrong_kind_or_rank_are_refused_naming_them(rng):
    """Level 1 reads shapes to pick the family and check states: a missing or misshapen array, a
    number where a tensor belongs, is a CulaError naming the argument, not an attribute or index error."""
    q, k, v, g, beta = _kda_inputs(rng, "cpu")
    g = -g.abs()
    pool = torch.zeros(4, 2, 64, 64)
    refusals = [
        (lambda: cula.cula_kda(q, k, v, None, beta), "g"),
        (lambda: cula.cula_kda(q, k, v[..., 0], g, beta), "v"),
        (lambda: cula.cula_kda(q, k, v, g, beta, cu_seqlens=torch.tensor(40, dtype=torch.int32)), "cu_seqlens"),
        (lambda: cula.cula_lightning(q, k, None, torch.rand(2)), "V"),
        (lambda: cula.cula_lightning(q, k, v, torch.rand(2), state_pool=16,
                                     initial_state_indices=torch.tensor([0], dtype=torch.int32)), "state_pool"),
        (lambda: cula.cula_decode(q[:, :1], k[:, :1], v[:, :1], pool, state_indices=torch.tensor([1], dtype=torch.int32),
                                  g=g[:, :1], beta=beta[:, :1], dt_bias=32), "dt_bias"),
    ]
    for call, name in refusals:
        with pytest.raises(cula.CulaError, match=f"argument '{name}'"):
            call()
