"""`load_checkpoint_weight_patches`: orchestration only.

validate -> resolve aliases -> order -> replay known routes | chunk -> stage -> guarded load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, cast

import torch

from patchctx._arguments import flag, instance_of, known_names, name_map, positive_int
from patchctx._bits import bit_view
from patchctx._chunking import ByteBudget, ChunkingPolicy, ChunkState
from patchctx._errors import (
    CastKindError,
    InvalidPatchError,
    InvalidPatchTypeError,
    LoaderContractError,
    LoaderError,
    PatchError,
    PatchProblem,
)
from patchctx._geometry import Route
from patchctx._grad import without_grad
from patchctx._kinds import kind_of, same_kind
from patchctx._model import SupportsLoadWeights, as_module, check_model, model_tensors
from patchctx._ordering import InputOrder, OrderingPolicy
from patchctx._patch import (
    CheckedPatch,
    CheckpointWeightPatch,
    PatchLike,
    check_patches,
    copied_of,
    patch_of,
    positions_of,
    readable,
    starts_of,
)
from patchctx._routes import RouteBook, RouteStore, book_of, replay, replay_bounds, replay_dense
from patchctx._session import Load, LoadResult, ModelIndex, run_loader
from patchctx._strategies import Auto, BoolMask, CopyStrategy, as_strategy
from patchctx._tied import tied_names
from patchctx._undo import UndoLog

if TYPE_CHECKING:  # the dry run is imported where first used: `import patchctx` skips it
    from patchctx._warm import WarmReport

__all__ = ["RouteCache", "load_checkpoint_weight_patches"]

# The defaults, made once (frozen: shared safely by every call).
_DEFAULT_STRATEGY = Auto()
_DEFAULT_CHUNKING = ByteBudget()


def _chunking_of(max_chunk_bytes: object, chunking: object) -> ChunkingPolicy:
    if max_chunk_bytes is not None and chunking is not None:
        raise InvalidPatchError(
            f"pass either max_chunk_bytes={max_chunk_bytes!r} or chunking={chunking!r}, not both "
            "(max_chunk_bytes=N is shorthand for chunking=ByteBudget(N))"
        )
    if chunking is None:
        if max_chunk_bytes is None:
            return _DEFAULT_CHUNKING
        return ByteBudget(positive_int(max_chunk_bytes, "max_chunk_bytes"))
    examples = "ByteBudget(n), PerTensor(), SingleCall() or your own"
    return cast(ChunkingPolicy, instance_of(chunking, ChunkingPolicy, "chunking=", examples))


def _ordering_of(ordering: object) -> OrderingPolicy:
    if ordering is None:
        return InputOrder()
    examples = "InputOrder(), Coalesce() or your own"
    return cast(OrderingPolicy, instance_of(ordering, OrderingPolicy, "ordering=", examples))


def _resolve_aliases(items: list[CheckedPatch], aliases: Mapping[str, str]) -> list[CheckedPatch]:
    """Load an alias under its canonical name; drop it when the canonical name is patched too.

    A dropped alias patch must equal one of the canonical name's patches in the call (tied
    weights are sent twice): otherwise one of the two updates would be lost, and the call is
    refused before any write.
    """
    if not aliases:
        return items
    by_name: dict[str, list[CheckpointWeightPatch]] = {}
    for item in items:
        by_name.setdefault(item.name, []).append(patch_of(item))
    resolved = []
    problems = []
    for item in items:
        canonical = aliases.get(item.name)
        if canonical is None or canonical == item.name:
            resolved.append(item)
        elif canonical not in by_name:
            resolved.append(item.renamed(canonical))
        elif not any(_same_update(patch_of(item), other) for other in by_name[canonical]):
            problems.append(
                PatchProblem(
                    item.position,
                    item.name,
                    f"is an alias of {canonical!r} (tied weights), which the call also patches, "
                    "with a different update; one of them would be lost. Send the tied tensor "
                    "once, or send identical patches to both names",
                )
            )
    if problems:
        raise InvalidPatchError(problems)
    return resolved


def _same_update(a: CheckpointWeightPatch, b: CheckpointWeightPatch) -> bool:
    """Whether two patches write the same bits to the same positions."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    if (a.indices is None) != (b.indices is None):
        return False
    if a.indices is not None and b.indices is not None:
        if a.indices.numel() != b.indices.numel():
            return False
        if not torch.equal(a.indices.long(), b.indices.to(a.indices.device).long()):
            return False
    values_a = a.values.to(a.dtype)
    values_b = b.values.to(device=a.values.device, dtype=b.dtype)
    # Compare bits, so that NaN payloads and -0.0 count as they are.
    return torch.equal(bit_view(values_a), bit_view(values_b))


def _apply_ordering(
    ordering: OrderingPolicy,
    items: list[CheckedPatch],
    strategy: CopyStrategy,
    validate_unique_indices: bool,
) -> list[CheckedPatch]:
    if type(ordering) is InputOrder:  # (exactly: a subclass may reorder or drop patches)
        return items
    # A checked patch of this call is loaded from validation's own copies (`CheckedPatch`),
    # which the policy never sees: whatever it does to `.patch`'s tensors is not written. A
    # patch checked elsewhere (another call) is validated again, like a patch it made.
    seen = {id(item) for item in items}
    result: list[CheckedPatch | None] = []
    fresh: list[tuple[int, object]] = []
    for entry in ordering.order(items):
        if isinstance(entry, CheckedPatch) and id(entry) in seen:
            result.append(entry)
        else:
            fresh.append((len(result), entry.patch if isinstance(entry, CheckedPatch) else entry))
            result.append(None)
    if fresh:
        # A policy made new patches: validate them as if they were input.
        try:
            rechecked = check_patches(
                [patch for _, patch in fresh],
                strategy=strategy,
                validate_unique_indices=validate_unique_indices,
            )
        except InvalidPatchError as error:
            raise type(error)(
                [
                    PatchProblem(
                        None, p.name, f"{ordering!r} produced an invalid patch: {p.reason}"
                    )
                    for p in error.problems
                ]
            ) from error
        for (slot, _), item in zip(fresh, rechecked, strict=True):
            result[slot] = item.unpositioned()
    return [item for item in result if item is not None]


def _refuse_kind_casts(items: list[CheckedPatch]) -> None:
    """Before any write: values whose kind is not their patch dtype's (`CastKindError`)."""
    problems = []
    for item in items:
        patch = patch_of(item)
        if not same_kind(patch.values.dtype, patch.dtype):
            problems.append(
                PatchProblem(
                    item.position,
                    patch.name,
                    f"its values are {kind_of(patch.values.dtype)} "
                    f"({_dtype(patch.values.dtype)}) and its dtype is "
                    f"{kind_of(patch.dtype)} ({_dtype(patch.dtype)}): "
                    "a cast across kinds changes what the values mean. Send values of the "
                    "patch's kind, or pass kind_casts=True",
                    is_type_error=True,
                )
            )
    if problems:
        raise CastKindError(str(InvalidPatchError(problems)))


class _Plan:
    """What a call knows before its first write: the model's tensors and the routes it may use.

    It learns the routes of dense names that have none (`learn_dense_routes`), refuses known
    routes into protected tensors or across kinds (`refuse_routes`), and finds the route a
    patch replays along (`usable`).
    """

    def __init__(
        self, model: SupportsLoadWeights, book: RouteBook | None, protect: Mapping[str, str]
    ) -> None:
        self.model, self.book, self.protect = model, book, protect
        self.module = as_module(model)  # what the loader calls run on
        # Replays look tensors up where the model registers them (`RouteBook.live`: two dict
        # reads a name); the full map is built only for a loader call or protect=.
        self.tensors: Mapping[str, torch.Tensor] = (
            model_tensors(model)
            if protect or (book is not None and not isinstance(model, torch.nn.Module))
            else book.live(self.module)
            if book is not None
            else {}
        )
        self.built: ModelIndex | None = None  # built at the first loader call

    @property
    def index(self) -> ModelIndex:
        """The model's tensors by storage, and the protected ones (built once, when needed)."""
        if self.built is None:
            self.built = ModelIndex(model_tensors(self.model), self.protect)
        return self.built

    def usable(self, patch: CheckpointWeightPatch) -> tuple[Route, list[torch.Tensor]] | None:
        """The known route of `patch` with its live destinations, or `None` (see `RouteBook`)."""
        if self.book is None:
            return None
        return self.book.usable(patch.name, patch.shape, patch.dtype, self.tensors)

    def learn_dense_routes(self, items: list[CheckedPatch]) -> None:
        """Learn the routes of dense patches' names that have none, by `RouteCache.warm`'s dry run.

        Only with ``RouteCache(learn_dense=True)``, which says why. A name the dry run finds no
        route for is remembered with its shape and dtype, and not tried again until the cache
        forgets it.
        """
        book = self.book
        if book is None or not book.learn_dense:
            return
        specs: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
        for item in items:
            patch = patch_of(item)
            name, shape = patch.name, tuple(patch.shape)
            if (
                patch.indices is None
                and name not in specs
                and book.route(name) is None
                and not book.unlearned(name, shape, patch.dtype)
            ):
                specs[name] = (name, shape, patch.dtype)
        if not specs:
            return
        # Learnt without `protect`, so that a route into a protected tensor is refused before
        # any write (`refuse_routes`), and not remembered as no route.
        index = ModelIndex(self.index.tensors, {}) if self.protect else self.index
        from patchctx._warm import learn

        for name, found in learn(self.module, index, list(specs.values())).items():
            if isinstance(found, Route):
                book.store(found)
            else:
                book.learnt_nothing(*specs[name])

    def refuse_routes(self, items: list[CheckedPatch], *, kind_casts: bool) -> None:
        """Before any write: known routes into protected tensors, or across kinds."""
        if self.book is None or (kind_casts and not self.protect):
            return
        protected, cast = [], []
        for item in items:
            patch = patch_of(item)
            usable = self.usable(patch)
            for target in usable[1] if usable is not None and self.protect else ():
                reason = self.index.protection(target)
                if reason is not None:
                    protected.append(f"{patch.name!r} -> {reason}")
                    break
            for target in usable[1] if usable is not None and not kind_casts else ():
                if not same_kind(patch.dtype, target.dtype):
                    cast.append(
                        f"patches[{item.position}] {patch.name!r} ({_dtype(patch.dtype)}) -> a "
                        f"{_dtype(target.dtype)} weight"
                    )
                    break
        if protected:
            raise LoaderContractError(
                "patches would write into protected tensors; nothing was written: "
                + "; ".join(protected)
            )
        if cast:
            raise CastKindError(
                "patches would be cast across kinds into weights (pass kind_casts=True to "
                "allow it); nothing was written: " + "; ".join(cast)
            )


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Written:
    """The names a call has written so far, and what its errors say is left (`atomic` or not)."""

    def __init__(self, atomic: bool) -> None:
        self.atomic = atomic
        # Loader calls and replays that finished, for the error of a call that fails later.
        self.names: list[str] = []

    def left(self) -> list[str]:
        """The names written and left so if the call fails now (none under `atomic`)."""
        return [] if self.atomic else list(dict.fromkeys(self.names))

    def note(self, error: PatchError, loads: Sequence[Load] = ()) -> None:
        """Say on `error` what a call without `atomic` leaves written (`PatchError.written`)."""
        if self.atomic or isinstance(error, LoaderError):
            return
        written = self.left()
        unwritten = {p.name for p in getattr(error, "problems", ())}  # (strict: none of theirs)
        partly = [
            load.name for load in loads if load.indices is None and load.name not in unwritten
        ]
        if not written and not partly:
            return
        error.written = (*written, *partly)
        if written:
            error.add_note(
                "atomic=False: written by earlier loader calls or replays and left so: "
                + ", ".join(map(repr, written))
            )
        if partly:
            error.add_note(
                "atomic=False: the failing loader call may have written part of its dense "
                "patches: " + ", ".join(map(repr, partly))
            )

    def loader_error(self, loads: list[Load], error: Exception) -> LoaderError:
        """The loader's own exception `error` as a `LoaderError` naming the call's patches."""
        named = ", ".join(
            f"patches[{load.position}] {load.name!r}"
            if load.position is not None
            else repr(load.name)
            for load in loads
        )
        dense = all(load.indices is None for load in loads)
        if self.atomic:
            state = "nothing was written (atomic=True: every write of the call was undone)"
        elif dense:
            state = "this loader call may have written part of its patches (dense, atomic=False)"
        else:
            state = "this loader call was undone"
        written = self.left()
        if written:
            state += "; written by earlier loader calls or replays and left so: " + ", ".join(
                map(repr, written)
            )
        elif not self.atomic:
            state += "; no earlier loader call or replay wrote anything"
        return LoaderError(
            f"the model's load_weights raised {type(error).__name__} loading {named}: "
            f"{str(error)[:500]}; {state}",
            names=[load.name for load in loads],
            written=written + ([load.name for load in loads] if dense and not self.atomic else []),
        )

    def failure(self, error: Exception) -> PatchError:
        """The error of a call that failed outside the loader (a replay's), saying what is left."""
        names = self.left()
        return PatchError(
            f"applying the patches failed ({type(error).__name__}: {str(error)[:300]}); "
            + (
                "every write of the call was undone (atomic=True)"
                if self.atomic
                else "written and left so (atomic=False): " + ", ".join(map(repr, names))
                if names
                else "nothing was left written"
            )
        )


class _Readers:
    """The call's patches in order, as read: a copy (`copy`) where an earlier write reaches one.

    A patch's values or indices may view a model tensor that an earlier patch of the same
    call writes (a layer's weights sent as another's, a payload decoded into a buffer the
    model holds): the loader path stages a chunk's sparse patches before writing any, a
    replay reads its patch when it writes, a dense load when the loader copies it. Copying
    before the first write that reaches them makes every path read the same values: those
    validation checked, whatever routes and chunking the call takes.
    """

    def __init__(self, items: list[CheckedPatch]) -> None:
        self.items = items
        self.inputs: set[int] | None = None  # see `storages`
        self.copied: set[int] = set()

    def storages(self) -> set[int]:
        """The storages the call's patches read (values and indices), by data pointer.

        Found once, at the call's first write that a later patch could read, before any write.
        """
        if self.inputs is None:
            found = {start for item in self.items for start in starts_of(item)}
            found.discard(0)  # (an empty storage holds nothing to change)
            self.inputs = found
        return self.inputs

    def copy(self, storages: AbstractSet[int], first: int) -> None:
        """Before a write into `storages`: the patches from `first` on that read one get copies.

        They read copies made now (`CheckedPatch._copied`), as the tensors were when the call
        began.
        """
        items, copied = self.items, self.copied
        for k in range(first, len(items)):
            if k not in copied and not storages.isdisjoint(starts_of(items[k])):
                copied.add(k)
                items[k] = copied_of(items[k])


class _Replays:
    """The replays a `_Loader` gathered since its last loader call, run in order by `run`."""

    def __init__(
        self, plan: _Plan, readers: _Readers, written: _Written, undo: UndoLog, names: set[str]
    ) -> None:
        # (What the loader holds too, never the loader itself: no cycle keeps the patches.)
        self.plan, self.readers, self.written = plan, readers, written
        self.undo = undo if written.atomic else None
        self.names = names  # the loader's: what the call returns
        # (route, the patch's index in `items`, each segment's destination as checked live).
        self.pending: list[tuple[Route, int, list[torch.Tensor]]] = []
        # The tensors they write, by name: gathered only once a route that read model values
        # needs them (`None` until then).
        self.tensors: set[str] | None = None

    def add(self, route: Route, at: int, targets: list[torch.Tensor]) -> None:
        """Replay the patch at `at` along `route` at the next `run`, in order."""
        self.pending.append((route, at, targets))
        if self.tensors is not None:
            self.tensors |= route.writes

    def writes(self) -> set[str]:
        """The tensors the pending replays write, by name (kept up to date from now on)."""
        if self.tensors is None:
            self.tensors = {name for route, _, _ in self.pending for name in route.writes}
        return self.tensors

    def run(self) -> None:
        """Replay the patches gathered since the last loader call, in order.

        Their partly covered segments are searched first, all together (`replay_bounds`):
        one host read per device for the whole run of replays, none inside it.
        """
        pending, self.pending = self.pending, []
        self.tensors = None
        if not pending:
            return
        readers, plan, undo = self.readers, self.plan, self.undo
        items = readers.items
        found = iter(replay_bounds(_searches(pending, items)))
        names, written = self.names, self.written.names
        assert plan.book is not None
        stats = plan.book.stats
        # The storages these replays write that the call's patches read (rarely any): before
        # each write into one, the later patches reading it get copies.
        hits: AbstractSet[int] = (
            set().union(*[route.storages for route, _, _ in pending]) & readers.storages()
            if len(items) > 1
            else set()
        )
        for route, at, targets in pending:
            if hits:
                reached = route.storages & hits
                if reached:
                    readers.copy(reached, at + 1)
            item = items[at]
            patch = patch_of(item)
            if plan.protect:
                for target in targets:
                    plan.index.refuse_protected(target, f"the patch to {patch.name!r}")
            indices = patch.indices
            if indices is None:
                readable(item)
                replay_dense(route, patch.values, targets, undo=undo)
            else:
                positions, listed = positions_of(item)
                replay(
                    route,
                    indices,
                    patch.values,
                    targets,
                    sorted_unique=item.sorted_unique,
                    undo=undo,
                    positions=positions,
                    bounds=None if route.whole else next(found),
                    listed=listed,
                )
            names |= route.reported
            stats.replayed += 1
            written.append(patch.name)


def _searches(
    pending: list[tuple[Route, int, list[torch.Tensor]]], items: list[CheckedPatch]
) -> list[tuple[Route, torch.Tensor | list[int], bool]]:
    """What `replay_bounds` searches for the pending sparse replays of partly covered routes."""
    searches: list[tuple[Route, torch.Tensor | list[int], bool]] = []
    for route, at, _ in pending:
        item = items[at]
        indices = patch_of(item).indices
        if indices is not None and not route.whole:
            positions, listed = positions_of(item)
            found = listed if listed is not None else positions
            searches.append((route, found if found is not None else indices, item.sorted_unique))
    return searches


class _Loader:
    """Runs the ordered patches: route replay where known, loader calls in chunks elsewhere.

    Input order is kept exactly: a replay first flushes the chunk gathered before it.
    """

    def __init__(
        self,
        plan: _Plan,
        chunking: ChunkingPolicy,
        undo: UndoLog,
        items: list[CheckedPatch],
        *,
        atomic: bool,
        strict: bool = True,
        kind_casts: bool = False,
    ) -> None:
        self.plan, self.chunking, self.undo = plan, chunking, undo
        self.strict, self.kind_casts = strict, kind_casts
        self.written = _Written(atomic)
        self.readers = _Readers(items)
        self.names: set[str] = set()
        self.replays = _Replays(plan, self.readers, self.written, undo, self.names)
        self.chunk: list[int] = []  # indices in `items`
        self.chunk_names: set[str] = set()
        self.chunk_nbytes = 0
        # Routes being verified in the current chunk: name -> the route to compare with.
        self.verifying: dict[str, Route] = {}

    def add(self, at: int) -> None:
        """Gather the patch at `at` in `items`: a replay, or the chunk of the next loader call."""
        item = self.readers.items[at]  # (a copy, if an earlier write reached what it reads)
        patch = patch_of(item)
        name = patch.name
        book = self.plan.book
        if book is not None:
            if name in self.chunk_names:
                self.flush()  # the chunk may record the route this patch can replay
            usable = book.usable(name, patch.shape, patch.dtype, self.plan.tensors)
            if (
                usable is not None
                and usable[0].reads
                and (self.chunk or not self.replays.writes().isdisjoint(usable[0].read_names))
                and not book.verify_all  # (`verify`'s patches change nothing)
            ):
                # Its loader decided on model values, which the patches before it in this
                # call may change (the chunk's loader call, or replays into what it read):
                # check them once those are written.
                self.flush()
                usable = self.plan.usable(patch)
            # A dense patch follows a known route too (the loader's copies, without the
            # loader); only sparse loads record routes, so only they are used to verify one.
            if usable is not None:
                if patch.indices is not None and book.due_for_verification(name):
                    self.verifying[name] = usable[0]  # through the loader, then compared
                else:
                    self.load_chunk()
                    self.replays.add(usable[0], at, usable[1])  # replayed at the next flush
                    return
        self.replays.run()  # earlier replays happen before this patch's loader call
        size = item.staged_nbytes
        if self.chunk and (
            name in self.chunk_names
            or item.sparse != self.readers.items[self.chunk[0]].sparse
            or self.chunking.split_before(
                ChunkState(self.chunk_nbytes, len(self.chunk), item, size)
            )
        ):
            self.flush()
        self.chunk.append(at)
        self.chunk_names.add(name)
        self.chunk_nbytes += size

    def flush(self) -> None:
        """Apply everything gathered: pending replays, or the chunk (never both at once)."""
        self.replays.run()
        self.load_chunk()

    def load_chunk(self) -> None:
        """Load the gathered chunk in one loader call; keep the routes it proves."""
        if not self.chunk:
            return
        chunk, self.chunk, self.chunk_names, self.chunk_nbytes = self.chunk, [], set(), 0
        plan, readers = self.plan, self.readers
        # The loader may write any model tensor. It reads the chunk's dense patches as it copies
        # them (its sparse ones are staged before it runs), and every later patch reads after
        # it: those that view a model tensor get copies first.
        index = plan.index
        reached = {key for key in readers.storages() if index.holds(key)}
        if reached:
            first = chunk[0] if not readers.items[chunk[0]].sparse else chunk[-1] + 1
            readers.copy(reached, first)
        loads = [_load_of(readers.items[at]) for at in chunk]
        if plan.book is not None:
            plan.book.stats.loader_calls += 1
        try:
            result = run_loader(
                plan.module,
                loads,
                index=index,
                undo=self.undo,
                atomic=self.written.atomic,
                strict=self.strict,
                kind_casts=self.kind_casts,
            )
        except PatchError as error:
            self.written.note(error, loads)
            raise
        except Exception as error:  # the loader's own: named, with what the call left
            raise self.written.loader_error(loads, error) from error
        if not self.written.atomic:
            self.undo.forget()  # this call stands; its old values are not needed any more
        self.written.names += [load.name for load in loads]
        self.names |= result.names
        if plan.book is not None:
            plan.book.stats.loaded += len(loads)
            _learn(plan, loads, result, self.verifying)


def _load_of(item: CheckedPatch) -> Load:
    """What a loader call stages for `item` (a dense patch's values made readable first)."""
    patch = patch_of(item)
    if patch.indices is None:
        readable(item)
    return Load(
        patch.name, tuple(patch.shape), patch.dtype, patch.values, patch.indices, item.position
    )


def _learn(plan: _Plan, loads: list[Load], result: LoadResult, verifying: dict[str, Route]) -> None:
    """Keep the routes a loader call proved; compare those it verified with the cached ones."""
    book = plan.book
    assert book is not None
    for load in loads:
        old = verifying.pop(load.name, None)
        new = result.routes.get(load.name)
        if new is None and load.name in result.alone:
            # Kept from a route only by the call's constant fills: whose they are shows
            # in a dry run of the name alone (no write, nothing staged).
            spec = (load.name, load.shape, load.dtype)
            from patchctx._warm import learn_alone

            new = learn_alone(plan.module, plan.index, spec, result.segments[load.name])
        if new is not None and not new.segments and not new.fills:
            new = None  # "writes nothing" is no route: the next patch asks the loader again
        if old is not None:
            book.verified(load.name, old, new)
        if new is not None:
            book.store(new)
        elif load.indices is not None:
            book.forget(load.name)


@without_grad
def load_checkpoint_weight_patches(
    model: SupportsLoadWeights,
    patches: Iterable[PatchLike],
    *,
    max_chunk_bytes: int | None = None,
    validate_unique_indices: bool = True,
    strategy: CopyStrategy | None = None,
    chunking: ChunkingPolicy | None = None,
    ordering: OrderingPolicy | None = None,
    routes: RouteCache | None = None,
    atomic: bool = False,
    aliases: Mapping[str, str] | None = None,
    protect: Mapping[str, str] | None = None,
    strict: bool = True,
    kind_casts: bool = False,
    verify: Callable[[], object] | None = None,
) -> set[str]:
    """Apply dense and sparse patches through the model's own ``load_weights``.

    A drop-in for vLLM's function of the same name: the same arguments behave the same way on
    valid input and raise the same exception classes on invalid input. On top of it, dense and
    sparse patches may be mixed, any dtype works (`Auto()` picks NaN or an integer sentinel),
    and chunking, ordering and aliases are typed policies.

    Every patch is validated before the first write (see `validate_patches`); an invalid call
    raises one `InvalidPatchError` listing every problem and changes nothing. Patches are then
    ordered, grouped into loader calls and staged one chunk at a time: a sparse patch becomes a
    staged tensor, checkpoint-shaped, that carries the mask of the positions it changes through
    whatever the loader does with it, so its writes change only those elements (or are refused
    before they happen). Dense chunks load with plain ``copy_``. Runs with gradient recording
    off (as under ``torch.no_grad()``), and puts it back as it was.

    Args:
        model: Every vLLM model, any ``torch.nn.Module`` with ``load_weights``, or any object
            with ``load_weights`` and ``named_parameters`` (see `SupportsLoadWeights`).
        patches: `CheckpointWeightPatch` objects, or any objects with the same five fields
            (`PatchLike`: vLLM's own NamedTuple included).
        max_chunk_bytes: Shorthand for ``chunking=ByteBudget(max_chunk_bytes)``.
        validate_unique_indices: Reject duplicate indices within one patch. Two patches may
            touch the same positions; the later one wins.
        strategy: Which values a sparse patch may not carry and which dtypes it may have
            (checked by validation); default `Auto()`.
        chunking: How many staged tensors go into one loader call; default
            ``ByteBudget(512 MiB)``.
        ordering: `InputOrder()` (default) or `Coalesce()`.
        routes: A `RouteCache` for this model: sparse patches to names whose route is known
            are replayed in O(nnz) without the loader, and dense ones copied along it; the
            other sparse patches record their routes. With ``RouteCache(learn_dense=True)``, a
            dense patch to a name without a route learns one first, by a dry run of the
            loader (see `RouteCache.warm`).
        atomic: On any failure (an invalid write, a loader exception, KeyboardInterrupt),
            restore every element this call wrote before the exception propagates. Costs
            memory for the old values, held until the call returns: O(nnz) per sparse
            patch, O(N) per dense one. Without it, a failure leaves the patches before the
            failing loader call or route replay applied, and the writes the failing loader
            call made before it failed; a refused write is never made.
        aliases: Alias name -> canonical name (tied embeddings). An alias patch is loaded under
            its canonical name, or dropped when the canonical name is patched in the same call
            with the same update (a different update is refused: one would be lost). Tied
            parameters the model shows need no entry: a parameter a ``torch.nn.Module``
            reaches under several names (one storage) has its later names, in module order,
            as aliases of its first; ``aliases=`` adds to (and overrides) those, and a name
            mapped to itself is loaded under its own name.
        protect: Qualified names of parameters or buffers that must not be written (with the
            reason), e.g. weights an engine has repacked into another layout; a name that is
            not a parameter or buffer of the model is refused. A write into one,
            by the loader or by a route, raises `LoaderContractError` before it happens; known
            routes are checked before the first write of the call. With ``atomic=True`` a
            refusal found mid-call leaves the model as it was.
        strict: Every patch must be consumed: a loader call whose ``load_weights`` writes
            none of a patch's data into a parameter or buffer (it skips the name: unknown,
            misspelt, held by another pipeline stage) is refused with `InvalidPatchError`
            naming the patch, and that loader call is undone (a dense one only with
            ``atomic=True``). Pass ``False`` for a loader that legitimately skips names:
            such patches then change nothing, and no route is ever kept for them.
        kind_casts: Allow casts that change the kind of a value: bool or integer values
            into a floating patch or weight, floating ones into an integer or bool one.
            Refused by default (`CastKindError`): the patch's values against its dtype before
            any write, the patch's dtype against the weight's at the write. Casts between
            floating dtypes (float32 into bfloat16) always happen, as in a dense load.
        verify: Called once every patch is written, before the call returns (a read-back of
            what landed, say); an exception it raises fails the call like a failed write:
            with ``atomic=True`` every write of the call is undone.

    Returns:
        The union of the names the model's ``load_weights`` calls reported.

    Raises:
        InvalidPatchError: An argument or patch is invalid, or (``strict``) no loader call
            consumed a patch.
        CastKindError: A patch would change kind on its way into a weight (``kind_casts``).
        LoaderContractError: The loader wrote staged data in a way the strategy cannot mask.
        LoaderError: The model's ``load_weights`` raised (its exception is the
            ``__cause__``). Every error is a `PatchError` naming the patches and the
            reason. With ``atomic``, the model is as it was; without it, a failure leaves
            what earlier loader calls and replays wrote, and the error says which names
            (`PatchError.written`).

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch, load_checkpoint_weight_patches
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for name, tensor in weights:
        ...             self.w.copy_(tensor)
        ...         return {"w"}
        >>> model = Model()
        >>> patch = CheckpointWeightPatch("w", (2, 3), torch.float32, torch.tensor([7.0]),
        ...                               indices=torch.tensor([4]))
        >>> load_checkpoint_weight_patches(model, [patch])
        {'w'}
        >>> model.w
        Parameter containing:
        tensor([[0., 0., 0.],
                [0., 7., 0.]])
    """
    check_model(model, "load_checkpoint_weight_patches")
    chosen_strategy = as_strategy(strategy, _DEFAULT_STRATEGY, "load_checkpoint_weight_patches")
    chosen_chunking = _chunking_of(max_chunk_bytes, chunking)
    chosen_ordering = _ordering_of(ordering)
    # Tied parameters the model shows (one storage, two names) first; aliases= adds to them.
    alias_map = {
        **tied_names(model),
        **name_map(aliases, "aliases= maps alias names to canonical names"),
    }
    protected = name_map(protect, "protect= maps tensor names to the reason they are protected")
    if routes is not None:
        instance_of(routes, RouteCache, "routes=", "one RouteCache() per model")
    if protected:
        known_names(protected, model_tensors(model), "protect=")
    _check_flags(verify, strict=strict, kind_casts=kind_casts)

    items = check_patches(
        patches, strategy=chosen_strategy, validate_unique_indices=validate_unique_indices
    )
    if not kind_casts:
        _refuse_kind_casts(items)
    items = _resolve_aliases(items, alias_map)
    items = _apply_ordering(chosen_ordering, items, chosen_strategy, validate_unique_indices)
    book = book_of(routes) if routes is not None else None
    if book is not None:
        book.bind(model)
    plan = _Plan(model, book, protected)
    plan.learn_dense_routes(items)
    plan.refuse_routes(items, kind_casts=kind_casts)
    undo = UndoLog()
    loader = _Loader(
        plan, chosen_chunking, undo, items, atomic=atomic, strict=strict, kind_casts=kind_casts
    )
    done = False
    try:
        try:
            for at in range(len(items)):
                loader.add(at)
            loader.flush()
            if verify is not None:
                verify()
        except PatchError as error:
            loader.written.note(error)
            raise
        except Exception as error:  # not the loader's (that is a LoaderError): a replay's
            raise loader.written.failure(error) from error
        done = True
    except BaseException:
        if atomic:
            undo.restore()
        raise
    finally:
        if not done and atomic:
            undo.restore()  # a second attempt, for an exception that cut the first short
    return loader.names


def _check_flags(verify: object, *, strict: object, kind_casts: object) -> None:
    """Refuse a `verify=` that is not callable and flags that are not bools."""
    if verify is not None and not callable(verify):
        raise InvalidPatchTypeError(
            [PatchProblem(None, "", f"verify= takes a callable or None, got {verify!r}", True)]
        )
    flag(strict, "strict=")
    flag(kind_casts, "kind_casts=")


class RouteCache(RouteStore):
    """Remembered routes from checkpoint names to parameter storage, for O(nnz) patches.

    Pass one cache to every `load_checkpoint_weight_patches` call on one model. The first sparse
    patch to a name goes through the loader and records its route when the loader's writes are
    provably view copies; later sparse patches to the name replay the route without the loader:
    O(nnz) time and memory, in place, bit-identical to the loader path. Dense patches are
    copied along the route; with ``learn_dense=True``, a dense patch to a name without one
    learns it first by a dry run of the loader, as `warm` does. Before each replay the
    route's destinations are checked against the model's live parameters and buffers; a
    parameter that was rebound or reallocated invalidates the route, and that patch goes
    through the loader again (recording a new route). A cache belongs to one model: used with
    another model it starts over.

    A route is a record of what the loader *did*, so it holds as long as the loader would do
    the same again. Call `clear` (or `invalidate` for one name) whenever that may have changed
    without the tensors changing: the loader's code or configuration, a rank, tensor-parallel
    or expert placement attribute it reads, or weights an engine repacked in place. To check
    rather than trust, pass ``verify_every=k``: every k-th patch to a name then goes through
    the loader instead of the route, and the route it records is compared with the cached one
    (``stats.verified``, ``stats.mismatched``; a mismatch replaces the route). `verify` checks
    every route at once without changing any weight.

    Args:
        verify_every: Send every k-th sparse patch of each name through the loader and
            compare routes; `None` (the default) trusts recorded routes.
        learn_dense: Before a call writes anything, learn the route of each name it sends
            dense and has no route for, by a dry run of the loader (`warm`'s: nothing is
            written), so that dense patches follow routes from the first: through the loader
            under the guard a dense patch costs about 3x a plain reload. The dry run is an
            extra call of ``load_weights``: leave this off for loaders with Python side
            effects (a call counter, a set of names seen, work done once all shards arrive).

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch, RouteCache, load_checkpoint_weight_patches
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for name, tensor in weights:
        ...             self.w.data[2:].copy_(tensor.narrow(0, 0, 2))  # a tensor-parallel slice
        ...         return {"w"}
        >>> model, routes = Model(), RouteCache()
        >>> def patch(i, v):
        ...     return CheckpointWeightPatch("w", (4, 4), torch.float32, torch.tensor([v]),
        ...                                  torch.tensor([i]))
        >>> _ = load_checkpoint_weight_patches(model, [patch(5, 1.0)], routes=routes)
        >>> "w" in routes, routes.stats.recorded
        (True, 1)
        >>> _ = load_checkpoint_weight_patches(model, [patch(6, 2.0)], routes=routes)
        >>> routes.stats.replayed, model.w[3, 1:3].tolist()
        (1, [1.0, 2.0])
    """

    def verify(self, model: Any) -> list[str]:
        """Check every route against the loader now; return the names whose route changed.

        Each name goes through the model's ``load_weights`` with a patch that changes
        nothing (weights stay bit-identical), and the route it records replaces the cached
        one: a changed route is corrected, a route that is no longer provable is dropped.

        Args:
            model: The model this cache belongs to.

        Returns:
            The names whose recorded route differed from the cached one (sorted).

        Examples:
            >>> import torch
            >>> from patchctx import CheckpointWeightPatch, RouteCache
            >>> from patchctx import load_checkpoint_weight_patches
            >>> class Model(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
            ...         self.rank = 0
            ...     def load_weights(self, weights):
            ...         for _, tensor in weights:  # this rank's half of the checkpoint
            ...             self.w.copy_(tensor.view(2, 4)[self.rank])
            ...         return {"w"}
            >>> model, routes = Model(), RouteCache()
            >>> patch = CheckpointWeightPatch("w", (8,), torch.float32, torch.tensor([1.0]),
            ...                               torch.tensor([5]))
            >>> _ = load_checkpoint_weight_patches(model, [patch], routes=routes)
            >>> routes.verify(model)
            []
            >>> model.rank = 1  # the mapping changed: the recorded route is stale
            >>> routes.verify(model)
            ['w']
        """
        book = book_of(self)
        routes = book.locked(lambda: list(book.routes.values()))
        nothing = torch.zeros(0, dtype=torch.long)
        patches = [
            CheckpointWeightPatch(r.name, r.shape, r.dtype, torch.zeros(0, dtype=r.dtype), nothing)
            for r in routes
        ]
        book.verify_all, book.mismatches = True, []
        try:
            # BoolMask stages every dtype (bool and complex routes too); the probes are empty.
            load_checkpoint_weight_patches(
                model, patches, routes=self, atomic=True, strategy=BoolMask()
            )
        finally:
            book.verify_all = False
        return sorted(book.mismatches)

    def warm(
        self,
        model: Any,
        specs: Iterable[tuple[str, Sequence[int], torch.dtype]],
        *,
        protect: Mapping[str, str] | None = None,
    ) -> WarmReport:
        """Learn the routes of `specs` now, by a dry run of the loader: nothing written or staged.

        The model's ``load_weights`` receives, for each ``(name, shape, dtype)``, a tensor with
        that checkpoint shape and dtype that holds no values (it wraps a meta tensor, so no
        checkpoint-sized memory is allocated). Its views and its ``copy_`` into the model are
        recorded as a patch load records them, and no write is performed: weights stay bit for
        bit as they were. A name learnt here gets exactly the route its first sparse patch would
        record, so that patch already replays in O(nnz). A loader that needs values (``item()``,
        a data-dependent shape), or does anything a dry run cannot mirror exactly, is reported
        per name and left to the first sparse patch, which records its route as before.
        Learnt routes are stored as if recorded (``stats.recorded``); `verify` checks them.

        Pass canonical names (tied aliases resolved), with the shape and dtype the trainer will
        send: a patch of another shape or dtype drops the route and records a new one.

        Args:
            model: The model this cache belongs to (a cache bound to another model starts over).
            specs: The checkpoint tensors: name, full shape and dtype, as for `audit`.
            protect: Tensors that must not be written, with the reason, as for
                `load_checkpoint_weight_patches`: a name whose loader writes one is not learnt.

        Returns:
            One row per name: ``learned``, ``unlearnable`` (no route exists: the loader does
            not copy a view of it) or ``deferred`` (the first sparse patch decides), with the
            reason. A name found unlearnable also loses a route cached before.

        Examples:
            >>> import torch
            >>> from patchctx import CheckpointWeightPatch, RouteCache
            >>> from patchctx import load_checkpoint_weight_patches
            >>> class Model(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.w = torch.nn.Parameter(torch.zeros(2, 4), requires_grad=False)
            ...         self.s = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
            ...     def load_weights(self, weights):
            ...         for name, tensor in weights:
            ...             if name == "w":  # rank 1 of 2: rows 2 and 3
            ...                 self.w.copy_(tensor.narrow(0, 2, 2))
            ...             else:  # a scalar read out of torch, as vLLM's default loader does
            ...                 self.s.fill_(tensor.item())
            ...         return {name for name, _ in weights}
            >>> model, routes = Model(), RouteCache()
            >>> report = routes.warm(model, [("w", (4, 4), torch.float32),
            ...                              ("s", (1,), torch.float32)])
            >>> print(report)
            name  status       reason
            ----  -----------  ------
            w     learned
            s     unlearnable  the loader reads its values (.item()); a route exists only \
for a loader that copies views
            1 learned, 1 unlearnable, 0 deferred
            >>> patch = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.tensor([7.0]),
            ...                               torch.tensor([13]))
            >>> _ = load_checkpoint_weight_patches(model, [patch], routes=routes)
            >>> routes.stats.replayed, routes.stats.loader_calls, model.w[1].tolist()
            (1, 0, [0.0, 7.0, 0.0, 0.0])
        """
        from patchctx._warm import warm

        return warm(self, model, specs, protect=protect)
