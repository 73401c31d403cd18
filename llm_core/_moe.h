/*
 * The MoE kernels (see _moe.c for what they compute and the layouts), without their Python entry
 * points, so that the decoder-layer kernel (_decoder_layer.c) runs the same code. Include after
 * Python.h and _kernels.h. Each extension that includes it has its own copy of the SIMD dispatch
 * (moe_use_avx2).
 */
#ifndef LLM_CORE_MOE_H
#define LLM_CORE_MOE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_gemm.h"

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
    const float *x, *weights, *gate_up, *down;
    const int64_t *experts;
    float *out;
    Py_ssize_t T, K, E, H, I;
} MoeProblem;

/* Returns NULL or a static error message. Called without the GIL. */
static const char *moe_run(const MoeProblem *pb) {
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
    const Strips gate_up_rows = {16, 2 * I}, down_rows = {16, H}; /* row-major [in, out] */
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
        gemm_rows(rows, c, pb->gate_up + e * H * 2 * I, H, 2 * I, hidden, 2 * I, next_gate_up, &gate_up_rows); /* [C, 2I] */
        for (Py_ssize_t r = 0; r < c; r++) {
            swiglu(hidden + r * 2 * I, I); /* over the gate half */
            rows[r] = hidden + r * 2 * I;
        }
        gemm_rows(rows, c, pb->down + e * I * H, I, H, y, H, next_down, &down_rows); /* [C, H] */
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

/* The products in use: the AVX2 + FMA ones (where the CPU has them) or the scalar ones. */
static int moe_use_avx2(int on) {
#ifdef HAVE_AVX2_PATH
    if (on && cpu_has_avx2()) {
        gemm_use_avx2(1), swiglu = swiglu_avx2;
        return 1;
    }
#endif
    gemm_use_avx2(0), swiglu = swiglu_scalar;
    return !on;
}

static inline int moe_uses_avx2(void) { return gemm_rows != gemm_rows_scalar; }

#endif
