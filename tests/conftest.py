"""Suite-wide hooks: ``cuda``-marked tests are skipped where CUDA is not available."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch  # only when some selected test needs it

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in cuda_items:
        item.add_marker(skip)
