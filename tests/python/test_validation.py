"""SPEC §4 through Python: each bad input raises CulaError naming the argument, what was
expected and what was given; outputs given by the caller stay untouched."""

import numpy as np
import pytest

import cula


def base(rng, family="kda", B=2, T=9, H=2, K=8, V=4):
    f = np.float32
    d = dict(q=rng.standard_normal((B, T, H, K)).astype(f), k=rng.standard_normal((B, T, H, K)).astype(f),
             v=rng.standard_normal((B, T, H, V)).astype(f))
    if family == "kda":
        d["g"] = -rng.uniform(0.01, 0.5, (B, T, H, K)).astype(f)
        d["beta"] = rng.uniform(0.1, 0.9, (B, T, H)).astype(f)
    return d


def call(d, **kw):
    d = dict(d)
    return cula.chunk_kda(d.pop("q"), d.pop("k"), d.pop("v"), d.pop("g"), d.pop("beta"), **d, **kw)


RULES = [
    ("q_ndim", lambda d, r: d.update(q=d["q"][0]), {}, ["'q'", "4-D"]),
    ("k_shape", lambda d, r: d.update(k=d["k"][:, :, :, :4].copy()), {}, ["'k'", "expected shape"]),
    ("q_dtype", lambda d, r: d.update(q=d["q"].astype(np.int32)), {}, ["'q'", "floating-point", "int32"]),
    ("v_heads", lambda d, r: d.update(v=np.ones((2, 9, 3, 4), np.float32)), {}, ["'v'", "divisible", "HV = 3"]),
    ("g_shape", lambda d, r: d.update(g=d["g"][..., 0].copy()), {}, ["'g'", "[B, T, HV, K]"]),
    ("beta_shape", lambda d, r: d.update(beta=d["beta"][:, :3].copy()), {}, ["'beta'", "[B, T, HV]"]),
    ("cu_batch", lambda d, r: d.update(cu_seqlens=np.array([0, 4, 9], np.int32)), {}, ["'q'", "batch size 1"]),
    ("cu_rank", lambda d, r: d.update(cu_seqlens=np.array([[0, 4, 9]], np.int32)), {}, ["'cu_seqlens'", "1-D", "[1, 3]"]),
    ("state_shape", lambda d, r: d.update(initial_state=np.zeros((2, 2, 8, 4), np.float32)), {}, ["'initial_state'", "K-last"]),
    ("state_dtype", lambda d, r: d.update(initial_state=np.zeros((2, 2, 4, 8), np.float16)), {}, ["'initial_state'", "float16"]),
    ("lower_bound", lambda d, r: d.update(A_log=np.zeros(2, np.float32)),
     dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-7.0), ["'lower_bound'", "[-5, 0)", "-7"]),
    ("A_log_missing", lambda d, r: None, dict(use_gate_in_kernel=True), ["'A_log'", "lower_bound is None"]),
    ("neg_eig", lambda d, r: None, dict(allow_neg_eigval=True), ["'allow_neg_eigval'"]),
    ("scale_type", lambda d, r: None, dict(scale="big"), ["'scale'", "str"]),
    ("list_input", lambda d, r: d.update(q=[[1.0]]), {}, ["'q'", "list"]),
    ("layout", lambda d, r: None, dict(state_layout="v_first"), ["'state_layout'", "v_first"]),
    ("chunk_size", lambda d, r: None, dict(chunk_size=0), ["'chunk_size'", "0"]),
    ("chunk_size_range", lambda d, r: None, dict(chunk_size=2 ** 40), ["'chunk_size'", "32-bit", str(2 ** 40)]),
]


@pytest.mark.parametrize("name,mutate,kw,fragments", RULES, ids=[r[0] for r in RULES])
def test_bad_input_is_named(rng, name, mutate, kw, fragments):
    d = base(rng)
    mutate(d, rng)
    with pytest.raises(cula.CulaError) as e:
        call(d, **kw)
    for f in fragments:
        assert f in str(e.value), str(e.value)


def test_cu_seqlens_rules(rng):
    d = base(rng, B=1)
    for cu, frag in [([1, 4, 9], "cu_seqlens[0] == 0"), ([0, 5, 4, 9], "non-decreasing"), ([0, 4, 8], "== T = 9")]:
        with pytest.raises(cula.CulaError, match="cu_seqlens") as e:
            call(d, cu_seqlens=np.array(cu, np.int64))
        assert frag in str(e.value)


def test_pool_index_out_of_range_leaves_pool_and_out_untouched(rng):
    d = base(rng)
    pool = rng.standard_normal((3, 2, 4, 8)).astype(np.float32)
    before = pool.copy()
    out = np.full((2, 9, 2, 4), np.nan, np.float32)
    with pytest.raises(cula.CulaError, match="state_indices") as e:
        call(d, state_pool=pool, state_indices=np.array([0, 3], np.int32), out=out)
    assert "< pool size P = 3" in str(e.value)
    assert np.array_equal(pool, before)
    assert np.isnan(out).all()


def test_decode_rules(rng):
    d = base(rng, B=3, T=1)
    pool = np.zeros((4, 2, 4, 8), np.float32)
    with pytest.raises(cula.CulaError, match="num_accepted_tokens"):
        cula.decode(d["q"], d["k"], d["v"], pool, g=d["g"], beta=d["beta"], state_indices=np.array([0, 1, 2], np.int32),
                    num_accepted_tokens=np.ones(3, np.int32))
    with pytest.raises(cula.CulaError, match="state_pool"):
        cula.decode(d["q"], d["k"], d["v"], np.zeros((2, 2, 4, 8), np.float32), g=d["g"], beta=d["beta"])


def test_unsupported_device_path_is_a_clear_error():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA dispatch error can only be seen on a GPU machine")
    x = torch.randn(1, 4, 1, 8, device="cuda")  # K = 8: no CUDA kernel takes it
    with pytest.raises(cula.CulaUnsupportedError, match="K in"):
        cula.chunk_gla(x, x, torch.randn(1, 4, 1, 8, device="cuda"), -torch.rand(1, 4, 1, 8, device="cuda"))


def test_read_only_outputs_are_refused(rng):
    d = base(rng)
    frozen = lambda a: np.frombuffer(a.tobytes(), a.dtype).reshape(a.shape)  # noqa: E731  read-only, like bytes
    out = frozen(np.zeros((2, 9, 2, 4), np.float32))
    with pytest.raises(cula.CulaError, match="argument 'out': expected a writeable array"):
        call(d, out=out)
    assert not out.any()
    pool = frozen(rng.standard_normal((3, 2, 4, 8)).astype(np.float32))
    before = pool.copy()
    with pytest.raises(cula.CulaError, match="argument 'state_pool': expected a writeable array"):
        cula.decode(d["q"][:, :1], d["k"][:, :1], d["v"][:, :1], pool, g=d["g"][:, :1], beta=d["beta"][:, :1])
    assert np.array_equal(pool, before)
    q_frozen = frozen(d["q"])  # inputs may be read-only
    o, _ = call({**d, "q": q_frozen})
    assert np.isfinite(o).all()


def test_written_fields_are_the_headers_non_const_tensors():
    """cula._lib.WRITTEN (checked for writeable arrays) lists exactly the `cula_tensor*` members
    that cula.h does not declare const."""
    import pathlib
    import re

    header = pathlib.Path(__file__).resolve().parents[2] / "include" / "cula" / "cula.h"
    if not header.exists():
        pytest.skip("cula.h is not beside this test (installed package only)")
    text = header.read_text()
    written = set(re.findall(r"^\s*cula_tensor\*\s+(\w+);", text, re.M))
    read = set(re.findall(r"^\s*const cula_tensor\*\s+(\w+);", text, re.M))
    assert written and read and not written & read
    assert cula._lib.WRITTEN == written


def test_cuda_kernels_input_rules_are_named(rng):
    """What the CUDA forward kernels need beyond validation (offsets and slot indices on the device,
    contiguous parameters, no float64) is refused naming the argument, whichever row would run."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA kernels' input rules can only be seen on a GPU machine")
    T, H, K, V = 96, 2, 64, 64
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32)).cuda()  # noqa: E731
    q, k, v = t(1, T, H, K).bfloat16(), (t(1, T, H, K) * K ** -0.5).bfloat16(), t(1, T, H, V).bfloat16()
    gla_g = -torch.rand(1, T, H, K, device="cuda") * 0.1
    cu = torch.tensor([0, 40, 96], dtype=torch.int32)
    with pytest.raises(cula.CulaError, match="argument 'cu_seqlens'.*device of q"):
        cula.chunk_gla(q, k, v, gla_g, cu_seqlens=cu)  # host offsets: no kernel may read them
    spread = torch.tensor([0, 7, 40, 7, 96, 7], dtype=torch.int32, device="cuda")[::2]
    with pytest.raises(cula.CulaError, match="argument 'cu_seqlens'.*contiguous"):
        cula.chunk_gla(q, k, v, gla_g, cu_seqlens=spread)
    o, _ = cula.chunk_gla(q, k, v, gla_g, cu_seqlens=cu.cuda())  # the same offsets on the device run
    assert torch.isfinite(o.float()).all()
    decay = torch.rand(2 * H, device="cuda")[::2]
    with pytest.raises(cula.CulaError, match="argument 'decay'.*contiguous"):
        cula.chunk_lightning(q, k, v, decay)
    kda = dict(g=t(1, T, H, K), beta=t(1, T, H), use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
               use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, dt_bias=t(H * K))
    with pytest.raises(cula.CulaError, match="argument 'A_log'.*contiguous"):
        cula.chunk_fwd("kda", q, k, v, A_log=t(2 * H)[::2], **kda)
    with pytest.raises(cula.CulaError, match="argument 'q'.*float64 runs on host tensors"):
        cula.chunk_fwd("kda", q.double(), k.double(), v.double(), A_log=t(H), **kda)


def test_torch_cu_seqlens_of_another_rank_is_named(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    d = {n: torch.from_numpy(x) for n, x in base(rng, B=1).items()}
    with pytest.raises(cula.CulaError, match="argument 'cu_seqlens': expected a 1-D tensor"):
        call(d, cu_seqlens=torch.tensor([[0, 4, 9]], dtype=torch.int32))


def test_intermediate_states_into_a_caller_buffer(rng):
    """A caller's intermediate-state buffer (poisoned) is written whole, and equals the library's own."""
    d = base(rng, T=70)
    kw = dict(output_final_state=True, return_intermediate_states=True, backend="cpu")
    o, s, own = cula.chunk_fwd("kda", **d, **kw)
    buf = np.full(own.shape, np.nan, dtype=own.dtype)
    o2, s2, got = cula.chunk_fwd("kda", **d, intermediate_states_out=buf, **kw)
    assert got is buf and np.isfinite(buf).all()
    np.testing.assert_array_equal(buf, own)
    np.testing.assert_array_equal(o2, o)
    with pytest.raises(cula.CulaError, match="intermediate_states"):
        cula.chunk_fwd("kda", **d, intermediate_states_out=buf[:, :1], **kw)
