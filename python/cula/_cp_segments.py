"""Deterministic context parallelism (``cula.dist.chunk_cp(..., deterministic=True)``): results
bitwise identical for any number of ranks.

The tokens of every sequence are cut on a grid fixed by the caller, not by the group: global
positions that are multiples of ``segment_len`` (dense batches: positions within each row; packed
batches: positions in the packed row), and every rank's slice must start on that grid. Each
segment is one call of the chunk engine on its own tokens: the first segment of a sequence from
the sequence's initial state, every later one from a zero state with the value columns extended
by K zero columns and the state by the identity, which gives its outputs from zero, q carried
through its transitions (Q~), the state it adds (A) and its K x K transition (M), as in chunk_cp.
The ranks all-gather every segment's (A, M) and each folds every sequence in segment order in
float32 (S <- S M_s + A_s, one product per segment), so the state entering each segment, the
correction of its outputs (o + S Q~) and the final states are computed with the same operations
on the same operands whatever the number of ranks. The backward mirrors it: a first backward of
each segment that does not end its sequence with no gradient leaving it gives the gradient it
sends back (R); the ranks all-gather R and fold every sequence from its last segment
(dS <- dS M_s^T + R_s); a second backward takes the gradient leaving the segment. The gradients
of the parameters every rank holds whole (A_log, dt_bias) are summed over all segments in
segment order on rank 0, and zeros on the other ranks, so any all-reduce of them is exact; the
initial states' gradients live on the rank of each sequence's first segment, zeros elsewhere.

The price: one engine call per segment (two for the backward of most), and outputs that differ in
rounding from the segment-free chunk_cp and from one un-segmented call (the fold replaces the
engine's own carry at every segment boundary)."""

from __future__ import annotations

from . import ops
from ._cp_exchange import all_gather
from ._cp_summary import DIAGONAL, diagonal_summary, precise_maps
from ._lib import CulaError


def segments(cu, B, total, seg):
    """The global segments [(row, sequence, begin, end, first, last)] of a dense batch (cu None: B
    rows of `total` tokens) or a packed one (global offsets cu), cut on multiples of seg."""
    spans = [(b, b, 0, total) for b in range(B)] if cu is None else [(0, n, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    out = []
    for row, n, a, b in spans:
        if a == b:
            out.append((row, n, a, a, True, True))
            continue
        lo = a
        while lo < b:
            hi = min(b, (lo // seg + 1) * seg)
            out.append((row, n, lo, hi, lo == a, hi == b))
            lo = hi
    return out


def owner(segment, starts, lengths):
    """The rank whose tokens hold the segment (an empty one: the rank holding its position, the last
    rank for the position at the end)."""
    a = segment[2]
    for r, (s, t) in enumerate(zip(starts, lengths)):
        if s <= a < s + t:
            return r
    return len(starts) - 1


def check_grid(lengths, seg):
    if not isinstance(seg, int) or seg < 1:
        raise CulaError(f"argument 'segment_len': expected a positive int, got {seg!r}")
    starts = [sum(lengths[:r]) for r in range(len(lengths))]
    off = [s for s in starts if s % seg]
    if off:
        raise CulaError(f"argument 'segment_len': deterministic context parallelism needs every rank's first token "
                        f"at a multiple of segment_len = {seg}; the ranks start at {starts}")
    return starts


def _gather_rows(dist, group, rows, count_per_rank, shape, dev):
    """All-gather this rank's per-segment tensors (rows [n_mine, *shape]), padded to the largest
    count; returns every rank's rows in rank order."""
    import torch

    most = max(count_per_rank) if count_per_rank else 0
    send = torch.zeros(most, *shape, dtype=torch.float32, device=dev)
    if rows is not None and len(rows):
        send[:len(rows)] = rows
    return [x[:c] for x, c in zip(all_gather(dist, group, send), count_per_rank)]


class Plan:
    """The segments, their owners and this rank's share, for one call."""

    def __init__(self, cu, B, lengths, rank, seg):
        self.starts = check_grid(lengths, seg)
        total = sum(lengths)
        self.start = self.starts[rank]
        self.all = segments(cu, B, total, seg)
        self.owners = [owner(s, self.starts, lengths) for s in self.all]
        self.counts = [self.owners.count(r) for r in range(len(lengths))]
        self.mine = [i for i, r in enumerate(self.owners) if r == rank]
        # a segment's place in the gathered rows: (rank, index among that rank's segments)
        self.slot = {}
        seen = [0] * len(lengths)
        for i, r in enumerate(self.owners):
            self.slot[i] = (r, seen[r])
            seen[r] += 1
        self.by_sequence = {}
        for i, s in enumerate(self.all):
            self.by_sequence.setdefault(s[1], []).append(i)

    def tokens(self, x, i):
        """Segment i's slice of a local tensor [B or 1, T_rank, ...]."""
        row, _, a, b, _, _ = self.all[i]
        return None if x is None else x[row:row + 1, a - self.start:b - self.start]


def _fold(dist, group, plan, A_mine, M_mine, N, HV, V, K, dev):
    """Every rank's segment maps gathered and folded per sequence in segment order: (the state
    entering each segment that does not start its sequence, the final states [N, HV, V, K], M of a
    segment). A of a first segment is its end state (from the sequence's initial state)."""
    import torch

    A_all = _gather_rows(dist, group, A_mine, plan.counts, (HV, V, K), dev)
    M_all = _gather_rows(dist, group, M_mine, plan.counts, (HV, K, K), dev)
    A_of = lambda i: A_all[plan.slot[i][0]][plan.slot[i][1]]  # noqa: E731
    M_of = lambda i: M_all[plan.slot[i][0]][plan.slot[i][1]]  # noqa: E731
    entering, final = {}, torch.zeros(N, HV, V, K, dtype=torch.float32, device=dev)
    for n, idx in plan.by_sequence.items():
        state = None
        for i in idx:
            if plan.all[i][4]:
                state = A_of(i)
            else:
                entering[i] = state
                state = A_of(i) + torch.matmul(state, M_of(i))
        final[n] = state
    return entering, final, M_of


def forward(family, q, k, v, g, beta, decay, dist, group, plan, N, initial_state, opts):
    """Outputs of this rank's tokens and final states [N, HV, V, K] (every rank). The backward keeps
    nothing of this pass: it folds its entering states again from float32 maps."""
    import torch

    HV, V, K = int(v.shape[2]), int(v.shape[3]), int(q.shape[3])
    dev = q.device
    diagonal = family in DIAGONAL  # no delta rule: no value-column extension (_cp_summary)
    # float32 until every correction is in (the segments' passes write float32: one rounding of o)
    o = torch.zeros(v.shape, dtype=torch.float32, device=dev)
    eye = torch.eye(K, dtype=torch.float32, device=dev)
    A_mine = torch.zeros(len(plan.mine), HV, V, K, dtype=torch.float32, device=dev)
    M_mine = torch.zeros(len(plan.mine), HV, K, K, dtype=torch.float32, device=dev)
    carried = {}
    for j, i in enumerate(plan.mine):
        _, n, a, b, first, _ = plan.all[i]
        if a == b:  # an empty sequence: its final state is its initial state
            if initial_state is not None:
                A_mine[j] = initial_state[n].float()
            continue
        vs = plan.tokens(v, i)
        if first or diagonal:
            init = torch.zeros(1, HV, V, K, dtype=torch.float32, device=dev)
            if initial_state is not None and first:
                init[0] = initial_state[n].float()
            W = V
        else:  # the values extended by K zero columns (read as zeros by the engine: value_dim)
            init = torch.zeros(1, HV, V + K, K, dtype=torch.float32, device=dev)
            init[0, :, V:, :] = eye
            W = V + K
        ow, fw = ops.chunk_fwd(family, plan.tokens(q, i), plan.tokens(k, i), vs.contiguous(), plan.tokens(g, i),
                               plan.tokens(beta, i), decay, initial_state=init, output_final_state=True,
                               state_layout="k_last", state_dtype="float32", value_dim=W,
                               out=torch.empty(1, b - a, HV, W, dtype=torch.float32, device=dev), **opts)
        A_mine[j] = fw[0, :, :V, :]
        if not first and diagonal:  # the transition and carried queries from the gates
            g_seg = plan.tokens(g, i)
            carried[i], M_mine[j] = diagonal_summary(family, plan.tokens(q, i)[0], None if g_seg is None else g_seg[0],
                                                     decay, HV, opts)
        elif not first:
            M_mine[j] = fw[0, :, V:, :]
            carried[i] = ow[0, :, :, V:].float()
        row = plan.all[i][0]
        o[row, a - plan.start:b - plan.start] = ow[0, :, :, :V]
    entering, final, _ = _fold(dist, group, plan, A_mine, M_mine, N, HV, V, K, dev)
    for i, Qc in carried.items():
        row, _, a, b, _, _ = plan.all[i]
        lo, hi = a - plan.start, b - plan.start
        o[row, lo:hi] += torch.einsum("lhk,hvk->lhv", Qc, entering[i])
    return o.to(v.dtype), final


def backward(family, q, k, v, g, beta, decay, A_log, dt_bias, dist, group, rank, plan, initial_state, d_out,
             d_final, opts):
    """The gradients of this rank's inputs (see the module docstring)."""
    import torch

    HV, V, K = int(v.shape[2]), int(v.shape[3]), int(q.shape[3])
    dev = q.device
    # the states entering the segments again, from float32 maps (precise_maps) instead of the
    # forward's engine summaries: their bf16-level error would reach the reduced gradients (dA_log)
    spans = [(plan.all[i][0], plan.all[i][2] - plan.start, plan.all[i][3] - plan.start) for i in plan.mine]
    h0s = [initial_state[plan.all[i][1]] if plan.all[i][4] and initial_state is not None else None for i in plan.mine]
    A_mine, M_mine = precise_maps(family, q, k, v, g, beta, decay, spans, dict(opts, A_log=A_log, dt_bias=dt_bias),
                                  h0=h0s)
    entering, _, M_of = _fold(dist, group, plan, A_mine, M_mine, len(plan.by_sequence), HV, V, K, dev)

    def call(i, d_leaving):
        _, n, _, _, first, _ = plan.all[i]
        if first:
            init = torch.zeros(1, HV, V, K, dtype=torch.float32, device=dev)
            if initial_state is not None:
                init[0] = initial_state[n].float()
        else:
            init = entering[i].unsqueeze(0).contiguous()
        return ops.chunk_bwd(family, plan.tokens(q, i), plan.tokens(k, i), plan.tokens(v, i), plan.tokens(g, i),
                             plan.tokens(beta, i), plan.tokens(d_out, i).contiguous(), decay=decay,
                             d_final_state=d_leaving.unsqueeze(0).contiguous(), initial_state=init, A_log=A_log,
                             dt_bias=dt_bias, state_layout="k_last", **opts)

    zero = torch.zeros(HV, V, K, dtype=torch.float32, device=dev)
    grads, R_mine = {}, torch.zeros(len(plan.mine), HV, V, K, dtype=torch.float32, device=dev)
    for j, i in enumerate(plan.mine):
        _, n, a, b, _, last = plan.all[i]
        if a == b:  # an empty sequence: the final state's gradient is the initial state's
            grads[i] = {"d_initial_state": d_final[n].float().unsqueeze(0)}
            continue
        got = call(i, d_final[n].float() if last else zero)
        if last:
            grads[i] = got
        R_mine[j] = got["d_initial_state"][0].float()
    R_all = _gather_rows(dist, group, R_mine, plan.counts, (HV, V, K), dev)
    R_of = lambda i: R_all[plan.slot[i][0]][plan.slot[i][1]]  # noqa: E731
    leaving = {}  # the gradient leaving each segment that does not end its sequence
    for n, idx in plan.by_sequence.items():
        d_state = None  # the gradient entering the segment after the current one
        for i in reversed(idx):
            _, _, _, _, first, last = plan.all[i]
            if not last:
                leaving[i] = d_state
            if not first:
                d_state = R_of(i) if last else torch.matmul(d_state, M_of(i).transpose(-1, -2)) + R_of(i)
    for i in plan.mine:
        if i not in grads:
            grads[i] = call(i, leaving[i])

    out = {}
    for name, x in (("dq", q), ("dk", k), ("dv", v), ("dg", g), ("dbeta", beta)):
        if x is None:
            continue
        full = torch.zeros(x.shape, dtype=torch.float32, device=dev)
        for i in plan.mine:
            if grads[i].get(name) is not None:
                row, _, a, b, _, _ = plan.all[i]
                full[row, a - plan.start:b - plan.start] = grads[i][name][0].float()
        out[name] = full
    for name, x in (("dA_log", A_log), ("ddt_bias", dt_bias)):
        if x is None:
            continue
        mine = torch.stack([grads[i][name].float().reshape(-1) if name in grads[i] else
                            torch.zeros(int(x.numel()), dtype=torch.float32, device=dev) for i in plan.mine]) \
            if plan.mine else None
        parts = _gather_rows(dist, group, mine, plan.counts, (int(x.numel()),), dev)
        total = torch.zeros(int(x.numel()), dtype=torch.float32, device=dev)
        if rank == 0:  # every segment's part, in segment order; zeros elsewhere keep any all-reduce exact
            for i in range(len(plan.all)):
                r, s = plan.slot[i]
                total = total + parts[r][s]
        out[name] = total.reshape(x.shape)
    if initial_state is not None:
        d_h0 = torch.zeros(initial_state.shape, dtype=torch.float32, device=dev)
        for i in plan.mine:
            _, n, _, _, first, _ = plan.all[i]
            if first:
                d_h0[n] = grads[i]["d_initial_state"][0].float()
        out["d_initial_state"] = d_h0
    return out
