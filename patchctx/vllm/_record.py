"""The trainer's record of what the workers hold: what its next diff starts from.

`remembered` copies a whole state into the record (reusing its tensors); `advance` writes an
update's patches into it, O(changed elements), bit for bit what `remembered` would make of the
state the patches were diffed to.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import torch

from patchctx import CheckpointWeightPatch
from patchctx._swap import builtin_copy

__all__ = ["advance", "kept_spares", "remembered", "storage_of"]


def storage_of(tensor: torch.Tensor) -> int:
    """Where `tensor`'s memory starts (its storage's address)."""
    return int(tensor.untyped_storage().data_ptr())


def advance(
    sent: dict[str, torch.Tensor],
    state: Mapping[str, torch.Tensor],
    patches: list[CheckpointWeightPatch],
    *,
    spare: dict[str, torch.Tensor] | None = None,
) -> bool:
    """Write `patches`, the diff from `sent` to `state`, into `sent`: O(changed), not a copy.

    `sent` then holds, bit for bit, what ``remember(state)`` would build: the diff's positions
    are where the bits of the cast differ, and its values are those bits. A tied name (a
    tensor of `state` that views another's elements) gets the patch sent under its twin. A
    dense patch's values (the diff's own copy, never a view of `state`) become the record.
    Returns whether it could; `False` (names, shapes or dtypes that differ, twins of another
    geometry) writes nothing, and the caller copies the state whole. Dense values that are
    `state`'s own memory (a caller's patches) are copied into the record, never adopted:
    the trainer writes its state again at its next step. A CPU record that dense values
    replace goes into `spare`, for the next diff to copy into (``buffers``).
    """
    if sent.keys() != state.keys():
        return False
    by_name = {patch.name: patch for patch in patches}
    if len(by_name) != len(patches):
        return False
    twins: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], list[str]] = {}
    for name, tensor in state.items():
        held = sent[name]
        if held.shape != tensor.shape or held.device != tensor.device:
            return False
        if tensor.numel() == 0:
            continue
        where = tensor.untyped_storage().data_ptr()
        offset = int(tensor.storage_offset())
        key = (where, offset, tuple(tensor.shape), tensor.stride(), tensor.dtype)
        twins.setdefault(key, []).append(name)
    if len({key[0] for key in twins}) != len(twins):
        return False  # tensors that overlap in other ways: the diff's own rules, a whole copy
    for names in twins.values():
        patched = [by_name[name] for name in names if name in by_name]
        if len(patched) == 1:  # sent once, under whichever twin the diff took first
            by_name.update(dict.fromkeys(names, patched[0]))
    for name, patch in by_name.items():
        record = sent.get(name)
        if record is None or patch.values.dtype != record.dtype or not record.is_contiguous():
            return False
        if patch.indices is None and patch.values.numel() != record.numel():
            return False
    uses = Counter(id(patch) for patch in by_name.values())
    states = {key[0] for key in twins}  # the storages of `state`'s tensors
    for name, patch in by_name.items():
        record = sent[name]
        if (
            patch.indices is None
            and uses[id(patch)] == 1
            and patch.values.is_contiguous()
            and patch.values.untyped_storage().data_ptr() not in states
        ):
            # The diff's dense values are its own copy, and spent once sent: they become
            # the record (a twin's record is a copy, so no two names share one).
            sent[name] = patch.values.view(record.shape)
            if spare is not None and record.device.type == "cpu":
                spare[name] = record  # whatever it held (a spare now the record) is gone
        elif patch.indices is None:
            builtin_copy(record.view(-1), patch.values.reshape(-1))
        else:
            record.view(-1).index_put_((patch.indices.to(torch.int64),), patch.values)
    return True


def kept_spares(
    spare: Mapping[str, torch.Tensor], record: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The `spare` buffers still of use: those of a name `record` holds in their shape.

    (One that came to share the record's memory is left out by the diff itself.)
    """
    return {
        name: buffer
        for name, buffer in spare.items()
        if name in record
        and record[name].shape == buffer.shape
        and record[name].dtype == buffer.dtype
    }


def remembered(
    held: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The record of `state`: a copy of each tensor, in `dtype` if it is floating.

    A tensor of `held` (the record so far) of the same shape, dtype and device is written in
    place, so a trainer that remembers at every step pays one copy, not a fresh allocation's
    page faults too; one shared with another name or with `state` is never written. The
    caller drops `held` first: cut short, this leaves nothing it could be mistaken for.
    """
    shared = Counter(storage_of(tensor) for tensor in held.values())
    given = {storage_of(tensor) for tensor in state.values()}
    record: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        # `dtype` is the receiver's for floating tensors only (as `diff_state_dicts` reads
        # it): an integer step counter or quantized weight stays exact, in its own dtype.
        want = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        old = held.get(name)
        if (
            old is not None
            and old.shape == tensor.shape
            and old.dtype == want
            and old.device == tensor.device
            and old.is_contiguous()
            and old.numel() > 0
            and shared[storage_of(old)] == 1
            and storage_of(old) not in given
        ):
            builtin_copy(old, tensor.detach())  # (a caller's masked region never applies)
            record[name] = old
        else:
            record[name] = tensor.detach().to(want, copy=True)
    return record
