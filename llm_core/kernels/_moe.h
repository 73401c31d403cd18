/*
 * The MoE kernels (see _moe.c for what they compute and the layouts), without their Python entry
 * points, so that the decoder-layer kernel (_decoder_layer.c) runs the same code. Include after
 * Python.h and _kernels.h. Each extension that includes it has its own copy of the SIMD dispatch
 * (moe_use_level).
 */
#ifndef LLM_CORE_MOE_H
#define LLM_CORE_MOE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_blas.h"
#include "_gemm.h"

/* An expert with at least this many rows multiplies through BLAS on one thread (linear_any, serial:
 * sgemm and MKL's per-thread count bound, _blas.h), fewer through the small-M product, which
 * streams the weights once without a packed copy. Experts run in parallel over our pool either
 * way (MKL's own thread team, alternating with the pool 176 times a decode step, collapsed a
 * served engine on 2 cores). Set by set_blas_min_rows (c_kernel.expert_blas_min_rows at import). */
static Py_ssize_t moe_blas_min_rows = 16;

/* The same for bf16 weights (c_kernel.blas_thresholds: a bf16 expert's weight is first widened
 * to float32, which pays only when many rows share it). */
static Py_ssize_t moe_bf16_blas_min_rows = 16;

static inline int moe_is_large(Py_ssize_t rows, int bf16) {
    return sgemm != NULL && blas_threads_local != NULL && rows >= (bf16 ? moe_bf16_blas_min_rows : moe_blas_min_rows);
}

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

static swiglu_fn swiglu = swiglu_scalar;

typedef struct {
    const float *x, *weights;
    const void *gate_up, *down; /* float32, or bf16 with wbf16 */
    const int64_t *experts;
    float *out;
    Py_ssize_t T, K, E, H, I;
    int wbf16;
    /* bf16 products (_blas.h): x's rows are bf16 values already, and each expert's activated rows
     * are rounded to bf16 before its down product */
    int round_bf16;
} MoeProblem;

/* Where each expert's assignments are: assignment a = t * K + k; order lists them grouped by
 * expert, in (t, k) order within each, expert e's at order[start[e] .. start[e + 1]). */
typedef struct {
    Py_ssize_t *start, *order;
    Py_ssize_t most; /* the largest expert's assignments */
} MoePlan;

static void moe_plan_free(MoePlan *plan) {
    free(plan->start);
    free(plan->order);
    plan->start = plan->order = NULL;
}

/* Fills plan (free it with moe_plan_free, also after an error); NULL or a static error message. */
static const char *moe_plan(const MoeProblem *pb, MoePlan *plan) {
    const Py_ssize_t n = pb->T * pb->K;
    plan->start = calloc((size_t)pb->E + 1, sizeof(Py_ssize_t));
    plan->order = malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    Py_ssize_t *fill = malloc((size_t)pb->E * sizeof(Py_ssize_t));
    const char *err = NULL;
    if (plan->start == NULL || plan->order == NULL || fill == NULL) {
        err = "moe_experts: out of memory";
        goto done;
    }
    for (Py_ssize_t a = 0; a < n; a++) {
        const int64_t e = pb->experts[a];
        if (e < 0 || e >= pb->E) {
            err = "moe_experts: an expert id is out of range";
            goto done;
        }
        plan->start[e + 1]++;
    }
    for (Py_ssize_t e = 0; e < pb->E; e++) plan->start[e + 1] += plan->start[e];
    memcpy(fill, plan->start, (size_t)pb->E * sizeof(Py_ssize_t));
    for (Py_ssize_t a = 0; a < n; a++) plan->order[fill[pb->experts[a]]++] = a; /* (t, k) order per expert */
    plan->most = 1;
    for (Py_ssize_t e = 0; e < pb->E; e++) {
        const Py_ssize_t c = plan->start[e + 1] - plan->start[e];
        plan->most = c > plan->most ? c : plan->most;
    }
done:
    free(fill);
    return err;
}

/* Experts e0 .. e1 - 1 over their assignments. Each weighted output row
 * w * y is added to its token's row of pb->out (experts in order: the sum of a token's rows in
 * expert order), or, with contrib non-NULL, stored at contrib [T * K, H] row a instead (ranges may
 * then run at the same time; moe_sum_contrib adds them up in the same order). A large expert's
 * products are single-threaded BLAS calls. NULL or a static error message. */
static const char *moe_experts_range(const MoeProblem *pb, const MoePlan *plan, Py_ssize_t e0, Py_ssize_t e1,
                                     float *contrib) {
    const Py_ssize_t H = pb->H, I = pb->I, most = plan->most, es = pb->wbf16 ? 2 : 4;
    const int blas = moe_is_large(most, pb->wbf16);
    /* scratch, for the largest expert's assignments: their rows of x, then gate|up [C, 2I]
     * (activated in place), then down outputs [C, H], and for BLAS the rows of x gathered [C, H] */
    const float **rows = malloc((size_t)most * sizeof(float *));
    float *scratch = malloc((size_t)(most * (2 * I + H + (blas ? H : 0))) * sizeof(float));
    if (rows == NULL || scratch == NULL) {
        free(rows);
        free(scratch);
        return "moe_experts: out of memory";
    }
    float *hidden = scratch, *y = scratch + most * 2 * I, *gathered = y + most * H;
    const Strips gate_up_rows = {16, 2 * I, pb->wbf16}, down_rows = {16, H, pb->wbf16}; /* row-major [in, out] */
    const int kind = weight_kind(pb->wbf16, pb->round_bf16); /* linear_any's */
    const char *err = NULL;
    for (Py_ssize_t e = e0; e < e1; e++) {
        const Py_ssize_t c = plan->start[e + 1] - plan->start[e];
        if (c == 0) continue;
        const int large = moe_is_large(c, pb->wbf16);
        const Py_ssize_t *mine = plan->order + plan->start[e];
        const char *gate_up = (const char *)pb->gate_up + e * H * 2 * I * es;
        const char *down = (const char *)pb->down + e * I * H * es;
        if (large) { /* [C, H] gathered -> [C, 2I] -> activated -> [C, H], two BLAS calls */
            for (Py_ssize_t r = 0; r < c; r++)
                memcpy(gathered + r * H, pb->x + (mine[r] / pb->K) * H, (size_t)H * sizeof(float));
            err = linear_any(gathered, H, gate_up, kind, NULL, hidden, c, H, 2 * I, 1);
            if (err != NULL) break;
            for (Py_ssize_t r = 0; r < c; r++) swiglu(hidden + r * 2 * I, I);
            if (pb->round_bf16) round_bf16_rows(hidden, 2 * I, c, I);
            err = linear_any(hidden, 2 * I, down, kind, NULL, y, c, I, H, 1);
            if (err != NULL) break;
        } else {
            Py_ssize_t e2 = e + 1; /* the next small expert with tokens: its weights are fetched meanwhile */
            while (e2 < e1 && (plan->start[e2 + 1] == plan->start[e2] ||
                               moe_is_large(plan->start[e2 + 1] - plan->start[e2], pb->wbf16)))
                e2++;
            const char *next_gate_up = e2 < e1 ? (const char *)pb->gate_up + e2 * H * 2 * I * es : NULL;
            const char *next_down = e2 < e1 ? (const char *)pb->down + e2 * I * H * es : NULL;
            for (Py_ssize_t r = 0; r < c; r++) rows[r] = pb->x + (mine[r] / pb->K) * H;
            gemm_rows(rows, c, gate_up, H, 2 * I, hidden, 2 * I, next_gate_up, &gate_up_rows); /* [C, 2I] */
            for (Py_ssize_t r = 0; r < c; r++) {
                swiglu(hidden + r * 2 * I, I); /* over the gate half */
                rows[r] = hidden + r * 2 * I;
            }
            if (pb->round_bf16) round_bf16_rows(hidden, 2 * I, c, I);
            gemm_rows(rows, c, down, I, H, y, H, next_down, &down_rows); /* [C, H] */
        }
        for (Py_ssize_t r = 0; r < c; r++) {
            const float w = pb->weights[mine[r]], *yr = y + r * H;
            if (contrib != NULL) {
                float *o = contrib + mine[r] * H;
                for (Py_ssize_t d = 0; d < H; d++) o[d] = w * yr[d];
            } else {
                float *o = pb->out + (mine[r] / pb->K) * H;
                for (Py_ssize_t d = 0; d < H; d++) o[d] += w * yr[d];
            }
        }
    }
    free(rows);
    free(scratch);
    return err;
}

/* out rows t0 .. t1 - 1 = the sum of each token's contrib rows, in expert order from 0 (the order
 * moe_experts_range adds them in): the same bits as the one-range path. */
static inline void moe_sum_contrib(const MoeProblem *pb, const float *contrib, Py_ssize_t t0, Py_ssize_t t1) {
    const Py_ssize_t K = pb->K, H = pb->H;
    for (Py_ssize_t t = t0; t < t1; t++) {
        float *o = pb->out + t * H;
        memset(o, 0, (size_t)H * sizeof(float));
        int64_t last = -1;
        for (Py_ssize_t i = 0; i < K; i++) { /* the next larger expert id among the token's K */
            Py_ssize_t pick = -1;
            for (Py_ssize_t k = 0; k < K; k++) {
                const int64_t e = pb->experts[t * K + k];
                if (e > last && (pick < 0 || e < pb->experts[t * K + pick])) pick = k;
            }
            if (pick < 0) break;
            last = pb->experts[t * K + pick];
            const float *c = contrib + (t * K + pick) * H;
            for (Py_ssize_t d = 0; d < H; d++) o[d] += c[d];
        }
    }
}

/* Returns NULL or a static error message. Called without the GIL. */
static const char *moe_run(const MoeProblem *pb) {
    MoePlan plan = {0};
    const char *err = moe_plan(pb, &plan);
    if (err == NULL) {
        memset(pb->out, 0, (size_t)(pb->T * pb->H) * sizeof(float));
        err = moe_experts_range(pb, &plan, 0, pb->E, NULL);
    }
    moe_plan_free(&plan);
    return err;
}

/* set_blas_min_rows(n, n_bf16): experts with n rows or more (n_bf16 for bf16 weights) multiply
 * through BLAS from now on. */
static PyObject *py_set_blas_min_rows(PyObject *self, PyObject *args) {
    Py_ssize_t n, n_bf16;
    (void)self;
    if (!PyArg_ParseTuple(args, "nn", &n, &n_bf16)) return NULL;
    if (n < 1 || n_bf16 < 1) {
        PyErr_SetString(PyExc_ValueError, "set_blas_min_rows: row counts must be >= 1");
        return NULL;
    }
    moe_blas_min_rows = n, moe_bf16_blas_min_rows = n_bf16;
    Py_RETURN_NONE;
}

#define SET_BLAS_MIN_ROWS_METHOD                                                                             \
    {"set_blas_min_rows", py_set_blas_min_rows, METH_VARARGS,                                              \
     "set_blas_min_rows(n, n_bf16): routed experts with n rows or more (n_bf16 with bf16 weights) multiply " \
     "through BLAS (when bound)."}

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

#define ROUTE_SIZES_ERROR "route: invalid sizes (experts, groups and top-k must be consistent)"

/* Whether the expert, group and top-k counts are consistent (route_token needs it). */
static int route_sizes_valid(const Route *rt) {
    return rt->T >= 0 && rt->H >= 1 && rt->E >= 1 && rt->K >= 1 && rt->n_group >= 1 && rt->E % rt->n_group == 0 &&
           rt->topk_group >= 1 && rt->topk_group <= rt->n_group && rt->K <= rt->topk_group * (rt->E / rt->n_group);
}

/* Bytes of the work buffer route_token takes. */
static size_t route_work_bytes(const Route *rt) { return (size_t)(4 * rt->E + rt->n_group) * sizeof(float); }

/* One token: scores = sigmoid(x W^T), selection by score + bias within the best groups, weights
 * from the scores (module doc of llm_core/models/moe.py). work: 3E floats + E bytes. */
/* noinline: inlined into the decoder layer's loop (a large function compiled with
 * -ffp-contract=off) it ran 3x slower, 74 against 24 ms for a 2,048-token step's 12 layers. */
__attribute__((noinline)) static void route_token(const Route *rt, Py_ssize_t t, float *work) {
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

/* SIMD level 2 (the AVX-512 product, AVX2 SwiGLU), 1 (AVX2 + FMA) or 0 (scalar), or the best
 * below it the CPU has; returns the level in use. */
static int moe_use_level(int level) {
    const int got = gemm_use_level(level);
#ifdef HAVE_AVX2_PATH
    swiglu = got >= 1 ? swiglu_avx2 : swiglu_scalar;
#else
    swiglu = swiglu_scalar;
#endif
    return got;
}

static inline int moe_level(void) { return gemm_level(); }

#endif
