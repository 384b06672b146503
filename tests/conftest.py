"""Shared test setup. The tests run thousands of tiny ops: intra-op threads only add overhead (and thrash
on a busy 2-core CI machine), so every test runs torch on one thread, in float32 by default.
transformers is imported here once, through bench.import_transformers (kernels.py shares its name with a package
transformers imports)."""
import pytest
import torch

import bench

bench.import_transformers()   # before any test imports it: transformers must bind Hugging Face's `kernels`, not ours


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_num_threads(n)
