import os
import secrets
import sys

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A fresh seed per test, printed on failure (set CULA_TEST_SEED to replay). Every datum of the
    test comes from it: the numpy generator returned here, and torch's generators (CPU and every
    CUDA device), seeded with it when the test module uses torch, so that torch.randn and friends
    replay too."""
    seed = int(os.environ.get("CULA_TEST_SEED", secrets.randbits(32)))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
    return np.random.default_rng(seed)


def rel(a, b, floor=0.0):
    """||a - b|| / ||b||; floor: an absolute floor per element under ||b|| (a reference that is zero
    measured against the rounding noise of terms that cancel exactly in exact arithmetic)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor * np.sqrt(b.size), 1e-300))


def worst(errs):
    """The largest of several relative errors, NaN counting as infinite (max() would skip a NaN)."""
    return max(float("inf") if not np.isfinite(x) else float(x) for x in errs)
