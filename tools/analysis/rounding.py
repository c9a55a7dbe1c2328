"""Roundings of float64 values to the formats the kernels keep them in (round to nearest even), for
the precision models beside this file. Each returns float64 arrays."""

import numpy as np


def _drop_bits(x, bits):
    """float32 x with its last `bits` mantissa bits rounded away."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    half = (1 << (bits - 1)) - 1
    b = ((b + half + ((b >> bits) & 1)) >> bits) << bits
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def bf16(x):
    return _drop_bits(x, 16)


def bf16x2(x):
    """x as a pair of bf16 values, hi = bf16(x) and lo = bf16(x - hi) (float32 x): the operands of a
    three-product bf16 scheme (hi hi + hi lo + lo hi on bf16 tensor cores), about 16 bits of
    mantissa. The scheme's dropped lo lo term (about 2^-18 of the product) is not modelled."""
    x32 = f32(x)
    hi = bf16(x32)
    return hi + bf16(x32 - hi)


def tf32(x):
    """TF32, the tensor cores' 10-bit mantissa (one product of the 3xTF32 scheme)."""
    return _drop_bits(x, 13)


def f16(x):
    return np.asarray(x, dtype=np.float16).astype(np.float64)


def f32(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def exact(x):
    return np.asarray(x, dtype=np.float64)
