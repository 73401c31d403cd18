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
 * Assignments are taken per expert in (t, k) order. Expert ids are checked (ValueError).
 * AVX2 + FMA where the CPU has them (chosen at import), plain loops otherwise.
 *
 * A second entry, route, is the router before it (llm_core/moe.py, TopKRouter): per token the
 * sigmoid scores of x @ W_router^T, the selection by score + bias within the best expert groups,
 * and the normalised, scaled weights, in one call instead of a dozen small torch ops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernels.h"

#define KERNEL "moe_experts" /* error messages start with this */

/* Small-M products: Y[r] = X[r] @ W for the few rows routed to one expert, W [in, n] row-major.
 * Column strips of 16 outer, tiles of 6 rows inner, and a 6 x 16 block of FMA accumulators
 * (12 of the 16 registers) over k: each strip of W (in x 64 bytes) is read from memory once and
 * stays in cache while every row tile passes over it, so the weights stream through once per call
 * (a BLAS packs them first, which for a handful of rows costs as much as the product). A tail tile
 * of fewer than 6 rows repeats its last row and stores only the real ones. (6 rows, not 4: 12
 * independent FMA chains per k instead of 8; ~10-18% faster on prefill-sized experts, the same
 * on decode-sized ones.)
 *
 * In a decode step every expert's weights come cold from DRAM, so the product also fetches
 * ``next`` (the next expert's matrix of the same shape, or NULL), a share of its lines per strip:
 * its memory traffic overlaps this expert's FMAs instead of following them. */
typedef void (*gemm_rows_fn)(const float *const *x, Py_ssize_t M, const float *W, Py_ssize_t in, Py_ssize_t n,
                             float *y, Py_ssize_t ldy, const float *next);

static void gemm_rows_scalar(const float *const *x, Py_ssize_t M, const float *W, Py_ssize_t in, Py_ssize_t n,
                             float *y, Py_ssize_t ldy, const float *next) {
    (void)next;
    for (Py_ssize_t r = 0; r < M; r++) {
        float *yr = y + r * ldy;
        memset(yr, 0, (size_t)n * sizeof(float));
        for (Py_ssize_t k = 0; k < in; k++) {
            const float xk = x[r][k], *wk = W + k * n;
            for (Py_ssize_t j = 0; j < n; j++) yr[j] += xk * wk[j];
        }
    }
}

#ifdef HAVE_AVX2_PATH
static AVX2 void gemm_rows_avx2(const float *const *x, Py_ssize_t M, const float *W, Py_ssize_t in, Py_ssize_t n,
                                float *y, Py_ssize_t ldy, const float *next) {
    const Py_ssize_t strips = n / 16, bytes = in * n * (Py_ssize_t)sizeof(float);
    for (Py_ssize_t s = 0; s < strips; s++) {
        const Py_ssize_t j = s * 16;
        /* the first row tile fetches the next strip, one line per k, and its share of ``next``,
         * lines [s, s + 1) / strips, spread over the same k loop */
        const char *pf = next != NULL ? (const char *)next + s * bytes / strips / 64 * 64 : NULL;
        const char *pf_end = next != NULL ? (const char *)next + (s + 1) * bytes / strips : NULL;
        const Py_ssize_t pf_step = next != NULL ? ((pf_end - pf) / in + 63) / 64 * 64 : 0;
        for (Py_ssize_t r0 = 0; r0 < M; r0 += 6) {
            const Py_ssize_t rows = M - r0 < 6 ? M - r0 : 6;
            const float *x0 = x[r0], *x1 = x[r0 + (rows > 1 ? 1 : 0)], *x2 = x[r0 + (rows > 2 ? 2 : 0)],
                        *x3 = x[r0 + (rows > 3 ? 3 : 0)], *x4 = x[r0 + (rows > 4 ? 4 : 0)],
                        *x5 = x[r0 + (rows > 5 ? 5 : 0)];
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
                   a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
            const float *w = W + j;
            const int first = r0 == 0;
            for (Py_ssize_t k = 0; k < in; k++, w += n) {
                if (first) {
                    if (s + 1 < strips) _mm_prefetch((const char *)(w + 16), _MM_HINT_T0);
                    if (pf != NULL && pf < pf_end) {
                        for (Py_ssize_t b = 0; b < pf_step; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
                        pf += pf_step;
                    }
                }
                const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
                __m256 xr = _mm256_broadcast_ss(x0 + k);
                a00 = _mm256_fmadd_ps(xr, w0, a00);
                a01 = _mm256_fmadd_ps(xr, w1, a01);
                xr = _mm256_broadcast_ss(x1 + k);
                a10 = _mm256_fmadd_ps(xr, w0, a10);
                a11 = _mm256_fmadd_ps(xr, w1, a11);
                xr = _mm256_broadcast_ss(x2 + k);
                a20 = _mm256_fmadd_ps(xr, w0, a20);
                a21 = _mm256_fmadd_ps(xr, w1, a21);
                xr = _mm256_broadcast_ss(x3 + k);
                a30 = _mm256_fmadd_ps(xr, w0, a30);
                a31 = _mm256_fmadd_ps(xr, w1, a31);
                xr = _mm256_broadcast_ss(x4 + k);
                a40 = _mm256_fmadd_ps(xr, w0, a40);
                a41 = _mm256_fmadd_ps(xr, w1, a41);
                xr = _mm256_broadcast_ss(x5 + k);
                a50 = _mm256_fmadd_ps(xr, w0, a50);
                a51 = _mm256_fmadd_ps(xr, w1, a51);
            }
            float *yr = y + r0 * ldy + j;
            _mm256_storeu_ps(yr, a00);
            _mm256_storeu_ps(yr + 8, a01);
            if (rows > 1) _mm256_storeu_ps(yr + ldy, a10), _mm256_storeu_ps(yr + ldy + 8, a11);
            if (rows > 2) _mm256_storeu_ps(yr + 2 * ldy, a20), _mm256_storeu_ps(yr + 2 * ldy + 8, a21);
            if (rows > 3) _mm256_storeu_ps(yr + 3 * ldy, a30), _mm256_storeu_ps(yr + 3 * ldy + 8, a31);
            if (rows > 4) _mm256_storeu_ps(yr + 4 * ldy, a40), _mm256_storeu_ps(yr + 4 * ldy + 8, a41);
            if (rows > 5) _mm256_storeu_ps(yr + 5 * ldy, a50), _mm256_storeu_ps(yr + 5 * ldy + 8, a51);
        }
    }
    for (Py_ssize_t r = 0; r < M; r++) /* columns past the last full strip, one at a time */
        for (Py_ssize_t c = strips * 16; c < n; c++) {
            float acc = 0.0f;
            for (Py_ssize_t k = 0; k < in; k++) acc += x[r][k] * W[k * n + c];
            y[r * ldy + c] = acc;
        }
}

#endif

/* h[i] = silu(h[i]) * h[I + i] for i < I: the SwiGLU activation over one [gate | up] row. */
typedef void (*swiglu_fn)(float *h, Py_ssize_t I);

static void swiglu_scalar(float *h, Py_ssize_t I) {
    for (Py_ssize_t i = 0; i < I; i++) h[i] = h[i] / (1.0f + expf(-h[i])) * h[I + i];
}

#ifdef HAVE_AVX2_PATH
static AVX2 void swiglu_avx2(float *h, Py_ssize_t I) {
    Py_ssize_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= I; i += 8) {
        const __m256 g = _mm256_loadu_ps(h + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)); /* e^-g, clamped for |g| > 87 */
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(silu, _mm256_loadu_ps(h + I + i)));
    }
    for (; i < I; i++) h[i] = h[i] / (1.0f + expf(-h[i])) * h[I + i];
}

#endif

static gemm_rows_fn gemm_rows = gemm_rows_scalar;
static swiglu_fn swiglu = swiglu_scalar;

typedef struct {
    const float *x, *weights, *gate_up, *down;
    const int64_t *experts;
    float *out;
    Py_ssize_t T, K, E, H, I;
} Problem;

/* Returns NULL or a static error message. Called without the GIL. */
static const char *run(const Problem *pb) {
    const Py_ssize_t n = pb->T * pb->K, H = pb->H, I = pb->I;
    const char *err = NULL;
    Py_ssize_t *start = calloc((size_t)pb->E + 1, sizeof(Py_ssize_t));
    Py_ssize_t *order = malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    /* scratch, for the largest expert's C assignments: their rows of x, then gate|up [C, 2I]
     * (activated in place), then down outputs [C, H]; sized below once the counts are known */
    const float **rows = NULL;
    float *scratch = NULL;
    if (start == NULL || order == NULL) {
        err = "moe_experts: out of memory";
        goto done;
    }
    for (Py_ssize_t a = 0; a < n; a++) {
        const int64_t e = pb->experts[a];
        if (e < 0 || e >= pb->E) {
            err = "moe_experts: an expert id is out of range";
            goto done;
        }
        start[e + 1]++;
    }
    for (Py_ssize_t e = 0; e < pb->E; e++) start[e + 1] += start[e];
    {
        Py_ssize_t *fill = malloc((size_t)pb->E * sizeof(Py_ssize_t));
        if (fill == NULL) {
            err = "moe_experts: out of memory";
            goto done;
        }
        memcpy(fill, start, (size_t)pb->E * sizeof(Py_ssize_t));
        for (Py_ssize_t a = 0; a < n; a++) order[fill[pb->experts[a]]++] = a; /* (t, k) order per expert */
        free(fill);
    }
    Py_ssize_t most = 1;
    for (Py_ssize_t e = 0; e < pb->E; e++) most = start[e + 1] - start[e] > most ? start[e + 1] - start[e] : most;
    rows = malloc((size_t)most * sizeof(float *));
    scratch = malloc((size_t)(most * (2 * I + H)) * sizeof(float));
    if (rows == NULL || scratch == NULL) {
        err = "moe_experts: out of memory";
        goto done;
    }
    float *hidden = scratch, *y = scratch + most * 2 * I;
    memset(pb->out, 0, (size_t)(pb->T * H) * sizeof(float));
    for (Py_ssize_t e = 0; e < pb->E; e++) {
        const Py_ssize_t c = start[e + 1] - start[e];
        if (c == 0) continue;
        Py_ssize_t e2 = e + 1; /* the next expert with tokens: its weights are fetched meanwhile */
        while (e2 < pb->E && start[e2 + 1] == start[e2]) e2++;
        const float *next_gate_up = e2 < pb->E ? pb->gate_up + e2 * H * 2 * I : NULL;
        const float *next_down = e2 < pb->E ? pb->down + e2 * I * H : NULL;
        const Py_ssize_t *mine = order + start[e];
        for (Py_ssize_t r = 0; r < c; r++) rows[r] = pb->x + (mine[r] / pb->K) * H;
        gemm_rows(rows, c, pb->gate_up + e * H * 2 * I, H, 2 * I, hidden, 2 * I, next_gate_up); /* [C, 2I] */
        for (Py_ssize_t r = 0; r < c; r++) {
            swiglu(hidden + r * 2 * I, I); /* over the gate half */
            rows[r] = hidden + r * 2 * I;
        }
        gemm_rows(rows, c, pb->down + e * I * H, I, H, y, H, next_down); /* [C, H] */
        for (Py_ssize_t r = 0; r < c; r++) {
            const float w = pb->weights[mine[r]], *yr = y + r * H;
            float *o = pb->out + (mine[r] / pb->K) * H;
            for (Py_ssize_t d = 0; d < H; d++) o[d] += w * yr[d];
        }
    }
done:
    free(start);
    free(order);
    free(rows);
    free(scratch);
    return err;
}

/* moe_experts(x, experts, weights, gate_up, down, out, T, K, E, H, I) -> None */
static PyObject *py_moe_experts(PyObject *self, PyObject *args) {
    Py_buffer x, experts, weights, gate_up, down, out;
    Problem pb = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*nnnnn", &x, &experts, &weights, &gate_up, &down, &out, &pb.T, &pb.K,
                          &pb.E, &pb.H, &pb.I))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t f = (Py_ssize_t)sizeof(float);
    if (pb.T < 0 || pb.K < 1 || pb.E < 1 || pb.H < 1 || pb.I < 1) {
        PyErr_SetString(PyExc_ValueError, "moe_experts: invalid sizes");
        goto done;
    }
    if (check_buffer(&x, KERNEL, pb.T * pb.H * f, "x") ||
        check_buffer(&experts, KERNEL, pb.T * pb.K * (Py_ssize_t)sizeof(int64_t), "experts") ||
        check_buffer(&weights, KERNEL, pb.T * pb.K * f, "weights") ||
        check_buffer(&gate_up, KERNEL, pb.E * pb.H * 2 * pb.I * f, "gate_up") ||
        check_buffer(&down, KERNEL, pb.E * pb.I * pb.H * f, "down") ||
        check_buffer(&out, KERNEL, pb.T * pb.H * f, "out"))
        goto done;
    pb.x = x.buf, pb.experts = experts.buf, pb.weights = weights.buf;
    pb.gate_up = gate_up.buf, pb.down = down.buf, pb.out = out.buf;
    const char *err;
    Py_BEGIN_ALLOW_THREADS
    err = run(&pb);
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

/* ---- routing ------------------------------------------------------------------------------- */

/* Index of the largest of v[0 .. n) not yet taken (ties: the lowest index, as a stable sort would),
 * or -1 when all are taken. */
static Py_ssize_t argmax_free(const float *v, const unsigned char *taken, Py_ssize_t n) {
    Py_ssize_t best = -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

typedef struct {
    const float *x, *w, *bias;
    int64_t *experts;
    float *weights;
    Py_ssize_t T, H, E, K, n_group, topk_group;
    int norm;
    float scaling;
} Route;

/* One token: scores = sigmoid(x W^T), selection by score + bias within the best groups, weights
 * from the scores (module doc of llm_core/moe.py). work: 3E floats + E bytes. */
static void route_token(const Route *rt, Py_ssize_t t, float *work) {
    const Py_ssize_t E = rt->E, H = rt->H, K = rt->K, per = E / rt->n_group; /* all >= 1 (checked) */
    float *score = work, *choice = work + E, *group = work + 2 * E;
    unsigned char *taken = (unsigned char *)(work + 3 * E);
    const float *x = rt->x + t * H;
    for (Py_ssize_t e = 0; e < E; e++) {
        const float z = dot8(x, rt->w + e * H, H);
        score[e] = 1.0f / (1.0f + expf(-z));
        choice[e] = score[e] + rt->bias[e];
    }
    if (rt->topk_group < rt->n_group) { /* a group scores the sum of its best two choices */
        for (Py_ssize_t g = 0; g < rt->n_group; g++) {
            for (Py_ssize_t e = 0; e < per; e++) taken[e] = 0;
            const Py_ssize_t a = argmax_free(choice + g * per, taken, per);
            taken[a] = 1;
            const Py_ssize_t b = argmax_free(choice + g * per, taken, per);
            group[g] = b < 0 ? choice[g * per + a] : choice[g * per + a] + choice[g * per + b];
        }
        for (Py_ssize_t g = 0; g < rt->n_group; g++) taken[g] = 0;
        for (Py_ssize_t i = 0; i < rt->topk_group; i++) taken[argmax_free(group, taken, rt->n_group)] = 1;
        for (Py_ssize_t g = 0; g < rt->n_group; g++)
            if (!taken[g])
                for (Py_ssize_t e = 0; e < per; e++) choice[g * per + e] = -INFINITY;
    }
    for (Py_ssize_t e = 0; e < E; e++) taken[e] = 0;
    int64_t *ex = rt->experts + t * K;
    float *wt = rt->weights + t * K, sum = 0.0f;
    for (Py_ssize_t k = 0; k < K; k++) {
        const Py_ssize_t e = argmax_free(choice, taken, E);
        taken[e] = 1;
        ex[k] = e;
        wt[k] = score[e];
        sum += score[e];
    }
    for (Py_ssize_t k = 0; k < K; k++) {
        if (rt->norm) wt[k] = wt[k] / (sum + 1e-20f);
        if (rt->scaling != 1.0f) wt[k] = wt[k] * rt->scaling;
    }
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
    if (rt.T < 0 || rt.H < 1 || rt.E < 1 || rt.K < 1 || rt.n_group < 1 || rt.E % rt.n_group ||
        rt.topk_group < 1 || rt.topk_group > rt.n_group || rt.K > rt.topk_group * (rt.E / rt.n_group)) {
        PyErr_SetString(PyExc_ValueError, "route: invalid sizes (experts, groups and top-k must be consistent)");
        goto done;
    }
    if (check_buffer(&x, "route", rt.T * rt.H * f, "x") || check_buffer(&w, "route", rt.E * rt.H * f, "weight") ||
        check_buffer(&bias, "route", rt.E * f, "bias") ||
        check_buffer(&experts, "route", rt.T * rt.K * (Py_ssize_t)sizeof(int64_t), "experts") ||
        check_buffer(&weights, "route", rt.T * rt.K * f, "weights"))
        goto done;
    work = malloc((size_t)(4 * rt.E + rt.n_group) * sizeof(float));
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

static PyObject *py_simd(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(gemm_rows == gemm_rows_scalar ? "scalar" : "avx2");
}

/* set_simd(name): "avx2" (where the CPU has it) or "scalar"; for tests of both paths. */
static PyObject *py_set_simd(PyObject *self, PyObject *args) {
    const char *name;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (strcmp(name, "scalar") == 0) {
        gemm_rows = gemm_rows_scalar;
        swiglu = swiglu_scalar;
        Py_RETURN_NONE;
    }
#ifdef HAVE_AVX2_PATH
    if (strcmp(name, "avx2") == 0 && cpu_has_avx2()) {
        gemm_rows = gemm_rows_avx2;
        swiglu = swiglu_avx2;
        Py_RETURN_NONE;
    }
#endif
    PyErr_Format(PyExc_ValueError, "set_simd: '%s' is not available on this CPU (try 'scalar')", name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"moe_experts", py_moe_experts, METH_VARARGS,
     "moe_experts(x, experts, weights, gate_up, down, out, T, K, E, H, I): float32 SwiGLU experts over "
     "routed tokens, weighted and summed per token into out [T, H]; releases the GIL."},
    {"route", py_route, METH_VARARGS,
     "route(x, weight, bias, experts, weights, T, H, E, K, n_group, topk_group, norm, scaling): sigmoid routing "
     "with a selection bias and group-limited top-k, into experts int64 [T, K] and weights float32 [T, K]."},
    {"simd", py_simd, METH_NOARGS, "simd() -> 'avx2' or 'scalar': the kernel in use."},
    {"set_simd", py_set_simd, METH_VARARGS, "set_simd(name): use the 'avx2' or the 'scalar' kernel."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_moe", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__moe(void) {
#ifdef HAVE_AVX2_PATH
    if (cpu_has_avx2()) gemm_rows = gemm_rows_avx2, swiglu = swiglu_avx2;
#endif
    return PyModule_Create(&module);
}
