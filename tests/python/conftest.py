import os
import tempfile

# A private Inductor cache per test session: the shared /tmp/torchinductor_$USER outlives builds,
# and a graph compiled against an earlier build's op schemas would be reused after they change.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="relpos-inductor-"))

import torch  # noqa: E402

torch.manual_seed(0)
