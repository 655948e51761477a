"""Where stored updates live: a local directory or any fsspec URL, behind one small interface.

A `Store` reads whole files, writes whole files atomically (a reader sees the old file, the new
file, or none; never part of one), lists the entries of a folder and removes folders. A local
path needs nothing beyond the standard library; a URL (``s3://``, ``gs://``, ``memory://``,
``file://``...) needs fsspec (``pip install 'patchctx[storage]'``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Protocol

from patchctx._errors import InvalidPatchTypeError, PatchProblem

__all__ = ["LocalStore", "SizeMismatch", "Store", "SubStore", "URLStore", "open_store"]

_CHUNK = 8 << 20


class SizeMismatch(Exception):
    """A file is not the size it was expected to be.

    `found` is its size, or `None` when it changed size while it was read.
    """

    def __init__(self, found: int | None) -> None:
        super().__init__(found)
        self.found = found


def read_into_owned(file: Any, size: int) -> bytearray:
    """Exactly `size` bytes of an open binary `file`, into a buffer this process owns.

    One copy from the file (the page cache, or the fetched object) into a ``bytearray`` that
    nothing else can write: what is checked afterwards is what is used. A file shorter or
    longer than `size` while it is read raises `SizeMismatch(None)`.
    """
    buffer = bytearray(size)
    view = memoryview(buffer)
    done = 0
    while done < size:
        got = file.readinto(view[done : min(size, done + _CHUNK)])
        if not got:
            raise SizeMismatch(None)
        done += got
    if file.read(1):
        raise SizeMismatch(None)
    return buffer


class Store(Protocol):
    """A folder of files, as stored updates use it (paths are ``/``-separated, relative)."""

    def describe(self, name: str) -> str:
        """Where `name` is, for messages (a path or URL)."""
        ...

    def read(self, name: str) -> bytes:
        """The whole file; `FileNotFoundError` when there is none."""
        ...

    def read_exactly(self, name: str, size: int) -> bytearray:
        """The whole file, which must be `size` bytes, into a buffer only this process holds.

        The size is checked before anything is allocated (`SizeMismatch` with the file's
        size), so a manifest cannot make the reader allocate more than the file holds;
        `FileNotFoundError` when there is none.
        """
        ...

    def write(self, name: str, data: bytes) -> None:
        """Write the whole file atomically, creating its folders."""
        ...

    def listdir(self, name: str) -> list[str]:
        """The entry names of a folder (`[]` when it does not exist)."""
        ...

    def remove(self, name: str) -> None:
        """Remove a file, or a folder and everything in it (nothing when there is none)."""
        ...


class LocalStore:
    """A directory on a local filesystem.

    Files are written to a temporary name in their folder, flushed to disk, then renamed over
    their final name (`os.replace`, atomic on POSIX and Windows), and the folder is synced.

    Examples:
        >>> import tempfile
        >>> from patchctx._storage._files import LocalStore
        >>> store = LocalStore(tempfile.mkdtemp())
        >>> store.write("v1/a.txt", b"hello")
        >>> store.read("v1/a.txt"), store.listdir("v1")
        (b'hello', ['a.txt'])
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def describe(self, name: str) -> str:
        return str(self.root / name)

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def read_exactly(self, name: str, size: int) -> bytearray:
        with open(self.root / name, "rb", buffering=0) as file:
            found = os.fstat(file.fileno()).st_size
            if found != size:
                raise SizeMismatch(found)
            return read_into_owned(file, size)

    def write(self, name: str, data: bytes) -> None:
        final = self.root / name
        final.parent.mkdir(parents=True, exist_ok=True)
        temporary = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(temporary, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, final)
        finally:
            temporary.unlink(missing_ok=True)
        _sync_folder(final.parent)

    def listdir(self, name: str) -> list[str]:
        try:
            return sorted(entry.name for entry in (self.root / name).iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, name: str) -> None:
        target = self.root / name
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)


def _sync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (where the platform can open a folder)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


class URLStore:
    """A folder at an fsspec URL (``memory://``, ``file://``, ``s3://``, ``gs://``, ...).

    On a local filesystem a file is written under a temporary name and moved; on an object
    store one whole-object put is already atomic (the object appears complete or not at all).

    Examples:
        >>> from patchctx._storage._files import URLStore
        >>> store = URLStore("memory://patchctx-doc-store")
        >>> store.write("v1/a.txt", b"hello")
        >>> store.read("v1/a.txt"), store.listdir("v1")
        (b'hello', ['a.txt'])
        >>> store.remove("v1"); store.listdir("v1")
        []
    """

    def __init__(self, url: str) -> None:
        try:
            import fsspec.core  # type: ignore[import-untyped]
        except ImportError as error:  # pragma: no cover - the test environment has fsspec
            raise ImportError(
                f"storing updates at {url!r} needs fsspec: pip install 'patchctx[storage]'"
            ) from error
        self.url = url.rstrip("/")
        fs, root = fsspec.core.url_to_fs(self.url)
        self.fs: Any = fs
        self.root: str = root.rstrip("/")
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        self._local = "file" in protocols or "local" in protocols

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def describe(self, name: str) -> str:
        return f"{self.url}/{name}" if name else self.url

    def read(self, name: str) -> bytes:
        data = self.fs.cat_file(self._path(name))
        return bytes(data)

    def read_exactly(self, name: str, size: int) -> bytearray:
        path = self._path(name)
        found = int(self.fs.size(path))
        if found != size:
            raise SizeMismatch(found)
        with self.fs.open(path, "rb") as file:
            return read_into_owned(file, size)

    def write(self, name: str, data: bytes) -> None:
        path = self._path(name)
        parent = path.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if not self._local:
            self.fs.pipe_file(path, data)
            return
        leaf = path.rsplit("/", 1)[1]
        temporary = f"{parent}/.{leaf}.{uuid.uuid4().hex}.tmp"
        try:
            with self.fs.open(temporary, "wb") as file:
                file.write(data)
            self.fs.mv(temporary, path)
        finally:
            if self.fs.exists(temporary):
                self.fs.rm(temporary)

    def listdir(self, name: str) -> list[str]:
        path = self._path(name)
        try:
            entries = [str(entry).rstrip("/") for entry in self.fs.ls(path, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        own = path.rstrip("/")  # a file lists as itself
        return sorted({entry.rsplit("/", 1)[-1] for entry in entries if entry != own})

    def remove(self, name: str) -> None:
        path = self._path(name)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)


class SubStore:
    """A `Store` rooted at one folder of another (an update's folder in a version chain).

    Examples:
        >>> import tempfile
        >>> from patchctx._storage._files import LocalStore, SubStore
        >>> root = LocalStore(tempfile.mkdtemp())
        >>> SubStore(root, "v1").write("a.txt", b"x"); root.read("v1/a.txt")
        b'x'
    """

    def __init__(self, store: Store, folder: str) -> None:
        self.store, self.folder = store, folder

    def describe(self, name: str) -> str:
        return self.store.describe(f"{self.folder}/{name}")

    def read(self, name: str) -> bytes:
        return self.store.read(f"{self.folder}/{name}")

    def read_exactly(self, name: str, size: int) -> bytearray:
        return self.store.read_exactly(f"{self.folder}/{name}", size)

    def write(self, name: str, data: bytes) -> None:
        self.store.write(f"{self.folder}/{name}", data)

    def listdir(self, name: str) -> list[str]:
        return self.store.listdir(f"{self.folder}/{name}" if name else self.folder)

    def remove(self, name: str) -> None:
        self.store.remove(f"{self.folder}/{name}")


def open_store(location: object, what: str) -> Store:
    """The `Store` for a directory path or a URL (anything with ``://``); `what` names the call."""
    if isinstance(location, (LocalStore, URLStore, SubStore)):
        return location
    if isinstance(location, os.PathLike):
        return LocalStore(location)
    if isinstance(location, str):
        return URLStore(location) if "://" in location else LocalStore(location)
    raise InvalidPatchTypeError(
        [
            PatchProblem(
                None,
                "",
                f"{what}: path must be a directory (str or os.PathLike) or an fsspec URL, "
                f"got {location!r}",
                is_type_error=True,
            )
        ]
    )
