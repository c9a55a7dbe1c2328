"""The affine summary of a slice of tokens for the families without the delta rule, shared by
context parallelism (cula.dist) and its deterministic mode (_cp_segments): their transitions are
diagonal, so the carried queries and the transition come from the gates, and the engine pass runs
the value columns alone."""

from __future__ import annotations

DIAGONAL = ("gla", "simple_gla", "lightning")  # the families without the delta rule: diagonal transitions
MIN_LOG_DECAY = -64.0  # the chunked kernels' floor of a token's log-decay (csrc/common/problem.h)
L2_EPS = 1e-6  # use_qk_l2norm_in_kernel: eps inside the sqrt (SPEC §2)


def diagonal_summary(family, q, g, decay, HV, opts):
    """For a family without the delta rule, a piece's carried queries and transition from its gates
    alone: with D_t = exp(sum of the piece's log-decays up to t) per key channel, Q~_t = scale D_t q^_t
    (q^: q after the in-kernel L2 norm) [L, HV, K] and M = diag(D_L) [HV, K, K], in float32 (cumulative
    sums in float64). q [L, H, K]; g [L, HV, K] (GLA) or [L, HV] (simple GLA); decay [H] or [HV]
    (Lightning, log-decay -decay per token)."""
    import torch

    L, H, K = (int(s) for s in q.shape)
    group = HV // H
    if family == "lightning":
        rate = decay.to(device=q.device, dtype=torch.float64).reshape(-1)
        if rate.numel() != HV:
            rate = rate.repeat_interleave(group)
        a = (-rate).clamp_min(MIN_LOG_DECAY).view(1, HV, 1).expand(L, HV, 1)
    else:
        a = g.to(torch.float64).clamp_min(MIN_LOG_DECAY)
        a = a if a.dim() == 3 else a.unsqueeze(-1)
    # the running sum along the last dimension of a [HV, K or 1, L] copy: torch scans an outer
    # dimension one column per thread, 16 columns of 65536 tokens in sequence (~15 ms on a GPU)
    cum = torch.exp(torch.cumsum(a.permute(1, 2, 0).contiguous(), dim=-1)).permute(2, 0, 1).float()  # [L, HV, K or 1]
    qh = q.float()
    if opts.get("use_qk_l2norm_in_kernel"):
        qh = qh / torch.sqrt((qh * qh).sum(-1, keepdim=True) + L2_EPS)
    scale = opts.get("scale")
    qh = qh.repeat_interleave(group, dim=1) * (K ** -0.5 if scale is None else float(scale))
    end = cum[-1].expand(HV, K) if L else torch.ones(HV, K, dtype=torch.float32, device=q.device)
    return qh * cum, torch.diag_embed(end)
