"""Array adapters: torch tensors and numpy arrays (and other DLPack producers on the host) to
cula_tensor views, and output allocation in the caller's array library."""

from __future__ import annotations

import ctypes

import numpy as np

from . import _lib
from ._lib import CulaError

_Dims = ctypes.c_int64 * _lib.MAX_DIMS  # shape / strides of a cula_tensor

_NP_DTYPES = {
    np.dtype(np.float16): _lib.FLOAT16,
    np.dtype(np.float32): _lib.FLOAT32,
    np.dtype(np.float64): _lib.FLOAT64,
    np.dtype(np.int32): _lib.INT32,
    np.dtype(np.int64): _lib.INT64,
}


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


_TORCH_CODES = None  # torch dtype -> DLPack code, built on first use (importing cula does not import torch)


def _torch_dtype_code(x):
    global _TORCH_CODES
    if _TORCH_CODES is None:
        import torch

        _TORCH_CODES = {
            torch.float16: _lib.FLOAT16,
            torch.float32: _lib.FLOAT32,
            torch.float64: _lib.FLOAT64,
            torch.bfloat16: _lib.BFLOAT16,
            torch.int32: _lib.INT32,
            torch.int64: _lib.INT64,
        }
    return _TORCH_CODES.get(x.dtype)


def as_array(x, name):
    """Returns an object view() accepts: torch tensors and numpy arrays as they are, other
    DLPack producers through numpy, Python sequences are refused."""
    if x is None or is_torch(x) or isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except Exception as e:  # a device array numpy cannot map
            raise CulaError(f"argument '{name}': expected a torch tensor or a host array, got {type(x).__name__} ({e})")
    raise CulaError(f"argument '{name}': expected a torch tensor or a numpy array, got {type(x).__name__}")


def view(x, name) -> _lib.Tensor | None:
    """A cula_tensor describing x (no copy). The caller keeps x alive for the call."""
    if x is None:
        return None
    if is_torch(x):
        code = _torch_dtype_code(x)
        if code is None:
            raise CulaError(f"argument '{name}': expected a float16/bfloat16/float32/float64 or int32/int64 tensor, got {x.dtype}")
        shape = x.shape
        n = len(shape)
        if n > _lib.MAX_DIMS:
            raise CulaError(f"argument '{name}': expected at most {_lib.MAX_DIMS} dimensions, got {n}")
        if x.is_cuda:
            dev_type, dev_id = _lib.CUDA, x.get_device()
        elif x.device.type == "cpu":
            dev_type, dev_id = _lib.CPU, 0
        else:
            raise CulaError(f"argument '{name}': expected a CPU or CUDA tensor, got a tensor on {x.device}")
        # one constructor call (this runs for every tensor of every call: host time per call)
        return _lib.Tensor(x.data_ptr() or None, code, n, _Dims(*shape), _Dims(*x.stride()), dev_type, dev_id)
    if isinstance(x, np.ndarray):
        code = _NP_DTYPES.get(x.dtype)
        if code is None:
            raise CulaError(f"argument '{name}': expected a float16/float32/float64 or int32/int64 array, got {x.dtype}")
        if x.ndim > _lib.MAX_DIMS:
            raise CulaError(f"argument '{name}': expected at most {_lib.MAX_DIMS} dimensions, got {x.ndim}")
        if any(s % x.itemsize for s in x.strides):
            raise CulaError(f"argument '{name}': expected strides that are multiples of the item size, got {x.strides}")
        return _lib.Tensor(x.ctypes.data or None, code, x.ndim, _Dims(*x.shape),
                           _Dims(*(st // x.itemsize for st in x.strides)), _lib.CPU, 0)
    raise CulaError(f"argument '{name}': expected a torch tensor or a numpy array, got {type(x).__name__}")


def ptr(t):
    return ctypes.pointer(t) if t is not None else None


def empty_like_family(ref, shape, dtype=None):
    """An uninitialised array of `shape` in ref's library/device; dtype None = ref's dtype,
    or one of 'float32', 'bfloat16', 'float64'."""
    if is_torch(ref):
        import torch

        td = ref.dtype if dtype is None else getattr(torch, dtype)
        return torch.empty(shape, dtype=td, device=ref.device)
    nd = ref.dtype if dtype is None else np.dtype("float32" if dtype == "bfloat16" else dtype)
    return np.empty(shape, dtype=nd)


def stream_of(ref):
    if is_torch(ref) and ref.is_cuda:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the stream handle without a Stream object
        if raw is not None:
            return ctypes.c_void_p(raw(ref.get_device()))
        return ctypes.c_void_p(torch.cuda.current_stream(ref.device).cuda_stream)
    return None


def dtype_name(x) -> str:
    if is_torch(x):
        return str(x.dtype).replace("torch.", "")
    return str(x.dtype)
