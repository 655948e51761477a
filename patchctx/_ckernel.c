/*
 * patchctx._ckernel: the host passes of a sparse patch (order and range, NaN, the write) as
 * single loops in C, for CPU tensors. patchctx/_kernel.py is the only caller: it checks that
 * every tensor is a plain contiguous CPU tensor, passes addresses and element counts, and
 * keeps the tensors alive during the call. Each function here is a plain loop over memory
 * the caller vouches for; the write checks every position against the destination's size
 * itself, so that no caller's mistake (or another thread changing the indices meanwhile) can
 * make it write outside the destination.
 *
 * Loads and stores go through memcpy (no alignment or aliasing assumptions); compilers turn
 * them into plain moves. Long loops run without the GIL, as torch's own kernels do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* From this many elements a loop releases the GIL (below it, the release costs more). */
#define RELEASE_FROM 16384

static int read_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                     const char *name, long long *out) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) {
            return -1;
        }
    }
    return 0;
}

/* Each typed loop below exists for every element size (1, 2, 4, 8 bytes, moved as unsigned
 * integers of that size) and index width (int32, int64): EACH_TYPE defines them, BY_TYPE
 * calls the one for `size` and `width` (checked by `sizes_ok` first). */
#define EACH_TYPE(DEFINE, prefix)                                                           \
    DEFINE(prefix##8_32, uint8_t, int32_t)                                                  \
    DEFINE(prefix##16_32, uint16_t, int32_t)                                                \
    DEFINE(prefix##32_32, uint32_t, int32_t)                                                \
    DEFINE(prefix##64_32, uint64_t, int32_t)                                                \
    DEFINE(prefix##8_64, uint8_t, int64_t)                                                  \
    DEFINE(prefix##16_64, uint16_t, int64_t)                                                \
    DEFINE(prefix##32_64, uint32_t, int64_t)                                                \
    DEFINE(prefix##64_64, uint64_t, int64_t)

#define BY_TYPE(result, prefix, size, width, ...)                                           \
    switch ((size) * 10 + (width)) {                                                        \
    case 14:                                                                                \
        result = prefix##8_32(__VA_ARGS__);                                                 \
        break;                                                                              \
    case 24:                                                                                \
        result = prefix##16_32(__VA_ARGS__);                                                \
        break;                                                                              \
    case 44:                                                                                \
        result = prefix##32_32(__VA_ARGS__);                                                \
        break;                                                                              \
    case 84:                                                                                \
        result = prefix##64_32(__VA_ARGS__);                                                \
        break;                                                                              \
    case 18:                                                                                \
        result = prefix##8_64(__VA_ARGS__);                                                 \
        break;                                                                              \
    case 28:                                                                                \
        result = prefix##16_64(__VA_ARGS__);                                                \
        break;                                                                              \
    case 48:                                                                                \
        result = prefix##32_64(__VA_ARGS__);                                                \
        break;                                                                              \
    default:                                                                                \
        result = prefix##64_64(__VA_ARGS__);                                                \
        break;                                                                              \
    }

/* Whether the element `size`, index `width` and `count` of a call of `name` are ones the
 * loops take; else a ValueError is set. */
static int sizes_ok(const char *name, int size, int width, Py_ssize_t count) {
    if ((width != 4 && width != 8) || (size != 1 && size != 2 && size != 4 && size != 8) ||
        count < 0) {
        PyErr_Format(PyExc_ValueError, "%s: width must be 4 or 8, size 1, 2, 4 or 8, count >= 0",
                     name);
        return 0;
    }
    return 1;
}

/*
 * The loops below read typed elements when the address is aligned to their size (torch's
 * tensors always are, but for a view made from a byte buffer at an odd offset), and through
 * memcpy otherwise. They have no early exit and no branch inside, so that the compiler
 * vectorises them: a failure (the rare case) costs the same pass as a success.
 */
#define ALIGNED(address, size) (((uintptr_t)(address) & ((size) - 1)) == 0)

/* Whether `count` unsigned integers of type T at `at` are strictly increasing, the last at
 * most `highest`. */
#define INCREASING(name, T)                                                                 \
    static int name(const char *at, Py_ssize_t count, uint64_t highest) {                     \
        if (count == 0) {                                                                   \
            return 1;                                                                       \
        }                                                                                   \
        int bad = 0;                                                                        \
        T last;                                                                             \
        if (ALIGNED(at, sizeof(T))) {                                                       \
            const T *p = (const T *)(const void *)at;                                       \
            for (Py_ssize_t i = 1; i < count; i++) {                                        \
                bad |= p[i] <= p[i - 1];                                                    \
            }                                                                               \
            last = p[count - 1];                                                            \
        } else {                                                                            \
            T previous;                                                                     \
            memcpy(&previous, at, sizeof(T));                                               \
            for (Py_ssize_t i = 1; i < count; i++) {                                        \
                T v;                                                                        \
                memcpy(&v, at + i * (Py_ssize_t)sizeof(T), sizeof(T));                      \
                bad |= v <= previous;                                                       \
                previous = v;                                                               \
            }                                                                               \
            last = previous;                                                                \
        }                                                                                   \
        return !bad && (uint64_t)last <= highest;                                              \
    }

INCREASING(increasing32, uint32_t)
INCREASING(increasing64, uint64_t)

/* Whether any of `count` IEEE floats (as unsigned integers of type T) at `at` is a NaN: its
 * bits without the sign above those of infinity. */
#define ANY_NAN(name, T, MAGNITUDE)                                                         \
    static int name(const char *at, Py_ssize_t count, T infinity) {                         \
        int found = 0;                                                                      \
        if (ALIGNED(at, sizeof(T))) {                                                       \
            const T *p = (const T *)(const void *)at;                                       \
            for (Py_ssize_t i = 0; i < count; i++) {                                        \
                found |= (T)(p[i] & (MAGNITUDE)) > infinity;                                \
            }                                                                               \
        } else {                                                                            \
            for (Py_ssize_t i = 0; i < count; i++) {                                        \
                T v;                                                                        \
                memcpy(&v, at + i * (Py_ssize_t)sizeof(T), sizeof(T));                      \
                found |= (T)(v & (MAGNITUDE)) > infinity;                                   \
            }                                                                               \
        }                                                                                   \
        return found;                                                                       \
    }

ANY_NAN(any_nan16, uint16_t, 0x7FFFu)
ANY_NAN(any_nan32, uint32_t, 0x7FFFFFFFu)
ANY_NAN(any_nan64, uint64_t, 0x7FFFFFFFFFFFFFFFull)

/* Whether `count` IEEE floats of `kind` (2 bfloat16, 3 float16, 4 float32, 8 float64) at `at`
 * hold a NaN; -1 for another kind. */
static int any_nan(const char *at, Py_ssize_t count, int kind) {
    switch (kind) {
    case 2:
        return any_nan16(at, count, 0x7F80u);
    case 3:
        return any_nan16(at, count, 0x7C00u);
    case 4:
        return any_nan32(at, count, 0x7F800000u);
    case 8:
        return any_nan64(at, count, 0x7FF0000000000000ull);
    default:
        return -1;
    }
}

/*
 * check(indices, count, width, highest, values, kind) -> bool
 *
 * A sparse patch's common case in one call: its `count` contiguous indices (integers of
 * `width` bytes, 4 or 8) strictly increasing and at most `highest`, read as unsigned (a
 * negative one reads as one above every index of its width that can be in range: the caller
 * caps `highest` at 2**(8 * width - 1) - 1), and, unless `kind` is 0, none of its `count`
 * contiguous values a NaN of any sign or payload. `kind`: 2 bfloat16, 3 float16, 4 float32,
 * 8 float64.
 */
static PyObject *check(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[6];
    if (read_args(args, nargs, 6, "check", a) < 0) {
        return NULL;
    }
    const char *indices = (const char *)(uintptr_t)a[0];
    Py_ssize_t count = (Py_ssize_t)a[1];
    int width = (int)a[2];
    uint64_t highest = (uint64_t)a[3];
    const char *values = (const char *)(uintptr_t)a[4];
    int kind = (int)a[5];
    if ((width != 4 && width != 8) || count < 0 ||
        !(kind == 0 || kind == 2 || kind == 3 || kind == 4 || kind == 8)) {
        PyErr_SetString(PyExc_ValueError,
                        "check: width must be 4 or 8, count >= 0, kind 0, 2, 3, 4 or 8");
        return NULL;
    }
    PyThreadState *saved = count >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
    int ok = width == 4 ? increasing32(indices, count, highest)
                        : increasing64(indices, count, highest);
    if (ok && kind) {
        ok = !any_nan(values, count, kind);
    }
    if (saved) {
        PyEval_RestoreThread(saved);
    }
    return PyBool_FromLong(ok);
}

/*
 * has_nan(values, count, kind) -> bool
 *
 * Whether the `count` contiguous IEEE floats of `kind` (as for `check`) at `values` hold a
 * NaN of any sign or payload.
 */
static PyObject *has_nan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[3];
    if (read_args(args, nargs, 3, "has_nan", a) < 0) {
        return NULL;
    }
    const char *values = (const char *)(uintptr_t)a[0];
    Py_ssize_t count = (Py_ssize_t)a[1];
    int kind = (int)a[2];
    if (count < 0 || !(kind == 2 || kind == 3 || kind == 4 || kind == 8)) {
        PyErr_SetString(PyExc_ValueError, "has_nan: count >= 0, kind 2, 3, 4 or 8");
        return NULL;
    }
    PyThreadState *saved = count >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
    int found = any_nan(values, count, kind);
    if (saved) {
        PyEval_RestoreThread(saved);
    }
    return PyBool_FromLong(found);
}

/* ``target[indices[i] - shift] = values[i]`` for element type T and index type I, each
 * position checked against `limit` (one not written is counted in `missed`). */
#define SCATTER(name, T, I)                                                                 \
    static long long name(char *target, uint64_t limit, const char *indices,                \
                          Py_ssize_t count, int64_t shift, const char *values) {            \
        long long missed = 0;                                                               \
        for (Py_ssize_t i = 0; i < count; i++) {                                            \
            I index;                                                                        \
            memcpy(&index, indices + i * (Py_ssize_t)sizeof(I), sizeof(I));                 \
            int64_t position = (int64_t)index - shift;                                      \
            if ((uint64_t)position >= limit) {                                              \
                missed++;                                                                   \
                continue;                                                                   \
            }                                                                               \
            T v;                                                                            \
            memcpy(&v, values + i * (Py_ssize_t)sizeof(T), sizeof(T));                      \
            memcpy(target + position * (int64_t)sizeof(T), &v, sizeof(T));                  \
        }                                                                                   \
        return missed;                                                                      \
    }

EACH_TYPE(SCATTER, scatter)

/* ``out[i] = target[indices[i] - shift]`` for element type T and index type I, each position
 * checked against `limit` (one not read is counted in `missed`, its `out` left as it was). */
#define GATHER(name, T, I)                                                                  \
    static long long name(const char *target, uint64_t limit, const char *indices,          \
                          Py_ssize_t count, int64_t shift, char *out) {                     \
        long long missed = 0;                                                               \
        for (Py_ssize_t i = 0; i < count; i++) {                                            \
            I index;                                                                        \
            memcpy(&index, indices + i * (Py_ssize_t)sizeof(I), sizeof(I));                 \
            int64_t position = (int64_t)index - shift;                                      \
            if ((uint64_t)position >= limit) {                                              \
                missed++;                                                                   \
                continue;                                                                   \
            }                                                                               \
            T v;                                                                            \
            memcpy(&v, target + position * (int64_t)sizeof(T), sizeof(T));                  \
            memcpy(out + i * (Py_ssize_t)sizeof(T), &v, sizeof(T));                         \
        }                                                                                   \
        return missed;                                                                      \
    }

EACH_TYPE(GATHER, gather)

/* Whether the byte ranges [a, a + an) and [b, b + bn) meet (both non-empty). */
static int meet(uintptr_t a, uint64_t an, uintptr_t b, uint64_t bn) {
    return an && bn && a < b + bn && b < a + an;
}

/*
 * scatter(target, limit, size, indices, width, count, shift, values) -> int
 *
 * ``target[indices[i] - shift] = values[i]`` for each of `count` entries: `target` holds
 * `limit` contiguous elements of `size` bytes (1, 2, 4 or 8), the indices are `count`
 * contiguous signed integers of `width` bytes (4 or 8), the values `count` contiguous elements
 * of `size` bytes. Bytes are moved as they are (the caller has the values in the destination's
 * dtype). Returns -1, having written nothing, when the indices or values lie in the target's
 * bytes (a write would change what later entries read: the caller copies them first).
 * Otherwise a position outside ``[0, limit)`` is not written, and the count of those is
 * returned (0: all written), so the caller can refuse a call whose checks did not hold.
 */
static PyObject *scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[8];
    if (read_args(args, nargs, 8, "scatter", a) < 0) {
        return NULL;
    }
    char *target = (char *)(uintptr_t)a[0];
    uint64_t limit = (uint64_t)a[1];
    int size = (int)a[2];
    const char *indices = (const char *)(uintptr_t)a[3];
    int width = (int)a[4];
    Py_ssize_t count = (Py_ssize_t)a[5];
    int64_t shift = (int64_t)a[6];
    const char *values = (const char *)(uintptr_t)a[7];
    if (!sizes_ok("scatter", size, width, count)) {
        return NULL;
    }
    uint64_t span = limit * (uint64_t)size;
    if (meet((uintptr_t)target, span, (uintptr_t)indices, (uint64_t)count * width) ||
        meet((uintptr_t)target, span, (uintptr_t)values, (uint64_t)count * size)) {
        return PyLong_FromLong(-1);
    }
    long long missed;
    PyThreadState *saved = count >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
    BY_TYPE(missed, scatter, size, width, target, limit, indices, count, shift, values);
    if (saved) {
        PyEval_RestoreThread(saved);
    }
    return PyLong_FromLongLong(missed);
}

/*
 * gather(target, limit, size, indices, width, count, shift, out) -> int
 *
 * ``out[i] = target[indices[i] - shift]`` for each of `count` entries, with the arguments of
 * `scatter` (`out`: `count` contiguous elements of `size` bytes): the old values an atomic
 * call keeps before `scatter` writes the new ones. Returns the count of positions outside
 * ``[0, limit)`` (not read).
 */
static PyObject *gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[8];
    if (read_args(args, nargs, 8, "gather", a) < 0) {
        return NULL;
    }
    const char *target = (const char *)(uintptr_t)a[0];
    uint64_t limit = (uint64_t)a[1];
    int size = (int)a[2];
    const char *indices = (const char *)(uintptr_t)a[3];
    int width = (int)a[4];
    Py_ssize_t count = (Py_ssize_t)a[5];
    int64_t shift = (int64_t)a[6];
    char *out = (char *)(uintptr_t)a[7];
    if (!sizes_ok("gather", size, width, count)) {
        return NULL;
    }
    long long missed;
    PyThreadState *saved = count >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
    BY_TYPE(missed, gather, size, width, target, limit, indices, count, shift, out);
    if (saved) {
        PyEval_RestoreThread(saved);
    }
    return PyLong_FromLongLong(missed);
}

/* The most dimensions `scatter_strided` decomposes an index into. */
#define MAX_DIMS 16

/* A strided view for `scatter_strided`: per dimension of size > 1, by decreasing stride. */
struct plan {
    int dims;
    int64_t offset, base;
    uint64_t limit;
    int64_t strides[MAX_DIMS], sizes[MAX_DIMS], target_strides[MAX_DIMS];
};

/* `scatter_strided`'s loop for element type T and index type I. The outer coordinate of the
 * previous index is kept while the next ones fall in the same outer slice (sorted indices,
 * dense enough): a division saved per index. An inner stride of 1 needs no division. With no
 * dimension (a one-element view), only the index at `offset` itself is the view's. Given
 * `positions` (`gather_strided`), it writes nothing: it appends each position and the value
 * there to `positions` and `old`, counting them in `found`. */
#define STRIDED(name, T, I)                                                                 \
    static long long name(const struct plan *view, char *target, const char *indices,       \
                          Py_ssize_t count, const char *values, int64_t *positions,         \
                          char *old, Py_ssize_t *found) {                                   \
        /* The plan in locals: writes through `target` (a char pointer) could otherwise be   \
         * taken to change it, and every field would be read again per index. */            \
        const int dims = view->dims;                                                        \
        const int64_t offset = view->offset, base = view->base;                             \
        const uint64_t limit = view->limit;                                                 \
        int64_t strides[MAX_DIMS], sizes[MAX_DIMS], target_strides[MAX_DIMS];               \
        for (int d = 0; d < dims; d++) {                                                    \
            strides[d] = view->strides[d];                                                  \
            sizes[d] = view->sizes[d];                                                      \
            target_strides[d] = view->target_strides[d];                                    \
        }                                                                                   \
        long long missed = 0;                                                               \
        int64_t outer = 0, outer_low = 0, outer_high = 0;                                   \
        for (Py_ssize_t i = 0; i < count; i++) {                                            \
            I index;                                                                        \
            memcpy(&index, indices + i * (Py_ssize_t)sizeof(I), sizeof(I));                 \
            if ((int64_t)index < offset) {                                                  \
                continue;                                                                   \
            }                                                                               \
            int64_t rest = (int64_t)index - offset;                                         \
            if (rest < outer_low || rest >= outer_high) {                                   \
                outer = dims ? rest / strides[0] : 0;                                       \
                outer_low = dims ? outer * strides[0] : 0;                                  \
                outer_high = dims ? outer_low + strides[0] : 1;                             \
            }                                                                               \
            if (dims && outer >= sizes[0]) {                                                \
                continue; /* beyond the view */                                             \
            }                                                                               \
            rest -= outer_low;                                                              \
            int64_t position = base + (dims ? outer * target_strides[0] : 0);               \
            int inside = 1;                                                                 \
            for (int d = 1; d < dims; d++) {                                                \
                int64_t coordinate;                                                         \
                if (strides[d] == 1) {                                                      \
                    coordinate = rest;                                                      \
                    rest = 0;                                                               \
                } else {                                                                    \
                    coordinate = rest / strides[d];                                         \
                    rest -= coordinate * strides[d];                                        \
                }                                                                           \
                if (coordinate >= sizes[d]) {                                               \
                    inside = 0;                                                             \
                    break;                                                                  \
                }                                                                           \
                position += coordinate * target_strides[d];                                 \
            }                                                                               \
            if (!inside || rest != 0) {                                                     \
                continue; /* another view's element */                                      \
            }                                                                               \
            if ((uint64_t)position >= limit) {                                              \
                missed++;                                                                   \
                continue;                                                                   \
            }                                                                               \
            T v;                                                                            \
            if (positions) { /* gathering: where it would write, and what is there */      \
                memcpy(&v, target + position * (int64_t)sizeof(T), sizeof(T));              \
                memcpy(old + *found * (Py_ssize_t)sizeof(T), &v, sizeof(T));                \
                positions[(*found)++] = position;                                           \
                continue;                                                                   \
            }                                                                               \
            memcpy(&v, values + i * (Py_ssize_t)sizeof(T), sizeof(T));                      \
            memcpy(target + position * (int64_t)sizeof(T), &v, sizeof(T));                  \
        }                                                                                   \
        return missed;                                                                      \
    }

EACH_TYPE(STRIDED, strided)

/* `scatter_strided` and `gather_strided`: the arguments they share (the first nine, then
 * `values` or the two outputs), the loop by element size and index width. */
static PyObject *strided(PyObject *const *args, Py_ssize_t nargs, int gathering) {
    const char *name = gathering ? "gather_strided" : "scatter_strided";
    Py_ssize_t want = gathering ? 11 : 10;
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return NULL;
    }
    long long a[8];
    for (int i = 0; i < 8; i++) {
        a[i] = PyLong_AsLongLong(args[i]);
        if (a[i] == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    long long tail[2] = {0, 0};
    for (int i = 0; i < (gathering ? 2 : 1); i++) {
        tail[i] = PyLong_AsLongLong(args[9 + i]);
        if (tail[i] == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    PyObject *plan = args[8];
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) > MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s: plan must be a tuple of at most %d triples", name,
                     MAX_DIMS);
        return NULL;
    }
    struct plan view;
    memset(&view, 0, sizeof view);
    view.dims = (int)PyTuple_GET_SIZE(plan);
    for (int d = 0; d < view.dims; d++) {
        PyObject *triple = PyTuple_GET_ITEM(plan, d);
        if (!PyTuple_Check(triple) || PyTuple_GET_SIZE(triple) != 3) {
            PyErr_Format(PyExc_ValueError, "%s: plan must be a tuple of triples", name);
            return NULL;
        }
        view.strides[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(triple, 0));
        view.sizes[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(triple, 1));
        view.target_strides[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(triple, 2));
        if (PyErr_Occurred()) {
            return NULL;
        }
        if (view.strides[d] <= 0 || view.sizes[d] <= 0) {
            PyErr_Format(PyExc_ValueError, "%s: strides and sizes must be > 0", name);
            return NULL;
        }
    }
    char *target = (char *)(uintptr_t)a[0];
    view.limit = (uint64_t)a[1];
    int size = (int)a[2];
    const char *indices = (const char *)(uintptr_t)a[3];
    int width = (int)a[4];
    Py_ssize_t count = (Py_ssize_t)a[5];
    view.offset = (int64_t)a[6];
    view.base = (int64_t)a[7];
    const char *values = gathering ? NULL : (const char *)(uintptr_t)tail[0];
    int64_t *positions = gathering ? (int64_t *)(uintptr_t)tail[0] : NULL;
    char *old = gathering ? (char *)(uintptr_t)tail[1] : NULL;
    if (!sizes_ok(name, size, width, count)) {
        return NULL;
    }
    uint64_t span = view.limit * (uint64_t)size;
    if (!gathering &&
        (meet((uintptr_t)target, span, (uintptr_t)indices, (uint64_t)count * width) ||
         meet((uintptr_t)target, span, (uintptr_t)values, (uint64_t)count * size))) {
        return PyLong_FromLong(-1);
    }
    long long missed;
    Py_ssize_t found = 0;
    PyThreadState *saved = count >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
    BY_TYPE(missed, strided, size, width, &view, target, indices, count, values, positions, old,
            &found);
    if (saved) {
        PyEval_RestoreThread(saved);
    }
    if (gathering) {
        return Py_BuildValue("(Ln)", missed, found);
    }
    return PyLong_FromLongLong(missed);
}

/*
 * scatter_strided(target, limit, size, indices, width, count, offset, base, plan, values)
 *     -> int
 *
 * `scatter` through a strided view: the view of the (contiguous, checkpoint-shaped) staged
 * tensor that starts at element `offset` and whose dimensions are `plan`, a tuple of
 * (stride, size, target stride) triples by decreasing stride, was copied into the view of the
 * target storage that starts at element `base` with those target strides. Each index,
 * less `offset`, decomposes greedily by the strides into one coordinate per dimension; an
 * index outside the view (a coordinate beyond its size, a remainder left: an element of
 * another rank's slice, say) is not this view's and is skipped; the others are written at
 * ``base + sum(coordinate * target stride)``. Strides are positive and each exceeds what the
 * smaller ones reach (the caller's view is injective), so the decomposition is exact.
 * Returns -1, having written nothing, when the indices or values lie in the target's bytes,
 * else the count of positions outside ``[0, limit)`` (not written).
 */
static PyObject *scatter_strided(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return strided(args, nargs, 0);
}

/*
 * gather_strided(target, limit, size, indices, width, count, offset, base, plan, positions,
 *                old) -> (int, int)
 *
 * What `scatter_strided` with the same arguments would write, without writing: for each
 * index the view holds, in order, the storage position it would write (into `positions`,
 * int64, room for `count`) and the value there now (into `old`, elements of `size` bytes,
 * room for `count`): an atomic call's undo log. Returns the count of positions outside
 * ``[0, limit)`` (not read) and the count found.
 */
static PyObject *gather_strided(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return strided(args, nargs, 1);
}

static PyMethodDef methods[] = {
    {"check", (PyCFunction)(void (*)(void))check, METH_FASTCALL,
     "check(indices, count, width, highest, values, kind) -> bool"},
    {"has_nan", (PyCFunction)(void (*)(void))has_nan, METH_FASTCALL,
     "has_nan(values, count, kind) -> bool"},
    {"scatter", (PyCFunction)(void (*)(void))scatter, METH_FASTCALL,
     "scatter(target, limit, size, indices, width, count, shift, values) -> int"},
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL,
     "gather(target, limit, size, indices, width, count, shift, out) -> int"},
    {"scatter_strided", (PyCFunction)(void (*)(void))scatter_strided, METH_FASTCALL,
     "scatter_strided(target, limit, size, indices, width, count, offset, base, plan, values) "
     "-> int"},
    {"gather_strided", (PyCFunction)(void (*)(void))gather_strided, METH_FASTCALL,
     "gather_strided(target, limit, size, indices, width, count, offset, base, plan, positions, "
     "old) -> (int, int)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ckernel",
    "The host passes of a sparse patch in C (see patchctx/_kernel.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ckernel(void) {
    PyObject *made = PyModule_Create(&module);
    if (made == NULL) {
        return NULL;
    }
#ifdef PATCHCTX_SOURCE
    if (PyModule_AddStringConstant(made, "SOURCE", PATCHCTX_SOURCE) < 0) {
        Py_DECREF(made);
        return NULL;
    }
#endif
    return made;
}
