from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny models here run many small ops: one intra-op thread is several times faster than two
    on the 2-core CI machine (thread hand-off dominates). Restored after each test."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
