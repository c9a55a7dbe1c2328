"""The binding's fast path (csrc/binding/fast_call.c, the argument structs packed in C) against its
ctypes packing: the same calls give the same results to the bit and the same errors, and what the
fast path does not take (numpy arrays, other dtypes, other devices) falls back to ctypes."""

import contextlib
import pathlib
import sysconfig

import numpy as np
import pytest

import cula
from cula import _lib, _tensor, ops
from cula.options import Options


def test_fast_call_module_is_built_and_loaded():
    if not (pathlib.Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers on this machine: the build leaves the fast-call module out")
    assert _lib.FAST_CALL is not None, "the build has Python headers but cula did not load _fast_call"
    assert _lib.binding() == "fast_call"
    kinds = sorted(k for k, _, _ in _lib.FAST_ENTRIES.values())
    assert kinds == [0, 1, 2, 3] and all(addr for _, addr, _ in _lib.FAST_ENTRIES.values())


needs_fast = pytest.mark.skipif(_lib.FAST_CALL is None, reason="cula was built without the fast-call module")


class HostTensor:
    """A numpy array behind the attributes the fast-call module reads of a torch tensor."""

    CODES = {np.dtype(np.float32): _lib.FLOAT32, np.dtype(np.float64): _lib.FLOAT64, np.dtype(np.int32): _lib.INT32}

    def __init__(self, a):
        self.a, self.dtype, self.shape = a, a.dtype, tuple(a.shape)
        self.is_cuda, self.is_cpu = False, True

    def stride(self):
        return tuple(st // self.a.itemsize for st in self.a.strides)

    def data_ptr(self):
        return self.a.ctypes.data

    def get_device(self):
        return -1


@needs_fast
def test_fast_call_packs_what_ctypes_packs(rng):
    """The C packing itself, without torch: host arrays behind tensor attributes through the fast
    path give the bits the ctypes packing gives."""
    f32 = np.float32
    q, k = rng.standard_normal((1, 23, 2, 16)).astype(f32), rng.standard_normal((1, 23, 2, 16)).astype(f32)
    v = rng.standard_normal((1, 2, 23, 8)).astype(f32).transpose(0, 2, 1, 3)  # a strided view
    decay, h0 = rng.uniform(0.01, 0.5, 2).astype(f32), rng.standard_normal((2, 2, 16, 8)).astype(f32)
    cu = np.array([0, 9, 23], np.int32)
    o_ref, s_ref = ops.chunk_fwd("lightning", q, k, v, decay=decay, initial_state=h0, cu_seqlens=cu, scale=0.3,
                                 output_final_state=True, state_layout="k_first")
    out, fin = np.full((1, 23, 2, 8), np.nan, f32), np.full((2, 2, 16, 8), np.nan, f32)
    fast = _lib.FAST_CALL
    kind, addr, fields = _lib.FAST_ENTRIES[_lib.ChunkFwdArgs]
    fast.configure(HostTensor, dict(HostTensor.CODES), tuple(f for _, _, f in sorted(_lib.FAST_ENTRIES.values())))
    try:
        arrays = {n: HostTensor(x) for n, x in dict(q=q, k=k, v=v, decay=decay, initial_state=h0, cu_seqlens=cu,
                                                     out=out, final_state=fin).items()}
        opt = Options(scale=0.3, state_layout="k_first").pack("lightning")
        assert fast.call(kind, addr, opt, 64, arrays) == _lib.OK
        # an array the module does not take (a float16 one): nothing called, None
        arrays["decay"] = HostTensor(decay.astype(np.float16))
        out2 = np.full_like(out, np.nan)
        arrays["out"] = HostTensor(out2)
        assert fast.call(kind, addr, opt, 64, arrays) is None and np.isnan(out2).all()
    finally:
        _tensor._FAST = None  # the next torch call configures the module for torch again
    assert np.array_equal(out, o_ref) and np.array_equal(fin, s_ref)


try:
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


@contextlib.contextmanager
def ctypes_only():
    """Every call through the ctypes packing."""
    saved = _tensor._FAST, _lib.FAST_CALL
    _tensor._FAST, _lib.FAST_CALL = None, None
    try:
        yield
    finally:
        _tensor._FAST, _lib.FAST_CALL = saved


@contextlib.contextmanager
def fast_only():
    """Fails the test if a call falls back to the ctypes packing."""
    real = _tensor._pack_tensor

    def refuse(*a, **k):
        raise AssertionError("the call fell back to the ctypes packing")

    _tensor._pack_tensor = refuse
    try:
        yield
    finally:
        _tensor._pack_tensor = real


def t(rng, *shape, scale=1.0, dtype=None, device="cpu"):
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale)
    return x.to(dtype or torch.float32).to(device)


def both_paths(fn):
    """fn() through the fast path and through ctypes; outputs as lists of tensors."""
    with fast_only():
        a = fn()
    with ctypes_only():
        b = fn()
    return a, b


def assert_identical(a, b):
    flat = lambda x: [y for y in (x if isinstance(x, (tuple, list)) else [x]) if y is not None]  # noqa: E731
    fa, fb = flat(a), flat(b)
    assert len(fa) == len(fb) and fa
    for x, y in zip(fa, fb):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.isfinite(x.float()).all()
        assert torch.equal(x, y)


@needs_torch
@needs_fast
@pytest.mark.parametrize("family", ["kda", "gdn", "gla", "simple_gla", "lightning"])
def test_chunk_fwd_same_results_both_paths(rng, family):
    B, T, H, HV, K, V = 1, 37, 2, 4, 16, 8
    q, k = t(rng, B, T, H, K), t(rng, B, T, H, K)
    v = t(rng, B, T, HV, V).transpose(1, 2).contiguous().transpose(1, 2)  # strided view: strides travel as they are
    g = beta = decay = None
    if family in ("kda", "gla"):
        g = -torch.from_numpy(rng.uniform(0.01, 0.3, (B, T, HV, K)).astype(np.float32))
    elif family in ("gdn", "simple_gla"):
        g = -torch.from_numpy(rng.uniform(0.01, 0.3, (B, T, HV)).astype(np.float32))
    else:
        decay = torch.from_numpy(rng.uniform(0.01, 0.5, HV).astype(np.float32))
    if family in ("kda", "gdn"):
        beta = torch.from_numpy(rng.uniform(0.1, 0.9, (B, T, HV)).astype(np.float32))
    cu = torch.tensor([0, 5, 5, 37], dtype=torch.int32)
    h0 = t(rng, 3, HV, K, V)

    def run():
        out = torch.full((B, T, HV, V), float("nan"))
        fin = torch.full((3, HV, K, V), float("nan"))
        res = ops.chunk_fwd(family, q, k, v, g, beta, decay, scale=0.3, initial_state=h0, cu_seqlens=cu,
                            use_qk_l2norm_in_kernel=True, state_layout="k_first", out=out, final_state_out=fin,
                            return_intermediate_states=True, chunk_size=16)
        assert res[0] is out and res[1] is fin
        return res

    assert_identical(*both_paths(run))


@needs_torch
@needs_fast
def test_decode_kda_gate_and_bwd_same_results_both_paths(rng):
    N, T, H, K, V = 3, 2, 2, 16, 8
    q, k, v = t(rng, N, T, H, K), t(rng, N, T, H, K), t(rng, N, T, H, V)
    g = -torch.from_numpy(rng.uniform(0.01, 0.3, (N, T, H, K)).astype(np.float32))
    beta = torch.from_numpy(rng.uniform(0.1, 0.9, (N, T, H)).astype(np.float32))
    pool0 = t(rng, 5, H, V, K)
    idx = torch.tensor([4, -1, 0], dtype=torch.int32)

    def decode():
        pool = pool0.clone()
        o, _ = ops.decode(q, k, v, pool, mode="kda", g=g, beta=beta, state_indices=idx, use_qk_l2norm_in_kernel=True)
        return o, pool

    assert_identical(*both_paths(decode))
    A_log, bias = t(rng, H), t(rng, H * K)
    assert_identical(*both_paths(lambda: ops.kda_gate(g, A_log, bias, lower_bound=-5.0, safe_gate=True)))
    do = t(rng, N, T, H, V)

    def bwd():
        grads = ops.chunk_bwd("kda", q, k, v, g, beta, do, initial_state=pool0[:N].transpose(-1, -2).contiguous(),
                              state_layout="k_first")
        return [grads[n] for n in sorted(grads)]

    assert_identical(*both_paths(bwd))


@needs_torch
@needs_fast
def test_fast_path_errors_match_ctypes(rng):
    q, k = t(rng, 1, 9, 2, 16), t(rng, 1, 9, 2, 16)
    v = t(rng, 1, 9, 3, 8)  # 3 value heads for 2 query heads: the C ABI refuses it
    decay = torch.ones(3)
    msgs = []
    for ctx in (fast_only, ctypes_only):
        with ctx(), pytest.raises(cula.CulaError) as e:
            ops.chunk_fwd("lightning", q, k, v, decay=decay)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "v" in msgs[0]


@needs_torch
@needs_fast
def test_what_the_fast_path_does_not_take_falls_back(rng):
    q, k, v = t(rng, 1, 20, 2, 16), t(rng, 1, 20, 2, 16), t(rng, 1, 20, 2, 8)
    decay = torch.full((2,), 0.2)
    with ctypes_only():
        o_ref, _ = ops.chunk_fwd("lightning", q, k, v, decay=decay, cu_seqlens=np.array([0, 7, 20], np.int64))
    # a numpy cu_seqlens among torch tensors: packed by ctypes, same result
    o, _ = ops.chunk_fwd("lightning", q, k, v, decay=decay, cu_seqlens=np.array([0, 7, 20], np.int64))
    assert torch.equal(o, o_ref)
    # a dtype cula does not know: the fallback names the argument
    with pytest.raises(cula.CulaError, match="argument 'decay'.*int16"):
        ops.chunk_fwd("lightning", q, k, v, decay=torch.ones(2, dtype=torch.int16))
    # a device cula does not know
    with pytest.raises(cula.CulaError, match="argument 'q'.*meta"):
        ops.chunk_fwd("lightning", q.to("meta"), k, v, decay=decay)


@needs_torch
@needs_fast
def test_explain_with_torch_tensors_explains_and_runs_nothing(rng):
    """explain() on torch tensors goes to the op's _explain entry (the fast-call module knows only the
    op's own entry per struct): it names the row, and the outputs it allocates stay unwritten."""
    B, T, H, K = 1, 20, 2, 16
    q, k, v, g, do = (t(rng, B, T, H, K) for _ in range(5))
    beta = torch.rand(B, T, H)
    assert cula.explain("chunk_bwd", "kda", q, k, v, g, beta, do).kernel == "reference"
    assert cula.explain("chunk_fwd", "kda", q, k, v, g, beta).kernel == "cpu"
    grads = {"dq": torch.full((B, T, H, K), float("nan"))}
    ops.chunk_bwd("kda", q, k, v, g, beta, do, grads=grads, _entry=_lib.LIB.cula_chunk_bwd_explain)
    assert torch.isnan(grads["dq"]).all()


@needs_torch
@needs_fast
def test_fast_call_refuses_misuse():
    fc = _lib.FAST_CALL
    kind, addr, _ = _lib.FAST_ENTRIES[_lib.ChunkFwdArgs]
    opt = Options().pack("lightning")
    with pytest.raises(TypeError):
        fc.call(kind, addr, opt, 0)  # no arrays dict
    with pytest.raises(TypeError):
        fc.call(kind, addr, opt[:5], 0, {})  # options of the wrong length
    with pytest.raises(ValueError):
        fc.call(7, addr, opt, 0, {})  # no such entry


@pytest.mark.skipif(torch is None or not torch.cuda.is_available() or _lib.LIB.cula_cuda_device_count() == 0,
                    reason="torch with a CUDA device visible to torch and cula is not available")
@needs_fast
@pytest.mark.parametrize("family", ["gdn", "lightning"])
def test_cuda_chunk_fwd_same_results_both_paths(rng, family):
    B, T, H, K = 2, 300, 4, 128
    q, k, v = (t(rng, B, T, H, K, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    g = beta = decay = None
    if family == "gdn":
        g = -torch.from_numpy(rng.uniform(0.01, 0.3, (B, T, H)).astype(np.float32)).cuda()
        beta = torch.from_numpy(rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32)).cuda()
    else:
        decay = torch.from_numpy(rng.uniform(0.01, 0.5, H).astype(np.float32)).cuda()

    def run():
        out = torch.full((B, T, H, K), float("nan"), dtype=torch.bfloat16, device="cuda")
        o, s = ops.chunk_fwd(family, q, k, v, g, beta, decay, out=out, output_final_state=True,
                             use_qk_l2norm_in_kernel=family == "gdn")
        torch.cuda.synchronize()
        return o, s

    a, b = both_paths(run)
    assert _lib.LIB.cula_last_kernel().decode().startswith("cuda")
    assert_identical(a, b)
