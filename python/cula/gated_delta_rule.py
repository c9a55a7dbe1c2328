"""FLA drop-in for Gated DeltaNet (the op Qwen3-Next uses):
``from cula.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, fused_gdn_gate``."""

from __future__ import annotations

from ._fla_common import fla_chunk_size, gate_param, offsets_for, per_token_head, recurrent_dropin, resolve_state_layout
from ._front import chunk, reject_unknown
from ._gate import gate

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "fused_gdn_gate"]


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, **kwargs):
    """FLA ``chunk_gated_delta_rule``: scalar log-gate g [B, T, HV], beta [B, T, HV]; like FLA it also
    takes ``use_gate_in_kernel`` with ``A_log`` [HV] and ``dt_bias`` [HV] through its keywords (g raw)."""
    state_v_first = resolve_state_layout("chunk_gated_delta_rule", state_v_first, kwargs)
    chunk_size = fla_chunk_size("chunk_gated_delta_rule", kwargs.pop("chunk_size", 64))
    use_gate_in_kernel = kwargs.pop("use_gate_in_kernel", False)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    reject_unknown("chunk_gated_delta_rule", kwargs)
    del chunk_indices  # FLA's precomputed chunk bookkeeping: cula derives its own
    if cp_context is not None:  # FLA's context parallelism: cula.dist (with autograd)
        from .dist import chunk_fla_cp

        return chunk_fla_cp("gdn", q, k, v, g, beta, cp_context=cp_context, initial_state=initial_state, scale=scale,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                            chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel, A_log=gate_param(A_log),
                            dt_bias=gate_param(dt_bias))
    return chunk("gdn", q, k, v, g, beta, initial_state=initial_state, scale=scale,
                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                 chunk_size=chunk_size, cu_seqlens=offsets_for(q, cu_seqlens, cu_seqlens_cpu),
                 state_layout="k_last" if state_v_first else "k_first", use_gate_in_kernel=use_gate_in_kernel,
                 A_log=gate_param(A_log), dt_bias=gate_param(dt_bias))


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, **kwargs):
    """FLA ``fused_recurrent_gated_delta_rule`` with a scalar gate g; per-key (gk) or per-value (gv)
    gates are not supported. Like FLA, no g means no decay and no beta means beta = 1. Also honours
    ``ssm_state_indices``/``num_accepted_tokens``/``inplace_final_state``."""
    if gk is not None or gv is not None:
        raise NotImplementedError("fused_recurrent_gated_delta_rule: gk/gv gates are not supported by cula; pass g")
    if g is None:
        if use_gate_in_kernel:
            raise ValueError("fused_recurrent_gated_delta_rule: argument 'g' (the raw gate [B, T, HV]) is required "
                             "with use_gate_in_kernel=True")
        g = per_token_head(v, 0.0)  # log-decay 0: no decay
    if beta is None:
        beta = per_token_head(v, 1.0)
    state_v_first = resolve_state_layout("fused_recurrent_gated_delta_rule", state_v_first, kwargs)
    return recurrent_dropin("fused_recurrent_gated_delta_rule", "gdn", q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                            scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                            lower_bound=None, state_v_first=state_v_first, cu_seqlens=cu_seqlens, kwargs=kwargs)


def fused_gdn_gate(g, A_log, dt_bias=None, output_dtype=None):
    """FLA ``fused_gdn_gate``: ``-exp(A_log) softplus(g + dt_bias)`` of g [..., HV] with autograd
    (A_log and dt_bias: HV values). The forward runs cula's gate kernel."""
    import torch

    return gate("fused_gdn_gate", g, A_log, dt_bias, None, output_dtype or torch.float32, per_head=True)
