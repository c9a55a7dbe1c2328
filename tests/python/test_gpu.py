"""CUDA kernels against the float64 reference. Skipped without a CUDA device (CI has none);
tools/gpu_check.sh runs them on the GPU machine."""

import numpy as np
import pytest
from conftest import rel

import cula

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available() or cula._lib.LIB.cula_cuda_device_count() == 0:
    pytest.skip("no CUDA device visible to torch and cula", allow_module_level=True)


@pytest.mark.sanitize
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lb", [None, -5.0])
@pytest.mark.parametrize("shape", [(1, 1, 1, 64), (2, 333, 8, 128), (1, 4096, 32, 128)])
def test_cuda_kda_gate_matches_reference(rng, in_dtype, out_dtype, lb, shape):
    B, T, HV, K = shape
    g = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 3).to(in_dtype).cuda()
    A = torch.from_numpy(rng.uniform(-1, 0.5, HV).astype(np.float32)).cuda()
    bias = torch.from_numpy(rng.standard_normal(HV * K).astype(np.float32)).cuda()
    out = cula.kda_gate(g, A, bias, lower_bound=lb, safe_gate=lb is not None, output_dtype=out_dtype)
    torch.cuda.synchronize()
    assert out.is_cuda and out.shape == g.shape
    ref = cula.kda_gate(g.float().cpu().numpy().astype(np.float64), A.cpu().numpy().astype(np.float64),
                        bias.cpu().numpy().astype(np.float64), lower_bound=lb)
    o = out.float().cpu().numpy()
    assert np.isfinite(o).all()
    assert rel(o, ref) < (5e-3 if out_dtype == "bfloat16" else 1e-5)


@pytest.mark.sanitize
def test_cuda_kda_gate_is_written_everywhere(rng):
    g = torch.randn(3, 77, 5, 64, device="cuda")
    A = torch.zeros(5, device="cuda")
    out = cula.kda_gate(g, A)
    out2 = cula.kda_gate(g, A)
    assert torch.equal(out, out2) and torch.isfinite(out).all()
    assert (out < 0).all()


@pytest.mark.sanitize
def test_cuda_kda_gate_rejects_host_parameters(rng):
    g = torch.randn(1, 4, 2, 8, device="cuda")
    with pytest.raises(cula.CulaError, match="A_log"):
        cula.kda_gate(g, torch.zeros(2))
