"""Random calls on CUDA tensors (the host side is tests/cpp/test_random_calls.cpp):
 - the inputs as strided views (q, k, v out of a fused projection, head-major tensors transposed,
   a last dimension strided by 2) run, on whichever kernel takes them, and match the float64
   reference as the contiguous call does;
 - a valid call broken in one random place is either run or refused with a named argument, leaves
   the poisoned output as it was when refused, and never leaves the device in an error state (a
   valid call after all of them still matches the reference).
Skipped without a CUDA device."""

import pytest
from conftest import rel, worst

import cula

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available() or cula._lib.LIB.cula_cuda_device_count() == 0:
    pytest.skip("no CUDA device visible to torch and cula", allow_module_level=True)

from cases import FAMILIES, chunk_inputs, draw_chunk_config  # noqa: E402
from test_gpu_chunk_mma import TOL  # noqa: E402


def _problem(rng):
    c = draw_chunk_config(rng, str(rng.choice(FAMILIES)))
    c["inter"] = False  # intermediate states are compared by the chunk tests
    d, cu, kw = chunk_inputs(rng, c)
    return c, d, cu, kw


def _reference(c, d, cu, kw):
    return cula.chunk_fwd(c["family"], **{n: (x.float() if n in "qkv" else x) for n, x in d.items()}, cu_seqlens=cu,
                          backend="reference", **kw)


def _strided(x, how):
    """x's values on the device behind other strides."""
    x = x.cuda()
    if how == "fused" and x.dim() == 4:  # one slice of a [B, T, 3, H, D] projection
        buf = torch.full((*x.shape[:2], 3, *x.shape[2:]), float("nan"), dtype=x.dtype, device="cuda")
        buf[:, :, 1] = x
        return buf[:, :, 1]
    if how == "head_major" and x.dim() == 4:  # a [B, H, T, D] tensor transposed
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "every_other" and x.dim() >= 3:  # last dimension strided by 2
        buf = torch.full((*x.shape[:-1], 2 * x.shape[-1]), float("nan"), dtype=x.dtype, device="cuda")
        buf[..., ::2] = x
        return buf[..., ::2]
    return x


@pytest.mark.parametrize("how", ["fused", "head_major", "every_other"])
def test_strided_cuda_inputs_match_the_reference(rng, how):
    for _ in range(6):
        c, d, cu, kw = _problem(rng)
        ref = _reference(c, d, cu, kw)
        inputs = {n: (_strided(x, how) if n in ("q", "k", "v", "g", "beta") else x.cuda()) for n, x in d.items()}
        out = torch.full(d["v"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        got = cula.chunk_fwd(c["family"], **inputs, cu_seqlens=None if cu is None else cu.cuda(), out=out, **kw)
        torch.cuda.synchronize()
        errs = [rel(out.float().cpu().numpy(), ref[0].float().numpy()),
                rel(got[1].float().cpu().numpy(), ref[1].float().numpy())]
        assert worst(errs) < TOL, (c, how, cula.last_kernel(), errs)


def _break(rng, c, args):
    """Breaks one random place of a chunk_fwd call's arguments in place; returns what it did."""
    tensors = [n for n, x in args.items() if torch.is_tensor(x)]
    n = str(rng.choice(tensors))
    x = args[n]
    kind = int(rng.integers(0, 9))
    if kind == 0:
        args[n] = None
        return f"dropped {n}"
    if kind == 1 and x.dim() > 0:
        shape = list(x.shape)
        shape[int(rng.integers(0, len(shape)))] += 1
        args[n] = torch.zeros(shape, dtype=x.dtype, device=x.device) + 0.5
        return f"resized {n}"
    if kind == 2:
        args[n] = x.unsqueeze(0) if rng.random() < 0.5 or x.dim() == 0 else x.reshape(-1)
        return f"changed the rank of {n}"
    if kind == 3:
        dt = [torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64][int(rng.integers(0, 6))]
        args[n] = x.to(dt)
        return f"retyped {n} to {dt}"
    if kind == 4:
        args[n] = x.cpu() if x.is_cuda else x.cuda()
        return f"moved {n}"
    if kind == 5 and x.dim() > 0:
        args[n] = _strided(x, "every_other") if x.dim() >= 3 else torch.stack([x, x], -1)[..., 0]
        return f"strided {n}"
    if kind == 6 and x.dim() > 0 and x.numel() > 1:
        args[n] = x.flatten()[1:].reshape(-1)[: x.numel() - 1]  # a misaligned start, wrong size
        return f"shifted {n}"
    if kind == 7:
        opt = str(rng.choice(["chunk_size", "lower_bound", "state_layout", "scale"]))
        args["kw"][opt] = {"chunk_size": 48, "lower_bound": 0.5, "state_layout": "k_first", "scale": float("inf")}[opt]
        return f"option {opt}"
    return "left as it was"


def test_broken_cuda_calls_are_refused_cleanly_and_leave_the_device_usable(rng):
    for trial in range(40):
        c, d, cu, kw = _problem(rng)
        args = {n: x.cuda() for n, x in d.items()}
        if cu is not None:
            args["cu_seqlens"] = cu.cuda()
        out = torch.full(d["v"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        args["out"] = out
        args["kw"] = dict(kw)
        what = _break(rng, c, args)
        call_kw = args.pop("kw")
        try:
            cula.chunk_fwd(c["family"], **args, **call_kw)
            torch.cuda.synchronize()
        except (cula.CulaError, cula.CulaUnsupportedError) as e:
            msg = str(e)
            assert msg, what
            if isinstance(e, cula.CulaError):
                assert "argument '" in msg, (what, msg)
            torch.cuda.synchronize()
            if args.get("out") is out:
                assert torch.isnan(out.float()).all(), (what, "out written by a refused call", msg)
    # The device is still usable: a valid call matches the reference.
    c, d, cu, kw = _problem(rng)
    ref = _reference(c, d, cu, kw)
    out = torch.full(d["v"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    got = cula.chunk_fwd(c["family"], **{n: x.cuda() for n, x in d.items()}, cu_seqlens=None if cu is None else cu.cuda(),
                         out=out, **kw)
    torch.cuda.synchronize()
    assert rel(out.float().cpu().numpy(), ref[0].float().numpy()) < TOL
    assert rel(got[1].float().cpu().numpy(), ref[1].float().numpy()) < TOL
