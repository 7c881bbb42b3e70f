"""GPU tests: skipped without CUDA (the reason is printed in the header and per test).

Run: ``python -m pytest tests/gpu -v -rs`` (benchmarks/gpu_smoke.sh does, then measures MFU).
"""
import pytest
import torch

from gpu_helpers import te_status


def pytest_report_header(config):
    cuda = (f"CUDA: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
            if torch.cuda.is_available() else "CUDA: none (every GPU test is skipped)")
    return [cuda, "TE: " + te_status()[1]]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: the GPU tests need one")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture
def need_te():
    ok, why = te_status()
    if not ok:
        pytest.skip(why)


