"""Version chains in storage: a trainer publishes, workers follow, prepare, then apply briefly.

Layout at the store's root (a directory or an fsspec URL)::

    v00000001/manifest.json + patches-*.safetensors    an anchor (base_version null)
    v00000002/...                                      a delta   (base_version 1)
    ...

Folder ``v<k>`` (eight digits, zero padded) holds the update whose ``target_version`` is ``k``
(`save_patches`' format). Its manifest is written last and atomically, so a version exists
exactly when its manifest does. A **delta** has ``base_version = k - 1``: the changes since the
previous version. An **anchor** has ``base_version = null``: every tensor, dense; it applies
whatever the receiver holds, and restarts the chain. The publisher writes an anchor first, after
a restart, and then every `anchor_every` versions.

The **garbage-collection rule**: after publishing version ``k``, the publisher deletes every
version older than its `keep_anchors`-th newest anchor (manifest first, so a version vanishes
whole). A worker at a version at or above that anchor catches up by deltas; any other worker
(older, or restarted with its version unknown) restarts from the newest anchor, which is never
deleted, nor is anything after it.

A worker (`StorageFollower`) finds the newest published version, walks its chain back to its own
version (or to an anchor), reads, checks and decodes every file of the chain, merges the updates
into one patch per tensor and learns the routes of new sparse tensors, all while the model keeps
serving; `StorageFollower.apply` then loads the prepared patches in one atomic call. Any broken
link (a missing version, a torn or corrupted file, a version that does not continue the
worker's) is refused with `StoredUpdateError` before anything is applied.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from patchctx._diff import diff_state_dicts, receiver_dtype
from patchctx._errors import InvalidPatchTypeError, PatchProblem
from patchctx._load import RouteCache, load_checkpoint_weight_patches
from patchctx._lowbyte import LowByteDetector
from patchctx._model import SupportsLoadWeights, model_tensors
from patchctx._ordering import Coalesce
from patchctx._patch import CheckpointWeightPatch, check_patches
from patchctx._storage._errors import StoredUpdateError
from patchctx._storage._files import Store, SubStore, open_store
from patchctx._storage._format import (
    MANIFEST,
    UpdateManifest,
    decode_update,
    manifest_of,
    save_patches,
)
from patchctx._strategies import Auto, CopyStrategy

__all__ = ["PreparedUpdate", "PublishedVersion", "StorageFollower", "StoragePublisher"]

_Model = TypeVar("_Model", bound=SupportsLoadWeights)
_FOLDER = re.compile(r"v(\d{8,})")


def version_folder(version: int) -> str:
    """The folder of `version` at a store's root."""
    return f"v{version:08d}"


def published_versions(store: Store) -> list[int]:
    """The versions whose folder exists, ascending (a folder may still lack its manifest)."""
    found = []
    for name in store.listdir(""):
        match = _FOLDER.fullmatch(name)
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


def _positive(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidPatchTypeError(
            [PatchProblem(None, "", f"{what} must be a positive int, got {value!r}", True)]
        )
    return value


@dataclass(frozen=True, slots=True)
class PublishedVersion:
    """What `StoragePublisher.publish` wrote.

    Attributes:
        version: The version published.
        base_version: The version it applies to (`None`: an anchor).
        patches: How many patches it holds.
        nbytes: Bytes of its data files.
        removed: Versions the garbage-collection rule deleted after it.

    Examples:
        >>> from patchctx import PublishedVersion
        >>> PublishedVersion(3, 2, 5, 1024, ()).base_version
        2
    """

    version: int
    base_version: int | None
    patches: int
    nbytes: int
    removed: tuple[int, ...]


class StoragePublisher:
    """The trainer's side: publish each new state as a version (a delta, or a dense anchor).

    The publisher keeps a copy of what it last published, in the receiver's dtype, and diffs
    the next state against it (`diff_state_dicts`, by wire size: ``cost=None``). It starts
    after the newest version already in the store, with an anchor, since after a restart it
    cannot know what the store holds. Versions only increase.

    Args:
        location: A directory or an fsspec URL.
        anchor_every: Publish an anchor when this many versions have passed since the last.
        keep_anchors: Keep this many anchors and every version after the oldest of them.
        dtype: The receiver's dtype (as for `diff_state_dicts`); `None`: each tensor's own.
        strategy: The receiver's strategy (as for `diff_state_dicts`).
        lean: Find changes with a `LowByteDetector` (1 byte per element) instead of a copy
            of what was sent; its misses (see its recall) are repaired by the next anchor.

    Examples:
        >>> import tempfile, torch
        >>> from patchctx import StoragePublisher
        >>> publisher = StoragePublisher(tempfile.mkdtemp(), anchor_every=3)
        >>> state = {"w": torch.zeros(1000)}
        >>> versions = []
        >>> for step in range(5):
        ...     state["w"][step] = 1.0
        ...     versions.append(publisher.publish(state))
        >>> [(v.version, v.base_version) for v in versions]
        [(1, None), (2, 1), (3, 2), (4, None), (5, 4)]
    """

    def __init__(
        self,
        location: object,
        *,
        anchor_every: int = 10,
        keep_anchors: int = 2,
        dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
        strategy: CopyStrategy | None = None,
        lean: bool = False,
    ) -> None:
        self.store = open_store(location, "StoragePublisher")
        self.lean = bool(lean)
        self._detector: LowByteDetector | None = None
        self.anchor_every = _positive(anchor_every, "anchor_every")
        self.keep_anchors = _positive(keep_anchors, "keep_anchors")
        self.dtype = dtype
        self.strategy = strategy
        existing = published_versions(self.store)
        self.version = existing[-1] if existing else 0
        self._sent: dict[str, torch.Tensor] | None = None
        self._anchors = [v for v in existing if self._is_anchor(v)]
        self._last_anchor = 0

    def _receiver(self, name: str, tensor: torch.Tensor) -> torch.dtype:
        return receiver_dtype(self.dtype, name, tensor)

    def publish(self, state: Mapping[str, torch.Tensor]) -> PublishedVersion:
        """Publish `state` as the next version; returns what was written.

        Raises:
            InvalidPatchError: `state` does not diff against the last published one (names,
                shapes); nothing was written.
        """
        version = self.version + 1
        anchor = self._sent is None or version - self._last_anchor >= self.anchor_every
        if anchor:
            patches = [
                CheckpointWeightPatch(
                    name,
                    tuple(t.shape),
                    self._receiver(name, t),
                    t.detach().to(self._receiver(name, t)).reshape(-1).clone(),
                )
                for name, t in state.items()
            ]
            base = None
        elif self._detector is not None:
            patches = self._detector.diff(state)
            base = self.version
        else:
            assert self._sent is not None
            patches = diff_state_dicts(
                self._sent, state, dtype=self.dtype, strategy=self.strategy, cost=None
            )
            base = self.version
        manifest = save_patches(
            self._store_of(version),
            patches,
            base_version=base,
            target_version=version,
            metadata={"kind": "anchor" if anchor else "delta"},
        )
        if self.lean:
            if anchor:
                self._detector = LowByteDetector(state, dtype=self.dtype, strategy=self.strategy)
            self._sent = {}  # known to be published; the detector holds what was sent
        else:
            self._sent = {
                name: t.detach().to(self._receiver(name, t)).clone() for name, t in state.items()
            }
        self.version = version
        if anchor:
            self._last_anchor = version
            self._anchors.append(version)
        removed = self._collect()
        return PublishedVersion(
            version,
            base,
            len(patches),
            sum(size for size, _ in manifest.files.values()),
            removed,
        )

    def _is_anchor(self, version: int) -> bool:
        try:
            return manifest_of(self._store_of(version)).base_version is None
        except StoredUpdateError:  # unpublished or torn: not an anchor a worker can use
            return False

    def _store_of(self, version: int) -> SubStore:
        """The store of one version's folder."""
        return SubStore(self.store, version_folder(version))

    def _collect(self) -> tuple[int, ...]:
        """Apply the garbage-collection rule (see the module); the versions removed."""
        if len(self._anchors) < self.keep_anchors:
            return ()
        oldest_kept = self._anchors[-self.keep_anchors]
        self._anchors = self._anchors[-self.keep_anchors :]
        removed = []
        for version in published_versions(self.store):
            if version >= oldest_kept:
                break
            folder = SubStore(self.store, version_folder(version))
            folder.remove(MANIFEST)  # first: the version vanishes whole
            self.store.remove(version_folder(version))
            removed.append(version)
        return tuple(removed)


@dataclass(frozen=True, slots=True)
class PreparedUpdate:
    """A chain of versions fetched, checked, decoded and merged: ready to apply.

    Attributes:
        base_version: The version the model must hold to apply it (`None`: any; the chain
            starts at an anchor).
        target_version: The version the model holds after it.
        chain: The versions read, oldest first.
        patches: One patch per changed tensor (the chain merged, later versions winning).
        nbytes: Bytes of the data files read.
        seconds: Time spent preparing (fetch, checks, decode, merge, route learning).

    Examples:
        >>> from patchctx import PreparedUpdate
        >>> PreparedUpdate(4, 6, (5, 6), (), 0, 0.0).chain
        (5, 6)
    """

    base_version: int | None
    target_version: int
    chain: tuple[int, ...]
    patches: tuple[CheckpointWeightPatch, ...]
    nbytes: int
    seconds: float


class StorageFollower(Generic[_Model]):
    """The worker's side: follow a publisher's versions, prepare in the background, apply briefly.

    `poll` says the newest version published; `prepare` reads the chain from the model's
    version to it (everything that can fail, fails here, with nothing applied); `apply` loads
    a prepared update in one atomic call, optionally inside `pause` (for a serving engine,
    `pause_generation` / `resume_generation`); `sync` does all three.

    Args:
        location: The publisher's directory or fsspec URL.
        model: The model to keep in step (anything `load_checkpoint_weight_patches` takes).
        version: The version the model holds; `None` when unknown (a fresh or restarted
            worker): the first update then starts at an anchor.
        routes: The model's `RouteCache` (one is made when not given).
        strategy: The strategy sparse patches load with (default `Auto()`).
        pause: A function returning a context manager entered around each apply.

    Examples:
        >>> import tempfile, torch
        >>> from patchctx import StorageFollower, StoragePublisher
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for _, tensor in weights:
        ...             self.w.copy_(tensor)
        ...         return {"w"}
        >>> folder = tempfile.mkdtemp()
        >>> publisher = StoragePublisher(folder)
        >>> follower = StorageFollower(folder, Model())
        >>> state = {"w": torch.arange(8.0)}
        >>> _ = publisher.publish(state)
        >>> state["w"][3] = -1.0
        >>> _ = publisher.publish(state)
        >>> follower.sync(), follower.model.w.tolist()
        (2, [0.0, 1.0, 2.0, -1.0, 4.0, 5.0, 6.0, 7.0])
    """

    def __init__(
        self,
        location: object,
        model: _Model,
        *,
        version: int | None = None,
        routes: RouteCache | None = None,
        strategy: CopyStrategy | None = None,
        pause: Callable[[], AbstractContextManager[object]] | None = None,
    ) -> None:
        self.store = open_store(location, "StorageFollower")
        self.model = model
        self.version = version
        self.routes = RouteCache() if routes is None else routes
        self.strategy = Auto() if strategy is None else strategy
        self.pause = pause
        self._warmed: set[tuple[str, tuple[int, ...], torch.dtype]] = set()

    def _max_numel(self) -> int:
        """What one declared patch may hold: 16 times the model's elements (any layout)."""
        tensors = model_tensors(self.model)
        return 16 * max(1, sum(t.numel() for t in tensors.values()))

    def poll(self) -> int | None:
        """The newest version whose manifest is published (`None`: none yet)."""
        for version in reversed(published_versions(self.store)):
            if MANIFEST in self.store.listdir(version_folder(version)):
                return version
        return None

    def _manifest(self, version: int) -> UpdateManifest:
        folder = SubStore(self.store, version_folder(version))
        manifest = manifest_of(folder)
        where = folder.describe(MANIFEST)
        if manifest.target_version != version:
            raise StoredUpdateError(
                f"{where}: target_version is {manifest.target_version!r}, the folder says "
                f"{version} (mismatched update)",
                path=where,
            )
        base = manifest.base_version
        if base is not None and base != version - 1:
            raise StoredUpdateError(
                f"{where}: base_version {base} does not precede version {version}", path=where
            )
        return manifest

    def chain(self, target: int) -> list[tuple[int, UpdateManifest]]:
        """The manifests from the model's version (exclusive) or an anchor up to `target`.

        Raises:
            StoredUpdateError: A link is missing, torn or mismatched.
        """
        links: list[tuple[int, UpdateManifest]] = []
        version = target
        while True:
            try:
                manifest = self._manifest(version)
            except StoredUpdateError as error:
                raise StoredUpdateError(
                    f"the chain to version {target} is broken at version {version}: {error}",
                    path=error.path,
                ) from error
            links.append((version, manifest))
            if manifest.base_version is None or manifest.base_version == self.version:
                break
            version = manifest.base_version
            if self.version is not None and version < self.version:
                raise StoredUpdateError(
                    f"version {target} does not continue the model's version {self.version}",
                    path=self.store.describe(version_folder(target)),
                )
        links.reverse()
        return links

    def prepare(
        self, target: int | None = None, *, learn_routes: bool = True
    ) -> PreparedUpdate | None:
        """Fetch, check, decode and merge the chain to `target` (default: `poll`).

        Also learns the routes of sparse tensors not seen before (`RouteCache.warm`: a dry run,
        nothing written), unless `learn_routes` is false (the caller learns them its own way).
        Returns `None` when the model already holds `target` or newer, or nothing is
        published.

        Raises:
            StoredUpdateError: A link of the chain is missing, torn, corrupted or mismatched;
                nothing was applied.
        """
        start = time.perf_counter()
        if target is None:
            target = self.poll()
        if target is None or (self.version is not None and target <= self.version):
            return None
        links = self.chain(target)
        patches: list[CheckpointWeightPatch] = []
        nbytes = 0
        for version, manifest in links:
            folder = SubStore(self.store, version_folder(version))
            patches.extend(decode_update(folder, manifest, max_numel=self._max_numel()))
            nbytes += sum(size for size, _ in manifest.files.values())
        merged = tuple(
            item.patch for item in Coalesce().order(check_patches(patches, strategy=self.strategy))
        )
        if learn_routes:
            self._learn(merged)
        first = links[0][1]
        return PreparedUpdate(
            first.base_version,
            target,
            tuple(version for version, _ in links),
            merged,
            nbytes,
            time.perf_counter() - start,
        )

    def _learn(self, patches: Sequence[CheckpointWeightPatch]) -> None:
        specs = [
            (p.name, tuple(p.shape), p.dtype)
            for p in patches
            if p.indices is not None and (p.name, tuple(p.shape), p.dtype) not in self._warmed
        ]
        if specs:
            self.routes.warm(self.model, specs)
            self._warmed.update(specs)

    def apply(self, prepared: PreparedUpdate) -> int:
        """Load `prepared` in one atomic call (inside `pause`, if given); the new version.

        Raises:
            StoredUpdateError: The model no longer holds the version `prepared` starts from
                (stale); nothing was applied.
            PatchError: The load failed; the model is as it was (``atomic=True``).
        """
        if prepared.base_version is not None and prepared.base_version != self.version:
            raise StoredUpdateError(
                f"the prepared update goes from version {prepared.base_version} to "
                f"{prepared.target_version}; the model holds {self.version} (stale base)",
            )
        with self._paused():
            load_checkpoint_weight_patches(
                self.model,
                prepared.patches,
                routes=self.routes,
                strategy=self.strategy,
                atomic=True,
            )
        self.version = prepared.target_version
        return prepared.target_version

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        if self.pause is None:
            yield
            return
        with self.pause():
            yield

    def sync(self, target: int | None = None) -> int | None:
        """`prepare` then `apply`; the version applied, or `None` when there was nothing new."""
        prepared = self.prepare(target)
        if prepared is None:
            return None
        return self.apply(prepared)
