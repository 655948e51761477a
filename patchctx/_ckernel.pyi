# The compiled kernel (patchctx/_ckernel.c), built by hatch_build.py where a C compiler works.
SOURCE: str

def check(
    indices: int, count: int, width: int, highest: int, values: int, kind: int, /
) -> bool: ...
def has_nan(values: int, count: int, kind: int, /) -> bool: ...
def scatter(
    target: int,
    limit: int,
    size: int,
    indices: int,
    width: int,
    count: int,
    shift: int,
    values: int,
    /,
) -> int: ...
def scatter_strided(
    target: int,
    limit: int,
    size: int,
    indices: int,
    width: int,
    count: int,
    offset: int,
    base: int,
    plan: tuple[tuple[int, int, int], ...],
    values: int,
    /,
) -> int: ...
def gather(
    target: int,
    limit: int,
    size: int,
    indices: int,
    width: int,
    count: int,
    shift: int,
    out: int,
    /,
) -> int: ...
def gather_strided(
    target: int,
    limit: int,
    size: int,
    indices: int,
    width: int,
    count: int,
    offset: int,
    base: int,
    plan: tuple[tuple[int, int, int], ...],
    positions: int,
    old: int,
    /,
) -> tuple[int, int]: ...
