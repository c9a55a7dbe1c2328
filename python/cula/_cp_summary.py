"""The affine summaries of slices of tokens, shared by context parallelism (cula.dist), its
deterministic mode (_cp_segments) and the parallel segments of one device (_segments):
diagonal_summary, for the families without the delta rule, whose transitions are diagonal (the
carried queries and the transition come from the gates, and the engine pass runs the value columns
alone); precise_maps, the maps in float32 that the backwards fold their entering states from."""

from __future__ import annotations

from . import ops

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


SUB_SEGMENT = 512  # tokens per sequential walk in precise_maps: enough parallel walks to fill a GPU


def precise_maps(family, q, k, v, g, beta, decay, spans, opts, h0=None):
    """The affine maps of token spans in float32 from float32 inputs, for the backward of context
    parallelism: the states entering its pieces fold from these instead of the forward's summaries,
    which the tensor-core engines compute with bf16 intermediates (about 2e-3 relative, which sums
    of many cancelling terms, dA_log, carry into the gradients).

    spans: [(row b, begin, end)] of the local tensors [B, T, ...]; h0: per span, None or a K-last
    state [HV, V, K] that the span starts from. Returns (A [S, HV, V, K]: the state at the span's
    end from h0 or zero, M [S, HV, K, K]: its transition, X -> X M + A). Each span is walked in
    pieces of SUB_SEGMENT tokens that run as the sequences of one call (float32 q, k, v: the
    recurrent kernels, no bf16 intermediates), whose maps then compose in order; without the delta
    rule M is the diagonal of the decays (diagonal_summary)."""
    import torch

    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    dev = q.device
    diagonal = family in DIAGONAL
    W = V if diagonal else V + K
    subs = []  # (span, begin, end) in the flattened [B * T] tokens
    for i, (b, lo, hi) in enumerate(spans):
        s = lo
        while s < hi:
            e = min(s + SUB_SEGMENT, hi)
            subs.append((i, b * T + s, b * T + e))
            s = e
    A = torch.zeros(len(spans), HV, V, K, dtype=torch.float32, device=dev)
    M = torch.eye(K, dtype=torch.float32, device=dev).repeat(len(spans), HV, 1, 1)
    if subs:
        idx = torch.cat([torch.arange(s, e, device=dev) for _, s, e in subs])
        pick = lambda x: None if x is None else x.reshape(B * T, *x.shape[2:])[idx].float().unsqueeze(0)  # noqa: E731
        qs, ks, vs, gs, bs = (pick(x) for x in (q, k, v, g, beta))
        init = torch.zeros(len(subs), HV, W, K, dtype=torch.float32, device=dev)
        if not diagonal:
            init[:, :, V:, :] = torch.eye(K, dtype=torch.float32, device=dev)
            vs = torch.cat([vs, vs.new_zeros(1, vs.shape[1], HV, K)], dim=-1)
        lengths = [e - s for _, s, e in subs]
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=dev)
        _, fw = ops.chunk_fwd(family, qs, ks, vs.contiguous(), gs, bs, decay, initial_state=init,
                              output_final_state=True, cu_seqlens=cu, state_layout="k_last", state_dtype="float32",
                              **opts)
        at = 0
        for j, (i, s, e) in enumerate(subs):
            a_j = fw[j, :, :V, :]
            if diagonal:
                m_j = diagonal_summary(family, qs[0, at:at + e - s], None if gs is None else gs[0, at:at + e - s],
                                       decay, HV, opts)[1]
            else:
                m_j = fw[j, :, V:, :]
            A[i] = torch.matmul(A[i], m_j) + a_j
            M[i] = torch.matmul(M[i], m_j)
            at += e - s
    if h0 is not None:
        for i, h in enumerate(h0):
            if h is not None:
                A[i] = A[i] + torch.matmul(h.float(), M[i])
    return A, M
