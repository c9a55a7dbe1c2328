"""ctypes binding of the C ABI (include/cula/cula.h).

The library is plain C ABI, loaded with ctypes: nothing is compiled against Python or torch, so
one build serves every Python >= 3.10 and every torch version.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pathlib
import struct

MAX_DIMS = 6

# dtype codes: DLPack's (type code << 8 | bits)
INT32, INT64 = 32, 64
FLOAT16, FLOAT32, FLOAT64 = (2 << 8) | 16, (2 << 8) | 32, (2 << 8) | 64
BFLOAT16 = (4 << 8) | 16
CPU, CUDA = 1, 2

OK, INVALID_ARGUMENT, UNSUPPORTED, CUDA_ERROR, INTERNAL = 0, 1, 2, 3, 4
FAMILIES = {"kda": 0, "gdn": 1, "gla": 2, "simple_gla": 3, "lightning": 4}
BACKENDS = {"auto": 0, "reference": 1, "oracle": 1, "cpu": 2, "cuda": 3, "cuda_fp32": 4}
LAYOUTS = {"k_last": 0, "k_first": 1}


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
    ]


TP = ctypes.POINTER(Tensor)


class Options(ctypes.Structure):
    _fields_ = [
        ("family", ctypes.c_int32),
        ("scale", ctypes.c_double),
        ("use_qk_l2norm", ctypes.c_int32),
        ("use_gate_in_kernel", ctypes.c_int32),
        ("safe_gate", ctypes.c_int32),
        ("has_lower_bound", ctypes.c_int32),
        ("lower_bound", ctypes.c_double),
        ("use_beta_sigmoid", ctypes.c_int32),
        ("allow_neg_eigval", ctypes.c_int32),
        ("state_layout", ctypes.c_int32),
        ("backend", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
    ]


# Options packed straight into an argument buffer (struct.pack_into: one call instead of a ctypes
# Structure and a dozen attribute writes per call; the host time of a call is part of its cost).
# Native alignment gives the C layout; checked against the ctypes description below.
OPTIONS_PACK = struct.Struct("@idiiiidiiiiP")


def _options_layout_matches() -> bool:
    probe, values = Options(), (1, 2.5, 3, 4, 5, 6, 7.5, 8, 9, 10, 11, 12)
    OPTIONS_PACK.pack_into(probe, 0, *values)
    return OPTIONS_PACK.size == ctypes.sizeof(Options) and tuple(getattr(probe, f) for f, _ in Options._fields_) == values


assert _options_layout_matches(), "cula_recurrence_options layout changed"


def _args_struct(name, tensor_fields, extra=()):
    fields = [("struct_size", ctypes.c_size_t), ("opt", Options)]
    fields += [(f, TP) for f in tensor_fields]
    fields += list(extra)
    return type(name, (ctypes.Structure,), {"_fields_": fields})


ChunkFwdArgs = _args_struct(
    "ChunkFwdArgs",
    ["q", "k", "v", "g", "beta", "decay", "A_log", "dt_bias", "cu_seqlens", "initial_state", "state_pool",
     "state_indices", "out", "final_state", "intermediate_states"],
    [("chunk_size", ctypes.c_int32), ("cu_seqlens_host", TP), ("value_dim", ctypes.c_int64),
     ("segment_len", ctypes.c_int64)],
)
DecodeArgs = _args_struct(
    "DecodeArgs",
    ["q", "k", "v", "g", "beta", "decay", "A_log", "dt_bias", "state_pool", "state_indices", "num_accepted_tokens",
     "out", "final_state_out"],
)
ChunkBwdArgs = _args_struct(
    "ChunkBwdArgs",
    ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state", "d_out", "d_final_state", "dq",
     "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "d_initial_state", "decay"],
)
KdaGateArgs = _args_struct("KdaGateArgs", ["g", "A_log", "dt_bias", "g_out"])
CpCorrectArgs = _args_struct("CpCorrectArgs", ["ow", "state", "o"])
# The fields the library writes (the non-const cula_tensor members of cula.h).
WRITTEN = frozenset({"state_pool", "out", "final_state_out", "final_state", "intermediate_states", "dq", "dk", "dv", "dg", "dbeta",
                     "dA_log", "ddt_bias", "d_initial_state", "g_out", "o"})


def _candidates():
    env = os.environ.get("CULA_LIBRARY")
    if env:
        yield pathlib.Path(env)
    here = pathlib.Path(__file__).resolve().parent
    yield here / "lib" / "libcula.so"
    # a source checkout: python/cula -> repository root -> build/
    root = here.parent.parent
    for build in sorted(root.glob("build*/libcula.so")):
        yield build


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.exists():
            lib = ctypes.CDLL(str(path))
            break
    else:
        raise ImportError(
            "cula: the native library libcula.so was not found (looked in: " + ", ".join(tried) + "). "
            "Install the package with `pip install .` or build it with CMake (see README)."
        )
    for fn, argtype in [
        ("cula_chunk_fwd", ChunkFwdArgs),
        ("cula_decode", DecodeArgs),
        ("cula_chunk_bwd", ChunkBwdArgs),
        ("cula_kda_gate", KdaGateArgs),
        ("cula_chunk_fwd_explain", ChunkFwdArgs),
        ("cula_decode_explain", DecodeArgs),
        ("cula_chunk_bwd_explain", ChunkBwdArgs),
        ("cula_kda_gate_explain", KdaGateArgs),
        ("cula_cp_correct", CpCorrectArgs),
        ("cula_cp_correct_explain", CpCorrectArgs),
        ("cula_chunk_fwd_validate", ChunkFwdArgs),
        ("cula_decode_validate", DecodeArgs),
    ]:
        f = getattr(lib, fn, None)
        if f is None and fn.endswith(("_explain", "_validate")):  # a library built before this entry: explain() fails, calls run
            continue
        f.argtypes = [ctypes.c_void_p]  # the address of an argument buffer laid out as argtype
        f.restype = ctypes.c_int
    for fn in ("cula_last_error", "cula_version", "cula_build_info", "cula_last_kernel", "cula_explained_kernel",
               "cula_explained_declines"):
        getattr(lib, fn).restype = ctypes.c_char_p
        getattr(lib, fn).argtypes = []
    lib.cula_abi_version.restype = ctypes.c_int32
    lib.cula_cuda_device_count.restype = ctypes.c_int32
    lib.cula_cuda_device_info.argtypes = [ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]
    lib.cula_cuda_device_info.restype = ctypes.c_int
    lib.cula_backend_for.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32]
    lib.cula_backend_for.restype = ctypes.c_char_p
    if hasattr(lib, "cula_workspace_peak_bytes"):  # (a library built before this entry: no workspace accounting)
        lib.cula_workspace_peak_bytes.argtypes = [ctypes.c_int32, ctypes.c_int32]
        lib.cula_workspace_peak_bytes.restype = ctypes.c_int64
    lib.cula_set_num_threads.argtypes = [ctypes.c_int32]
    lib.cula_set_num_threads.restype = None
    lib.path = path
    return lib


LIB = _load()
ABI_VERSION = 1
if LIB.cula_abi_version() != ABI_VERSION:
    raise ImportError(f"cula: native library ABI {LIB.cula_abi_version()} does not match the Python package's {ABI_VERSION}")


def _load_fast_call(lib_path):
    """The optional C module that packs the argument structs (csrc/binding/fast_call.c): beside
    the loaded library (a build tree) or in the package (a wheel). None when it is absent or
    CULA_FAST_CALL=0; the ctypes packing then serves every call."""
    if os.environ.get("CULA_FAST_CALL", "1") == "0":
        return None
    for folder in (pathlib.Path(lib_path).resolve().parent, pathlib.Path(__file__).resolve().parent):
        for path in sorted(folder.glob("_fast_call*.so")):
            spec = importlib.util.spec_from_file_location("cula._fast_call", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


FAST_CALL = _load_fast_call(LIB.path)
# Argument struct -> (the fast-call module's entry number, the entry's address, tensor fields in
# struct order): the module calls the function this ctypes handle loaded.
def _tensor_run(args_type):
    """The tensor fields up to the first scalar after them: the ones the fast-call module fills (a
    tensor field after a scalar, like cu_seqlens_host, goes through the ctypes path)."""
    run = []
    for name, kind in args_type._fields_[2:]:  # after struct_size and opt
        if kind is not TP:
            break
        run.append(name)
    return tuple(run)


FAST_ENTRIES = {
    t: (kind, ctypes.cast(getattr(LIB, fn), ctypes.c_void_p).value, _tensor_run(t))
    for kind, (fn, t) in enumerate([("cula_chunk_fwd", ChunkFwdArgs), ("cula_decode", DecodeArgs),
                                    ("cula_chunk_bwd", ChunkBwdArgs), ("cula_kda_gate", KdaGateArgs)])
}


def binding() -> str:
    """How calls reach the library: "fast_call" (the C module) or "ctypes"."""
    return "fast_call" if FAST_CALL is not None else "ctypes"


class CulaError(ValueError):
    """A bad argument: the message names the argument, what was expected and what was given."""


class CulaUnsupportedError(NotImplementedError):
    """Valid input that no kernel of this build can run (e.g. a CUDA kernel not yet written)."""


class CulaRuntimeError(RuntimeError):
    """A CUDA or internal failure."""


def check(status: int) -> None:
    if status == OK:
        return
    msg = LIB.cula_last_error().decode()
    if status == INVALID_ARGUMENT:
        raise CulaError(msg)
    if status == UNSUPPORTED:
        raise CulaUnsupportedError(msg)
    raise CulaRuntimeError(msg)



