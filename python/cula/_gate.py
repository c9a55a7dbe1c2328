"""The gate activation as FLA's fused_kda_gate / fused_gdn_gate compute it, with autograd: the
forward is the library's gate kernel (cula.ops.kda_gate), the backward its elementwise derivative
in torch (one pass over g, like the forward).

    lower_bound None:  out = -exp(A_log) softplus(g + dt_bias)
    lower_bound lb:    out = lb sigmoid(exp(A_log) (g + dt_bias))   (A_log None: exp(A_log) = 1)

g is [..., H, K] (K = 1 for GDN's per-head gate), A_log holds H values in any shape, dt_bias H * K."""

from __future__ import annotations

from . import ops
from ._front import LazyFunction
from ._lib import CulaError

_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16"}


def _make_gate_fn():
    import torch
    import torch.nn.functional as F

    class GateFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, g, A_log, dt_bias, lower_bound, output_dtype):
            H, K = int(g.shape[-2]), int(g.shape[-1])
            kernel_dtype = _DTYPES.get(str(output_dtype), "float32")
            # (the parameters as float32: the CUDA kernel reads them so)
            out = ops.kda_gate(g.reshape(1, -1, H, K).contiguous(),
                               None if A_log is None else A_log.reshape(-1).float().contiguous(),
                               None if dt_bias is None else dt_bias.reshape(-1).float().contiguous(),
                               lower_bound=lower_bound, output_dtype=kernel_dtype)
            ctx.save_for_backward(g, A_log, dt_bias)
            ctx.lower_bound = lower_bound
            return out.reshape(g.shape).to(output_dtype)

        @staticmethod
        def backward(ctx, d_out):
            g, A_log, dt_bias = ctx.saved_tensors
            H, K = int(g.shape[-2]), int(g.shape[-1])
            do = d_out.float()
            x = g.float() + (dt_bias.float().reshape(H, K) if dt_bias is not None else 0.0)
            a = A_log.float().reshape(H, 1).exp() if A_log is not None else None
            if ctx.lower_bound is None:
                dx = do * -a * torch.sigmoid(x)
                dA = do * -a * F.softplus(x)  # d out / d A_log = out
            else:
                z = x * a if a is not None else x
                s = torch.sigmoid(z)
                dz = do * ctx.lower_bound * s * (1 - s)
                dx = dz * a if a is not None else dz
                dA = dz * z  # d z / d A_log = z
            d_g = dx.to(g.dtype) if ctx.needs_input_grad[0] else None
            d_A = (dA.reshape(-1, H, K).sum((0, 2)).reshape(A_log.shape).to(A_log.dtype)
                   if A_log is not None and ctx.needs_input_grad[1] else None)
            d_b = (dx.reshape(-1, H * K).sum(0).reshape(dt_bias.shape).to(dt_bias.dtype)
                   if dt_bias is not None and ctx.needs_input_grad[2] else None)
            return d_g, d_A, d_b, None, None

    return GateFn


_GateFn = LazyFunction(_make_gate_fn)


def gate(fn_name, g, A_log, dt_bias, lower_bound, output_dtype, per_head):
    """FLA's gate activation on g [..., H, K], or [..., H] with per_head (GDN)."""
    if A_log is None and lower_bound is None:
        raise CulaError(f"{fn_name}: argument 'A_log': expected a tensor of H values when lower_bound is None, got None")
    x = g.unsqueeze(-1) if per_head else g
    out = _GateFn.apply(x, A_log, dt_bias, lower_bound, output_dtype)
    return out.squeeze(-1) if per_head else out
