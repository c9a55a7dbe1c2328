"""cula: linear-attention kernels (KDA, Gated DeltaNet, GLA, Lightning) behind one C ABI.

Level 0 (explicit raw ops) lives in :mod:`cula.ops`; its functions are re-exported here.
"""

from ._lib import CulaError, CulaRuntimeError, CulaUnsupportedError
from ._lib import LIB as _LIB
from .ops import (
    backend_for,
    chunk_bwd,
    chunk_fwd,
    chunk_gated_delta_rule,
    chunk_gdn,
    chunk_gla,
    chunk_kda,
    chunk_lightning,
    chunk_simple_gla,
    decode,
    explain,
    kda_gate,
    last_kernel,
    set_num_threads,
)

from .options import Options  # noqa: E402
from .api import cula_decode, cula_kda, cula_lightning  # noqa: E402  (Level 1)

__version__ = _LIB.cula_version().decode()

__all__ = [
    "CulaError", "CulaRuntimeError", "CulaUnsupportedError", "Options", "backend_for", "chunk_bwd", "chunk_fwd",
    "chunk_gated_delta_rule", "chunk_gdn", "chunk_gla", "chunk_kda", "chunk_lightning", "chunk_simple_gla", "decode",
    "explain", "kda_gate", "last_kernel", "set_num_threads", "__version__", "cula_kda", "cula_lightning", "cula_decode",
]
