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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--accelerators-way",
        action="store_true",
        help="send CPU tensors the way they go on a GPU (patchctx._cpu_passes.HOST = False): "
        "the accelerators' code run where none is; tests marked host_only are skipped",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--accelerators-way"):
        from patchctx import _cpu_passes

        _cpu_passes.HOST = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--accelerators-way"):
        skip = pytest.mark.skip(reason="checks the host's ways; the suite runs the accelerators'")
        for item in items:
            if "host_only" in item.keywords:
                item.add_marker(skip)


_ORIGINAL_COPY = torch.Tensor.copy_


@pytest.fixture(autouse=True)
def _copy_is_restored() -> Iterator[None]:
    """Every test must leave torch.Tensor.copy_ exactly as it found it (identity)."""
    assert torch.Tensor.copy_ is _ORIGINAL_COPY
    assert "copy_" not in torch.Tensor.__dict__
    yield
    assert torch.Tensor.copy_ is _ORIGINAL_COPY, "torch.Tensor.copy_ was not restored"
    assert "copy_" not in torch.Tensor.__dict__, "a patched copy_ was left in Tensor.__dict__"
