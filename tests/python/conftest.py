import os
import shutil
import tempfile

# A private Inductor cache per test session: the shared /tmp/torchinductor_$USER outlives builds,
# and a graph compiled against an earlier build's op schemas would be reused after they change.
_INDUCTOR_CACHE = None
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="relpos-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE

import torch  # noqa: E402

torch.manual_seed(0)


def pytest_unconfigure(config):
    if _INDUCTOR_CACHE is not None:
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes: OpenMP's start-up and spinning, not the work, would dominate on a shared
    machine (a forward takes ~20 ms on two busy threads, ~1 ms on one). A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
