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
/* MKL's gemm_bf16bf16f32 (Fortran interface: bf16 A and B, float32 C and sums), or NULL where
 * torch's BLAS is not MKL. On a CPU with AVX512-BF16 dot products (or AMX) it runs about twice
 * sgemm's FLOPs: 845-930 against 448-481 GFLOPS for the [2048, 768] x [768, 1280] product on the
 * 2-core Zen 5 (docs/performance.md). */
typedef void (*gemm_bf16_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                             const float *alpha, const uint16_t *a, const int *lda, const uint16_t *b,
                             const int *ldb, const float *beta, float *c, const int *ldc);
static gemm_bf16_fn gemm_bf16 = NULL;

/* bf16 products (W_BF16_INPUTS below; the decoder-layer kernel's set_bf16_products, a moe_experts
 * argument): with bf16 weights, every product's input rows are rounded to bf16 as well (the
 * callers round them: round_bf16_rows), as a bf16 model's are, and the sums stay float32. Then a
 * product of many rows runs as bf16 x bf16 -> float32 in MKL (bf16_gemm, set_bf16_gemm: where that
 * is the faster; c_kernel chooses at import) or as sgemm over the widened weight, and a small one
 * as the strip product: the same math in every path, float32 sums in different orders. Without
 * them the inputs stay float32 and a bf16 weight gives the bits of a float32 weight of its values. */
static int bf16_gemm = 0;

/* Rows [M, K] (row stride ld) rounded to bf16 in place (values a float32 holds exactly). */
static void round_bf16_rows(float *x, Py_ssize_t ld, Py_ssize_t M, Py_ssize_t K) {
    for (Py_ssize_t r = 0; r < M; r++) {
        uint32_t *row = (uint32_t *)(x + r * ld);
        for (Py_ssize_t k = 0; k < K; k++) {
            float f;
            memcpy(&f, row + k, sizeof f);
            row[k] = (uint32_t)float_to_bf16(f) << 16;
        }
    }
}

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

/* y [M, N] (row stride ldy) = x @ w for a bf16 w [K, N] (row stride ldw: a block of columns of a
 * wider weight): a block of WIDEN_COLUMNS columns widened at a time, each one linear into its
 * columns of y. Every output element still sums its K products in one call,
 * so the result has the bits of one sgemm over a float32 twin of w (tested against it). NULL or a
 * static error message. */
static const char *linear_bf16(const float *x, Py_ssize_t ldx, const void *w, Py_ssize_t ldw, const float *bias,
                               float *y, Py_ssize_t ldy, Py_ssize_t M, Py_ssize_t K, Py_ssize_t N) {
    for (Py_ssize_t j0 = 0; j0 < N; j0 += WIDEN_COLUMNS) {
        const Py_ssize_t nb = N - j0 < WIDEN_COLUMNS ? N - j0 : WIDEN_COLUMNS;
        const float *wf = widen_bf16_columns(w, K, ldw, j0, nb);
        if (wf == NULL) return "linear: out of memory widening a bf16 weight";
        linear(x, ldx, wf, nb, bias != NULL ? bias + j0 : NULL, y + j0, ldy, M, K, nb);
    }
    return NULL;
}

/* Rows of x converted to bf16 at a time by linear_bf16_gemm: its scratch is this many rows of K
 * (a real MiMo expert's down projection, K = 2048: 1 MiB per thread), and at 256 rows MKL's bf16
 * product runs at its full speed already. */
#define BF16_GEMM_ROWS 256

/* y [M, N] (row stride ldy) = x @ w for a bf16 w [K, N] (row stride ldw: a block of columns of a
 * wider weight) with bf16 inputs: x's rows converted to bf16 (rounded, so also right for rows not
 * rounded before), BF16_GEMM_ROWS at a time, each block one gemm_bf16bf16f32 call into its rows of
 * y (every output sums its K products in one call). NULL or a static error message. */
static const char *linear_bf16_gemm(const float *x, Py_ssize_t ldx, const void *w, Py_ssize_t ldw, const float *bias,
                                    float *y, Py_ssize_t ldy, Py_ssize_t M, Py_ssize_t K, Py_ssize_t N) {
    static __thread uint16_t *buf = NULL;
    static __thread Py_ssize_t cap = 0;
    const Py_ssize_t rows = M < BF16_GEMM_ROWS ? M : BF16_GEMM_ROWS, need = rows * K;
    if (need > cap) {
        uint16_t *grown = aligned_alloc(64, (size_t)((need + 31) / 32 * 32) * sizeof(uint16_t));
        if (grown == NULL) return "linear: out of memory converting rows to bf16";
        free(buf);
        buf = grown, cap = need;
    }
    const int n = (int)N, k = (int)K, lda = (int)ldw, ldc = (int)ldy;
    const float one = 1.0f, beta = bias != NULL ? 1.0f : 0.0f;
    for (Py_ssize_t r0 = 0; r0 < M; r0 += rows) {
        const int m = (int)(M - r0 < rows ? M - r0 : rows);
        for (Py_ssize_t r = 0; r < m; r++) {
            const float *src = x + (r0 + r) * ldx;
            uint16_t *dst = buf + r * K;
            for (Py_ssize_t j = 0; j < K; j++) dst[j] = float_to_bf16(src[j]);
            if (bias != NULL) memcpy(y + (r0 + r) * ldy, bias, (size_t)N * sizeof(float));
        }
        /* column-major, as linear: y^T [N, m] = w^T [N, K] x^T [K, m] */
        gemm_bf16("N", "N", &n, &m, &k, &one, w, &lda, buf, &k, &beta, y + r0 * ldy, &ldc);
    }
    return NULL;
}

/* What linear_any multiplies: a float32 weight, a bf16 one (float32 inputs), or a bf16 one with
 * inputs already rounded to bf16 (bf16 products), which may take MKL's bf16 product. */
enum { W_F32 = 0, W_BF16 = 1, W_BF16_INPUTS = 2 };

/* The kind of a product of weights stored bf16 (wbf16) or float32, inputs rounded to bf16 or not. */
static inline int weight_kind(int wbf16, int round_bf16) {
    return !wbf16 ? W_F32 : round_bf16 ? W_BF16_INPUTS : W_BF16;
}

/* y [M, N] (row stride ldy) = x @ w (+ bias) for w [K, N] (row stride ldw) of kind (W_*): columns
 * [c0, c0 + N) of a wider weight and output are w, bias and y offset by c0. float32: linear; bf16:
 * linear_bf16, or with bf16 inputs and bf16_gemm linear_bf16_gemm. NULL or a static error message. */
static const char *linear_kind(const float *x, Py_ssize_t ldx, const void *w, Py_ssize_t ldw, int kind,
                               const float *bias, float *y, Py_ssize_t ldy, Py_ssize_t M, Py_ssize_t K,
                               Py_ssize_t N) {
    if (kind == W_BF16_INPUTS && bf16_gemm && gemm_bf16 != NULL)
        return linear_bf16_gemm(x, ldx, w, ldw, bias, y, ldy, M, K, N);
    if (kind != W_F32) return linear_bf16(x, ldx, w, ldw, bias, y, ldy, M, K, N);
    linear(x, ldx, w, ldw, bias, y, ldy, M, K, N);
    return NULL;
}

/* A column block of a weight of kind (W_*): w's c0-th column. */
static inline const void *weight_columns(const void *w, int kind, Py_ssize_t c0) {
    return kind == W_F32 ? (const void *)((const float *)w + c0) : (const void *)((const uint16_t *)w + c0);
}

/* linear of a weight stored float32 or bf16 (kind: W_*; linear_kind);
 * serial != 0: on the calling thread alone (BLAS's own threads not used), for products that run in
 * parallel over our pool's threads (needs blas_threads_local). NULL or a static error message. */
static const char *linear_any(const float *x, Py_ssize_t ldx, const void *w, int kind, const float *bias, float *y,
                              Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, int serial) {
    const int before = serial ? blas_threads_local(1) : 0;
    const char *err = linear_kind(x, ldx, w, N, kind, bias, y, N, M, K, N);
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
    gemm_bf16 = (gemm_bf16_fn)dlsym(lib, "gemm_bf16bf16f32");                       /* NULL: not MKL */
    Py_RETURN_NONE;
}

/* set_bf16_gemm(on): products of many rows of a bf16 weight and bf16 inputs (W_BF16_INPUTS) run in
 * MKL's bf16 product where bound (on), or as sgemm over the widened weight. Returns whether that
 * product is bound. */
static PyObject *py_set_bf16_gemm(PyObject *self, PyObject *args) {
    int on;
    (void)self;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    bf16_gemm = on;
    return PyBool_FromLong(gemm_bf16 != NULL);
}

#define SET_BF16_GEMM_METHOD                                                                                 \
    {"set_bf16_gemm", py_set_bf16_gemm, METH_VARARGS,                                                      \
     "set_bf16_gemm(on): multiply many rows of bf16 weights and bf16 inputs in MKL's bf16 product (when " \
     "bound: the return value) or as sgemm over the widened weight."}

#define BIND_SGEMM_METHOD                                                                                    \
    {"bind_sgemm", py_bind_sgemm, METH_VARARGS,                                                            \
     "bind_sgemm(path): use sgemm_ from the loaded shared library at path for products of many rows."}

#endif
