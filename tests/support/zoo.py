"""The loader zoo: ordinary-looking loaders, each a way of writing a checkpoint tensor into a model.

Every entry is a tiny ``write(layer, w)`` that puts the checkpoint tensor ``w`` ([4, 6]) into
the layer's tensors, the way some real loader does (vLLM's, a hand-written one, a careless
one). The oracle (`check`) holds for each, whatever the dtype, strategy, ``atomic`` or routes:
a patch load gives **bit for bit what a dense load of the patched checkpoint through the same
loader gives**, or raises a `PatchError` and leaves the model **exactly as before** (values,
shapes, strides, dtypes, storages, and the same set of tensors).

Each entry also says what happens for float32: ``"masked"`` (the dense truth) or
``"refused"``. The docs' write-path table lists exactly these.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import ctypes
import functools
import io
import math
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from patchctx import (
    CheckpointWeightPatch,
    CopyStrategy,
    PatchError,
    RouteCache,
    load_checkpoint_weight_patches,
    masked_copy,
)
from tests.support.models import same_bits

Write = Callable[["ZooLayer", torch.Tensor], object]
Outcome = Literal["masked", "refused"]
SHAPE = (4, 6)


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values every dtype holds exactly enough: small integers for ints, normals for floats."""
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


class Norm(nn.Module):
    """A submodule with a [6] weight of any dtype (the zoo's loaders never patch it)."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(_random((6,), dtype, seed), requires_grad=False)


class ZooLayer(nn.Module):
    """A [4, 6] weight with neighbours: a tied head, a packed [2, 6], a scale buffer, a scalar.

    It also has a parameter slot and a buffer slot registered as ``None`` (``bias``,
    ``running``), as ``nn.Linear(bias=False)`` and ``BatchNorm(track_running_stats=False)`` do.
    """

    def __init__(self, write: Write, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(_random(SHAPE, dtype, seed), requires_grad=False)
        self.head = nn.Parameter(_random(SHAPE, dtype, seed + 1), requires_grad=False)
        self.other = nn.Parameter(_random((2, 6), dtype, seed + 2), requires_grad=False)
        self.one = nn.Parameter(_random((1,), dtype, seed + 3), requires_grad=False)
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.ones(4))
        self.norm = Norm(dtype, seed + 4)  # a submodule, never patched
        self.bias: nn.Parameter | None
        self.register_parameter("bias", None)
        self.running: torch.Tensor | None
        self.register_buffer("running", None)
        self.write = write
        self.cache: list[torch.Tensor] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.write(self, tensor)
        return {"weight"}


@dataclass(frozen=True)
class Entry:
    id: str
    write: Write
    outcome: Outcome
    does: str  # what the loader does, for the docs


ZOO: list[Entry] = []


def entry(id: str, outcome: Outcome, does: str) -> Callable[[Write], Write]:
    def register(write: Write) -> Write:
        ZOO.append(Entry(id, write, outcome, does))
        return write

    return register


def _rows(w: torch.Tensor) -> torch.Tensor:
    return torch.arange(w.shape[0])


def _in_thread(function: Callable[[], object]) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            function()
        except BaseException as error:  # re-raised in the loader's thread
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


# -- copy_ and its spellings --------------------------------------------------------------

entry("copy_", "masked", "`p.data.copy_(w)`")(lambda m, w: m.weight.data.copy_(w))
entry("copy_-non_blocking", "masked", "`p.data.copy_(w, non_blocking=True)`")(
    lambda m, w: m.weight.data.copy_(w, non_blocking=True)
)
entry("Tensor.copy_-unbound", "masked", "`torch.Tensor.copy_(p.data, w)`")(
    lambda m, w: torch.Tensor.copy_(m.weight.data, w)
)
entry("C-level-copy_", "masked", "`torch._C.TensorBase.copy_(p.data, w)`")(
    lambda m, w: torch._C.TensorBase.copy_(m.weight.data, w)
)
entry("copy_-on-parameter", "masked", "`p.copy_(w)` on the `Parameter` itself")(
    lambda m, w: m.weight.copy_(w)
)
entry("copy_-twice", "masked", "`p.data.copy_(w)` twice")(
    lambda m, w: (m.weight.data.copy_(w), m.weight.data.copy_(w))
)


@entry("setitem-basic-slice", "masked", "`p.data[1:] = w[1:]` then `p.data[0:1] = w[0:1]`")
def _setitem_slices(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data[1:] = w[1:]
    m.weight.data[0:1] = w[0:1]


@entry("setitem-ellipsis", "masked", "`p.data[...] = w`")
def _setitem_ellipsis(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data[...] = w


@entry("setitem-advanced-index", "masked", "`p.data[rows] = w` (`index_put_`)")
def _setitem_rows(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data[_rows(w)] = w


@entry("setitem-on-parameter", "masked", "`p[:] = w`")
def _setitem_param(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight[:] = w


@entry("setitem-bool-mask", "masked", "`p.data[m] = w[m]` with a boolean mask")
def _setitem_bool(m: ZooLayer, w: torch.Tensor) -> None:
    mask = torch.zeros(w.shape, dtype=torch.bool)
    mask[::2] = True
    m.weight.data[mask] = w[mask]
    m.weight.data[~mask] = w[~mask]


@entry("gather-then-advanced-setitem", "masked", "`p.data.view(-1)[i] = w.reshape(-1)[i]`")
def _gather_setitem(m: ZooLayer, w: torch.Tensor) -> None:
    flat = torch.arange(w.numel())
    m.weight.data.view(-1)[flat] = w.reshape(-1)[flat]


@entry("setitem-strided-columns", "masked", "`p.data[:, ::2] = w[:, ::2]`, then the odd ones")
def _setitem_columns(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data[:, ::2].copy_(w[:, ::2])
    m.weight.data[:, 1::2].copy_(w[:, 1::2])


# -- views, aliases, layout copies and casts ---------------------------------------------

entry("copy-of-detach", "masked", "`p.data.copy_(w.detach())`")(
    lambda m, w: m.weight.data.copy_(w.detach())
)
entry("copy-of-.data", "masked", "`p.data.copy_(w.data)`")(lambda m, w: m.weight.data.copy_(w.data))
entry("copy-of-Parameter(w)", "masked", "`p.data.copy_(nn.Parameter(w))`")(
    lambda m, w: m.weight.data.copy_(nn.Parameter(w, requires_grad=False))
)
entry("copy-of-a-cast", "masked", "`p.data.copy_(w.to(torch.float64))`")(
    lambda m, w: m.weight.data.copy_(w.to(torch.float64))
)
entry("copy-of-a-lossy-cast", "masked", "`p.data.copy_(w.half())`")(
    lambda m, w: m.weight.data.copy_(w.half())
)
entry("copy-of-cast-then-detach", "masked", "`p.data.copy_(w.to(torch.float64).detach())`")(
    lambda m, w: m.weight.data.copy_(w.to(torch.float64).detach())
)
entry("copy-of-cat-then-.data", "masked", "`p.data.copy_(torch.cat([w[:2], w[2:]]).data)`")(
    lambda m, w: m.weight.data.copy_(torch.cat([w[:2], w[2:]]).data)
)
entry("copy-via-empty_like", "masked", "`t = torch.empty_like(w); t.copy_(w); p.copy_(t)`")(
    lambda m, w: m.weight.data.copy_(torch.empty_like(w).copy_(w))
)
entry("copy-via-zeros_like", "masked", "`t = torch.zeros_like(w); t.copy_(w); p.copy_(t)`")(
    lambda m, w: m.weight.data.copy_(torch.zeros_like(w).copy_(w))
)
entry("copy-of-clone", "masked", "`p.data.copy_(w.clone())`")(
    lambda m, w: m.weight.data.copy_(w.clone())
)
entry("copy-of-contiguous-transpose", "masked", "`p.data.copy_(w.t().contiguous().t())`")(
    lambda m, w: m.weight.data.copy_(w.t().contiguous().t())
)
entry("copy-of-cat", "masked", "`p.data.copy_(torch.cat([w[:2], w[2:]]))`")(
    lambda m, w: m.weight.data.copy_(torch.cat([w[:2], w[2:]]))
)
entry("copy-of-stack-select", "masked", "`p.data.copy_(torch.stack([w])[0])`")(
    lambda m, w: m.weight.data.copy_(torch.stack([w])[0])
)
entry("copy-of-reshape-roundtrip", "masked", "`p.data.copy_(w.reshape(-1).view(4, 6))`")(
    lambda m, w: m.weight.data.copy_(w.reshape(-1).view(4, 6))
)
entry("copy-of-flip-twice", "masked", "`p.data.copy_(w.flip(0).flip(0))`")(
    lambda m, w: m.weight.data.copy_(w.flip(0).flip(0))
)
entry("copy-of-index_select", "masked", "`p.data.copy_(w.index_select(0, rows))`")(
    lambda m, w: m.weight.data.copy_(w.index_select(0, _rows(w)))
)
entry("copy-of-unsqueeze-squeeze", "masked", "`p.data.copy_(w.unsqueeze(0).squeeze(0))`")(
    lambda m, w: m.weight.data.copy_(w.unsqueeze(0).squeeze(0))
)
entry("copy-of-permute-contiguous", "masked", "`p.data.copy_(w.permute(1, 0).contiguous().T)`")(
    lambda m, w: m.weight.data.copy_(w.permute(1, 0).contiguous().T)
)
entry("copy-of-broadcast-row", "masked", "`p.data.copy_(w[0])` (a row broadcast to all rows)")(
    lambda m, w: m.weight.data.copy_(w[0])
)
entry("copy-of-expand", "masked", "`p.data.copy_(w[1:2].expand(4, 6))`")(
    lambda m, w: m.weight.data.copy_(w[1:2].expand(4, 6))
)


@entry("narrow-into-packed-halves", "masked", "two `narrow`s of `w` into two slices of `p`")
def _narrow_halves(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.narrow(0, 0, 2).copy_(w.narrow(0, 0, 2))
    m.weight.data.narrow(0, 2, 2).copy_(w.narrow(0, 2, 2))


entry("transposed-into-transposed", "masked", "`p.data.t().copy_(w.t())`")(
    lambda m, w: m.weight.data.t().copy_(w.t())
)


@entry("split-and-copy-each", "masked", "`for a, b in zip(p.split(1), w.split(1)): a.copy_(b)`")
def _split(m: ZooLayer, w: torch.Tensor) -> None:
    for a, b in zip(m.weight.data.split(1), w.split(1), strict=True):  # type: ignore[no-untyped-call]
        a.copy_(b)


entry("unbind-and-copy-each", "masked", "the rows of `w.unbind()` into `p.data[i]`")(
    lambda m, w: [m.weight.data[i].copy_(row) for i, row in enumerate(w.unbind())]
)


# -- byte-reinterpreting views --------------------------------------------------------------

entry("view-as-int-of-same-width", "masked", "`p.data.view(int).copy_(w.view(int))`, same width")(
    lambda m, w: m.weight.data.view(_int_of(w)).copy_(w.view(_int_of(w)))
)
entry("view-as-bytes", "masked", "`p.data.view(torch.uint8).copy_(w.view(torch.uint8))`")(
    lambda m, w: m.weight.data.view(torch.uint8).copy_(w.view(torch.uint8))
)
entry(
    "view-as-wider-int",
    "refused",
    "`p.data.view(torch.int64).copy_(w.view(torch.int64))`: elements of mixed bytes",
)(lambda m, w: m.weight.data.view(torch.int64).copy_(w.view(torch.int64)))
entry("untyped_storage-copy", "refused", "`p.untyped_storage().copy_(w.untyped_storage())`")(
    lambda m, w: m.weight.data.untyped_storage().copy_(w.untyped_storage())
)


def _int_of(tensor: torch.Tensor) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]


# -- computations ------------------------------------------------------------------------

entry("copy-of-arithmetic", "masked", "`p.data.copy_(w * 2)`")(
    lambda m, w: m.weight.data.copy_(w * 2)
)
entry("copy-of-nan_to_num", "masked", "`p.data.copy_(torch.nan_to_num(w))`")(
    lambda m, w: m.weight.data.copy_(torch.nan_to_num(w))
)
entry("copy-of-where-isnan", "masked", "`p.data.copy_(torch.where(torch.isnan(w), 0, w))`")(
    lambda m, w: m.weight.data.copy_(torch.where(torch.isnan(w), torch.zeros_like(w), w))
)
entry("copy-of-w-plus-w", "masked", "`p.data.copy_(w + w)` (two staged inputs that agree)")(
    lambda m, w: m.weight.data.copy_(w + w)
)
entry("copy-of-w-times-shifted-w", "refused", "`p.data.copy_(w * w.roll(1))`: inputs disagree")(
    lambda m, w: m.weight.data.copy_(w * w.roll(1))
)
entry("copy-of-abs-neg", "masked", "`p.data.copy_(-w.abs())`")(
    lambda m, w: m.weight.data.copy_(-w.abs())
)
entry("copy-of-matmul", "refused", "`p.data.copy_(w @ I)`: combines positions")(
    lambda m, w: m.weight.data.copy_(w @ torch.eye(6, dtype=w.dtype))
)
entry("copy-of-sum", "refused", "`p.data.copy_(w.sum(0, keepdim=True).expand(4, 6))`")(
    lambda m, w: m.weight.data.copy_(w.sum(0, keepdim=True).expand(4, 6))
)
entry("copy-of-softmax", "refused", "`p.data.copy_(w.softmax(-1))`")(
    lambda m, w: m.weight.data.copy_(w.softmax(-1))
)
entry("copy-of-sort", "refused", "`p.data.copy_(w.sort(-1).values)`")(
    lambda m, w: m.weight.data.copy_(w.sort(-1).values)
)
entry("staged-filled-in-place", "masked", "`p.data.copy_(w.fill_(0))`")(
    lambda m, w: m.weight.data.copy_(w.fill_(0))
)
entry("staged-zeroed-in-place", "masked", "`p.data.copy_(w.zero_())`")(
    lambda m, w: m.weight.data.copy_(w.zero_())
)
entry("staged-overwritten-by-copy_", "masked", "`p.data.copy_(w.copy_(torch.zeros_like(w)))`")(
    lambda m, w: m.weight.data.copy_(w.copy_(torch.zeros_like(w)))
)
entry("staged-scaled-in-place", "masked", "`w.mul_(2)`, then `p.data.copy_(w)`")(
    lambda m, w: m.weight.data.copy_(w.mul_(2))
)
entry("staged-clamped-in-place", "masked", "`w.clamp_(-1, 1)`, then `p.data.copy_(w)`")(
    lambda m, w: m.weight.data.copy_(w.clamp_(-1, 1))
)


@entry("staged-row-overwritten", "masked", "`w[0] = 0` (one staged row made known), then copy")
def _row_overwritten(m: ZooLayer, w: torch.Tensor) -> None:
    w[0] = 0
    m.weight.data.copy_(w)


# -- staged data combined with model state, out of place (a family) -------------------------
#
# Every arithmetic form below, with every kind of plain tensor beside the staged one: at a
# position the patch keeps, a dense load combines the checkpoint's value with that tensor as
# it is now, which the masked merge (keeping what the model holds) cannot follow. Each is
# refused before any write (with every index changed, as the hypothesis layer draws, it is the
# dense truth), whatever the strategy, dtype, atomic or routes.

# A tensor from outside the call (a module global the loader reads).
_OUTSIDE = torch.linspace(-2, 2, 24).reshape(SHAPE)


def _the_weight(m: ZooLayer) -> torch.Tensor:
    return m.weight


def _a_clone_of_the_weight(m: ZooLayer) -> torch.Tensor:
    return m.weight.detach().clone()


def _the_scale_buffer(m: ZooLayer) -> torch.Tensor:
    return m.scale[:, None]


def _a_scale_changed_in_the_call(m: ZooLayer) -> torch.Tensor:
    m.scale.mul_(2)  # the loader's own write, undone with the refusal
    return m.scale[:, None]


def _the_tied_head(m: ZooLayer) -> torch.Tensor:
    return m.head


def _a_norm_row(m: ZooLayer) -> torch.Tensor:
    return m.norm.weight


def _a_reduction_of_the_weight(m: ZooLayer) -> torch.Tensor:
    return m.weight.float().mean().to(m.weight.dtype)


def _an_outside_tensor(m: ZooLayer) -> torch.Tensor:
    return _OUTSIDE.to(m.weight.dtype)


MODEL_STATE: list[tuple[str, str, Callable[[ZooLayer], torch.Tensor]]] = [
    ("the-weight", "`p`", _the_weight),
    ("a-clone-of-the-weight", "`old = p.clone()`", _a_clone_of_the_weight),
    ("the-scale-buffer", "`scale[:, None]`", _the_scale_buffer),
    (
        "a-scale-changed-in-the-call",
        "`scale.mul_(2)`, then `scale[:, None]`",
        _a_scale_changed_in_the_call,
    ),
    ("the-tied-head", "`head`", _the_tied_head),
    ("a-norm-row", "`norm.weight`", _a_norm_row),
    ("a-reduction-of-the-weight", "`p.mean()`", _a_reduction_of_the_weight),
    ("an-outside-tensor", "a module global", _an_outside_tensor),
]


def _in_place_on_a_clone(m: ZooLayer, w: torch.Tensor, x: torch.Tensor) -> None:
    staged = w.clone()
    staged.add_(x)
    m.weight.data.copy_(staged)


def _diagonal(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.diag(torch.broadcast_to(x, w.shape)[0].to(w.dtype))


FORMS: list[tuple[str, str, Callable[[ZooLayer, torch.Tensor, torch.Tensor], object]]] = [
    ("w-plus", "`p.data.copy_(w + X)`", lambda m, w, x: m.weight.data.copy_(w + x)),
    ("plus-w", "`p.data.copy_(X + w)`", lambda m, w, x: m.weight.data.copy_(x + w)),
    (
        "w-times",
        "`p.data.copy_(w * X)` (a scale folded in)",
        lambda m, w, x: m.weight.data.copy_(w * x),
    ),
    (
        "lerp",
        "`p.data.copy_(torch.lerp(X, w, 0.5))`",
        lambda m, w, x: m.weight.data.copy_(torch.lerp(x, w, 0.5)),
    ),
    (
        "where",
        "`p.data.copy_(torch.where(X > 0, w, X))`",
        lambda m, w, x: m.weight.data.copy_(torch.where(x > 0, w, x)),
    ),
    (
        "maximum",
        "`p.data.copy_(torch.maximum(w, X))`",
        lambda m, w, x: m.weight.data.copy_(torch.maximum(w, x)),
    ),
    (
        "matmul",
        "`p.data.copy_(w @ torch.diag(X[0]))`",
        lambda m, w, x: m.weight.data.copy_(w @ _diagonal(w, x)),
    ),
    ("in-place-on-a-clone", "`t = w.clone(); t.add_(X); p.data.copy_(t)`", _in_place_on_a_clone),
    ("out=", "`torch.add(w, X, out=p.data)`", lambda m, w, x: torch.add(w, x, out=m.weight.data)),
]


def _combined_with(
    form: Callable[[ZooLayer, torch.Tensor, torch.Tensor], object],
    source: Callable[[ZooLayer], torch.Tensor],
) -> Write:
    return lambda m, w: form(m, w, source(m))


for _form, _form_does, _apply in FORMS:
    for _source, _source_does, _read in MODEL_STATE:
        entry(
            f"state-{_form}-{_source}",
            "refused",
            f"{_form_does}, X = {_source_does}",
        )(_combined_with(_apply, _read))


@entry(
    "state-joined-by-cat-then-combined",
    "refused",
    "`x = torch.cat([w[:2], head[2:]])`, then `p.data.copy_(x + w)`",
)
def _joined_then_combined(m: ZooLayer, w: torch.Tensor) -> None:
    joined = torch.cat([w[:2], m.head[2:]])
    m.weight.data.copy_(joined + w)


@entry(
    "state-copied-into-staged-then-combined",
    "refused",
    "`t = w.clone(); t[2:] = head[2:]`, then `p.data.copy_(t * w)`",
)
def _copied_in_then_combined(m: ZooLayer, w: torch.Tensor) -> None:
    staged = w.clone()
    staged[2:] = m.head[2:]
    m.weight.data.copy_(staged * w)


@entry(
    "state-joined-by-cat-and-copied",
    "masked",
    "`p.data.copy_(torch.cat([w[:2], head[2:]]))`: model state copied, combined with nothing",
)
def _joined_and_copied(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(torch.cat([w[:2], m.head[2:]]))


# Constants the loader makes during the call (a Python number torch turns into a tensor, a
# literal, a factory, an operation on constants alone) may meet kept positions: a dense load
# combines the checkpoint with the same values. One a model tensor was copied into is not one.

entry("const-where-with-a-number", "masked", "`p.data.copy_(torch.where(w > 0, w, 0.0))`")(
    lambda m, w: m.weight.data.copy_(torch.where(w > 0, w, 0.0))
)
entry("const-times-a-literal", "masked", "`p.data.copy_(w * torch.tensor(2.0))`")(
    lambda m, w: m.weight.data.copy_(w * torch.tensor(2.0))
)
entry("const-plus-a-full-tensor", "masked", "`p.data.copy_(w + torch.full((4, 6), 0.5))`")(
    lambda m, w: m.weight.data.copy_(w + torch.full(SHAPE, 0.5))
)
entry("const-plus-a-cast-literal", "masked", "`p.data.copy_(w + torch.tensor(1.5).to(w.dtype))`")(
    lambda m, w: m.weight.data.copy_(w + torch.tensor(1.5).to(w.dtype))
)
entry("const-plus-an-empty-filled", "masked", "`c = torch.empty(4, 6).fill_(1)`, then `w + c`")(
    lambda m, w: m.weight.data.copy_(w + torch.empty(SHAPE).fill_(1.0))
)


@entry(
    "const-holding-model-state",
    "refused",
    "`c = torch.zeros(4, 6); c.copy_(p)`, then `p.data.copy_(w + c)`",
)
def _constant_given_the_weight(m: ZooLayer, w: torch.Tensor) -> None:
    held = torch.zeros(SHAPE)
    held.copy_(m.weight)
    m.weight.data.copy_(w + held)


@entry(
    "const-view-given-model-state",
    "refused",
    "`c = torch.zeros(4, 6); c[1:].copy_(p[1:])`, then `p.data.copy_(w + c)`",
)
def _constant_view_given_the_weight(m: ZooLayer, w: torch.Tensor) -> None:
    held = torch.zeros(SHAPE)
    held[1:].copy_(m.weight[1:])
    m.weight.data.copy_(w + held)


# -- writes through aliases made around torch (a family) -----------------------------------
#
# A view of a slice of a model tensor made outside torch's view tracking has a storage of its
# own that starts inside the weight's (numpy, ctypes, from_numpy, frombuffer, DLPack): its
# writes would escape the undo log and protect=. Ownership is by byte range, so each such
# write is refused before it happens, whoever writes (the loader's own fill, staged data).


def _bytes_alias(tensor: torch.Tensor, how: str) -> torch.Tensor:
    """A tensor over the bytes of `tensor` (a slice of a model tensor), made around torch."""
    if how == "from_numpy":
        return torch.from_numpy(tensor.detach().numpy())
    if how == "frombuffer":
        size = tensor.numel() * tensor.element_size()
        raw = (ctypes.c_char * size).from_address(tensor.data_ptr())
        return torch.frombuffer(raw, dtype=tensor.dtype).view(tensor.shape)
    return torch.utils.dlpack.from_dlpack(tensor.detach())  # a DLPack capsule of the slice


ALIASES = ["from_numpy", "frombuffer", "from_dlpack"]
_NAMES = {"weight": "p", "head": "head", "other": "other"}


def _alias_fill(how: str, target: str) -> Write:
    def write(m: ZooLayer, w: torch.Tensor) -> None:
        m.weight.data.copy_(w)
        _bytes_alias(getattr(m, target).data[1:], how).fill_(1)

    return write


def _alias_copy(how: str) -> Write:
    def write(m: ZooLayer, w: torch.Tensor) -> None:
        m.weight.data[:1].copy_(w[:1])
        _bytes_alias(m.weight.data[1:], how).copy_(w[1:])

    return write


for _how in ALIASES:
    for _target in ("weight", "head", "other"):
        entry(
            f"alias-{_how}-of-a-slice-of-{_target}-filled",
            "refused",
            f"`p.data.copy_(w)`, then a `{_how}` alias of `{_NAMES[_target]}[1:]` filled",
        )(_alias_fill(_how, _target))
    entry(
        f"alias-{_how}-of-a-slice-takes-staged-data",
        "refused",
        f"`p.data[:1].copy_(w[:1])`, then a `{_how}` alias of `p[1:]` takes `w[1:]`",
    )(_alias_copy(_how))


# -- other in-place writes of staged data into a weight ----------------------------------

entry("index_copy_", "masked", "`p.data.index_copy_(0, rows, w)`")(
    lambda m, w: m.weight.data.index_copy_(0, _rows(w), w)
)
entry("masked_scatter_", "masked", "`p.data.masked_scatter_(ones, w)`")(
    lambda m, w: m.weight.data.masked_scatter_(torch.ones(w.shape, dtype=torch.bool), w)
)
entry("scatter_", "masked", "`p.data.scatter_(0, index, w)`")(
    lambda m, w: m.weight.data.scatter_(0, _rows(w).unsqueeze(1).expand(w.shape), w)
)
entry("torch.add-out", "masked", "`torch.add(w, 0, out=p.data)`")(
    lambda m, w: torch.add(w, 0, out=m.weight.data)
)
entry("torch.mul-out", "masked", "`torch.mul(w, 3, out=p.data)`")(
    lambda m, w: torch.mul(w, 3, out=m.weight.data)
)
entry("where-out-reading-the-weight", "refused", "`torch.where(c, p, w, out=p)`")(
    lambda m, w: torch.where(torch.isnan(w), m.weight.data, w, out=m.weight.data)
)
entry("add_", "refused", "`p.data.add_(w)`")(lambda m, w: m.weight.data.add_(w))
entry("inplace-operator", "refused", "`p.data += w`")(lambda m, w: m.weight.data.__iadd__(w))
entry("mul_0-then-add_", "refused", "`p.data.mul_(0).add_(w)`")(
    lambda m, w: m.weight.data.mul_(0).add_(w)
)
entry("index_add_", "refused", "`p.data.index_add_(0, rows, w)`")(
    lambda m, w: m.weight.data.index_add_(0, _rows(w), w)
)
entry("index_put-accumulate", "refused", "`p.data.index_put_((rows,), w, accumulate=True)`")(
    lambda m, w: m.weight.data.index_put_((_rows(w),), w, accumulate=True)
)
entry("lerp_", "refused", "`p.data.lerp_(w, 0.5)`")(lambda m, w: m.weight.data.lerp_(w, 0.5))
entry("torch.add-out-reading-the-weight", "refused", "`torch.add(p, w, out=p)`")(
    lambda m, w: torch.add(m.weight.data, w, out=m.weight.data)
)

# -- staged data as an index: a codebook-quantized weight, dequantized by the loader ---------
# The checkpoint tensor holds codes; the weight is the codebook looked up at them. A code the
# patch keeps is a placeholder in the staged data, not the checkpoint's code, so any lookup
# with it would fetch the wrong entry.


def _codes(w: torch.Tensor, count: int) -> torch.Tensor:
    """`w` read as integer codes in ``[0, count)``."""
    return w.long().remainder(count)


entry("dequantize-index_select", "refused", "`p.data.copy_(book.index_select(0, codes))`")(
    lambda m, w: m.weight.data.copy_(
        m.norm.weight.data.index_select(0, _codes(w, 6).reshape(-1)).view(SHAPE)
    )
)
entry("dequantize-take", "refused", "`p.data.copy_(torch.take(book, codes))`")(
    lambda m, w: m.weight.data.copy_(torch.take(m.norm.weight.data, _codes(w, 6)))
)
entry("dequantize-gather", "refused", "`p.data.copy_(book.expand(4, 6).gather(1, codes))`")(
    lambda m, w: m.weight.data.copy_(m.norm.weight.data.expand(SHAPE).gather(1, _codes(w, 6)))
)
entry("dequantize-getitem", "refused", "`p.data.copy_(book[codes])`")(
    lambda m, w: m.weight.data.copy_(m.norm.weight.data[_codes(w, 6)])
)


@entry("setitem-at-staged-positions", "refused", "`p.data.view(-1)[codes] = 0`")
def _setitem_at_codes(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    m.weight.data.view(-1)[_codes(w, 24)] = 0


@entry(
    "staged-index_fill_-at-staged-positions",
    "refused",
    "`t = w.clone(); t.view(-1).index_fill_(0, codes, 0); p.data.copy_(t)`",
)
def _index_fill_at_codes(m: ZooLayer, w: torch.Tensor) -> None:
    filled = w.clone()
    filled.view(-1).index_fill_(0, _codes(w, 24).reshape(-1), 0)
    m.weight.data.copy_(filled)


# -- out= operations with several outputs ----------------------------------------------------


@entry(
    "aminmax-out-into-a-neighbour-and-a-temporary",
    "masked",
    "`torch.aminmax(p, dim=0, out=(other[0], spare))`, then `other[1].copy_(spare)`",
)
def _aminmax_aside(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    spare = torch.empty(0, dtype=w.dtype)
    torch.aminmax(m.weight.data, dim=0, out=(m.other.data[0], spare))
    m.other.data[1].copy_(spare)


@entry(
    "aminmax-out-into-two-neighbour-rows",
    "masked",
    "`torch.aminmax(p, dim=0, out=(other[0], other[1]))`",
)
def _aminmax_rows(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    torch.aminmax(m.weight.data, dim=0, out=(m.other.data[0], m.other.data[1]))


@entry(
    "aminmax-out-twice-into-one-row",
    "refused",
    "`torch.aminmax(p, dim=0, out=(other[0], other[0]))`: which output lands is the kernel's",
)
def _aminmax_overlapping(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    torch.aminmax(m.weight.data, dim=0, out=(m.other.data[0], m.other.data[0]))


@entry(
    "sort-out-values-into-the-head",
    "masked",
    "`torch.sort(p, out=(head, order))` (int64 order aside), then `scale.copy_(order[:, 0])`",
)
def _sort_aside(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    order = torch.empty(0, dtype=torch.long)
    torch.sort(m.weight.data, dim=1, stable=True, out=(m.head.data, order))
    m.scale.copy_(order[:, 0])


@entry(
    "split_copy-out-into-a-neighbour-and-a-temporary",
    "masked",
    "`torch.split_copy(p, 2, out=[other, spare])`, then `head[:2].copy_(spare)`",
)
def _split_copy_aside(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    spare = torch.empty(2, 6, dtype=w.dtype)
    torch.split_copy(m.weight.data, 2, out=[m.other.data, spare])
    m.head.data[:2].copy_(spare)


# -- reading values out of torch ---------------------------------------------------------

entry("fill-from-item-of-a-changed-element", "refused", "`one.fill_(w.view(-1)[1].item())`")(
    lambda m, w: (m.weight.data.copy_(w), m.one.data.fill_(w.reshape(-1)[1].item()))
)
entry(
    "fill-from-item-of-an-unchanged-element",
    "refused",
    "`one.fill_(w.view(-1)[0].item())` (vLLM's `default_weight_loader` for a scalar)",
)(lambda m, w: m.one.data.fill_(w.reshape(-1)[0].item()))
entry("fill_-from-a-0-d-staged-tensor", "masked", "`one.fill_(w.view(-1)[1])`")(
    lambda m, w: (m.weight.data.copy_(w), m.one.data.fill_(w.reshape(-1)[1]))
)
entry("copy-of-tolist", "refused", "`p.data.copy_(torch.tensor(w.tolist()))`")(
    lambda m, w: m.weight.data.copy_(torch.tensor(w.tolist(), dtype=w.dtype))
)
entry("copy-of-numpy", "refused", "`p.data.copy_(torch.from_numpy(w.numpy()))`")(
    lambda m, w: m.weight.data.copy_(torch.from_numpy(w.numpy()))
)
entry("copy-of-pickle-roundtrip", "refused", "`p.data.copy_(pickle.loads(pickle.dumps(w)))`")(
    lambda m, w: m.weight.data.copy_(pickle.loads(pickle.dumps(w)))
)


# -- loaders that catch patchctx's refusal and carry on --------------------------------------
# The refusal is not the loader's to swallow: what it does next rests on data it could not see
# (a branch on a value, a fallback copy), so the load fails all the same.


@entry(
    "branch-on-item-swallowing-the-refusal",
    "refused",
    "`try: big = w.view(-1)[0].item() > 0` `except Exception: big = False`, then a copy",
)
def _branch_on_item(m: ZooLayer, w: torch.Tensor) -> None:
    try:
        big = bool(w.reshape(-1)[0].item() > 0)
    except Exception:
        big = False
    m.weight.data.copy_(w * 2 if big else w)


@entry(
    "add_-swallowing-the-refusal",
    "refused",
    "`try: p.data.add_(w)` `except Exception: p.data.copy_(w)`",
)
def _add_swallowed(m: ZooLayer, w: torch.Tensor) -> None:
    try:
        m.weight.data.add_(w)
    except Exception:
        m.weight.data.copy_(w)


@entry(
    "tolist-in-a-thread-swallowing-the-refusal",
    "refused",
    "another thread's `w.tolist()` fails and is ignored, then `p.data.copy_(w)`",
)
def _tolist_thread_swallowed(m: ZooLayer, w: torch.Tensor) -> None:
    with contextlib.suppress(Exception):
        _in_thread(lambda: w.tolist())
    m.weight.data.copy_(w)


@entry(
    "resize-swallowing-the-refusal",
    "refused",
    "`try: p.data.resize_(...)` `except Exception: pass`, then `p.data.copy_(w)`",
)
def _resize_swallowed(m: ZooLayer, w: torch.Tensor) -> None:
    with contextlib.suppress(Exception):
        m.weight.data.resize_(2 * w.numel())
    m.weight.data.copy_(w)


# -- branches on values that leave torch without .item() -------------------------------------
# A Python bool or a data-dependent shape carries values out of torch just the same: the loader
# can branch on it and write the kept elements differently.

entry(
    "branch-on-torch.equal",
    "refused",
    "`p.data.copy_(w * 2 if torch.equal(w[:1], w[1:2]) else w)`",
)(lambda m, w: m.weight.data.copy_(w * 2 if torch.equal(w[:1], w[1:2]) else w))
entry(
    "branch-on-nonzero-count",
    "refused",
    "`p.data.copy_(w * 2 if w.view(-1)[:3].nonzero().shape[0] > 1 else w)`",
)(lambda m, w: m.weight.data.copy_(w * 2 if w.reshape(-1)[:3].nonzero().shape[0] > 1 else w))
entry(
    "branch-on-masked_select-size",
    "refused",
    "`p.data.copy_(w * 2 if w.masked_select(w > 0).numel() > 3 else w)`",
)(lambda m, w: m.weight.data.copy_(w * 2 if w.masked_select(w > 0).numel() > 3 else w))


@entry("copy-of-torch.save-load", "refused", "`torch.save(w, buffer)`, then `torch.load`")
def _save_load(m: ZooLayer, w: torch.Tensor) -> None:
    buffer = io.BytesIO()
    torch.save(w, buffer)
    buffer.seek(0)
    m.weight.data.copy_(torch.load(buffer))


entry("copy-of-frombuffer", "refused", "`torch.frombuffer(w.numpy().tobytes(), ...)`")(
    lambda m, w: m.weight.data.copy_(
        torch.frombuffer(bytearray(w.numpy().tobytes()), dtype=w.dtype).view(w.shape)
    )
)
entry("copy-of-deepcopy", "masked", "`p.data.copy_(copy.deepcopy(w))`")(
    lambda m, w: m.weight.data.copy_(copy.deepcopy(w))
)

# -- the loader's own writes ---------------------------------------------------------------


@entry("zero-then-copy", "refused", "`p.data.zero_()`, then `p.data.copy_(w)`")
def _zero_then_copy(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.zero_()
    m.weight.data.copy_(w)


@entry("copy-then-scale", "refused", "`p.data.copy_(w)`, then `p.data.mul_(2)`")
def _copy_then_scale(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    m.weight.data.mul_(2)


@entry("copy-then-zero-padding", "masked", "`p.data[:3].copy_(w[:3])`, then `p.data[3:].fill_(0)`")
def _copy_then_pad(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data[:3].copy_(w[:3])
    m.weight.data[3:].fill_(0)


@entry("zero-padding-then-copy", "masked", "`p.data[3:].fill_(0)`, then `p.data[:3].copy_(w[:3])`")
def _pad_then_copy(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data[3:].fill_(0)
    m.weight.data[:3].copy_(w[:3])


@entry("tied-head-copied-from-weight", "masked", "`p.copy_(w)`, then `head.copy_(p)`")
def _tied_head(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    m.head.data.copy_(m.weight.data)


@entry("neighbour-derived-from-weight", "masked", "`p.copy_(w)`, then `other.copy_(p[:2] * 2)`")
def _derived_neighbour(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    m.other.data.copy_(m.weight.data[:2] * 2)


@entry("buffer-maintained-by-the-loader", "masked", "`p.copy_(w)`, then `scale.mul_(2)`")
def _scale_buffer(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    m.scale.mul_(2)


# -- structure: new, replaced, rebound, reshaped tensors ------------------------------------

entry("param.data-rebind", "refused", "`p.data = w.clone()`")(
    lambda m, w: setattr(m.weight, "data", w.clone())
)


@entry("param.data-rebind-to-a-slice", "refused", "`p.data = p.data[:1]`")
def _rebind_slice(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    m.weight.data = m.weight.data[:1]


entry("module-attribute-replaced", "refused", "`module.weight = nn.Parameter(w.clone())`")(
    lambda m, w: setattr(m, "weight", nn.Parameter(w.clone(), requires_grad=False))
)
entry("new-parameter", "refused", "`module.extra = nn.Parameter(w)`")(
    lambda m, w: setattr(m, "extra", nn.Parameter(w, requires_grad=False))
)
entry("new-buffer", "refused", "`module.register_buffer('extra', w.clone())`")(
    lambda m, w: m.register_buffer("extra", w.clone())
)
entry(
    "none-parameter-slot-filled",
    "refused",
    "`module.bias = nn.Parameter(w.clone())`, `bias` was `None`",
)(lambda m, w: setattr(m, "bias", nn.Parameter(w.clone(), requires_grad=False)))
entry("none-buffer-slot-filled", "refused", "`module.running = w.clone()`, the buffer was `None`")(
    lambda m, w: setattr(m, "running", w.clone())
)


@entry("new-submodule", "refused", "`module.sub = nn.Linear(6, 4)`, then copy into it")
def _new_submodule(m: ZooLayer, w: torch.Tensor) -> None:
    sub = nn.Linear(6, 4, dtype=w.dtype)
    m.sub = sub
    sub.weight.data.copy_(w)


@entry("submodule-replaced", "refused", "`module.norm = Norm()` (a fresh one), then `p.copy_(w)`")
def _submodule_replaced(m: ZooLayer, w: torch.Tensor) -> None:
    m.norm = Norm(w.dtype, seed=99)
    m.weight.data.copy_(w)


@entry("submodule-deleted", "refused", "`del module.norm`, then `p.copy_(w)`")
def _submodule_deleted(m: ZooLayer, w: torch.Tensor) -> None:
    del m.norm
    m.weight.data.copy_(w)


entry("as_strided_", "refused", "`p.as_strided_((24,), (1,))`")(
    lambda m, w: (m.weight.data.copy_(w), m.weight.as_strided_((24,), (1,)))
)
entry("t_", "refused", "`p.t_()` after the copy")(lambda m, w: (m.weight.copy_(w), m.weight.t_()))
entry("set_", "refused", "`p.data.set_(w.clone().untyped_storage())`")(
    lambda m, w: m.weight.data.set_(w.clone().untyped_storage())
)
entry("zeros-out-resizing", "refused", "`torch.zeros(8, 6, out=p.data)`")(
    lambda m, w: torch.zeros(8, 6, dtype=w.dtype, out=m.weight.data)
)

# -- temporaries and stashes ---------------------------------------------------------------

entry("copy-into-a-plain-temporary", "refused", "`t = torch.zeros(4, 6); t.copy_(w); p.copy_(t)`")(
    lambda m, w: m.weight.data.copy_(torch.zeros(w.shape, dtype=w.dtype).copy_(w))
)


@entry("stash-a-clone", "refused", "`p.copy_(w)`, then `self.cache.append(w.clone())`")
def _stash_clone(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    m.cache.append(w.clone())


@entry("stash-a-view", "refused", "`p.copy_(w)`, then `self.cache.append(w[1:])`")
def _stash_view(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.copy_(w)
    m.cache.append(w[1:])


# -- threads, regions, generators ----------------------------------------------------------

entry("copy-in-a-thread", "masked", "`threading.Thread(target=lambda: p.data.copy_(w))`")(
    lambda m, w: _in_thread(lambda: m.weight.data.copy_(w))
)


@entry("copy-in-a-thread-pool", "masked", "rows copied by a `ThreadPoolExecutor`")
def _pool(m: ZooLayer, w: torch.Tensor) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: m.weight.data[i].copy_(w[i]), range(4)))


@entry("zero-then-copy-in-a-thread", "refused", "`p.data.zero_()`, then a thread copies `w`")
def _zero_then_thread(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data.zero_()
    _in_thread(lambda: m.weight.data.copy_(w))


@entry("setitem-in-a-thread", "masked", "`p.data[rows] = w` in another thread")
def _setitem_thread(m: ZooLayer, w: torch.Tensor) -> None:
    _in_thread(lambda: m.weight.data.__setitem__(_rows(w), w))


@entry("copy-inside-a-masked_copy-region", "masked", "`with masked_copy(): p.data.copy_(w)`")
def _in_region(m: ZooLayer, w: torch.Tensor) -> None:
    with masked_copy():
        m.weight.data.copy_(w)


@entry("copy-from-a-generator", "masked", "a generator yields views of `w`, each copied")
def _generator(m: ZooLayer, w: torch.Tensor) -> None:
    def rows() -> Iterator[tuple[int, torch.Tensor]]:
        yield from enumerate(w)

    for i, row in rows():
        m.weight.data[i].copy_(row)


def _rounded(w: torch.Tensor) -> torch.Tensor:
    return w.float().round().to(w.dtype)


entry("copy-of-round-trip-through-float", "masked", "`p.data.copy_(w.float().round().to(dt))`")(
    lambda m, w: m.weight.data.copy_(_rounded(w))
)

# ----------------------------------------------------------------------------------- oracle


def full_state(model: nn.Module) -> dict[str, Any]:
    """Everything the contract says stays the same on refusal: names, layouts, storages, bits."""
    result: dict[str, Any] = {"modules": sorted(name for name, _ in model.named_modules())}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        result[name] = (
            tensor.detach().clone(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.storage_offset(),
            tensor.dtype,
            tensor.untyped_storage().data_ptr(),
            tensor.untyped_storage().nbytes(),
            type(tensor),
        )
    return result


def same_state(
    a: dict[str, Any], b: dict[str, Any], *, storages: bool = True, values: bool = True
) -> list[str]:
    """The entries of two `full_state`s that differ (values compared bit for bit)."""
    if a.keys() != b.keys():
        return [f"tensors: {sorted(a.keys() ^ b.keys())}"]
    different = []
    for name in a:
        if name == "modules":
            if a[name] != b[name]:
                different.append("modules")
            continue
        (va, *ma), (vb, *mb) = a[name], b[name]
        if not storages:
            ma, mb = ma[:4], mb[:4]
        if ma != mb or (values and not same_bits(va, vb)):
            different.append(name)
    return different


def patched(checkpoint: torch.Tensor, patch: CheckpointWeightPatch) -> torch.Tensor:
    result = checkpoint.clone()
    assert patch.indices is not None
    result.view(-1)[patch.indices] = patch.values.to(result.dtype)
    return result


def dense_load(model: ZooLayer, checkpoint: torch.Tensor) -> BaseException | None:
    with torch.no_grad():
        try:
            model.load_weights([("w", checkpoint.clone())])
        except Exception as error:
            return error
    model.cache.clear()
    return None


def _attempt(call: Callable[[], object]) -> Exception | None:
    try:
        call()
    except Exception as error:
        return error
    return None


@dataclass
class Verdict:
    outcomes: list[str]  # "masked" / "refused" / "failed" per patch, in order
    messages: list[str]


def check(
    write: Write,
    dtype: torch.dtype,
    patches: list[CheckpointWeightPatch],
    *,
    strategy: CopyStrategy | None,
    atomic: bool,
    routes: bool,
    seed: int = 0,
) -> Verdict:
    """Apply `patches` one call at a time and hold each call to the oracle (see module doc)."""
    base = ZooLayer(write, dtype, seed)
    checkpoint = _random(SHAPE, dtype, seed + 10)
    fresh = full_state(base)
    if dense_load(base, checkpoint) is not None:
        return Verdict(["loader-fails-densely"], [])
    if same_state(full_state(base), fresh, values=False):
        # The loader changes the model's structure (rebinds, reshapes, adds tensors): a patch
        # load must refuse it, with nothing changed.
        model = ZooLayer(write, dtype, seed)
        before = full_state(model)
        error = _attempt(
            lambda: load_checkpoint_weight_patches(
                model, patches[:1], strategy=strategy, atomic=atomic
            )
        )
        model.cache.clear()
        assert isinstance(error, PatchError), f"a structure-changing loader gave {error!r}"
        changed = same_state(full_state(model), before)
        assert not changed, f"refused ({error}) but changed {changed}"
        return Verdict(["refused"], [str(error)])
    truth, model = copy.deepcopy(base), copy.deepcopy(base)
    cache = RouteCache() if routes else None
    verdict = Verdict([], [])
    for patch in patches:
        checkpoint = patched(checkpoint, patch)
        before = full_state(model)
        failed = dense_load(truth, checkpoint)
        error = _attempt(
            functools.partial(
                load_checkpoint_weight_patches,
                model,
                [patch],
                strategy=strategy,
                atomic=atomic,
                routes=cache,
            )
        )
        model.cache.clear()
        if error is not None:
            if not isinstance(error, PatchError):
                assert failed is not None, f"the patch load raised {error!r}; the dense did not"
            changed = same_state(full_state(model), before)
            assert not changed, f"refused ({error!r}) but changed {changed}"
            verdict.outcomes.append("refused" if isinstance(error, PatchError) else "failed")
            verdict.messages.append(str(error))
            return verdict
        assert failed is None, f"the dense load raised {failed!r}; the patch load did not"
        differ = same_state(full_state(model), full_state(truth), storages=False)
        assert not differ, f"not the dense truth: {differ}"
        after = full_state(model)
        assert all(after[n][5] == before[n][5] for n in before if n != "modules"), "reallocated"
        verdict.outcomes.append("masked")
    return verdict


def sparse(indices: list[int], values: list[float], dtype: torch.dtype) -> CheckpointWeightPatch:
    tensor = torch.tensor(values, dtype=torch.float64)
    if not dtype.is_floating_point:
        tensor = tensor.round()
    return CheckpointWeightPatch(
        "w", SHAPE, dtype, tensor.to(dtype), torch.tensor(indices, dtype=torch.long)
    )


# -------------------------------------------------------- loaders over names (accounting)
#
# Each is ``write(layer, name, w)`` for a layer with a float weight [4, 6], a float norm [6]
# and int32 codes [6], the way a real loader handles the names it is given: vLLM's skip the
# names they do not know, hand-written ones raise their own errors, and copy_ casts. The
# oracle (`check_named`): bit for bit the dense load through the same loader, or a
# `PatchError` naming the patch with the model exactly as before.

NamedWrite = Callable[["NamedLayer", str, torch.Tensor], object]


class NamedLayer(nn.Module):
    """Three tensors a loader finds by name: ``weight`` [4, 6], ``norm`` [6], ``codes`` [6]."""

    def __init__(self, write: NamedWrite, seed: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(_random(SHAPE, torch.float32, seed), requires_grad=False)
        self.norm = nn.Parameter(_random((6,), torch.float32, seed + 1), requires_grad=False)
        self.codes: torch.Tensor
        self.register_buffer("codes", _random((6,), torch.int32, seed + 2))
        self.write = write

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "norm": self.norm, "codes": self.codes}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            self.write(self, name, tensor)
            loaded.add(name)
        return loaded


def _skip_unknown(m: NamedLayer, name: str, w: torch.Tensor) -> None:
    target = m.tensors().get(name)
    if target is not None:  # vLLM: `if name not in params_dict: continue`
        target.data.copy_(w)


def _raise_unknown(m: NamedLayer, name: str, w: torch.Tensor) -> None:
    m.tensors()[name].data.copy_(w)  # a KeyError for a name it does not know


def _cast_then_copy(m: NamedLayer, name: str, w: torch.Tensor) -> None:
    target = m.tensors()[name]
    target.data.copy_(w.to(target.dtype))  # an explicit cast before the copy


def _narrow_rows(m: NamedLayer, name: str, w: torch.Tensor) -> None:
    target = m.tensors()[name]
    if w.shape != target.shape:  # a loader's own error for a tensor of the wrong shape
        raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} != {tuple(target.shape)}")
    for i in range(w.shape[0]):
        target.data[i].copy_(w[i])


NAMED_ZOO: dict[str, NamedWrite] = {
    "skips-unknown-names": _skip_unknown,
    "raises-for-unknown-names": _raise_unknown,
    "casts-then-copies": _cast_then_copy,
    "checks-shapes-copies-rows": _narrow_rows,
}


def dense_named(layer: NamedLayer, name: str, checkpoint: torch.Tensor) -> Exception | None:
    """A dense load of `checkpoint` under `name` through the layer's loader."""
    with torch.no_grad():
        try:
            layer.load_weights([(name, checkpoint.clone())])
        except Exception as error:
            return error
    return None


def check_named(
    write: NamedWrite,
    patch: CheckpointWeightPatch,
    *,
    atomic: bool,
    routes: bool,
    strict: bool = True,
    kind_casts: bool = False,
) -> str:
    """Hold one patch load to the oracle; return ``"exact"`` or ``"refused"``."""
    model, truth = NamedLayer(write), NamedLayer(write)
    target = truth.tensors().get(patch.name)
    if target is None:  # a name the model does not have: the checkpoint holds it anyway
        checkpoint = torch.zeros(patch.shape, dtype=patch.dtype)
    else:
        checkpoint = target.detach().clone().to(patch.dtype).reshape(-1)
        if checkpoint.numel() != math.prod(patch.shape):
            checkpoint = torch.zeros(patch.shape, dtype=patch.dtype)
    checkpoint = checkpoint.reshape(patch.shape).clone()
    if patch.indices is None:
        checkpoint = patch.values.to(patch.dtype).reshape(patch.shape).clone()
    else:
        checkpoint.view(-1)[patch.indices] = patch.values.to(patch.dtype)
    before = full_state(model)
    failed = dense_named(truth, patch.name, checkpoint)
    error = _attempt(
        functools.partial(
            load_checkpoint_weight_patches,
            model,
            [patch],
            atomic=atomic,
            routes=RouteCache() if routes else None,
            strict=strict,
            kind_casts=kind_casts,
        )
    )
    if error is not None:
        assert isinstance(error, PatchError), f"not a PatchError: {error!r}"
        assert f"'{patch.name}'" in str(error), f"the error does not name the patch: {error}"
        if failed is not None and not isinstance(error.__cause__, PatchError | None):
            assert type(error.__cause__) is type(failed), (error.__cause__, failed)
        changed = same_state(full_state(model), before)
        assert not changed, f"refused ({error}) but changed {changed}"
        return "refused"
    assert failed is None, f"the dense load raised {failed!r}; the patch load did not"
    differ = same_state(full_state(model), full_state(truth), storages=False)
    assert not differ, f"not the dense truth: {differ}"
    return "exact"
