"""The guard: a dispatch mode on the loader's thread that sees the loader's *plain* operations.

Operations on staged data are handled by the data itself (`patchctx._staged`), in any thread.
What is left is what the loader does with plain tensors in its own thread: writes into model
tensors (constant fills, its own bookkeeping, dense patches) and reads of weights it has
already written. The guard reports each to the `WriteLedger` *before* the operation runs, so a
refused write never happens. ``out=`` writes into a model tensor are computed aside first, so a
result of the wrong shape is refused instead of resizing (reallocating) the weight; each output
of an operation with several gets a tensor of its own, and a temporary among them is written
as the loader asked.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_map

from patchctx import _ops
from patchctx._dispatch_mode import DispatchMode
from patchctx._errors import LoaderContractError
from patchctx._staged import StagedTensor
from patchctx._writes import Constant, WriteLedger, span_of, storage_key

__all__ = ["Guard", "constant_of"]


def constant_of(func: torch._ops.OpOverload, args: tuple[Any, ...]) -> Constant | None:
    """The value `func` fills its target with when it is a constant fill, else `None`."""
    if not _ops.rule(func).fill:
        return None
    value = args[1] if len(args) > 1 else 0  # (zero_)
    return value if isinstance(value, (bool, int, float, complex)) else None


class Guard(DispatchMode):
    """The dispatch mode of one loader call, on the thread that called the loader."""

    def __init__(self, ledger: WriteLedger) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ledger = ledger

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        try:
            return self._dispatch(func, args, kwargs or {})
        except LoaderContractError as error:
            if all(error is not known for known in self.ledger.refusals):
                self.ledger.refusals.append(error)  # even if the loader catches it
            raise

    def _dispatch(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        tensors = _ops.tensors_in((args, kwargs))
        if any(isinstance(t, StagedTensor) for t in tensors):
            return func(*args, **kwargs)  # the staged data handles it
        for tensor in _ops.host_reads(func, args, kwargs):  # the loader may decide on it
            self.ledger.host_read(tensor)
        rule = _ops.rule(func)
        targets = _ops.targets_of(func, args, kwargs)
        ledger = self.ledger
        if (ledger.masked or not ledger.performs) and rule.kind != "view":
            skipped = rule.pure_write or not ledger.performs  # (a dry run skips the write)
            for tensor in tensors:
                if not skipped or all(tensor is not t for t in targets):
                    ledger.read(tensor, func)
        for target in targets:
            ledger.input_write(target)  # a dense patch's values: undone when the call ends
        model_targets = [t for t in targets if ledger.index.owner(t) is not None]
        if len(model_targets) < len(targets):
            for target in targets:
                if all(target is not t for t in model_targets):
                    ledger.index.refuse_aliased(target, f"the loader, with {func},")
        if not model_targets:
            result = func(*args, **kwargs)
            ledger.lineage.derive(tensors, result)
            if ledger.lineage.sources:
                ledger.plain_sources(tensors, [], result)  # dense data carried on
            ledger.lineage.constancy(rule.lifts, tensors, targets, result)
            return result
        if ledger.lineage.sources:
            ledger.plain_sources(tensors, model_targets, None)  # before the write: kinds
        for target in model_targets:
            owner = ledger.index.owner(target)
            assert owner is not None
            if rule.reshaping:
                raise LoaderContractError(
                    f"the loader calls {func} on {owner.name!r}, changing its shape, strides or "
                    "storage; patch loads write in place; nothing was written"
                )
        if not ledger.performs:
            return ledger.skip(func, args, kwargs, targets)
        if rule.out:
            return self._out(func, args, kwargs, model_targets)
        for target in model_targets:
            ledger.plain_write(target, str(func), constant=constant_of(func, args))
        return func(*args, **kwargs)

    def _out(
        self,
        func: torch._ops.OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        targets: list[torch.Tensor],
    ) -> Any:
        """``op(..., out=weight)``: computed aside, refused if it would resize the weight.

        Every model tensor among the outputs gets a fresh tensor of its own (an operation with
        several outputs, ``aminmax`` or ``qr``, writes each into its own); the other outputs,
        the loader's temporaries, are written as the loader asked. Each result is checked
        against its weight's shape before any weight is written, then copied into it.
        """
        index = self.ledger.index
        spans = [span_of(target, storage_key(target) or 0) for target in targets]
        for i, span in enumerate(spans):
            for j in range(i):
                if span.overlaps(spans[j]):
                    owner = index.owner(targets[i])
                    raise LoaderContractError(
                        f"the loader writes two outputs of {func} into the same bytes of "
                        f"{owner.name if owner else 'a weight'!r}: which one lands there is "
                        "the kernel's choice; nothing was written"
                    )
        fresh: dict[int, torch.Tensor] = {}  # id(model target) -> the tensor computed aside
        back: dict[int, torch.Tensor] = {}  # id(fresh tensor) -> its model target

        def aside(value: Any, *, sized: bool) -> Any:
            if not isinstance(value, torch.Tensor) or all(value is not t for t in targets):
                return value
            if id(value) not in fresh:
                # Empty, so that a kernel resizes it silently and a result of the wrong shape is
                # refused below; the tensors of a list output come sized, as the *_copy kernels
                # (split_copy, unbind_copy...) that write them require.
                shape = value.shape if sized else (0,)
                tensor = torch.empty(shape, dtype=value.dtype, device=value.device)
                fresh[id(value)] = tensor
                back[id(tensor)] = value
            return fresh[id(value)]

        new_args = list(args)
        new_kwargs = dict(kwargs)
        for position, name in _ops.rule(func).writes:
            in_args = position < len(new_args)
            if not in_args and name not in new_kwargs:
                continue
            value = new_args[position] if in_args else new_kwargs[name]
            sized = isinstance(value, (list, tuple))
            value = tree_map(functools.partial(aside, sized=sized), value)
            if in_args:
                new_args[position] = value
            else:
                new_kwargs[name] = value
        result = func(*new_args, **new_kwargs)
        for target in targets:
            computed = fresh[id(target)]
            if computed.shape != target.shape:
                owner = index.owner(target)
                raise LoaderContractError(
                    f"the loader writes a {tuple(computed.shape)} result with {func} into "
                    f"{owner.name if owner else 'a weight'!r} of shape {tuple(target.shape)}: "
                    "it would be resized (reallocated); nothing was written"
                )
        for target in targets:
            self.ledger.plain_write(target, str(func), constant=None)
        for target in targets:
            target.copy_(fresh[id(target)])
        return tree_map(lambda value: back.get(id(value), value), result)
