"""A worker's book of updates: who may send, what is open, what the weights have been at.

The backend's bookkeeping, apart from fetching and applying: the connected trainer, the update
being received (chunks held, none applied), every version the weights have been at (versions
never repeat) and every update committed. Each refusal here is raised before anything
changes, with the message the trainer acts on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from patchctx import InvalidPatchError
from patchctx.vllm._codec import PatchPayload
from patchctx.vllm._errors import UpdateConflictError, WeightVersionError

if TYPE_CHECKING:
    from patchctx.vllm._apply import WorkerPatcher
    from patchctx.vllm._backend import PatchctxInitInfo, PatchctxUpdateInfo

__all__ = ["OpenUpdate", "UpdateLedger"]

logger = logging.getLogger("patchctx.vllm")

Version = str | int | None


@dataclass
class OpenUpdate:
    """An update being received: its owner, versions and the chunks held (none applied)."""

    update_id: str
    trainer: str | None
    base: Version
    target: Version
    chunks: list[PatchPayload] = field(default_factory=list)
    complete: bool = False


class UpdateLedger:
    """The updates of one worker's weights: the connected trainer, the open update, history.

    Attributes:
        update: The update being received (chunks held, nothing applied), or `None`.
        trainer_id: The connected trainer (the last init); `None`: anonymous.
        served: Every version the worker's weights have been at, in order.
        commits: Every update applied: (update id, trainer id, target version), in order.
    """

    def __init__(self, rank: int, version: Version) -> None:
        self.rank = rank
        self.update: OpenUpdate | None = None
        self.trainer_id: str | None = None
        self.served: list[Version] = [version]
        self.commits: list[tuple[str, str | None, Version]] = []

    def owner(self) -> str | None:
        """The trainer an init must be: the open update's, else the connected one."""
        return self.update.trainer if self.update is not None else self.trainer_id

    def foreign(self, info: PatchctxUpdateInfo) -> bool:
        """Whether the chunk belongs to another update than the open one, or another trainer."""
        open_update = self.update
        if open_update is None or open_update.update_id == info.update_id:
            return False
        return info.trainer_id is None or info.trainer_id != open_update.trainer

    # -- connecting ------------------------------------------------------------------------

    def roll_back(self, info: PatchctxInitInfo) -> None:
        """Drop the open update (or an empty session) for the trainer connecting."""
        dropped = self.update
        self.update = None
        logger.warning(
            "patchctx: rank %d rolled back %s of trainer %r for trainer %r (%s); none of "
            "it was applied",
            self.rank,
            f"update {dropped.update_id!r}" if dropped is not None else "an empty session",
            dropped.trainer if dropped is not None else self.trainer_id,
            info.trainer_id,
            "takeover" if info.takeover else "its own init again",
        )

    def connect(self, info: PatchctxInitInfo) -> None:
        """The trainer of `info` is connected; an adopted version starts a new line."""
        if info.adopt_version:  # declared by whoever reloaded the weights: a new line
            self.served = [info.weight_version]
        self.trainer_id = info.trainer_id

    # -- receiving -------------------------------------------------------------------------

    def joined(
        self,
        open_update: OpenUpdate | None,
        info: PatchctxUpdateInfo,
        payload: PatchPayload,
        patcher: WorkerPatcher,
    ) -> OpenUpdate:
        """The update `payload` goes to, its versions checked (the first chunk opens it)."""
        if open_update is None:
            patcher.check_base(payload.base_version)
            self.check_target(payload.base_version, payload.target_version, patcher.version)
            return OpenUpdate(
                info.update_id or "",
                info.trainer_id,
                payload.base_version,
                payload.target_version,
            )
        if (payload.base_version, payload.target_version) != (
            open_update.base,
            open_update.target,
        ):
            raise InvalidPatchError(
                "the chunks of one update name different versions: "
                f"{open_update.base!r} -> {open_update.target!r} and "
                f"{payload.base_version!r} -> {payload.target_version!r}"
            )
        return open_update

    def check_target(self, base: Version, target: Version, version: Version) -> None:
        """Versions never repeat: the target is none the weights have been at."""
        if target is not None and target in self.served:
            raise WeightVersionError(
                f"the update's target version {target!r} is one these weights were at before "
                f"(versions served: {self.served[-8:]!r}): a version names one set of weights "
                "only; nothing was written",
                expected=base,
                found=version,
            )

    # -- finishing -------------------------------------------------------------------------

    def take_complete(self) -> OpenUpdate:
        """The open, complete update, now closed; `UpdateConflictError` if there is none."""
        if self.update is None or not self.update.complete:
            raise UpdateConflictError(
                "no complete update to finish: "
                + (
                    "no chunk arrived in this session"
                    if self.update is None
                    else f"update {self.update.update_id!r} has {len(self.update.chunks)} "
                    "chunk(s), not its last one yet (it stays open for its trainer)"
                )
                + "; nothing was applied, and no version is recorded"
            )
        open_update, self.update = self.update, None
        return open_update

    def committed(self, update: OpenUpdate, stats: Mapping[str, Any] | None) -> None:
        """`update` is applied: its target is a version served.

        With `stats` (of patchctx's own apply, not of a comparison's) it is a commit too,
        recorded and logged.
        """
        self.served.append(update.target)
        if stats is None:
            return
        self.commits.append((update.update_id, update.trainer, update.target))
        logger.info(
            "patchctx: rank %d applied update %r (%d patches, %d replayed, %d loader calls) "
            "in %.1f ms; weights now at version %r",
            self.rank,
            update.update_id,
            sum(len(chunk.patches) for chunk in update.chunks),
            stats["replayed"],
            stats["loader_calls"],
            stats["milliseconds"],
            stats["version"],
        )

    def drop(self, *, at_shutdown: bool = False) -> None:
        """Forget the open update (none of it was applied); logged `at_shutdown`."""
        if at_shutdown and self.update is not None:
            logger.warning(
                "patchctx: rank %d dropped update %r at shutdown; nothing of it was written",
                self.rank,
                self.update.update_id,
            )
        self.update = None
