"""Offline cross-reference inventories for Python and PyTorch: the table, the files, the hook.

The docs link Python and PyTorch names (``torch.Tensor``, ``ValueError`` ...) to their official
pages through Sphinx inventories. mkdocstrings would download ``objects.inv`` from
docs.python.org and docs.pytorch.org at build time; the build must not touch the network, so the
inventories are small files committed next to this script, written from the table below:

    python docs/inventories/inventories.py    # rewrite python.inv and torch.inv from ENTRIES

mkdocs loads this file as a hook (``hooks:`` in mkdocs.yml). Its ``on_env`` reads each committed
inventory with the Python handler's own parser (``PythonHandler.load_inventory``) and registers
every name with autorefs, exactly as mkdocstrings does with a downloaded inventory, before
autorefs resolves cross-references. No URL is fetched and nothing is cached outside the repository.

A name the docs reference but the table lacks renders as plain text; ``tests/test_docs_site.py``
fails on it, so add the name here (with the page's real URL) and rerun the script. The real
upstream ``objects.inv`` of either project is a drop-in replacement for its file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from jinja2 import Environment
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files

HERE = Path(__file__).resolve().parent


class Source(NamedTuple):
    """One inventory: where its file lies, whose docs it points into, and its entries."""

    file: str
    project: str
    version: str
    base_url: str
    entries: tuple[tuple[str, str, str], ...]  # (name, role, uri relative to base_url)


def _same_page(page: str, role: str, *names: str) -> tuple[tuple[str, str, str], ...]:
    return tuple((name, role, f"{page}#{name}") for name in names)


def _generated(role: str, *names: str) -> tuple[tuple[str, str, str], ...]:
    # PyTorch documents most API objects on a page of their own under generated/.
    return tuple((name, role, f"generated/{name}.html#{name}") for name in names)


PYTHON = Source(
    file="python.inv",
    project="Python",
    version="3",
    base_url="https://docs.python.org/3/",
    entries=(
        *_same_page("library/functions.html", "class", "bool", "float", "int", "object"),
        *_same_page(
            "library/stdtypes.html",
            "class",
            "bytearray",
            "bytes",
            "dict",
            "frozenset",
            "list",
            "memoryview",
            "set",
            "str",
            "tuple",
        ),
        ("None", "data", "library/constants.html#None"),
        *_same_page(
            "library/exceptions.html",
            "exception",
            "AssertionError",
            "Exception",
            "KeyError",
            "KeyboardInterrupt",
            "NotImplementedError",
            "RuntimeError",
            "TimeoutError",
            "TypeError",
            "ValueError",
        ),
        *_same_page(
            "library/collections.abc.html",
            "class",
            "collections.abc.Callable",
            "collections.abc.Generator",
            "collections.abc.Iterable",
            "collections.abc.Iterator",
            "collections.abc.Mapping",
            "collections.abc.Sequence",
        ),
        (
            "contextlib.AbstractContextManager",
            "class",
            "library/contextlib.html#contextlib.AbstractContextManager",
        ),
        ("contextvars.ContextVar", "class", "library/contextvars.html#contextvars.ContextVar"),
        ("dataclasses.dataclass", "function", "library/dataclasses.html#dataclasses.dataclass"),
        ("enum.Enum", "class", "library/enum.html#enum.Enum"),
        *_same_page("library/threading.html", "class", "threading.RLock", "threading.Thread"),
        ("typing.Any", "data", "library/typing.html#typing.Any"),
        *_same_page(
            "library/typing.html",
            "class",
            "typing.Generic",
            "typing.Literal",
            "typing.NamedTuple",
            "typing.Protocol",
        ),
        ("typing.runtime_checkable", "function", "library/typing.html#typing.runtime_checkable"),
    ),
)

DTYPES = (
    "bfloat16",
    "bool",
    "complex64",
    "complex128",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
)

TORCH = Source(
    file="torch.inv",
    project="PyTorch",
    version="stable",
    base_url="https://docs.pytorch.org/docs/stable/",
    entries=(
        ("torch", "module", "torch.html#module-torch"),
        ("torch.Tensor", "class", "tensors.html#torch.Tensor"),
        # The dtype objects are listed in the table of the torch.dtype section.
        *((f"torch.{name}", "data", "tensor_attributes.html#torch.dtype") for name in DTYPES),
        *_same_page("tensor_attributes.html", "class", "torch.device", "torch.dtype"),
        *_generated("class", "torch.Generator", "torch.nn.Module"),
        *_generated(
            "method",
            "torch.Tensor.contiguous",
            "torch.Tensor.copy_",
            "torch.Tensor.index_copy_",
            "torch.Tensor.narrow",
            "torch.Tensor.to",
        ),
        *_generated("function", "torch.isnan", "torch.where"),
        *_generated("class", "torch.nn.parameter.Parameter"),
        (
            "torch.nn.Parameter",
            "class",
            "generated/torch.nn.parameter.Parameter.html#torch.nn.parameter.Parameter",
        ),
    ),
)

# The vLLM classes patchctx.vllm's backend derives from or takes (vLLM's API reference).
VLLM = Source(
    file="vllm.inv",
    project="vLLM",
    version="latest",
    base_url="https://docs.vllm.ai/en/latest/",
    entries=_same_page(
        "api/vllm/distributed/weight_transfer/base/",
        "class",
        *(
            f"vllm.distributed.weight_transfer.base.{name}"
            for name in (
                "TrainerInitInfo",
                "TrainerWeightTransferEngine",
                "WeightSource",
                "WeightTransferEngine",
                "WeightTransferInitInfo",
                "WeightTransferUpdateInfo",
            )
        ),
    ),
)

SOURCES = (PYTHON, TORCH, VLLM)


def inventory_bytes(source: Source) -> bytes:
    """The Sphinx ``objects.inv`` (version 2) content for `source`."""
    from mkdocstrings import Inventory

    inventory = Inventory(project=source.project, version=source.version)
    for name, role, uri in sorted(source.entries):
        inventory.register(name=name, domain="py", role=role, uri=uri)
    return inventory.format_sphinx()


def write_all(directory: Path = HERE) -> list[Path]:
    """Write every inventory file into `directory`; return their paths."""
    written = []
    for source in SOURCES:
        path = directory / source.file
        path.write_bytes(inventory_bytes(source))
        written.append(path)
    return written


def on_env(env: Environment, /, *, config: MkDocsConfig, files: Files) -> Environment:
    """Register every committed inventory's names with autorefs: the mkdocs hook (no network)."""
    from mkdocs_autorefs import AutorefsPlugin
    from mkdocstrings_handlers.python import PythonHandler

    autorefs = config.plugins["autorefs"]  # added by mkdocstrings when mkdocs.yml does not
    assert isinstance(autorefs, AutorefsPlugin)
    register = autorefs.register_url
    for source in SOURCES:
        with (HERE / source.file).open("rb") as stream:
            items = PythonHandler.load_inventory(stream, source.file, base_url=source.base_url)
            for identifier, url in items:
                register(identifier, url)
    return env


if __name__ == "__main__":
    for path in write_all():
        sys.stdout.write(f"wrote {path}\n")
