"""The built documentation site, shared by the tests that read it (`tests/conftest.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent

# Refuses (and records) every socket use, DNS included, for the rest of the process.
NETWORK_GUARD = r"""
import sys

attempts = []

def refuse_network(event, args):
    if event in {"socket.connect", "socket.getaddrinfo", "socket.gethostbyname",
                 "socket.gethostbyname_ex", "socket.gethostbyaddr", "socket.sendto"}:
        attempts.append(f"{event}{args!r}")
        raise OSError(f"network access during the docs build: {event}{args!r}")

sys.addaudithook(refuse_network)
"""

# mkdocs build --strict behind the guard; exit status 3 if anything tried the network.
OFFLINE_BUILD = (
    NETWORK_GUARD
    + r"""
from mkdocs.__main__ import cli

sys.argv = ["mkdocs", "build", "--strict", "--config-file", sys.argv[1],
            "--site-dir", sys.argv[2]]
code = 0
try:
    cli()
except SystemExit as exit:
    code = exit.code
if attempts:
    sys.stderr.write("network access attempted:\n" + "\n".join(attempts) + "\n")
    code = 3
sys.exit(code)
"""
)


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built strictly and offline, once per test session."""
    directory = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-c", OFFLINE_BUILD, str(ROOT / "mkdocs.yml"), str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    if result.returncode != 0:
        pytest.fail(
            f"mkdocs build --strict failed (exit {result.returncode}):\n{result.stderr}",
            pytrace=False,
        )
    return directory
