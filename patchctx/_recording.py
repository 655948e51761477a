"""Route recording: which names of one loader call are provably replayable, and along what.

A name is replayable only when replaying it does exactly what the loader did: every write of
its staged data was a ``copy_`` of a one-to-one view of the staged tensor into a model tensor,
made in the loader's thread; the call wrote nothing else that replay would skip (the loader's
own writes are allowed only as constant fills outside the name's bytes, which the route
records and replay makes again); nothing read a weight back after the name's data reached it
(a tied copy); no other name wrote the same bytes; and nothing read its values out of torch or
changed the staged tensor itself.

A constant fill belongs to the name being loaded, but only a call that loads that name alone
shows which name that is (a loader may take every tensor before writing any). So a call of
several names that also filled something proves no route: its names are left for a call of
their own (`Recorder.alone`), which a dry run makes cheaply (`patchctx._warm`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from patchctx._geometry import Geometry, Holder, Read, Route, Segment
from patchctx._staged import data_of, provenance_of

if TYPE_CHECKING:
    from patchctx._geometry import Fill
    from patchctx._staged import StagedTensor
    from patchctx._writes import Span

__all__ = ["LOADED_WITH_OTHERS", "Recorder"]

LOADED_WITH_OTHERS = (
    "the loader also made constant fills, in a call of several names: a route repeats the fills "
    "of its own name, and which name a fill is for shows only in a call of that name alone"
)


@dataclass
class Recorder:
    """Segments and disqualifications of the sparse names of one loader call."""

    segments: dict[str, list[Segment]] = field(default_factory=dict)
    spans: dict[str, list[Span]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    # Names whose only obstacle was sharing a call with other names and constant fills.
    alone: set[str] = field(default_factory=set)
    # Model tensors the loader read out of torch, by name (the last read of each).
    reads: dict[str, Read] = field(default_factory=dict)
    # Why no route of the call can follow what the loader read (an inference tensor), or None.
    unfollowed: str | None = None

    def expect(self, name: str) -> None:
        """`name` is a sparse name of this call (so "writes nothing" is a finding too)."""
        self.segments.setdefault(name, [])

    def host_read(self, name: str, tensor: torch.Tensor) -> None:
        """The loader read model tensor `name` out of torch: every route of the call hangs on it.

        Which name's decision the value fed cannot be told, so all of them do. An inference
        tensor keeps no version counter: then no route of the call holds.
        """
        if tensor.is_inference():
            self.unfollowed = (
                f"the loader reads a value of {name!r}, an inference tensor (made under "
                "torch.inference_mode), whose changes no route can follow"
            )
            return
        self.reads[name] = Read.of(name, tensor)

    def unprovable(self, names: Iterable[str], reason: str) -> None:
        for name in names:
            self.reasons.setdefault(name, reason)

    def segment(
        self,
        source: StagedTensor,
        destination: torch.Tensor,
        owner_name: str,
        key: int,
        owner: torch.Tensor,
        span: Span,
        holders: tuple[Holder, ...] = (),
    ) -> None:
        """A ``copy_`` of staged data into a model tensor: a segment if provably affine.

        `holders`: the other model tensors over the bytes written (`ModelIndex.holders`).
        """
        prov = provenance_of(source)
        root = prov.root
        names = prov.names
        if root is None or len(names) != 1:
            self.unprovable(names, "the loader copied a computed copy, not a view")
            return
        if root.tampered:
            self.unprovable(names, "the loader modified the staged tensor")
            return
        data = data_of(source)
        source_geometry = Geometry.of(data)
        target_geometry = Geometry.of(destination)
        low, high = source_geometry.span()
        if (
            data.dtype != root.data.dtype
            or data.is_conj()
            or data.is_neg()
            or destination.is_conj()  # a lazy conjugation or negation: not the stored bits
            or destination.is_neg()
            or source.shape != destination.shape
            or destination.dtype != owner.dtype
            or not source_geometry.injective()
            or not target_geometry.injective()
            or low < 0
            or high >= root.data.numel()
        ):
            self.unprovable(names, "the copy is not a one-to-one view of the staged data")
            return
        name = next(iter(names))
        self.segments.setdefault(name, []).append(
            Segment(
                source_geometry,
                target_geometry,
                owner_name,
                key,
                destination.dtype,
                Geometry.of(owner),
                holders,
            )
        )
        self.spans.setdefault(name, []).append(span)

    def routes(
        self,
        shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        *,
        other_writes: list[str],
        constants: list[tuple[Span, Fill]],
        loading: frozenset[str],
        reported: set[str],
        tensor_names: frozenset[str] | None = None,
    ) -> dict[str, Route]:
        """The routes this call proves (after it succeeded).

        Args:
            shapes: The checkpoint shape and dtype of every sparse name of the call.
            other_writes: The loader's own writes that are not constant fills.
            constants: The loader's constant fills, in order, with the bytes each wrote.
            loading: Every checkpoint name of the call.
            reported: The names the loader returned.
            tensor_names: The names of the model's tensors, kept by a route that writes
                nothing (`Route.holding`).
        """
        if self.unfollowed is not None:
            self.unprovable(self.segments, self.unfollowed)
        if other_writes:
            self.unprovable(
                self.segments,
                f"the loader also wrote {', '.join(sorted(set(other_writes)))}, which replay "
                "would skip",
            )
        for name, spans in self.spans.items():
            if any(s.overlaps(c) for s in spans for c, _ in constants):
                self.unprovable([name], "the loader fills part of its bytes with a constant")
            for other, other_spans in self.spans.items():
                if other != name and any(s.overlaps(o) for s in spans for o in other_spans):
                    self.unprovable([name, other], "two names write the same bytes")
        if constants and len(loading) > 1:
            self.alone |= {name for name in self.segments if name not in self.reasons}
            self.unprovable(self.segments, LOADED_WITH_OTHERS)
        fills = tuple(fill for _, fill in constants)
        routes = {}
        for name, segments in self.segments.items():
            if name in self.reasons or name not in shapes:
                continue
            targets = {segment.tensor_name for segment in segments}
            targets |= {fill.tensor_name for fill in fills}
            names = frozenset(n for n in reported if n in targets or n == name)
            routes[name] = Route(
                name,
                *shapes[name],
                tuple(segments),
                names,
                fills,
                tuple(self.reads.values()),
                None if segments or fills else tensor_names,
            )
        return routes
