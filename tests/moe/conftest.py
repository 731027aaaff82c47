import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    # These shapes are tiny; with 2 OpenMP threads on a shared 2-core box every small op can wait
    # for a descheduled thread (tests took 2 s quiet, 16 s busy). Restored afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
