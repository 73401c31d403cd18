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
 * a product on one core (linear_serial) instead of each starting a BLAS thread team. */
typedef int (*blas_threads_fn)(int);
static blas_threads_fn blas_threads_local = NULL;

/* y [M, N] (row stride N) = x [M, K] (row stride ldx) @ w [K, N] (+ bias [N]), as torch's linear
 * does it for an input-major weight: the bias copied into y, then one column-major sgemm call
 * computing y^T = w^T x^T with beta 1 (0 without bias). sgemm must be bound. */
static void linear(const float *x, Py_ssize_t ldx, const float *w, const float *bias, float *y, Py_ssize_t M,
                   Py_ssize_t K, Py_ssize_t N) {
    const int m = (int)N, n = (int)M, k = (int)K, lda = (int)N, ldb = (int)ldx, ldc = (int)N;
    const float one = 1.0f, beta = bias != NULL ? 1.0f : 0.0f;
    if (bias != NULL)
        for (Py_ssize_t r = 0; r < M; r++) memcpy(y + r * N, bias, (size_t)N * sizeof(float));
    sgemm("N", "N", &m, &n, &k, &one, w, &lda, x, &ldb, &beta, y, &ldc);
}

/* linear on the calling thread alone (BLAS's own threads not used): for products that run in
 * parallel over our pool's threads. Needs blas_threads_local. */
static void linear_serial(const float *x, Py_ssize_t ldx, const float *w, const float *bias, float *y, Py_ssize_t M,
                          Py_ssize_t K, Py_ssize_t N) {
    const int before = blas_threads_local(1);
    linear(x, ldx, w, bias, y, M, K, N);
    blas_threads_local(before);
}

/* A float32 copy of n bf16 weights, in this thread's scratch (grown as needed, kept for the
 * thread's next call: a product of many rows widens its weight once, then runs the same sgemm as a
 * float32 weight of the same values, so the results are the same bits). NULL when out of memory.
 * The scratch holds the largest weight this thread widened (pool threads: one expert's). */
static float *widen_bf16(const void *w, Py_ssize_t n) {
    static __thread float *buf = NULL;
    static __thread Py_ssize_t cap = 0;
    if (n > cap) {
        float *grown = aligned_alloc(64, (size_t)((n + 15) / 16 * 16) * sizeof(float));
        if (grown == NULL) return NULL;
        free(buf);
        buf = grown, cap = n;
    }
    const uint16_t *h = w;
    uint32_t *out = (uint32_t *)buf;
    for (Py_ssize_t i = 0; i < n; i++) out[i] = (uint32_t)h[i] << 16; /* exact: bf16 is a float's top half */
    return buf;
}

/* linear (or linear_serial, serial != 0) of a weight stored float32 or bf16 (widened first);
 * NULL or a static error message. */
static const char *linear_any(const float *x, Py_ssize_t ldx, const void *w, int bf16, const float *bias, float *y,
                              Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, int serial) {
    const float *wf = bf16 ? widen_bf16(w, K * N) : w;
    if (wf == NULL) return "linear: out of memory widening a bf16 weight";
    if (serial) linear_serial(x, ldx, wf, bias, y, M, K, N);
    else linear(x, ldx, wf, bias, y, M, K, N);
    return NULL;
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
