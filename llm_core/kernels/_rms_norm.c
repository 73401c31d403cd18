/*
 * RMSNorm for the CPU, optionally fused with the residual add that precedes it in a pre-norm
 * decoder:
 *
 *   rms_norm(x, weight)              out = weight * (x * rsqrt(mean(x^2) + eps))
 *   rms_norm(x, weight, residual)    sum = x + residual;  out = rms_norm(sum)   (both returned)
 *
 * Why: torch runs RMSNorm on CPU as a handful of element-wise and reduction ops, ~50 us for a
 * 32-row decode batch, and the residual add is one more; a transformer layer has two of each. Here
 * it is one pass per row. Rows are independent; the sum of squares uses 8 partial sums (which the
 * compiler vectorizes), so results agree with torch to float32 rounding, not bit for bit.
 *
 * Layouts (C-contiguous float32): x, residual, out, sum [rows, dim], weight [dim].
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_kernels.h"
#include "_rms_norm.h"

#define KERNEL "rms_norm" /* error messages start with this */

/* rms_norm(x, weight, residual, out, sum, rows, dim, eps) -> None; residual and sum empty: no add */
static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    Py_buffer x, weight, residual, out, sum;
    Py_ssize_t rows, dim;
    float eps;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*nnf", &x, &weight, &residual, &out, &sum, &rows, &dim, &eps))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t f = (Py_ssize_t)sizeof(float), n = rows * dim * f;
    const int add = residual.len != 0;
    if (rows < 0 || dim < 1) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: invalid sizes");
        goto done;
    }
    if (check_buffer(&x, KERNEL, n, "x") || check_buffer(&weight, KERNEL, dim * f, "weight") ||
        check_buffer(&out, KERNEL, n, "out") ||
        (add && (check_buffer(&residual, KERNEL, n, "residual") || check_buffer(&sum, KERNEL, n, "sum"))))
        goto done;
    const float *xs = x.buf, *w = weight.buf, *res = residual.buf;
    float *o = out.buf, *s = sum.buf;
    Py_BEGIN_ALLOW_THREADS
    rms_norm_rows(xs, add ? res : NULL, w, o, add ? s : NULL, rows, dim, eps);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release_buffers((Py_buffer *[]){&x, &weight, &residual, &out, &sum}, 5);
    return result;
}

static PyMethodDef methods[] = {
    {"rms_norm", py_rms_norm, METH_VARARGS,
     "rms_norm(x, weight, residual, out, sum, rows, dim, eps): float32 RMSNorm of x [rows, dim] into out; with "
     "a non-empty residual, of sum = x + residual (written to sum); releases the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rms_norm", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* EPD_SOURCE_HASH: the hash of this extension's sources, defined by setup.py (epd_common/native.py
   compares it with the tree at import, so a stale build is not used). */
PyMODINIT_FUNC PyInit__rms_norm(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_HASH", EPD_SOURCE_HASH) < 0) Py_CLEAR(m);
    return m;
}
