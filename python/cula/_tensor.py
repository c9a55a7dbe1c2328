"""Array adapters: torch tensors and numpy arrays (and other DLPack producers on the host) to
cula_tensor views, and output allocation in the caller's array library."""

from __future__ import annotations

import ctypes
import struct
import sys

import numpy as np

from . import _lib
from ._lib import CulaError

_NP_DTYPES = {
    np.dtype(np.float16): _lib.FLOAT16,
    np.dtype(np.float32): _lib.FLOAT32,
    np.dtype(np.float64): _lib.FLOAT64,
    np.dtype(np.int32): _lib.INT32,
    np.dtype(np.int64): _lib.INT64,
}


_IS_TORCH = {}  # type -> bool: the check runs for every argument of every call (host time per call)


def is_torch(x) -> bool:
    t = type(x)
    r = _IS_TORCH.get(t)
    if r is None:
        r = _IS_TORCH[t] = t.__module__.startswith("torch") and hasattr(x, "data_ptr")
    return r


_TORCH_CODES = None  # torch dtype -> DLPack code, built on first use (importing cula does not import torch)


def _torch_codes():
    global _TORCH_CODES
    import torch

    _TORCH_CODES = {
        torch.float16: _lib.FLOAT16,
        torch.float32: _lib.FLOAT32,
        torch.float64: _lib.FLOAT64,
        torch.bfloat16: _lib.BFLOAT16,
        torch.int32: _lib.INT32,
        torch.int64: _lib.INT64,
    }
    return _TORCH_CODES


def as_array(x, name):
    """Returns an object call() accepts: torch tensors and numpy arrays as they are, other
    DLPack producers through numpy, Python sequences are refused."""
    if x is None or is_torch(x) or isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except Exception as e:  # a device array numpy cannot map
            raise CulaError(f"argument '{name}': expected a torch tensor or a host array, got {type(x).__name__} ({e})")
    raise CulaError(f"argument '{name}': expected a torch tensor or a numpy array, got {type(x).__name__}")


_TENSOR = struct.Struct("=Qii6q6qii")  # the bytes of a cula_tensor
assert _TENSOR.size == ctypes.sizeof(_lib.Tensor), "cula_tensor layout changed"
# One struct per rank n: the dims past n are pad bytes, left as the zeroed buffer has them, so a
# tensor's shape and strides go in as they are (no padded tuples built per call).
_TENSOR_RANK = [struct.Struct(f"=Qii{n}q{8 * (_lib.MAX_DIMS - n)}x{n}q{8 * (_lib.MAX_DIMS - n)}xii")
                for n in range(_lib.MAX_DIMS + 1)]
assert all(t.size == _TENSOR.size for t in _TENSOR_RANK)
_ADDR = struct.Struct("=Q")


def _pack_tensor(buf, at, x, name) -> None:
    """Writes the cula_tensor describing x (no copy) at byte `at` of buf (zeroed)."""
    if is_torch(x):
        code = (_TORCH_CODES or _torch_codes()).get(x.dtype)
        if code is None:
            raise CulaError(f"argument '{name}': expected a float16/bfloat16/float32/float64 or int32/int64 tensor, got {x.dtype}")
        shape = x.shape
        n = len(shape)
        if n > _lib.MAX_DIMS:
            raise CulaError(f"argument '{name}': expected at most {_lib.MAX_DIMS} dimensions, got {n}")
        if x.is_cuda:
            dev_type, dev_id = _lib.CUDA, x.get_device()
        elif x.is_cpu:
            dev_type, dev_id = _lib.CPU, 0
        else:
            raise CulaError(f"argument '{name}': expected a CPU or CUDA tensor, got a tensor on {x.device}")
        _TENSOR_RANK[n].pack_into(buf, at, x.data_ptr(), code, n, *shape, *x.stride(), dev_type, dev_id)
        return
    if isinstance(x, np.ndarray):
        code = _NP_DTYPES.get(x.dtype)
        if code is None:
            raise CulaError(f"argument '{name}': expected a float16/float32/float64 or int32/int64 array, got {x.dtype}")
        n = x.ndim
        if n > _lib.MAX_DIMS:
            raise CulaError(f"argument '{name}': expected at most {_lib.MAX_DIMS} dimensions, got {n}")
        if any(s % x.itemsize for s in x.strides):
            raise CulaError(f"argument '{name}': expected strides that are multiples of the item size, got {x.strides}")
        if not x.flags.writeable and name in _lib.WRITTEN:
            raise CulaError(f"argument '{name}': expected a writeable array (the call writes it), got a read-only array")
        _TENSOR_RANK[n].pack_into(buf, at, x.ctypes.data, code, n, *x.shape, *(st // x.itemsize for st in x.strides),
                                  _lib.CPU, 0)
        return
    raise CulaError(f"argument '{name}': expected a torch tensor or a numpy array, got {type(x).__name__}")


_SCALAR_CODES = {ctypes.c_int32: "i", ctypes.c_int64: "q", ctypes.c_double: "d"}
_LAYOUTS = {}  # argument struct type -> (size, options offset, {tensor field: offset}, {scalar: (Struct, offset)})
_SIZE = struct.Struct("@N")  # size_t


def _layout(args_type):
    fields = dict(args_type._fields_)
    tensors = {n: getattr(args_type, n).offset for n, t in fields.items() if t is _lib.TP}
    scalars = {n: (struct.Struct("=" + _SCALAR_CODES[t]), getattr(args_type, n).offset) for n, t in fields.items()
               if t in _SCALAR_CODES}
    # a multiple of 8: the cula_tensors after the struct stay aligned
    lay = _LAYOUTS[args_type] = (ctypes.sizeof(args_type), args_type.opt.offset, tensors, scalars)
    return lay


_FAST = None  # the fast-call module once it knows torch's tensor type and dtypes


def _fast_ready():
    global _FAST
    torch = sys.modules.get("torch")  # no torch imported: no torch tensors, nothing to speed up
    if _lib.FAST_CALL is None or torch is None:
        return None
    fields = tuple(f for _, _, f in sorted(_lib.FAST_ENTRIES.values()))
    _lib.FAST_CALL.configure(torch.Tensor, dict(_TORCH_CODES or _torch_codes()), fields)
    _FAST = _lib.FAST_CALL
    return _FAST


def call(args_type, entry, opt, tensors: dict, fast: bool = True, **scalars) -> None:
    """Calls a C ABI entry with its argument struct (laid out as args_type) built from `tensors`
    (field name -> array; fields not given stay NULL) and `scalars`, raising the library's error
    as a Python exception. opt: Options.pack(...). The arrays stay alive for the call.

    Torch tensors go through the fast-call module when it is built (the struct packed in C);
    anything it does not take (numpy arrays, an unknown dtype, another device) comes here, where
    the struct and one cula_tensor per array are packed into one buffer with struct.pack_into.
    fast=False: always here. Another entry than the op's own (its _explain twin) comes here too: the
    fast-call module calls the one entry it knows per struct."""
    fast = (_FAST or _fast_ready()) if fast else None
    kind, address, _ = _lib.FAST_ENTRIES.get(args_type, (None, None, None))  # (an op the module does not know)
    if fast is not None and kind is not None and ctypes.cast(entry, ctypes.c_void_p).value == address:
        seg = scalars.get("segment_len")
        status = fast.call(kind, address, opt, scalars.get("chunk_size", 0), tensors, *(() if seg is None else (seg,)))
        if status is not None:
            _lib.check(status)
            return
    size, opt_at, offsets, scalar_at = _LAYOUTS.get(args_type) or _layout(args_type)
    given = [(n, x) for n, x in tensors.items() if x is not None]
    buf = ctypes.create_string_buffer(size + _TENSOR.size * len(given))
    base = ctypes.addressof(buf)
    _SIZE.pack_into(buf, 0, size)
    _lib.OPTIONS_PACK.pack_into(buf, opt_at, *opt)
    at = size
    pack_addr = _ADDR.pack_into
    for n, x in given:
        _pack_tensor(buf, at, x, n)
        pack_addr(buf, offsets[n], base + at)
        at += _TENSOR.size
    for n, x in scalars.items():
        packer, off = scalar_at[n]
        packer.pack_into(buf, off, x)
    _lib.check(entry(base))


def empty_like_family(ref, shape, dtype=None):
    """An uninitialised array of `shape` in ref's library/device; dtype None = ref's dtype,
    or one of 'float32', 'bfloat16', 'float64'."""
    if is_torch(ref):
        if dtype is None:
            return ref.new_empty(shape)  # ref's dtype and device, no device object built per call
        import torch

        return ref.new_empty(shape, dtype=getattr(torch, dtype))
    nd = ref.dtype if dtype is None else np.dtype("float32" if dtype == "bfloat16" else dtype)
    return np.empty(shape, dtype=nd)


def stream_of(ref) -> int:
    """The current CUDA stream of ref's device as an int (cudaStream_t), 0 for host arrays."""
    if is_torch(ref) and ref.is_cuda:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the stream handle without a Stream object
        if raw is not None:
            return raw(ref.get_device())
        return torch.cuda.current_stream(ref.device).cuda_stream
    return 0


def dtype_name(x) -> str:
    if is_torch(x):
        return str(x.dtype).replace("torch.", "")
    return str(x.dtype)
