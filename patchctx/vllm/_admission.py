"""Who may connect to a worker, and which chunk may join its open update: the refusals.

Each rule reads the worker's `UpdateLedger` and raises before anything changes, with the
message the trainer acts on (`UpdateConflictError`, `WeightVersionError`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from patchctx.vllm._errors import UpdateConflictError, WeightVersionError
from patchctx.vllm._ledger import OpenUpdate, UpdateLedger, Version

if TYPE_CHECKING:
    from patchctx.vllm._backend import PatchctxInitInfo, PatchctxUpdateInfo

__all__ = ["admit", "check_init"]

logger = logging.getLogger("patchctx.vllm")


def check_init(
    ledger: UpdateLedger, info: PatchctxInitInfo, session_open: bool, version: Version
) -> None:
    """Every refusal of the init `info`, before anything changes."""
    busy = ledger.update is not None or session_open
    owner = ledger.owner()
    mine = info.trainer_id is not None and info.trainer_id == owner
    if busy and not mine and not info.takeover:
        what = (
            f"update {ledger.update.update_id!r} ({len(ledger.update.chunks)} chunk(s) held, "
            f"{'complete' if ledger.update.complete else 'not complete'})"
            if ledger.update is not None
            else "a weight-update session (started, no chunk yet)"
        )
        raise UpdateConflictError(
            f"{what} of trainer {owner!r} is open: trainer {info.trainer_id!r} cannot "
            "connect while it is. Wait for it to finish, or pass takeover=True to roll "
            "it back whole (none of it is applied) and connect; nothing changed"
        )
    declared = info.weight_version
    if declared is not None and not info.adopt_version and declared != version:
        raise WeightVersionError(
            f"the trainer declares its state at weight version {declared!r}; this worker's "
            f"weights are at {version!r}. Its differences would be applied "
            "to other weights than they were computed from (a trainer resumed from an "
            "older checkpoint?): send a full update from the served weights, or declare "
            "adopt_version=True only if the weights really are at that version; nothing "
            "changed",
            expected=declared,
            found=version,
        )


def admit(ledger: UpdateLedger, info: PatchctxUpdateInfo) -> OpenUpdate | None:
    """The open update the chunk joins (`None`: it opens one), or `UpdateConflictError`.

    A chunk of the open update's trainer for another update starts over: the open one is
    dropped (nothing of it was applied) before the chunk is read.
    """
    if (
        ledger.trainer_id is not None
        and info.trainer_id != ledger.trainer_id
        and (ledger.update is None or ledger.foreign(info))
    ):
        raise UpdateConflictError(
            f"a chunk of trainer {info.trainer_id!r}, but trainer {ledger.trainer_id!r} is "
            "the one connected (the last init_weight_transfer_engine): connect first; "
            "nothing changed"
        )
    open_update = ledger.update
    if open_update is not None and open_update.update_id != info.update_id:
        if ledger.foreign(info):
            raise UpdateConflictError(
                f"update {open_update.update_id!r} of trainer {open_update.trainer!r} is "
                f"open ({len(open_update.chunks)} chunk(s) held): a chunk of update "
                f"{info.update_id!r} cannot join or replace it. It stays open for its "
                "trainer; a takeover init rolls it back; nothing changed"
            )
        logger.warning(
            "patchctx: rank %d: trainer %r started update %r over its own open update %r "
            "(%d chunk(s) dropped, none applied)",
            ledger.rank,
            info.trainer_id,
            info.update_id,
            open_update.update_id,
            len(open_update.chunks),
        )
        ledger.drop()
        open_update = None
    if open_update is not None and open_update.complete:
        raise UpdateConflictError(
            f"update {info.update_id!r} is complete (its last chunk arrived): a further "
            "chunk is refused; finish it, or start another update"
        )
    expected = 0 if open_update is None else len(open_update.chunks)
    if info.chunk is not None and info.chunk != expected:
        raise UpdateConflictError(
            f"chunk {info.chunk} of update {info.update_id!r} arrived where chunk "
            f"{expected} was due (a chunk lost or sent twice); the update is dropped, "
            "nothing of it was applied"
        )
    return open_update
