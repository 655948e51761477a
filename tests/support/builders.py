"""Hypothesis builders, all in one place: sparse patches, values with special floats, models."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from patchctx import CheckpointWeightPatch
from patchctx._strategies import indexable
from tests.support.models import Spec, ToyModel, packed_tp_model, random_tensor

SPECIAL_FLOATS = [0.0, -0.0, float("inf"), float("-inf"), 1e-40, -1e-45, 65504.0, 3.0e38]


@dataclass(frozen=True)
class Sparse:
    """A sparse patch in checkpoint coordinates (flat row-major indices)."""

    name: str
    spec: Spec
    indices: torch.Tensor
    values: torch.Tensor

    def apply_to(self, full: torch.Tensor) -> torch.Tensor:
        """The dense reference: the full checkpoint tensor with this patch applied."""
        patched = full.clone()
        patched.view(-1)[self.indices.long()] = self.values.to(self.spec.dtype)
        return patched


@st.composite
def sparse_values(
    draw: st.DrawFn,
    count: int,
    dtype: torch.dtype,
    *,
    allow_nan: bool,
    seed: int,
    forbid: int | None = None,
) -> torch.Tensor:
    """`count` values for `dtype`: random ones plus drawn special floats (or integer extremes)."""
    generator = torch.Generator().manual_seed(seed)
    values = random_tensor((count,), dtype, generator)
    if count and dtype.is_floating_point:
        specials = SPECIAL_FLOATS + ([float("nan")] if allow_nan else [])
        chosen = draw(st.lists(st.sampled_from(specials), max_size=min(count, 4)))
        for i, v in enumerate(chosen):
            values[i] = v
        if not allow_nan:
            values = torch.where(torch.isnan(values), torch.zeros_like(values), values)
    elif count and not dtype.is_floating_point and dtype != torch.bool:
        info = torch.iinfo(dtype)
        chosen_int = draw(
            st.lists(
                st.sampled_from([info.min, info.max, 0, -1 if info.min else 1]),
                max_size=min(count, 3),
            )
        )
        for i, iv in enumerate(chosen_int):
            values[i] = iv
    if forbid is not None:
        values = torch.where(values == forbid, torch.zeros_like(values), values)
    return values


@st.composite
def sparse_patch(
    draw: st.DrawFn,
    name: str,
    spec: Spec,
    *,
    allow_nan: bool = False,
    forbid: int | None = None,
    index_dtype: torch.dtype | None = None,
) -> Sparse:
    """A sparse patch for `name`: unique indices at a drawn density, sorted or not."""
    numel = math.prod(spec.shape)
    density = draw(st.sampled_from([0.0, 0.001, 0.05, 0.3, 1.0]))
    count = min(numel, max(0, round(numel * density)) or (1 if density else 0))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(numel, generator=generator)[:count]
    if draw(st.booleans()):
        indices = indices.sort().values
    chosen_dtype = index_dtype or draw(st.sampled_from([torch.int32, torch.int64]))
    values = draw(sparse_values(count, spec.dtype, allow_nan=allow_nan, seed=seed, forbid=forbid))
    return Sparse(name, spec, indices.to(chosen_dtype), values)


@st.composite
def tp_models(
    draw: st.DrawFn, dtypes: list[torch.dtype] | None = None
) -> tuple[ToyModel, dict[str, object]]:
    """A packed tensor-parallel toy model at a drawn rank, with the arguments that built it."""
    tp_size = draw(st.sampled_from([1, 2, 4]))
    kwargs: dict[str, object] = {
        "tp_size": tp_size,
        "tp_rank": draw(st.integers(0, tp_size - 1)),
        "kv_heads": draw(st.sampled_from([1, 2, 4])),
        "dtype": draw(st.sampled_from(dtypes or [torch.float32, torch.bfloat16, torch.float16])),
    }
    return packed_tp_model(**kwargs), kwargs  # type: ignore[arg-type]


@st.composite
def dense_values(draw: st.DrawFn, spec: Spec, *, allow_nan: bool = True) -> torch.Tensor:
    """A whole tensor's worth of values, flattened (dense patches may carry NaN)."""
    seed = draw(st.integers(0, 2**31 - 1))
    numel = math.prod(spec.shape)
    return draw(sparse_values(numel, spec.dtype, allow_nan=allow_nan, seed=seed))


@st.composite
def patch_sequences(
    draw: st.DrawFn,
    specs: dict[str, Spec],
    *,
    max_size: int = 6,
    kinds: tuple[str, ...] = ("dense", "sparse"),
    forbid_int_min: bool = True,
) -> list[CheckpointWeightPatch]:
    """Patch sequences with repeated names, dense and sparse mixed, int32 and int64 indices."""
    names = sorted(specs)
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=max_size))
    patches = []
    for name in chosen:
        spec = specs[name]
        kind = draw(st.sampled_from(kinds))
        if kind == "dense":
            values = draw(dense_values(spec, allow_nan=spec.dtype.is_floating_point))
            patches.append(CheckpointWeightPatch(name, spec.shape, spec.dtype, values))
        else:
            forbid = None
            if forbid_int_min and not spec.dtype.is_floating_point:
                forbid = torch.iinfo(spec.dtype).min
            sparse = draw(sparse_patch(name, spec, forbid=forbid))
            patches.append(
                CheckpointWeightPatch(name, spec.shape, spec.dtype, sparse.values, sparse.indices)
            )
    return patches


# ------------------------------------------------------------------ state dicts for diffing

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _sign_bit(as_int: torch.dtype) -> int:
    return 0x80 if as_int == torch.uint8 else torch.iinfo(as_int).min


def nan_with_payload(dtype: torch.dtype, payload: int, *, negative: bool = False) -> torch.Tensor:
    """A 0-d NaN of `dtype` whose low mantissa bits are OR-ed with `payload` (still a NaN)."""
    nan = torch.full((), float("nan"), dtype=dtype)
    as_int = _INT_OF_WIDTH[nan.element_size()]
    raw = nan.view(as_int) | payload
    if negative:
        raw = raw | _sign_bit(as_int)
    return raw.view(dtype)


def _special_values(dtype: torch.dtype) -> list[torch.Tensor]:
    """0-d values worth putting into weights of `dtype` (signed zeros, infinities, NaNs)."""
    if dtype == torch.bool:
        return [torch.tensor(True), torch.tensor(False)]
    if dtype.is_complex:
        return [
            torch.tensor(complex(-0.0, 0.0), dtype=dtype),
            torch.tensor(complex(float("nan"), 1.0), dtype=dtype),
            torch.tensor(complex(float("inf"), -0.0), dtype=dtype),
        ]
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return [torch.tensor(v, dtype=dtype) for v in (info.min, info.max, 0)]
    values = [torch.tensor(v, dtype=torch.float64).to(dtype) for v in SPECIAL_FLOATS]
    values += [nan_with_payload(dtype, p) for p in (0, 1, 2)]
    values.append(nan_with_payload(dtype, 1, negative=True))
    return values


def _twin(value: torch.Tensor) -> torch.Tensor:
    """A value that differs from `value` only in bits people forget: the sign of a zero or an
    infinity, a NaN's payload; or `value` itself (then it is not a change)."""
    dtype = value.dtype
    if dtype == torch.bool or dtype.is_complex or not dtype.is_floating_point:
        return value.clone()
    as_int = _INT_OF_WIDTH[value.element_size()]
    raw = value.view(as_int)
    if torch.isnan(value.to(torch.float32)):
        return (raw ^ 3).view(dtype) if value.element_size() > 1 else value.clone()
    return (raw ^ _sign_bit(as_int)).view(dtype)


@st.composite
def state_dict_pairs(
    draw: st.DrawFn,
    specs: dict[str, Spec],
    *,
    trainer_dtypes: dict[str, torch.dtype] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(old, new) state dicts over `specs` (held in `trainer_dtypes` where given).

    `old` holds random weights with special values (signed zeros, infinities, NaNs with
    payloads, integer extremes) at drawn positions. Each tensor of `new` is drawn as: an equal
    copy, a few changed elements (special values included), the special
    positions flipped to their twins (-0.0 for 0.0, another NaN payload, ...), tiny relative
    noise (floats), or a fresh tensor.
    """
    old: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        dtype = (trainer_dtypes or {}).get(name, spec.dtype)
        seed = draw(st.integers(0, 2**31 - 1))
        generator = torch.Generator().manual_seed(seed)
        before = random_tensor(spec.shape, dtype, generator)
        numel = before.numel()
        flat = before.view(-1)
        specials = _special_values(dtype)
        special_at = torch.randperm(numel, generator=generator)[: min(numel, len(specials))]
        for position, value in zip(special_at.tolist(), specials, strict=False):
            flat[position] = value
        old[name] = before
        # Never the same object: `old` sharing storage with `new` is refused (what was sent
        # must be a copy; tests/test_diff.py checks the refusal).
        kinds = ["copy", "sparse", "twins", "fresh"]
        if dtype.is_floating_point:
            kinds.append("noise")
        kind = draw(st.sampled_from(kinds))
        after = before.clone()
        if kind == "sparse" and numel:
            density = draw(st.sampled_from([0.01, 0.1, 0.3, 0.5, 1.0]))
            count = max(1, round(numel * density))
            positions = torch.randperm(numel, generator=generator)[:count]
            if dtype.is_complex:
                values = random_tensor((count,), dtype, generator)
            else:
                values = draw(sparse_values(count, dtype, allow_nan=True, seed=seed))
            indexable(after).view(-1)[positions] = indexable(values)
        elif kind == "twins":
            for position in special_at.tolist():
                after.view(-1)[position] = _twin(flat[position])
        elif kind == "noise":
            scale = draw(st.sampled_from([1e-9, 1e-6, 1e-3]))
            noise = torch.randn(spec.shape, generator=generator, dtype=torch.float64)
            after = (before.to(torch.float64) * (1 + scale * noise)).to(dtype)
        elif kind == "fresh":
            after = random_tensor(spec.shape, dtype, generator)
        new[name] = after
    return old, new
