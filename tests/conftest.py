import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: tests never touch a hub

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run several times faster on one thread when the 2 cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
