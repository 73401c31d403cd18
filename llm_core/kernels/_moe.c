/*
 * The routed experts of a MoE layer on the CPU, in one call: SwiGLU experts over the tokens routed
 * to them, weighted and summed per token.
 *
 *   out[t] = sum_k weights[t, k] * down_e(silu(x[t] @ Wg_e) * (x[t] @ Wu_e)),   e = experts[t, k]
 *
 * Why: with a few tokens per expert (a decode step), running the experts through a BLAS means one
 * small GEMM pair per expert plus gathers, padding, activation and scatter ops around them, most
 * of the step's MoE time. Here each expert's tokens go through a small-M product that streams
 * each weight matrix once per call, with the activation and the weighted sum fused.
 *
 * Layouts (C-contiguous float32; "[E, in, out]" is what GroupedExperts.fuse_weights lays out):
 *   x [T, H]    experts int64 [T, K]   weights [T, K]   out [T, H] (overwritten)
 *   gate_up [E, H, 2I]  (columns 0..I-1 gate, I..2I-1 up)     down [E, I, H]
 * With bf16 = True, gate_up and down hold bfloat16 (widened as they are read: the bits of float32
 * weights of the same values). Assignments are taken per expert in (t, k) order. Expert ids are checked (ValueError).
 * AVX-512 or AVX2 + FMA where the CPU has them (chosen at import), plain loops otherwise.
 *
 * A second entry, route, is the router before it (llm_core/models/moe.py, TopKRouter): per token the
 * sigmoid scores of x @ W_router^T, the selection by score + bias within the best expert groups,
 * and the normalised, scaled weights, in one call instead of a dozen small torch ops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "_kernels.h"
#include "_moe.h"

#define KERNEL "moe_experts" /* error messages start with this */

/* moe_experts(x, experts, weights, gate_up, down, out, T, K, E, H, I[, bf16, bf16_inputs]) -> None;
 * bf16_inputs (bf16 products, _blas.h): x's rows are bf16 values (the caller rounded them) and each
 * expert's activated rows are rounded too. */
static PyObject *py_moe_experts(PyObject *self, PyObject *args) {
    Py_buffer x, experts, weights, gate_up, down, out;
    MoeProblem pb = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*nnnnn|pp", &x, &experts, &weights, &gate_up, &down, &out, &pb.T, &pb.K,
                          &pb.E, &pb.H, &pb.I, &pb.wbf16, &pb.round_bf16))
        return NULL;
    pb.round_bf16 = pb.round_bf16 && pb.wbf16;
    PyObject *result = NULL;
    const Py_ssize_t f = (Py_ssize_t)sizeof(float), wf = pb.wbf16 ? 2 : f;
    if (pb.T < 0 || pb.K < 1 || pb.E < 1 || pb.H < 1 || pb.I < 1) {
        PyErr_SetString(PyExc_ValueError, "moe_experts: invalid sizes");
        goto done;
    }
    if (check_buffer(&x, KERNEL, pb.T * pb.H * f, "x") ||
        check_buffer(&experts, KERNEL, pb.T * pb.K * (Py_ssize_t)sizeof(int64_t), "experts") ||
        check_buffer(&weights, KERNEL, pb.T * pb.K * f, "weights") ||
        check_buffer(&gate_up, KERNEL, pb.E * pb.H * 2 * pb.I * wf, "gate_up") ||
        check_buffer(&down, KERNEL, pb.E * pb.I * pb.H * wf, "down") ||
        check_buffer(&out, KERNEL, pb.T * pb.H * f, "out"))
        goto done;
    pb.x = x.buf, pb.experts = experts.buf, pb.weights = weights.buf;
    pb.gate_up = gate_up.buf, pb.down = down.buf, pb.out = out.buf;
    const char *err;
    Py_BEGIN_ALLOW_THREADS
    err = moe_run(&pb);
    Py_END_ALLOW_THREADS
    if (err != NULL) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release_buffers((Py_buffer *[]){&x, &experts, &weights, &gate_up, &down, &out}, 6);
    return result;
}

/* route(x, weight, bias, experts, weights, T, H, E, K, n_group, topk_group, norm, scaling) -> None */
static PyObject *py_route(PyObject *self, PyObject *args) {
    Py_buffer x, w, bias, experts, weights;
    Route rt = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*nnnnnnpf", &x, &w, &bias, &experts, &weights, &rt.T, &rt.H, &rt.E,
                          &rt.K, &rt.n_group, &rt.topk_group, &rt.norm, &rt.scaling))
        return NULL;
    PyObject *result = NULL;
    float *work = NULL;
    const Py_ssize_t f = (Py_ssize_t)sizeof(float);
    if (!route_sizes_valid(&rt)) {
        PyErr_SetString(PyExc_ValueError, ROUTE_SIZES_ERROR);
        goto done;
    }
    if (check_buffer(&x, "route", rt.T * rt.H * f, "x") || check_buffer(&w, "route", rt.E * rt.H * f, "weight") ||
        check_buffer(&bias, "route", rt.E * f, "bias") ||
        check_buffer(&experts, "route", rt.T * rt.K * (Py_ssize_t)sizeof(int64_t), "experts") ||
        check_buffer(&weights, "route", rt.T * rt.K * f, "weights"))
        goto done;
    work = malloc(route_work_bytes(&rt));
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    rt.x = x.buf, rt.w = w.buf, rt.bias = bias.buf, rt.experts = experts.buf, rt.weights = weights.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < rt.T; t++) route_token(&rt, t, work);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    free(work);
    release_buffers((Py_buffer *[]){&x, &w, &bias, &experts, &weights}, 5);
    return result;
}

static const char *const simd_names[] = {"scalar", "avx2", "avx512"};

static PyObject *py_simd(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(simd_names[moe_level()]);
}

/* set_simd(name): "avx512" or "avx2" (where the CPU has it) or "scalar"; for tests of every path. */
static PyObject *py_set_simd(PyObject *self, PyObject *args) {
    const char *name;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    const int before = moe_level();
    for (int level = 0; level < 3; level++)
        if (strcmp(name, simd_names[level]) == 0) {
            if (moe_use_level(level) == level) Py_RETURN_NONE;
            moe_use_level(before);
        }
    PyErr_Format(PyExc_ValueError, "set_simd: '%s' is not available on this CPU (try 'scalar')", name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"moe_experts", py_moe_experts, METH_VARARGS,
     "moe_experts(x, experts, weights, gate_up, down, out, T, K, E, H, I[, bf16, bf16_inputs]): SwiGLU experts "
     "over routed tokens, weighted and summed per token into out [T, H] (float32 sums; bf16_inputs: x holds bf16 "
     "values and the activated rows are rounded to bf16 too); releases the GIL."},
    {"route", py_route, METH_VARARGS,
     "route(x, weight, bias, experts, weights, T, H, E, K, n_group, topk_group, norm, scaling): sigmoid routing "
     "with a selection bias and group-limited top-k, into experts int64 [T, K] and weights float32 [T, K]."},
    BIND_SGEMM_METHOD,
    SET_BLAS_MIN_ROWS_METHOD,
    SET_BF16_GEMM_METHOD,
    {"simd", py_simd, METH_NOARGS, "simd() -> 'avx512', 'avx2' or 'scalar': the products in use."},
    {"set_simd", py_set_simd, METH_VARARGS, "set_simd(name): use the 'avx512', 'avx2' or 'scalar' products."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_moe", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* EPD_SOURCE_HASH: the hash of this extension's sources, defined by setup.py (epd_common/native.py
   compares it with the tree at import, so a stale build is not used). */
PyMODINIT_FUNC PyInit__moe(void) {
    moe_use_level(2);
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_HASH", EPD_SOURCE_HASH) < 0) Py_CLEAR(m);
    return m;
}
