"""ops.cp_correct, context parallelism's carried-state correction in one pass: o = round(ow[..., :V] +
X[h] ow[..., V:]) per token and head. The host row (float64 sums) against numpy; the CUDA kernel
against the host row with the output poisoned first (bf16, fp16, float32 outputs, ow a strided view
of a longer row, a tile that ends inside the tokens); bad arguments named."""

import numpy as np
import pytest
from conftest import rel

from cula import CulaError, CulaUnsupportedError, ops

torch = pytest.importorskip("torch", reason="torch is not installed")
CUDA = torch.cuda.is_available() and ops._lib.LIB.cula_cuda_device_count() > 0


def _inputs(rng, L, HV, V, K, extra=0):
    ow = rng.standard_normal((L, HV, V + K + extra)).astype(np.float32)
    x = (rng.standard_normal((HV, V, K)) * 0.3).astype(np.float32)
    ref = ow[..., :V].astype(np.float64) + np.einsum("hvk,thk->thv", x.astype(np.float64), ow[..., V:V + K].astype(np.float64))
    return ow, x, ref


def test_host_row_matches_numpy(rng):
    ow, x, ref = _inputs(rng, 45, 3, 64, 128)
    o = np.full((45, 3, 64), np.nan, np.float32)
    ops.cp_correct(ow, x, o)
    assert ops.last_kernel() == "cpu"
    assert rel(o, ref) < 1e-6


def test_bad_arguments_are_named(rng):
    ow, x, _ = _inputs(rng, 8, 2, 64, 64)
    o = np.empty((8, 2, 64), np.float32)
    with pytest.raises(CulaError, match="argument 'state'"):
        ops.cp_correct(ow, x[:, :, :32].copy(), o)  # V + K != the columns of ow
    with pytest.raises(CulaError, match="argument 'ow'"):
        ops.cp_correct(ow.astype(np.float64), x, o)
    with pytest.raises(CulaError, match="argument 'o'"):
        ops.cp_correct(ow, x, np.empty((8, 2, 32), np.float32))
    with pytest.raises(CulaError, match="argument 'o'"):
        ops.cp_correct(ow, x, np.empty((8, 2, 64), np.float64))


@pytest.mark.sanitize
@pytest.mark.skipif(not CUDA, reason="the CUDA correction needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("V,K,L,HV", [(128, 128, 77, 3), (64, 128, 77, 3), (128, 64, 77, 3), (64, 64, 400, 400)])
def test_cuda_kernel_matches_the_host_row(rng, dtype, V, K, L, HV):
    # 77 tokens: the last 16-token tile ends inside; 400 heads of 400 tokens: one block per head, whose
    # warps walk several tiles each
    ow, x, ref = _inputs(rng, L, HV, V, K, extra=8)  # ow: a view of longer rows, like the pass's output
    ow_d = torch.from_numpy(ow).cuda()[..., :V + K]
    o = torch.full((L, HV, V), float("nan"), dtype=dtype, device="cuda")
    ops.cp_correct(ow_d, torch.from_numpy(x).cuda(), o)
    torch.cuda.synchronize()
    assert ops.last_kernel() == "cuda"
    got = o.float().cpu().numpy()
    assert np.isfinite(got).all(), "unwritten output"
    # one TF32 product under a 16-bit rounding: within the rounding of o (bf16 2^-9, fp16 2^-12 relative)
    tol = 4e-3 if dtype == torch.bfloat16 else 1e-3
    assert rel(got, ref) < tol, rel(got, ref)


@pytest.mark.skipif(not CUDA, reason="the CUDA correction needs a CUDA device")
def test_cuda_row_declines_other_head_sizes_with_a_reason(rng):
    ow, x, _ = _inputs(rng, 8, 2, 256, 128)
    o = torch.empty(8, 2, 256, device="cuda")
    with pytest.raises(CulaUnsupportedError, match="K and V in"):
        ops.cp_correct(torch.from_numpy(ow).cuda(), torch.from_numpy(x).cuda(), o.bfloat16())
    ow, x, _ = _inputs(rng, 8, 2, 128, 128)
    with pytest.raises(CulaUnsupportedError, match="16-bit o"):  # float32 o: torch's float32 product
        ops.cp_correct(torch.from_numpy(ow).cuda(), torch.from_numpy(x).cuda(), torch.empty(8, 2, 128, device="cuda"))
