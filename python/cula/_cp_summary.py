"""The affine summaries of slices of tokens, shared by context parallelism (cula.dist), its
deterministic mode (_cp_segments) and the parallel segments of one device (_segments):
diagonal_summary, diagonal_decays and uniform_diagonal_decays (the transitions of many pieces at once) and
diagonal_end_state, for the families without the delta rule, whose transitions are diagonal (the
carried queries, the transition and a piece's own end state come from its gates, keys and values
without an engine pass); precise_maps, the maps in float32 that the backwards fold their entering
states from; cut, the pieces of packed sequences."""

from __future__ import annotations

import itertools

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
    G = _cumulative(_log_decays(family, g, decay, L, HV, q.device))
    cum = torch.exp(G).permute(2, 0, 1).float()  # [L, HV, K or 1]
    qh = _as_read(q, opts)
    scale = opts.get("scale")
    qh = qh.repeat_interleave(group, dim=1) * (K ** -0.5 if scale is None else float(scale))
    end = cum[-1].expand(HV, K) if L else torch.ones(HV, K, dtype=torch.float32, device=q.device)
    return qh * cum, torch.diag_embed(end)


def _cumulative(a):
    """The running sums of log-decays a [L, HV, K or 1] over the tokens, as [HV, K or 1, L]: summed
    along the last dimension of a copy, since torch scans an outer dimension one column per thread
    (16 columns of 65536 tokens in sequence: ~15 ms on a GPU)."""
    import torch

    return torch.cumsum(a.permute(1, 2, 0).contiguous(), dim=-1)


def _as_read(x, opts):
    """q or k in float32 as the kernels read them: L2-normalised when use_qk_l2norm_in_kernel."""
    import torch

    x = x.float()
    if opts.get("use_qk_l2norm_in_kernel"):
        x = x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)
    return x


def _bf16_parts(x):
    """x as bfloat16 parts whose sum is x: itself when bfloat16, else hi + lo (x - hi rounded),
    about 17 of float32's 24 bits."""
    import torch

    hi = x.to(torch.bfloat16)
    return [hi] if x.dtype == torch.bfloat16 else [hi, (x - hi.float()).to(torch.bfloat16)]


def bmm_f32(a, b):
    """a [n, m, k] @ b [n, k, p] in float32 precision (either operand float32 or bfloat16). On CUDA
    on the tensor cores: each float32 operand in two bfloat16 parts (_bf16_parts), the products
    hi.hi + hi.lo + lo.hi accumulated in float32 (lo.lo, 2^-18 of the product, dropped); elsewhere
    a float32 bmm. For products that reduce over the tokens into a small output (the diagonal maps:
    a float32 SIMT product over 64k tokens took about 1 ms); where the output is as large as the
    inputs, the extra passes over it cost more than the tensor cores save."""
    import torch

    if a.device.type != "cuda":
        return torch.bmm(a.float(), b.float())
    out = None
    for i, x in enumerate(_bf16_parts(a)):
        for j, y in enumerate(_bf16_parts(b)):
            if i + j > 1:
                continue
            out = torch.bmm(x, y, out_dtype=torch.float32) if out is None else \
                torch.baddbmm(out, x, y, out_dtype=torch.float32)
    return out


def diagonal_decays(family, g, decay, L, HV, K, starts, ends, device):
    """The diagonals of the transitions of many pieces of one row of L tokens at once: for piece i,
    tokens [starts[i], ends[i]), the product of its decays per key channel, [pieces, HV, K] in
    float64 (differences of float64 running sums over the row; an empty piece: ones). starts and
    ends: lists, or int64 tensors on the device (no copy the host waits for)."""
    import torch

    G = _cumulative(_log_decays(family, g, decay, L, HV, device))
    G = torch.cat([G.new_zeros(*G.shape[:2], 1), G], dim=-1)  # G[..., t]: the sum of the first t tokens
    ends, starts = (torch.as_tensor(x, device=device) for x in (ends, starts))
    return torch.exp(G[..., ends] - G[..., starts]).permute(2, 0, 1).expand(len(starts), HV, K)


def uniform_diagonal_decays(family, g, decay, B, T, HV, K, seg_len, device):
    """diagonal_decays for B dense sequences of T tokens each cut every seg_len tokens from its start
    (the pieces of cut() over offsets b T), [pieces, HV, K] in float64: each piece's log-decays summed
    by a reduction with float64 accumulation, one pass over g (no running sums over every token:
    a float64 scan of g and its copies cost an engine pass at 32k tokens x 4 heads of GLA). g: [B T, HV,
    K or 1 ...] as diagonal_decays takes it."""
    import torch

    full, rest = divmod(T, seg_len)
    lengths = [seg_len] * full + ([rest] if rest or not full else [])
    if family == "lightning":  # a constant log-decay per head: the piece's length times it
        rate = _log_decays(family, None, decay, 1, HV, device)[0, :, 0]  # [HV], clamped
        n = torch.full((len(lengths),), float(seg_len), dtype=torch.float64, device=device)
        n[-1] = float(lengths[-1])  # (made on the device: no copy from the host)
        d = torch.exp(n.view(-1, 1) * rate.view(1, HV))  # [pieces of a sequence, HV]
        return d.view(1, -1, HV, 1).expand(B, -1, HV, K).reshape(-1, HV, K)
    a = g.float().clamp_min(MIN_LOG_DECAY).reshape(B, T, HV, -1)
    parts = []
    if full:
        parts.append(a[:, :full * seg_len].reshape(B, full, seg_len, HV, -1).sum(2, dtype=torch.float64))
    if rest or not full:
        parts.append(a[:, full * seg_len:].sum(1, keepdim=True, dtype=torch.float64))
    sums = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [B, pieces, HV, K or 1]
    return torch.exp(sums).expand(B, len(lengths), HV, K).reshape(-1, HV, K)


def host_to_device(host, device):
    """A host tensor on `device` by one copy from pinned memory that the host does not wait for (a
    copy from pageable memory waits for the stream: it would put the GPU's whole queue in the call's
    time); the host tensor itself for a host device."""
    if getattr(device, "type", device) != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def cut(offsets, seg_len):
    """[(sequence n, start, end, first)] over packed tokens (sequence n at [offsets[n], offsets[n+1])):
    each sequence cut every seg_len tokens from its start (an empty sequence: one empty piece, so
    that its final state is its initial one)."""
    out = []
    for n in range(len(offsets) - 1):
        bos, eos = offsets[n], offsets[n + 1]
        s = bos
        while True:
            e = min(s + seg_len, eos)
            out.append((n, s, e, s == bos))
            if e >= eos:
                break
            s = e
    return out


def _log_decays(family, g, decay, L, HV, device):
    """A piece's per-token log-decays [L, HV, K or 1] in float64, clamped as the chunked kernels do."""
    import torch

    if family == "lightning":
        rate = decay.to(device=device, dtype=torch.float64).reshape(-1)
        if rate.numel() != HV:
            rate = rate.repeat_interleave(HV // rate.numel())
        return (-rate).clamp_min(MIN_LOG_DECAY).view(1, HV, 1).expand(L, HV, 1)
    a = g.to(torch.float64).clamp_min(MIN_LOG_DECAY)
    return a if a.dim() == 3 else a.unsqueeze(-1)


def diagonal_end_state(family, k, v, g, decay, HV, opts, s0=None):
    """For a family without the delta rule, a piece's map X -> X M + A in float32 from its keys,
    values and gates alone (no pass over q, no outputs): A = D_L s0 + sum_t v_t (D_L / D_t) k^_t
    ([HV, V, K], K-last; s0 the piece's own initial state or None for zero) and M = diag(D_L), with
    D_t = exp(sum of the log-decays up to t) per key channel (cumulative sums in float64, every
    factor D_L / D_t <= 1). k [L, H, K], v [L, HV, V]; g and decay as diagonal_summary's."""
    import torch

    L, H, K = (int(s) for s in k.shape)
    dev = k.device
    a = _log_decays(family, g, decay, L, HV, dev)
    G = _cumulative(a)  # [HV, K or 1, L]
    end = G[..., -1:] if L else torch.zeros(HV, a.shape[-1], 1, dtype=torch.float64, device=dev)
    tail = torch.exp(end - G).permute(2, 0, 1).float()  # D_L / D_t [L, HV, K or 1]
    kh = _as_read(k, opts).repeat_interleave(HV // H, dim=1) * tail  # [L, HV, K]
    A = bmm_f32(v.permute(1, 2, 0), kh.transpose(0, 1))  # per head [V, L] @ [L, K]
    d_end = torch.exp(end[..., 0]).float().expand(HV, K)  # D_L [HV, K]
    if s0 is not None:
        A = A + s0.to(device=dev, dtype=torch.float32) * d_end.unsqueeze(1)
    return A, torch.diag_embed(d_end)


SUB_SEGMENT = 512  # tokens per sequential walk in precise_maps: enough parallel walks to fill a GPU


def precise_maps(family, q, k, v, g, beta, decay, spans, opts, h0=None):
    """The affine maps of token spans in float32 from float32 inputs, for the backward of context
    parallelism: the states entering its pieces fold from these instead of the forward's summaries,
    which the tensor-core engines compute with bf16 intermediates (about 2e-3 relative, which sums
    of many cancelling terms, dA_log, carry into the gradients).

    spans: [(row b, begin, end)] of the local tensors [B, T, ...]; h0: per span, None or a K-last
    state [HV, V, K] that the span starts from. Returns (A [S, HV, V, K]: the state at the span's
    end from h0 or zero, M [S, HV, K, K]: its transition, X -> X M + A). Each span is walked in
    pieces of SUB_SEGMENT tokens that run as the sequences of one call (float32 q, k, v; on CUDA the
    backend "cuda_fp32": the recurrent kernels, no bf16 tiles), whose maps then compose in order; without the delta
    rule M is the diagonal of the decays (diagonal_decays, for all the pieces at once)."""
    import torch

    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    dev = q.device
    diagonal = family in DIAGONAL
    W = V if diagonal else V + K
    # (span, begin, end) in the flattened [B * T] tokens
    subs = [(i, s, e) for i, (b, lo, hi) in enumerate(spans)
            for _, s, e, _ in cut([b * T + lo, b * T + hi], SUB_SEGMENT) if e > s]
    A = torch.zeros(len(spans), HV, V, K, dtype=torch.float32, device=dev)
    M = torch.eye(K, dtype=torch.float32, device=dev).repeat(len(spans), HV, 1, 1)
    if subs:
        idx = torch.cat([torch.arange(s, e, device=dev) for _, s, e in subs])
        pick = lambda x: None if x is None else x.reshape(B * T, *x.shape[2:])[idx].float().unsqueeze(0)  # noqa: E731
        qs, ks, vs, gs, bs = (pick(x) for x in (q, k, v, g, beta))
        init = torch.zeros(len(subs), HV, W, K, dtype=torch.float32, device=dev)
        if not diagonal:
            init[:, :, V:, :] = torch.eye(K, dtype=torch.float32, device=dev)  # (v's K more columns: zeros)
        if q.is_cuda:
            opts = dict(opts, backend="cuda_fp32")
        ends = list(itertools.accumulate(e - s for _, s, e in subs))  # of each sub-piece in the picked tokens
        # (the engine and the decays take the offsets on the device, the engine their host copy too)
        cu_host = torch.tensor([0] + ends, dtype=torch.int64)
        cu = host_to_device(cu_host, dev)
        _, fw = ops.chunk_fwd(family, qs, ks, vs.contiguous(), gs, bs, decay, initial_state=init,
                              output_final_state=True, cu_seqlens=cu, cu_seqlens_host=cu_host, state_layout="k_last",
                              state_dtype="float32", value_dim=W, **opts)
        if diagonal:  # every sub-piece's decays from one running sum over the picked tokens
            d = diagonal_decays(family, None if gs is None else gs[0], decay, ends[-1], HV, K,
                                cu[:-1], cu[1:], dev).float().unsqueeze(2)  # [subs, HV, 1, K]
        for j, (i, s, e) in enumerate(subs):
            a_j = fw[j, :, :V, :]
            if diagonal:  # X diag(d): the columns scaled
                A[i] = A[i] * d[j] + a_j
                M[i] = M[i] * d[j]
            else:
                m_j = fw[j, :, V:, :]
                A[i] = torch.matmul(A[i], m_j) + a_j
                M[i] = torch.matmul(M[i], m_j)
    if h0 is not None:
        for i, h in enumerate(h0):
            if h is not None:
                A[i] = A[i] + torch.matmul(h.float(), M[i])
    return A, M
