"""Every tuned threshold, in one place: the sizes at which a code path changes.

Each only chooses between two exact ways of doing one thing, measured on the 2-core machine
at one torch thread. Modules read them at call time, so a test may lower one to run both
sides of it on small data.
"""

BLOCK = 1 << 20  # positions per block of validation and replay (8 MiB of int64 scratch)
# An atomic CPU write saves and writes blocks spanning this many elements, what the save read
# still cached for the write: 1.4x faster than 1M positions at 1 % density, 1.1x at 10 %.
UNDO_SPAN = 1 << 21
FEW = 1024  # up to this many positions ``put_`` is the cheapest CPU write (1.2 against 2.6 µs)
HOST_FROM = 1 << 15  # from here torch's CPU ops wait for busy intra-op threads: numpy passes
# Up to this many indices a patch is checked as Python lists, and replay keeps the list (23-34
# µs a call against 36-37 by numpy for 40-130 indices; the loops lose from about 160).
LISTED_UP_TO = 128
SMALL_ORDER_TEST = 1 << 12  # up to this many indices the order test takes a fresh temporary
# Sparse patches up to `BATCHED_UP_TO` indices (on CPU `CPU_BATCHED_UP_TO`, from
# `CPU_JOINED_FROM` of them) are validated in one concatenation; below `BATCHED_BELOW` indices
# per patch on average, a device's reserved-value test runs on all its patches at once.
BATCHED_UP_TO, CPU_BATCHED_UP_TO, CPU_JOINED_FROM, BATCHED_BELOW = 1 << 16, 1 << 12, 8, 4096
# The NaN bit test beats the float amax from `INTEGER_NAN_FROM` values (2.5x at 1M, 3x slower
# at 4K); on the host, torch's amax finds NaN up to `AMAX_UP_TO`.
INTEGER_NAN_FROM, AMAX_UP_TO = 1 << 15, 8192
# The diff's block by device type: ~20 dispatches each, under 0.15 ns an element on CPU at 1M.
DIFF_BLOCK = {"cpu": 1 << 20, "other": 1 << 24}
# From `SAMPLED_FROM` elements a CPU tensor is sampled at `SAMPLES` random positions (30 µs; 100
# at 4096): dense unscanned if it rules sparse out by 4 standard errors. No column fools a draw.
SAMPLED_FROM, SAMPLES = 1 << 18, 1024
LOW_BYTE_BLOCK = 1 << 20  # elements per block of `LowByteDetector`
BITMASK_BLOCK_BYTES = 2**17  # bytes of a bitmask decoded at a time (2**20 positions)
HASHED_CHUNK = 1 << 20  # payload bytes copied, then hashed while still in the cache
