from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.support.site import site  # noqa: F401  (the built docs site, for every test file)

settings.register_profile(
    "default",
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("fuzz", parent=settings.get_profile("default"), max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Checked by mypy, never run (they call functions with wrong arguments on purpose).
collect_ignore = ["typing"]

_ORIGINAL_COPY = torch.Tensor.copy_


@pytest.fixture(autouse=True)
def _copy_is_restored() -> Iterator[None]:
    """Every test must leave torch.Tensor.copy_ exactly as it found it (identity)."""
    assert torch.Tensor.copy_ is _ORIGINAL_COPY
    assert "copy_" not in torch.Tensor.__dict__
    yield
    assert torch.Tensor.copy_ is _ORIGINAL_COPY, "torch.Tensor.copy_ was not restored"
    assert "copy_" not in torch.Tensor.__dict__, "a patched copy_ was left in Tensor.__dict__"
