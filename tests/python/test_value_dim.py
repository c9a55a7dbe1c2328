"""value_dim: a chunked forward over values extended by zero columns without the copy (context
parallelism's pass over the identity state's columns). On every row that takes the call, o and the
final states equal those of the same call on v concatenated with zero columns, bit for bit (where
both calls run on one row), and the float64 reference's, with the outputs poisoned first; a
value_dim below v's V is refused naming it."""

import numpy as np
import pytest
from cases import family_arrays, offsets, state_shape
from conftest import rel

from cula import CulaError, ops

torch = pytest.importorskip("torch", reason="torch is not installed")
CUDA = torch.cuda.is_available() and ops._lib.LIB.cula_cuda_device_count() > 0


def _inputs(rng, family, K, V, extra, seqlens, layout, dtype, device):
    H, HV = 2, 4
    B, T = (1, sum(seqlens)) if seqlens else (2, 150)
    a = family_arrays(rng, family, B, T, H, HV, K, V, l2norm=True)
    d = {n: torch.from_numpy(x).to(device) for n, x in a.items()}
    for n in ("q", "k", "v"):
        d[n] = d[n].to(dtype)
    N = len(seqlens) if seqlens else B
    h0 = rng.standard_normal(state_shape(N, HV, K, V + extra, layout)).astype(np.float32) * 0.5
    d["initial_state"] = torch.from_numpy(h0).to(device)
    cu = torch.from_numpy(offsets(seqlens)).to(device) if seqlens else None
    return d, cu, dict(use_qk_l2norm_in_kernel=True, output_final_state=True, state_layout=layout, cu_seqlens=cu)


def _both(d, kw, family, V, extra, backend, out_dtype):
    """(o, final, kernel) of the value_dim call and of the call on concatenated zeros."""
    results = []
    for extended in (True, False):
        v = d["v"]
        if not extended:
            v = torch.cat([v, v.new_zeros(*v.shape[:3], extra)], dim=-1)
        out = torch.full((*v.shape[:3], V + extra), float("nan"), dtype=out_dtype, device=v.device)
        o, fin = ops.chunk_fwd(family, **{**d, "v": v}, out=out, backend=backend,
                               value_dim=V + extra if extended else None, **kw)
        results.append((o, fin, ops.last_kernel()))
    return results


HOST_CASES = [
    ("kda", 16, 8, 16, [5, 0, 70, 1], "k_last"),
    ("gdn", 16, 12, 16, None, "k_first"),
    ("gla", 8, 8, 8, [65, 3], "k_last"),
    ("simple_gla", 16, 4, 16, None, "k_last"),
    ("lightning", 8, 8, 8, [9, 64], "k_first"),
]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("family,K,V,extra,seqlens,layout", HOST_CASES, ids=[c[0] for c in HOST_CASES])
def test_host_rows_read_columns_past_v_as_zeros(rng, backend, family, K, V, extra, seqlens, layout):
    dtype = torch.float32 if backend == "cpu" else torch.float64
    d, _, kw = _inputs(rng, family, K, V, extra, seqlens, layout, dtype, "cpu")
    (o1, f1, k1), (o2, f2, k2) = _both(d, kw, family, V, extra, backend, dtype)
    assert k1 == k2 == backend
    assert torch.isfinite(o1).all(), "unwritten output"
    assert torch.equal(o1, o2) and torch.equal(f1, f2)


def test_value_dim_below_v_is_refused(rng):
    d, _, kw = _inputs(rng, "kda", 8, 8, 0, None, "k_last", torch.float32, "cpu")
    with pytest.raises(CulaError, match="argument 'value_dim'"):
        ops.chunk_fwd("kda", **d, value_dim=4, **kw)


# (family, input dtype, K, V, extra columns, seqlens, backend, the row expected)
GPU_CASES = [
    ("kda", torch.bfloat16, 128, 128, 128, [100, 0, 257, 1], "auto", "cuda_mma"),
    ("kda", torch.float32, 64, 64, 64, None, "auto", "cuda_mma"),  # (through the engine's bf16 copy)
    ("gdn", torch.float16, 128, 64, 128, [70, 130], "auto", "cuda_mma"),
    ("gla", torch.bfloat16, 64, 64, 64, None, "auto", "cuda_mma"),
    ("simple_gla", torch.bfloat16, 128, 128, 128, [300, 5], "auto", "cuda"),  # (the fused engine declines it)
    ("lightning", torch.float16, 64, 64, 64, None, "auto", "cuda"),
    ("kda", torch.float32, 64, 36, 64, [40, 0, 77], "cuda_fp32", "cuda"),  # the recurrent kernel
    ("gdn", torch.bfloat16, 128, 40, 88, None, "auto", "cuda"),  # V + extra not a multiple of 64
]


@pytest.mark.sanitize
@pytest.mark.skipif(not CUDA, reason="the CUDA rows need a CUDA device")
@pytest.mark.parametrize("family,dtype,K,V,extra,seqlens,backend,row", GPU_CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-V{c[3]}+{c[4]}-{c[7]}" for c in GPU_CASES])
def test_cuda_rows_read_columns_past_v_as_zeros(rng, family, dtype, K, V, extra, seqlens, backend, row):
    d, _, kw = _inputs(rng, family, K, V, extra, seqlens, "k_last", dtype, "cuda")
    (o1, f1, k1), (o2, f2, k2) = _both(d, kw, family, V, extra, backend, torch.float32)
    torch.cuda.synchronize()
    assert k1 == row, k1
    assert torch.isfinite(o1).all(), "unwritten output"
    if k2 == k1:  # (else the concatenated call went to a faster row: V + extra a multiple of 64)
        assert torch.equal(o1, o2) and torch.equal(f1, f2)
    # and the result is the function's: the float64 reference on the concatenated values
    host = {n: x.cpu().double() if n in ("q", "k", "v") else x.cpu() for n, x in d.items()}
    host["v"] = torch.cat([host["v"], host["v"].new_zeros(*host["v"].shape[:3], extra)], dim=-1)
    cu = kw["cu_seqlens"]
    ref, _ = ops.chunk_fwd(family, **host, **{**kw, "cu_seqlens": None if cu is None else cu.cpu()}, backend="reference")
    assert rel(o1.cpu().numpy(), ref.numpy()) < 8e-3  # (SPEC: 16-bit inputs and operands)
