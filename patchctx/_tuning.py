"""Every tuned threshold of patchctx, in one place: the sizes at which a code path changes.

Each one only chooses between two ways of doing the same thing, both exact: none changes a
value written, only how fast (or in how much memory) it is written. Each was measured on the
2-core development machine (one torch thread) as its comment says. Modules read them here at
call time (``_tuning.NAME``), so a test may lower one to run both sides of it on small data.
"""

from __future__ import annotations

__all__ = [
    "AMAX_UP_TO",
    "BATCHED_BELOW",
    "BATCHED_UP_TO",
    "BITMASK_BLOCK_BYTES",
    "BLOCK",
    "CPU_BATCHED_UP_TO",
    "CPU_JOINED_FROM",
    "DIFF_BLOCK",
    "FEW",
    "HASHED_CHUNK",
    "HOST_FROM",
    "INTEGER_NAN_FROM",
    "LISTED_UP_TO",
    "LOW_BYTE_BLOCK",
    "SAMPLED_FROM",
    "SAMPLES",
    "SMALL_ORDER_TEST",
    "UNDO_SPAN",
]

# -- writes and their undo (`patchctx._blocks`, `patchctx._bits`)

# Positions per block: 1M (8 MiB of int64 scratch), so a 100M-element update is ~100 writes.
BLOCK = 1 << 20
# A write that saves the old values first (atomic) goes, on CPU, in blocks whose positions span
# about this many elements: the cache lines the save reads are still in cache for the write.
# 1.4x faster than 1M positions at a time at 1 % density, 1.1x at 10 % (`_blocks.undo_block`).
UNDO_SPAN = 1 << 21
# Up to this many positions, ``put_`` on the destination as it is (no flat view to make) is the
# cheapest write on CPU: 1.2-1.7 µs for 16-256 positions against 2.6-3.1 µs for a flat view and
# ``index_copy_``; from a few thousand up, ``scatter_`` through an integer view is faster.
FEW = 1024

# -- host passes on CPU (`patchctx._cpu_passes`)

# From this many elements a torch elementwise operation or reduction on CPU runs on every
# intra-op thread (torch's grain size) and waits for a busy core: longer tensors take the
# host's passes instead.
HOST_FROM = 1 << 15
# A patch of at most this many indices (and values) is checked on the host as Python lists (one
# ``tolist`` each, against a microsecond or more for each numpy or torch operation), and replay
# keeps the list of indices. A call of one such patch (bf16, int32 indices, a whole-tensor
# route, one thread) took 23-34 µs this way against 36-37 through numpy for 40 to 130 indices,
# and a third less right after a sweep of memory (numpy's first calls cost 20-30 µs each); from
# about 160 the Python loops cost more in a loop of calls.
LISTED_UP_TO = 128
# Up to this many indices, the order test writes a fresh temporary (a few KiB).
SMALL_ORDER_TEST = 1 << 12

# -- validation of sparse patches (`patchctx._patch`)

# Sparse patches of at most this many indices are checked together, in one concatenation
# (int64, kept as their replay positions); longer ones block by block.
BATCHED_UP_TO = 1 << 16
# On CPU, from a few thousand indices up, a patch is checked on its own by numpy (two passes,
# nothing concatenated, no int64 copy made: replay converts its indices with the segment's
# shift in one pass). The concatenation pays for tiny patches only.
CPU_BATCHED_UP_TO = 1 << 12
# On CPU, the short patches of a call are checked together from this many up; fewer are checked
# one by one like the long ones, by numpy: two passes each, no concatenation, no int64 copy.
# Joining them costs a concatenation, its int64 copy and its split, which pay off over many
# patches only.
CPU_JOINED_FROM = 8
# Below this many indices per patch on average, the patches of a device are checked together
# (a fixed number of operations for any number of patches); above it, patch by patch.
BATCHED_BELOW = 4096

# -- reserved values (`patchctx._strategies`)

# From this many values the NaN bit test beats the float amax (2.5x at 1M, 3x slower at 4K).
INTEGER_NAN_FROM = 1 << 15
# Up to this many values, NaN is found by torch's amax (numpy's speed at fp32; the bit test
# reads bf16 faster from about 10K on).
AMAX_UP_TO = 8192

# -- the trainer's diff (`patchctx._changes`, `patchctx._choose`, `patchctx._lowbyte`)

# Elements per block of the diff's scan, per device type (others: `DIFF_BLOCK["other"]`).
# Each block costs ~20 dispatches (100-150 us on CPU), so on CPU a block of 1M elements (5 MB
# of buffers for a bf16 receiver) keeps that under 0.15 ns per element. On an accelerator the
# same dispatches cost as much host time while a block streams at TB/s: 16M elements (80 MB of
# buffers) keeps the launches from dominating as far as one can.
DIFF_BLOCK = {"cpu": 1 << 20, "other": 1 << 24}
# A CPU tensor of at least this many elements is first sampled at `SAMPLES` positions drawn
# uniformly (a fixed seed per size): when even the low end of the density they show (four
# standard errors below it) rules sparse out, it goes dense with no scan (about 60 µs, against
# 0.5 ms for the scan of 262K elements and 5 ms of 4M). A pattern cannot fool the draw as it
# could a stride: a column, a row or a block is hit as often as its share.
SAMPLED_FROM = 1 << 18
SAMPLES = 4096
# Elements per block of `LowByteDetector`'s pass.
LOW_BYTE_BLOCK = 1 << 20

# -- the wire (`patchctx._encoding`, `patchctx.vllm`)

# Bytes of a bitmask decoded at a time (2**20 positions).
BITMASK_BLOCK_BYTES = 2**17
# Bytes a payload is copied in, then hashed while they are still in the cache.
HASHED_CHUNK = 1 << 20
