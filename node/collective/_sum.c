/* The rank-order float32 sum of bfloat16 partials, rounded once: reduce.py's rule in C.
 *
 * numpy has no bfloat16 of its own: ml_dtypes' casts run a value at a time, and MLX's CPU backend
 * converts bfloat16 a value at a time too, so summing a decode step's partials cost more than the
 * frames' trip between the nodes (docs/envoy.md). Here each value is widened exactly (its bits in
 * the high half of a float32), the partials are added in rank order in float32, and the sum is
 * rounded to nearest even; a NaN is written 0x7FC0, as MLX writes it. The bytes are those of the
 * numpy path in reduce.py (tests/unit/test_reduce.py compares the two): nodes built with and
 * without this module sum alike.
 *
 * On x86-64 the bulk goes eight values at a time in SSE2 (part of the architecture: no dispatch);
 * elsewhere, and for the tail, plain loops over blocks that the compiler vectorises (NEON narrows
 * a 32-bit lane to 16 bits in one instruction; SSE2 has no unsigned pack, and gcc's code for these
 * loops ran 3x slower than the hand-written one there). No -ffast-math: the float32 adds must stay
 * in order and unfused.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_PARTS 64
/* below this many values the GIL is kept: releasing it costs more than the sum */
#define RELEASE_AT 16384

static inline float widen(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t narrow(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : rounded; /* a select, not a branch: the loops vectorise */
}

/* Values [from, n) in blocks: each loop below is one simple pass the compiler vectorises */
#define BLOCK 512
static void sum_portable(uint16_t *out, const uint16_t *const *parts, int k, Py_ssize_t from,
                         Py_ssize_t n)
{
    float acc[BLOCK];
    for (Py_ssize_t at = from; at < n; at += BLOCK) {
        Py_ssize_t m = n - at < BLOCK ? n - at : BLOCK;
        const uint16_t *first = parts[0] + at;
        uint16_t *o = out + at;
        if (k == 2) {
            const uint16_t *second = parts[1] + at;
            for (Py_ssize_t i = 0; i < m; i++)
                o[i] = narrow(widen(first[i]) + widen(second[i]));
            continue;
        }
        for (Py_ssize_t i = 0; i < m; i++)
            acc[i] = widen(first[i]);
        for (int p = 1; p < k; p++) {
            const uint16_t *part = parts[p] + at;
            for (Py_ssize_t i = 0; i < m; i++)
                acc[i] += widen(part[i]);
        }
        for (Py_ssize_t i = 0; i < m; i++)
            o[i] = narrow(acc[i]);
    }
}

/* Values [0, returned) summed; a NaN among them leaves *nan set (its lanes then hold garbage). */
static Py_ssize_t sum_vector(uint16_t *out, const uint16_t *const *parts, int k, Py_ssize_t n,
                             int *nan)
{
#if defined(__SSE2__)
    const __m128i zero = _mm_setzero_si128(), one = _mm_set1_epi32(1),
                  half = _mm_set1_epi32(0x7FFF);
    __m128 unordered = _mm_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i v = _mm_loadu_si128((const __m128i *)(parts[0] + i));
        __m128 lo = _mm_castsi128_ps(_mm_unpacklo_epi16(zero, v));
        __m128 hi = _mm_castsi128_ps(_mm_unpackhi_epi16(zero, v));
        for (int p = 1; p < k; p++) {
            v = _mm_loadu_si128((const __m128i *)(parts[p] + i));
            lo = _mm_add_ps(lo, _mm_castsi128_ps(_mm_unpacklo_epi16(zero, v)));
            hi = _mm_add_ps(hi, _mm_castsi128_ps(_mm_unpackhi_epi16(zero, v)));
        }
        unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(lo, hi));
        __m128i ulo = _mm_castps_si128(lo), uhi = _mm_castps_si128(hi);
        ulo = _mm_add_epi32(ulo, _mm_add_epi32(half, _mm_and_si128(_mm_srli_epi32(ulo, 16), one)));
        uhi = _mm_add_epi32(uhi, _mm_add_epi32(half, _mm_and_si128(_mm_srli_epi32(uhi, 16), one)));
        /* an arithmetic shift leaves the high half as a value int16 holds: the signed pack keeps
           its bits exactly */
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm_packs_epi32(_mm_srai_epi32(ulo, 16), _mm_srai_epi32(uhi, 16)));
    }
    *nan = _mm_movemask_ps(unordered) != 0;
    return i;
#else
    (void)out, (void)parts, (void)k, (void)n;
    *nan = 0;
    return 0;
#endif
}

static void sum(uint16_t *out, const uint16_t *const *parts, int k, Py_ssize_t n)
{
    int nan = 0;
    Py_ssize_t done = sum_vector(out, parts, k, n, &nan);
    /* a NaN is rare: its whole stretch is summed again the portable way */
    sum_portable(out, parts, k, nan ? 0 : done, n);
}

static void release(Py_buffer *views, int k)
{
    for (int p = 0; p < k; p++)
        PyBuffer_Release(&views[p]);
}

PyDoc_STRVAR(bfloat16_doc,
             "bfloat16(out, parts)\n--\n\n"
             "Write the rank-order float32 sum of `parts` (bfloat16 bit patterns: contiguous "
             "2-byte buffers of equal length), rounded to nearest even, into `out` (a writable "
             "buffer of the same length, apart from every part).");

static PyObject *bfloat16(PyObject *self, PyObject *args)
{
    PyObject *seq;
    Py_buffer out_view, views[MAX_PARTS];
    const uint16_t *parts[MAX_PARTS];
    (void)self;
    if (!PyArg_ParseTuple(args, "w*O:bfloat16", &out_view, &seq))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "parts must be a sequence of buffers");
    if (fast == NULL) {
        PyBuffer_Release(&out_view);
        return NULL;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    int got = 0;
    if (k < 1 || k > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "%zd parts: 1 to %d can be summed", k, MAX_PARTS);
        goto done;
    }
    if (out_view.len % 2) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, not 2-byte values", out_view.len);
        goto done;
    }
    const char *out_at = (const char *)out_view.buf, *out_end = out_at + out_view.len;
    while (got < k) {
        Py_buffer *view = &views[got];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), view, PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        got++;
        const char *at = (const char *)view->buf;
        if (view->len != out_view.len) {
            PyErr_Format(PyExc_ValueError, "part %d holds %zd bytes, out %zd", got - 1, view->len,
                         out_view.len);
            goto done;
        }
        /* a NaN's stretch is summed again from the parts: out must not have overwritten them */
        if (at < out_end && out_at < at + view->len) {
            PyErr_Format(PyExc_ValueError, "part %d overlaps out", got - 1);
            goto done;
        }
        parts[got - 1] = (const uint16_t *)at;
    }
    Py_ssize_t n = out_view.len / 2;
    if (n >= RELEASE_AT) {
        Py_BEGIN_ALLOW_THREADS sum((uint16_t *)out_view.buf, parts, (int)k, n);
        Py_END_ALLOW_THREADS
    } else {
        sum((uint16_t *)out_view.buf, parts, (int)k, n);
    }
done:
    release(views, got);
    Py_DECREF(fast);
    PyBuffer_Release(&out_view);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bfloat16", bfloat16, METH_VARARGS, bfloat16_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_sum",
    .m_doc = "Rank-order float32 sums of bfloat16 partials (node/collective/reduce.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__sum(void) { return PyModule_Create(&module); }
