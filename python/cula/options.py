"""The options of the recurrence, named once: FLA's keyword names, their defaults and their types.

One ``Options`` object carries them from the public entries (FLA drop-ins, Level 1) through
Level 0 (``cula.ops``) and the registered torch ops (whose schemas are generated from the fields
below) to the binding, which packs them into the C ABI's ``cula_options`` struct (``pack``).
Adding an option means adding a field here (and to the C struct); nothing else restates the list.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ._lib import BACKENDS, FAMILIES, LAYOUTS, CulaError


@dataclasses.dataclass(frozen=True)
class Options:
    """scale: the query scale (None: K^-0.5). use_qk_l2norm_in_kernel: L2-normalise q and k rows.
    use_gate_in_kernel: g is the raw gate, activated in the kernel with A_log / dt_bias (SPEC §2);
    with lower_bound (or safe_gate) the bounded form lb * sigmoid(.), else -exp(A_log) softplus(.).
    use_beta_sigmoid_in_kernel: beta is a logit; allow_neg_eigval doubles it (beta in (0, 2)).
    state_layout: "k_last" ([.., HV, V, K], the RFC's canonical layout) or "k_first" ([.., HV, K, V])."""

    scale: Optional[float] = None
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    safe_gate: bool = False
    lower_bound: Optional[float] = None
    state_layout: str = "k_last"

    def __post_init__(self):
        for name in ("scale", "lower_bound"):  # (the kernels take them as float32)
            x = getattr(self, name)
            if x is None:
                continue
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise CulaError(f"argument '{name}': expected a float or None, got {type(x).__name__}")
            if name == "scale" and math.isnan(x):  # (NaN is the C ABI's "None": K^-0.5)
                raise CulaError("argument 'scale': expected a finite number (or None for K^-0.5), got nan")
            if not abs(x) <= _FLOAT32_MAX:
                raise CulaError(f"argument '{name}': expected a finite float32 number, got {x!r}")
        for name in _BOOL_FIELDS:  # FLA tests them for truth: anything with one truth value, stored as a bool
            x = getattr(self, name)
            if not isinstance(x, bool):
                try:
                    truth = bool(x)
                except Exception:  # noqa: BLE001 (a tensor of several values, say)
                    raise CulaError(f"argument '{name}': expected a bool, got {type(x).__name__} "
                                    f"{tuple(getattr(x, 'shape', ())) or ''}".rstrip()) from None
                object.__setattr__(self, name, truth)
        if self.state_layout not in LAYOUTS:
            raise CulaError(f"argument 'state_layout': expected 'k_last' or 'k_first', got {self.state_layout!r}")

    def as_kwargs(self) -> dict:
        return {n: getattr(self, n) for n in NAMES}

    def values(self) -> tuple:
        """The fields in schema order (the registered torch ops take them positionally)."""
        return tuple(getattr(self, n) for n in NAMES)

    def pack(self, family: str, backend: str = "auto", stream=None) -> tuple:
        """The values of the C struct cula_options in its field order (_lib.OPTIONS_PACK); stream:
        a cudaStream_t as an int, 0 for none."""
        if family not in FAMILIES:
            raise CulaError(f"argument 'family': expected one of {sorted(FAMILIES)}, got {family!r}")
        if backend not in BACKENDS:
            raise CulaError(f"argument 'backend': expected one of {sorted(BACKENDS)}, got {backend!r}")
        lb = self.lower_bound
        return (FAMILIES[family], math.nan if self.scale is None else float(self.scale),
                int(bool(self.use_qk_l2norm_in_kernel)), int(bool(self.use_gate_in_kernel)), int(bool(self.safe_gate)),
                int(lb is not None), float(lb) if lb is not None else 0.0, int(bool(self.use_beta_sigmoid_in_kernel)),
                int(bool(self.allow_neg_eigval)), LAYOUTS[self.state_layout], BACKENDS[backend], stream or 0)


NAMES = tuple(f.name for f in dataclasses.fields(Options))
_BOOL_FIELDS = tuple(f.name for f in dataclasses.fields(Options) if f.type == "bool")
_FLOAT32_MAX = 3.4028234663852886e38

# torch.library schema types of the fields (their annotations, strings under `from __future__ import
# annotations`), for the registered ops (torch_ops.py)
_SCHEMA_TYPES = {"Optional[float]": "float?", "bool": "bool", "str": "str"}


def schema_args() -> str:
    """The options as torch.library schema arguments, in field order: "float? scale, bool ..."."""
    return ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}" for f in dataclasses.fields(Options))
