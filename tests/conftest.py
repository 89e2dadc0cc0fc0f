"""Shared test set-up.

Triton kernels run under the interpreter on CPU: TRITON_INTERPRET must be set before any
``@triton.jit`` function is defined, so it is set here, before any test module imports
``rqlib.kernels``. The interpreter multiplies the fp16 inputs of a ``tl.dot`` exactly and sums
in float32, as a GPU's tensor cores do, so the kernels' tensor-core products are checked at the
precision a GPU computes them.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def rng() -> torch.Generator:
    """A generator with a fresh random seed for each test; the seed is printed on failure.

    ``RQLIB_TEST_SEED=<seed> pytest <test>`` replays a failure with the seed it printed.
    """
    replay = os.environ.get("RQLIB_TEST_SEED")
    seed = int(replay) if replay else int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)
