"""Fixtures shared by the shoal pytest suite (host backend in CI)."""

import gc

import pytest

import shoal


def live_allocations(allocator: shoal.Allocator) -> int:
    return allocator.stats()["allocations"]["all"]["current"]


@pytest.fixture
def allocator():
    """A fresh allocator (SHOAL_ALLOC_CONF ignored); the test must give back every block it took."""
    a = shoal.Allocator(use_environment=False, trace_entries=1000)
    yield a
    gc.collect()
    assert live_allocations(a) == 0, "the test leaked storages"
    a.empty_cache()
    assert a.stats()["reserved_bytes"]["all"]["current"] == 0


def pytest_configure(config):
    config.addinivalue_line("markers", "python: the Python package's suite (every test here)")
    config.addinivalue_line("markers", "torch: needs PyTorch with CUDA and a GPU (shoal.torch)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device as shoal's default device")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.python)
