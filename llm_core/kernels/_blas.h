/*
 * The BLAS product the CPU kernels use for many rows: torch's own sgemm_ (MKL or OpenBLAS, Fortran
 * interface, 32-bit integers, exported by libtorch_cpu), bound at run time by bind_sgemm, so that a
 * kernel's large products run the code (and give the bits) of torch's CPU linear. Include after
 * Python.h. Each extension that includes it has its own pointer and its own bind_sgemm entry.
 */
#ifndef LLM_CORE_BLAS_H
#define LLM_CORE_BLAS_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);
static sgemm_fn sgemm = NULL;
/* MKL's per-thread thread count (MKL_Set_Num_Threads_Local; returns the previous, 0 = the global
 * one), or NULL where torch's BLAS is not MKL: what lets several threads of our own pool each run
 * a product on one core (linear_any's serial) instead of each starting a BLAS thread team. */
typedef int (*blas_threads_fn)(int);
static blas_threads_fn blas_threads_local = NULL;

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w [K, N] (row stride ldw) (+ bias [N]),
 * as torch's linear does it for an input-major weight: the bias copied into y, then one
 * column-major sgemm call computing y^T = w^T x^T with beta 1 (0 without bias). The strides let a
 * block of columns of a wider product be one call (linear_bf16). sgemm must be bound. */
static void linear(const float *x, Py_ssize_t ldx, const float *w, Py_ssize_t ldw, const float *bias, float *y,
                   Py_ssize_t ldy, Py_ssize_t M, Py_ssize_t K, Py_ssize_t N) {
    const int m = (int)N, n = (int)M, k = (int)K, lda = (int)ldw, ldb = (int)ldx, ldc = (int)ldy;
    const float one = 1.0f, beta = bias != NULL ? 1.0f : 0.0f;
    if (bias != NULL)
        for (Py_ssize_t r = 0; r < M; r++) memcpy(y + r * ldy, bias, (size_t)N * sizeof(float));
    sgemm("N", "N", &m, &n, &k, &one, w, &lda, x, &ldb, &beta, y, &ldc);
}

/* Columns of a bf16 weight widened at a time: the scratch holds K x WIDEN_COLUMNS floats (a real
 * MiMo expert's down projection, K = 2048: 4 MiB per thread), not the whole weight. */
#define WIDEN_COLUMNS 512

/* A float32 copy of columns [j0, j0 + nb) of a bf16 weight [K, N] (row stride N) as a [K, nb]
 * block, in this thread's scratch (grown as needed up to K x WIDEN_COLUMNS, kept for the thread's
 * next call). Exact: a bf16 value is a float's top half. NULL when out of memory. */
static float *widen_bf16_columns(const void *w, Py_ssize_t K, Py_ssize_t N, Py_ssize_t j0, Py_ssize_t nb) {
    static __thread float *buf = NULL;
    static __thread Py_ssize_t cap = 0;
    const Py_ssize_t n = K * nb;
    if (n > cap) {
        float *grown = aligned_alloc(64, (size_t)((n + 15) / 16 * 16) * sizeof(float));
        if (grown == NULL) return NULL;
        free(buf);
        buf = grown, cap = n;
    }
    const uint16_t *h = w;
    uint32_t *out = (uint32_t *)buf;
    for (Py_ssize_t k = 0; k < K; k++) {
        const uint16_t *row = h + k * N + j0;
        uint32_t *dst = out + k * nb;
        for (Py_ssize_t j = 0; j < nb; j++) dst[j] = (uint32_t)row[j] << 16;
    }
    return buf;
}

/* y [M, N] = x @ w for a bf16 w [K, N]: a block of WIDEN_COLUMNS columns widened at a time, each
 * one linear into its columns of y. Every output element still sums its K products in one call,
 * so the result has the bits of one sgemm over a float32 twin of w (tested against it). NULL or a
 * static error message. */
static const char *linear_bf16(const float *x, Py_ssize_t ldx, const void *w, const float *bias, float *y,
                               Py_ssize_t M, Py_ssize_t K, Py_ssize_t N) {
    for (Py_ssize_t j0 = 0; j0 < N; j0 += WIDEN_COLUMNS) {
        const Py_ssize_t nb = N - j0 < WIDEN_COLUMNS ? N - j0 : WIDEN_COLUMNS;
        const float *wf = widen_bf16_columns(w, K, N, j0, nb);
        if (wf == NULL) return "linear: out of memory widening a bf16 weight";
        linear(x, ldx, wf, nb, bias != NULL ? bias + j0 : NULL, y + j0, N, M, K, nb);
    }
    return NULL;
}

/* linear of a weight stored float32 or bf16 (widened a block of columns at a time: linear_bf16);
 * serial != 0: on the calling thread alone (BLAS's own threads not used), for products that run in
 * parallel over our pool's threads (needs blas_threads_local). NULL or a static error message. */
static const char *linear_any(const float *x, Py_ssize_t ldx, const void *w, int bf16, const float *bias, float *y,
                              Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, int serial) {
    const int before = serial ? blas_threads_local(1) : 0;
    const char *err = NULL;
    if (bf16) err = linear_bf16(x, ldx, w, bias, y, M, K, N);
    else linear(x, ldx, w, N, bias, y, N, M, K, N);
    if (serial) blas_threads_local(before);
    return err;
}

/* bind_sgemm(path): take sgemm_ from the already loaded shared library at path (libtorch_cpu). */
static PyObject *py_bind_sgemm(PyObject *self, PyObject *args) {
    const char *path;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    sgemm_fn fn = lib != NULL ? (sgemm_fn)dlsym(lib, "sgemm_") : NULL;
    if (fn == NULL) {
        PyErr_Format(PyExc_OSError, "bind_sgemm: no sgemm_ in a loaded %s", path);
        return NULL;
    }
    sgemm = fn; /* the library stays loaded: torch holds it (and dlopen took a reference) */
    /* the C entry (takes the count by value; the lower-case symbol here is the Fortran one) */
    blas_threads_local = (blas_threads_fn)dlsym(lib, "MKL_Set_Num_Threads_Local"); /* NULL: not MKL */
    Py_RETURN_NONE;
}

#define BIND_SGEMM_METHOD                                                                                    \
    {"bind_sgemm", py_bind_sgemm, METH_VARARGS,                                                            \
     "bind_sgemm(path): use sgemm_ from the loaded shared library at path for products of many rows."}

#endif
