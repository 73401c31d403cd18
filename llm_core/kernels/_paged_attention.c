/*
 * Paged attention for the CPU: causal, optional sliding window, optional per-head sinks, GQA, and a
 * value head dim that may differ from the q/k one. Reads keys and values straight from the paged
 * pools through the page table, so no gather, no mask and no score tensor is ever materialised.
 *
 * Semantics: those of llm_core/kernels/attention.py (masked_attention), for packed varlen queries:
 *
 *   sequence b: queries cu[b] .. cu[b+1]-1 sit at positions len_b - n_b .. len_b - 1
 *   query at position p sees keys j with max(0, p - W + 1) <= j <= p      (W = window, 0: none)
 *   out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m))      s_j = scale * (q . k_j)
 *
 * One query at a time, keys in blocks of KEY_BLOCK with an online (rescaled) softmax, so memory
 * is O(heads * KEY_BLOCK) whatever the context length. Per block and head: scores of 8 keys at a
 * time (8 independent FMA chains, then one 8-way horizontal sum), exponentials 8 at a time, and
 * the weighted value sum kept in registers across the block.
 *
 * Layouts (all C-contiguous):
 *   q      float32 [T, H, D]            k pool  float32 [slots, Hkv, D]   (slots = pages * page)
 *   out    float32 [T, H, Dv]           v pool  float32 [slots, Hkv, Dv]
 *   table  int32 [B, P]  logical page -> physical page (pages a query reads must be >= 0)
 *   cu     int32 [B + 1]   lens  int32 [B]   sinks  float32 [H] or an empty buffer
 * Query head h reads KV head h / (H / Hkv). Everything is checked against the buffer sizes; a
 * page outside the pool raises ValueError (nothing out of bounds is ever read).
 *
 * A second entry, qkv_attention, takes the fused projection output instead of q: per sequence, it
 * first applies the partial rotary embedding to the q and k heads of its new rows (in place), stores
 * their k and value-scaled v in the pools at the given slots, then attends as above with the q
 * heads read in place. That is the whole attention layer between the two projections, in one call.
 *
 * x86-64 with AVX2 + FMA uses the vector primitives (chosen at import); other CPUs the scalar ones.
 * Results agree to float32 rounding (the sums run in a different order than torch's).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_kernels.h"
#include "_paged_attention.h"

/* out [T, H, Dv] for the T queries of a set-up problem; 0, or -1 with a ValueError set. */
static int attention_check_out(AttnProblem *pb, Py_buffer *out) {
    const Py_ssize_t T = pb->B ? pb->cu[pb->B] : 0;
    if (check_buffer(out, ATTENTION_KERNEL, T * pb->H * pb->Dv * (Py_ssize_t)sizeof(float), "out")) return -1;
    pb->out = out->buf;
    return 0;
}

/* Runs pb without the GIL; returns 0, or -1 with a ValueError set. */
static int attention_run_released(const AttnProblem *pb) {
    const char *err;
    Py_BEGIN_ALLOW_THREADS
    err = attention_run(pb);
    Py_END_ALLOW_THREADS
    if (err != NULL) {
        PyErr_SetString(PyExc_ValueError, err);
        return -1;
    }
    return 0;
}

/* paged_attention(q, k, v, table, cu, lens, sinks, out, H, Hkv, D, Dv, page, window, scale) -> None */
static PyObject *py_paged_attention(PyObject *self, PyObject *args) {
    Py_buffer q, k, v, table, cu, lens, sinks, out;
    Py_ssize_t H, Hkv, D, Dv, page, window;
    float scale;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*w*nnnnnnf", &q, &k, &v, &table, &cu, &lens, &sinks, &out, &H,
                          &Hkv, &D, &Dv, &page, &window, &scale))
        return NULL;
    PyObject *result = NULL;
    AttnProblem pb = {0};
    if (attention_setup(&pb, &k, &v, &table, &cu, &lens, &sinks, H, Hkv, D, Dv, page, window, scale, 0) ||
        check_buffer(&q, ATTENTION_KERNEL, (pb.B ? pb.cu[pb.B] : 0) * H * D * (Py_ssize_t)sizeof(float), "q") ||
        attention_check_out(&pb, &out))
        goto done;
    pb.q = q.buf;
    pb.q_stride = H * D;
    if (attention_run_released(&pb) == 0) result = Py_NewRef(Py_None);
done:
    release_buffers((Py_buffer *[]){&q, &k, &v, &table, &cu, &lens, &sinks, &out}, 8);
    return result;
}

/* qkv_attention(qkv, cos, sin, slots, k, v, table, cu, lens, sinks, out, H, Hkv, D, Dv, page, window, scale,
 *               v_scale) -> None */
static PyObject *py_qkv_attention(PyObject *self, PyObject *args) {
    Py_buffer qkv, cos, sin, slots, k, v, table, cu, lens, sinks, out;
    Py_ssize_t H, Hkv, D, Dv, page, window;
    float scale, v_scale;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*y*w*w*y*y*y*y*w*nnnnnnff", &qkv, &cos, &sin, &slots, &k, &v, &table, &cu,
                          &lens, &sinks, &out, &H, &Hkv, &D, &Dv, &page, &window, &scale, &v_scale))
        return NULL;
    PyObject *result = NULL;
    AttnProblem pb = {0};
    if (attention_setup(&pb, &k, &v, &table, &cu, &lens, &sinks, H, Hkv, D, Dv, page, window, scale, 0))
        goto done;
    const Py_ssize_t T = pb.B ? pb.cu[pb.B] : 0;
    if (check_buffer(&qkv, ATTENTION_KERNEL, T * ((H + Hkv) * D + Hkv * Dv) * (Py_ssize_t)sizeof(float), "qkv") ||
        attention_setup_fused(&pb, qkv.buf, &cos, &sin, &slots, v_scale) || attention_check_out(&pb, &out))
        goto done;
    if (attention_run_released(&pb) == 0) result = Py_NewRef(Py_None);
done:
    release_buffers((Py_buffer *[]){&qkv, &cos, &sin, &slots, &k, &v, &table, &cu, &lens, &sinks, &out}, 11);
    return result;
}

static PyObject *py_simd(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(attention_uses_avx2() ? "avx2" : "scalar");
}

/* set_simd(name): "avx2" (where the CPU has it) or "scalar"; for tests of both paths. */
static PyObject *py_set_simd(PyObject *self, PyObject *args) {
    const char *name;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    const int avx2 = strcmp(name, "avx2") == 0;
    if ((avx2 || strcmp(name, "scalar") == 0) && attention_use_avx2(avx2)) Py_RETURN_NONE;
    PyErr_Format(PyExc_ValueError, "set_simd: '%s' is not available on this CPU (try 'scalar')", name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"paged_attention", py_paged_attention, METH_VARARGS,
     "paged_attention(q, k, v, page_table, cu_seqlens_q, seq_lens, sinks, out, H, Hkv, D, Dv, page_size, "
     "window, scale): float32 varlen causal attention over paged KV pools into out [T, H, Dv] (window 0: "
     "none; sinks: float32 [H] or empty); releases the GIL."},
    {"qkv_attention", py_qkv_attention, METH_VARARGS,
     "qkv_attention(qkv, cos, sin, slots, k, v, page_table, cu_seqlens_q, seq_lens, sinks, out, H, Hkv, D, Dv, "
     "page_size, window, scale, v_scale): rotate q and k inside qkv [T, (H + Hkv) * D + Hkv * Dv], store k and "
     "v_scale * v at slots [T] of the pools, then paged_attention with those queries; releases the GIL."},
    {"simd", py_simd, METH_NOARGS, "simd() -> 'avx2' or 'scalar': the primitives in use."},
    {"set_simd", py_set_simd, METH_VARARGS, "set_simd(name): use the 'avx2' or the 'scalar' primitives."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_paged_attention", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* EPD_SOURCE_HASH: the hash of this extension's sources, defined by setup.py (epd_common/native.py
   compares it with the tree at import, so a stale build is not used). */
PyMODINIT_FUNC PyInit__paged_attention(void) {
    attention_use_avx2(1);
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_HASH", EPD_SOURCE_HASH) < 0) Py_CLEAR(m);
    return m;
}
