/*
 * One whole decoder layer of the MiMo model on the CPU, in one call (float32 activations and sums):
 *
 *   residual += x            (the first layer: residual = x)
 *   h = rms_norm(residual) * ln1
 *   qkv = h @ Wqkv (+ bias)                                   BLAS sgemm
 *   a = attention(qkv): rotary, KV store at the step's slots, paged attention (_paged_attention.h)
 *   residual += a @ Wo                                        BLAS sgemm
 *   h = rms_norm(residual) * ln2
 *   x = mlp(h): dense SwiGLU (sgemm, swiglu, sgemm) or routed experts (route + experts, _moe.h)
 *
 * x and residual [T, hidden] are updated in place: the model keeps two buffers for a whole forward.
 *
 * Threads (set_threads, _pool.h): attention is split by query rows (ranges of about equal work, a
 * long prompt's queries too; every new key is stored first), the routed experts by expert (each
 * part stores its weighted rows, then the rows are summed per token in expert order), the
 * projections by 16-column strip (prefill-sized ones as one single-threaded BLAS call per part:
 * MKL's own OpenMP team, spinning after each call, slowed everything the pool ran next), the norms
 * and the router of a prefill by rows. Every part writes its own outputs and every sum runs in the
 * same order, so any thread count gives the same bits.
 *
 * Why: a decode step of a small model spends as much time between the kernels (module calls,
 * argument checks, tensor allocations, buffer exports: ~15 Python-level operations per layer) as
 * in some of them. Here the layer is one call and one pass of argument checks, with the GIL
 * released throughout. The pieces are the per-op kernels' code (the same headers). Projections of
 * more than PACKED_MAX_ROWS rows call the BLAS routine torch's CPU linear calls (sgemm_, exported
 * by libtorch_cpu, bound at run time by bind_sgemm) with the same arguments, so such a MoE layer
 * gives the bits of the per-op path; smaller ones (decode) multiply by strip-packed copies of the
 * weights (``project``), which agree to float32 rounding. The dense MLP's activation is the MoE
 * kernel's SwiGLU (its own exponential), not torch's silu: float32 rounding again.
 *
 * Storage in bf16 (w_bf16, kv_bf16): the projection and expert weights (and their packed copies),
 * and the KV pools, may be bfloat16; a bf16 value widens to float32 exactly as it is read. With bf16
 * products (set_bf16_products, _blas.h; on by default where MKL has a fast bf16 product) and bf16
 * weights, every product's input rows are rounded to bf16 first (the normed rows, which the router
 * reads too, the attention output, the activated MLP rows), as a bf16 model's activations are, and
 * products of many rows run in MKL's bf16 x bf16 -> float32 product; off, the inputs stay float32 and
 * a bf16 weight gives the bits of a float32 weight of the same values. New keys and values are rounded
 * to bf16 as torch's .to(torch.bfloat16) rounds. Everything else stays float32: x, residual, norm
 * and router weights, biases, sinks, scratch.
 *
 * Layouts (C-contiguous float32 unless noted; projection weights input-major [in, out], as
 * model.fuse_weights lays them out):
 *   x, residual [T, hidden]     ln1, ln2 [hidden]
 *   qkv_w [hidden, (H + Hkv) * D + Hkv * Dv]   qkv_b [that] or empty   o_w [H * Dv, hidden]
 *   attention step and pools: as qkv_attention in _paged_attention.c
 *   dense MLP (E = 0): gate_up [hidden, 2I] (gate columns first), down [I, hidden]
 *   MoE (E > 0): router_w [E, hidden], router_b [E], gate_up [E, hidden, 2I], down [E, I, hidden]
 *   strip-packed copies (each optional: empty): qkv_p, o_p, and for a dense MLP gate_up_p, down_p,
 *   a weight [in, out] as [out / 16, in, 16]
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_kernels.h"
#include "_moe.h"
#include "_paged_attention.h"
#include "_pool.h"
#include "_rms_norm.h"

#define KERNEL "decoder_layer" /* error messages start with this */

/* Batches of at most this many rows (decode steps) multiply by the strip-packed copy of a projection
 * weight, [out / 16, in, 16], with the MoE kernel's small-M product: each 16-column strip is one
 * contiguous stream. BLAS copies the weight into such a layout on every call (at 32 rows about as
 * long as the product itself) and a row-major weight's strips are rows 1-4 KB apart; larger
 * batches (prefill) amortise that, and BLAS is faster there. */
#define PACKED_MAX_ROWS 64

/* ---- parallel parts (_pool.h): each a disjoint share of the outputs, so any number of threads
 * gives the same bits ---------------------------------------------------------------------------- */

/* A packed projection: part p computes its share of the 16-column strips for every row. */
typedef struct {
    const float *const *rows;
    const void *packed; /* float32, or bf16 with bf16 */
    const float *bias;
    float *y;
    Py_ssize_t M, K, N;
    int bf16;
} ProjectJob;

static void project_part(void *ctx, int p, int parts) {
    const ProjectJob *j = ctx;
    Py_ssize_t s0, s1;
    pool_split(j->N / 16, p, parts, &s0, &s1);
    if (s1 == s0) return;
    const Strips packed_strips = {j->K * 16, 16, j->bf16};
    const char *first = (const char *)j->packed + s0 * j->K * 16 * (j->bf16 ? 2 : 4);
    gemm_rows(j->rows, j->M, first, j->K, (s1 - s0) * 16, j->y + s0 * 16, j->N, NULL, &packed_strips);
    if (j->bias != NULL)
        for (Py_ssize_t r = 0; r < j->M; r++)
            for (Py_ssize_t c = s0 * 16; c < s1 * 16; c++) j->y[r * j->N + c] += j->bias[c];
}

/* A product of many rows on the pool's threads: part p computes its share of the 16-column strips
 * (the last one may be narrower) for every row, BLAS single-threaded in each (linear_kind). */
typedef struct {
    const float *x;
    Py_ssize_t ldx;
    const void *w; /* [K, N] of kind */
    int kind;
    const float *bias;
    float *y;
    Py_ssize_t M, K, N;
    const char *err[POOL_MAX];
} GemmJob;

static void gemm_part(void *ctx, int p, int parts) {
    GemmJob *j = ctx;
    Py_ssize_t s0, s1;
    pool_split((j->N + 15) / 16, p, parts, &s0, &s1);
    const Py_ssize_t c0 = s0 * 16, c1 = s1 * 16 < j->N ? s1 * 16 : j->N;
    if (c1 <= c0) return;
    const int before = blas_threads_local(1);
    j->err[p] = linear_kind(j->x, j->ldx, weight_columns(j->w, j->kind, c0), j->N, j->kind,
                            j->bias != NULL ? j->bias + c0 : NULL, j->y + c0, j->N, j->M, j->K, c1 - c0);
    blas_threads_local(before);
}

/* Rows of a layer's norm (rms_norm_rows: with residual, the add in place first), then with round
 * the normed rows rounded to bf16 (bf16 products): part p takes rows [t0, t1) of an even split. */
typedef struct {
    const float *x, *residual, *w;
    float *out, *sum;
    Py_ssize_t T, D;
    float eps;
    int round;
} NormJob;

static void norm_part(void *ctx, int p, int parts) {
    const NormJob *j = ctx;
    Py_ssize_t t0, t1;
    pool_split(j->T, p, parts, &t0, &t1);
    if (t1 <= t0) return;
    const Py_ssize_t o = t0 * j->D;
    rms_norm_rows(j->x + o, j->residual != NULL ? j->residual + o : NULL, j->w, j->out + o,
                  j->sum != NULL ? j->sum + o : NULL, t1 - t0, j->D, j->eps);
    if (j->round) round_bf16_rows(j->out + o, j->D, t1 - t0, j->D);
}

/* Rows from which a layer's norms and router split over the pool (fewer: a decode step's few
 * rows cost less than waking a thread). */
#define ROWS_PARALLEL_MIN 64

/* fn over T rows: split over the pool from ROWS_PARALLEL_MIN rows, else on the caller alone. */
static void rows_run(Py_ssize_t T, pool_fn fn, void *job) {
    if (T >= ROWS_PARALLEL_MIN && pool_size() > 1) pool_run(pool_size(), fn, job);
    else fn(job, 0, 1);
}

/* The router over the pool: part p routes tokens [t0, t1) with its own work buffer. */
typedef struct {
    const Route *rt;
    float *work;
    Py_ssize_t work_floats;
} RouteJob;

static void route_part(void *ctx, int p, int parts) {
    const RouteJob *j = ctx;
    Py_ssize_t t0, t1;
    pool_split(j->rt->T, p, parts, &t0, &t1);
    for (Py_ssize_t t = t0; t < t1; t++) route_token(j->rt, t, j->work + p * j->work_floats);
}

/* Attention: part p stores the new keys of rows [t0, t1) of an even split, then (a second region)
 * attends rows bounds[p] .. bounds[p + 1] (attention_split: equal work, a long prompt split too). */
typedef struct {
    const AttnProblem *pb;
    Py_ssize_t bounds[POOL_MAX + 1];
    const char *err[POOL_MAX];
} AttnJob;

static void store_part(void *ctx, int p, int parts) {
    const AttnProblem *pb = ((const AttnJob *)ctx)->pb;
    Py_ssize_t t0, t1;
    pool_split(pb->B ? pb->cu[pb->B] : 0, p, parts, &t0, &t1);
    attention_store(pb, t0, t1);
}

static void attention_part(void *ctx, int p, int parts) {
    AttnJob *j = ctx;
    (void)parts;
    j->err[p] = attention_run_rows(j->pb, j->bounds[p], j->bounds[p + 1]);
}

/* Routed experts: part p runs experts bounds[p] .. bounds[p + 1] into contrib rows, then (a
 * second region) adds up tokens rows [t0, t1) of its share. */
typedef struct {
    const MoeProblem *pb;
    const MoePlan *plan;
    float *contrib;
    Py_ssize_t bounds[POOL_MAX + 1];
    const char *err[POOL_MAX];
} MoeJob;

static void moe_part(void *ctx, int p, int parts) {
    MoeJob *j = ctx;
    (void)parts;
    j->err[p] = moe_experts_range(j->pb, j->plan, j->bounds[p], j->bounds[p + 1], j->contrib);
}

static void moe_sum_part(void *ctx, int p, int parts) {
    const MoeJob *j = ctx;
    Py_ssize_t t0, t1;
    pool_split(j->pb->T, p, parts, &t0, &t1);
    moe_sum_contrib(j->pb, j->contrib, t0, t1);
}

/* What streaming an expert's weight costs, in rows of its products: a row of an expert does 2
 * FLOPs per weight element, and a core computes about 10 FLOPs in the time its share of memory
 * bandwidth brings one byte (~200 GFLOPS against ~20 GB/s here), so a weight of es-byte elements
 * costs about 5 x es rows. Only the split between threads reads it; the bits never depend on it. */
#define MOE_WEIGHT_ROWS(es) (5 * (es))

static inline Py_ssize_t moe_expert_cost(const MoePlan *plan, Py_ssize_t e, Py_ssize_t weight_rows) {
    const Py_ssize_t rows = plan->start[e + 1] - plan->start[e];
    return rows > 0 ? weight_rows + rows : 0;
}

/* The routed experts over the pool's threads: expert ranges of about equal cost, each
 * expert through the small-M product or, with many rows, single-threaded BLAS (_moe.h). */
static const char *moe_parallel(const MoeProblem *moe, int parts) {
    if (parts <= 1) return moe_run(moe);
    MoePlan plan = {0};
    MoeJob job = {moe, &plan, NULL, {0}, {NULL}};
    const char *err = moe_plan(moe, &plan);
    if (err == NULL) job.contrib = malloc((size_t)(moe->T * moe->K * moe->H) * sizeof(float));
    if (err == NULL && job.contrib == NULL) err = "moe_experts: out of memory";
    if (err == NULL) {
        /* Ranges of about equal cost, not equal rows: an expert with tokens streams its whole
         * weight once (most of a decode step's cost: a few rows an expert) and then pays per row
         * (most of a prefill chunk's: hundreds), so it costs MOE_WEIGHT_ROWS(es) rows plus its
         * own. With 16 experts and 64 rows, equal rows left one thread up to 10 weights to stream
         * against the other's 6. */
        const Py_ssize_t weight_rows = MOE_WEIGHT_ROWS(moe->wbf16 ? 2 : 4);
        Py_ssize_t total = 0;
        for (Py_ssize_t x = 0; x < moe->E; x++) total += moe_expert_cost(&plan, x, weight_rows);
        Py_ssize_t e = 0, before = 0; /* the cost of experts [0, e) */
        for (int p = 1; p < parts; p++) {
            const Py_ssize_t target = total * p / parts;
            /* take expert e while at least half of its cost lies before the target */
            while (e < moe->E && 2 * before + moe_expert_cost(&plan, e, weight_rows) <= 2 * target)
                before += moe_expert_cost(&plan, e++, weight_rows);
            job.bounds[p] = e;
        }
        job.bounds[parts] = moe->E;
        pool_run(parts, moe_part, &job);
        for (int p = 0; p < parts && err == NULL; p++) err = job.err[p];
        if (err == NULL) pool_run(parts, moe_sum_part, &job);
    }
    free(job.contrib);
    moe_plan_free(&plan);
    return err;
}

/* y [M, N] = x [M, K] (row stride ldx) @ w (+ bias), w and its packed copy float32 or bf16 (kind:
 * _blas.h's W_*): the packed copy (or NULL) for small M, else BLAS (linear_kind: a bf16 weight
 * widened first, or with bf16 inputs MKL's bf16 product), either split over the pool's threads by
 * column strips. NULL or a static error message. */
static const char *project(const float *x, Py_ssize_t ldx, const void *w, const void *packed, int kind,
                           const float *bias, float *y, Py_ssize_t M, Py_ssize_t K, Py_ssize_t N) {
    const int packed_rows = packed != NULL && M <= PACKED_MAX_ROWS;
    if (!packed_rows && blas_threads_local != NULL) {
        /* split over the pool, not BLAS's own threads: MKL's OpenMP team keeps spinning after a
         * call and, on two cores, slows the pool's work that comes next (bf16, decode c = 32:
         * attention 3.3 -> 12.3 ms, experts 15 -> 27 ms a step; a 136-row step's norms 1 -> 16) */
        GemmJob job = {x, ldx, w, kind, bias, y, M, K, N, {NULL}};
        const int parts = pool_size();
        pool_run(parts, gemm_part, &job);
        for (int p = 0; p < parts; p++)
            if (job.err[p] != NULL) return job.err[p];
        return NULL;
    }
    if (!packed_rows) return linear_any(x, ldx, w, kind, bias, y, M, K, N, 0);
    const float *rows[PACKED_MAX_ROWS];
    for (Py_ssize_t r = 0; r < M; r++) rows[r] = x + r * ldx;
    ProjectJob job = {rows, packed, bias, y, M, K, N, kind != W_F32};
    pool_run(pool_size(), project_part, &job);
    return NULL;
}

/* bf16 products (_blas.h): set by set_bf16_products, read as each layer call starts. */
static int bf16_products = 0;

/* set_bf16_products(on): with bf16 weights, round every product's input rows to bf16 (_blas.h). */
static PyObject *py_set_bf16_products(PyObject *self, PyObject *args) {
    int on;
    (void)self;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    bf16_products = on;
    Py_RETURN_NONE;
}

/* ---- phase profile (profile(on), phase_seconds()): where a layer's time goes, off by default -------
 * Each phase's wall time is added up over every layer call while on (one clock read per phase). */
enum { PH_NORM, PH_QKV, PH_ATTENTION, PH_O_PROJ, PH_ROUTER, PH_EXPERTS, PH_DENSE_MLP, PH_COUNT };
static const char *const phase_names[PH_COUNT] = {"norms",  "qkv_proj",       "attention", "o_proj",
                                                  "router", "routed_experts", "dense_mlp"};
static int profiling = 0;
static int64_t phase_ns[PH_COUNT];

static inline int64_t clock_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The time since *mark goes to phase ph; *mark moves to now. */
static inline void phase_end(int ph, int64_t *mark) {
    if (!profiling) return;
    const int64_t now = clock_ns();
    phase_ns[ph] += now - *mark;
    *mark = now;
}

/* The layer's weights and sizes, and its scratch. */
typedef struct {
    float *x, *residual;
    int first;
    const float *ln1, *ln2, *qkv_b;
    /* the projection weights and their strip-packed copies (or NULL): float32, or bf16 with wbf16 */
    const void *qkv_w, *o_w, *qkv_p, *o_p, *gate_up_p, *down_p;
    int wbf16;
    int round_bf16; /* bf16 products (_blas.h): every product's input rows rounded to bf16 first */
    float eps;
    Py_ssize_t T, hidden, qkv_dim;
    AttnProblem attn;
    /* MLP: E == 0 dense */
    const void *gate_up, *down;
    Py_ssize_t E, I, K;
    Route route;
    /* scratch */
    float *h, *qkv, *a, *g;
    int64_t *experts;
    float *weights, *route_work; /* route_work: route_floats per pool thread */
    Py_ssize_t route_floats;
} Layer;

/* Runs the layer; NULL or a static error message. Called without the GIL. */
static const char *layer_run(Layer *ly) {
    const Py_ssize_t T = ly->T, Hd = ly->hidden, I = ly->I;
    int64_t mark = profiling ? clock_ns() : 0;
    if (ly->first) {
        memcpy(ly->residual, ly->x, (size_t)(T * Hd) * sizeof(float));
        rows_run(T, norm_part, &(NormJob){ly->residual, NULL, ly->ln1, ly->h, NULL, T, Hd, ly->eps, ly->round_bf16});
    } else {
        rows_run(T, norm_part,
                 &(NormJob){ly->x, ly->residual, ly->ln1, ly->h, ly->residual, T, Hd, ly->eps, ly->round_bf16});
    }
    const int kind = weight_kind(ly->wbf16, ly->round_bf16);
    phase_end(PH_NORM, &mark);
    const char *err = project(ly->h, Hd, ly->qkv_w, ly->qkv_p, kind, ly->qkv_b, ly->qkv, T, Hd, ly->qkv_dim);
    if (err != NULL) return err;
    phase_end(PH_QKV, &mark);
    const int parts = pool_size();
    AttnJob attn = {&ly->attn, {0}, {NULL}};
    if (attention_resident(&ly->attn) < 0) return NOT_RESIDENT;
    pool_run(parts, store_part, &attn); /* every new key stored before any query reads it */
    attention_split(&ly->attn, parts, attn.bounds);
    pool_run(parts, attention_part, &attn); /* out: ly->a [T, H * Dv] */
    for (int p = 0; p < parts; p++)
        if (attn.err[p] != NULL) return attn.err[p];
    phase_end(PH_ATTENTION, &mark);
    const Py_ssize_t attn_dim = ly->attn.H * ly->attn.Dv;
    if (ly->round_bf16) round_bf16_rows(ly->a, attn_dim, T, attn_dim);
    err = project(ly->a, attn_dim, ly->o_w, ly->o_p, kind, NULL, ly->h, T, attn_dim, Hd);
    if (err != NULL) return err;
    phase_end(PH_O_PROJ, &mark);
    /* rounded with bf16 products: the router's input too, as a bf16 model's */
    rows_run(T, norm_part, &(NormJob){ly->h, ly->residual, ly->ln2, ly->g, ly->residual, T, Hd, ly->eps, ly->round_bf16});
    phase_end(PH_NORM, &mark);
    if (ly->E == 0) { /* dense SwiGLU: [T, 2I] = g @ gate_up, activated in place, then down from the gate half */
        float *gu = ly->h; /* free again, and sized for [T, 2I] too */
        err = project(ly->g, Hd, ly->gate_up, ly->gate_up_p, kind, NULL, gu, T, Hd, 2 * I);
        if (err != NULL) return err;
        for (Py_ssize_t r = 0; r < T; r++) swiglu(gu + r * 2 * I, I);
        if (ly->round_bf16) round_bf16_rows(gu, 2 * I, T, I);
        err = project(gu, 2 * I, ly->down, ly->down_p, kind, NULL, ly->x, T, I, Hd);
        phase_end(PH_DENSE_MLP, &mark);
        return err;
    }
    ly->route.x = ly->g;
    rows_run(T, route_part, &(RouteJob){&ly->route, ly->route_work, ly->route_floats});
    phase_end(PH_ROUTER, &mark);
    const MoeProblem moe = {ly->g,      ly->weights, ly->gate_up, ly->down, ly->experts, ly->x,
                            T,          ly->K,       ly->E,       Hd,       I,           ly->wbf16,
                            ly->round_bf16};
    err = moe_parallel(&moe, parts);
    phase_end(PH_EXPERTS, &mark);
    return err;
}

/* A strip-packed weight [out / 16, in, 16] of es-byte elements: empty (none), or whole strips of
 * the right size. */
static int check_packed(const Py_buffer *buf, Py_ssize_t in, Py_ssize_t out, Py_ssize_t es, const char *name) {
    if (buf->len == 0) return 0;
    if (out % 16) {
        PyErr_Format(PyExc_ValueError, "decoder_layer: %s: %zd outputs are not whole strips of 16", name, out);
        return -1;
    }
    return check_buffer(buf, KERNEL, in * out * es, name);
}

/* decoder_layer(x, residual, first, cos, sin, slots, table, cu, lens, k, v, page, kv_bf16, ln1, ln2, eps, qkv_w,
 *               qkv_b, o_w, sinks, H, Hkv, D, Dv, window, scale, v_scale, gate_up, down, router_w, router_b, E,
 *               I, K, n_group, topk_group, norm, scaling, qkv_p, o_p, gate_up_p, down_p, w_bf16) -> None */
static PyObject *py_decoder_layer(PyObject *self, PyObject *args) {
    Py_buffer x, residual, cos, sin, slots, table, cu, lens, k, v, ln1, ln2, qkv_w, qkv_b, o_w, sinks, gate_up, down,
        router_w, router_b, qkv_p, o_p, gate_up_p, down_p;
    Py_ssize_t page, H, Hkv, D, Dv, window, n_group, topk_group;
    float scale, v_scale, scaling;
    int norm, kv_bf16;
    Layer ly = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*py*y*y*y*y*y*w*w*npy*y*fy*y*y*y*nnnnnffy*y*y*y*nnnnnpfy*y*y*y*p", &x, &residual,
                          &ly.first, &cos, &sin, &slots, &table, &cu, &lens, &k, &v, &page, &kv_bf16, &ln1, &ln2,
                          &ly.eps, &qkv_w, &qkv_b, &o_w, &sinks, &H, &Hkv, &D, &Dv, &window, &scale, &v_scale,
                          &gate_up, &down, &router_w, &router_b, &ly.E, &ly.I, &ly.K, &n_group, &topk_group, &norm,
                          &scaling, &qkv_p, &o_p, &gate_up_p, &down_p, &ly.wbf16))
        return NULL;
    ly.round_bf16 = ly.wbf16 && bf16_products;
    PyObject *result = NULL;
    float *scratch = NULL;
    int64_t *experts = NULL;
    const Py_ssize_t f = (Py_ssize_t)sizeof(float);
    if (sgemm == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "decoder_layer: no BLAS bound (call bind_sgemm first)");
        goto done;
    }
    if (attention_setup(&ly.attn, &k, &v, &table, &cu, &lens, &sinks, H, Hkv, D, Dv, page, window, scale, kv_bf16))
        goto done;
    const Py_ssize_t Hd = ln1.len / f, T = ly.attn.B ? ly.attn.cu[ly.attn.B] : 0, E = ly.E, I = ly.I;
    const Py_ssize_t wf = ly.wbf16 ? 2 : f; /* bytes per projection-weight element */
    ly.T = T, ly.hidden = Hd, ly.qkv_dim = (H + Hkv) * D + Hkv * Dv;
    if (Hd < 1 || E < 0 || I < 1 || (E > 0 && ly.K < 1)) {
        PyErr_SetString(PyExc_ValueError, "decoder_layer: invalid sizes");
        goto done;
    }
    if (check_buffer(&x, KERNEL, T * Hd * f, "x") || check_buffer(&residual, KERNEL, T * Hd * f, "residual") ||
        check_buffer(&ln1, KERNEL, Hd * f, "ln1") || check_buffer(&ln2, KERNEL, Hd * f, "ln2") ||
        check_buffer(&qkv_w, KERNEL, Hd * ly.qkv_dim * wf, "qkv_w") ||
        (qkv_b.len != 0 && check_buffer(&qkv_b, KERNEL, ly.qkv_dim * f, "qkv_b")) ||
        check_buffer(&o_w, KERNEL, H * Dv * Hd * wf, "o_w") ||
        check_buffer(&gate_up, KERNEL, (E ? E : 1) * Hd * 2 * I * wf, "gate_up") ||
        check_buffer(&down, KERNEL, (E ? E : 1) * I * Hd * wf, "down") ||
        (E > 0 && (check_buffer(&router_w, KERNEL, E * Hd * f, "router_w") ||
                   check_buffer(&router_b, KERNEL, E * f, "router_b"))) ||
        check_packed(&qkv_p, Hd, ly.qkv_dim, wf, "qkv_p") || check_packed(&o_p, H * Dv, Hd, wf, "o_p") ||
        (E == 0 &&
         (check_packed(&gate_up_p, Hd, 2 * I, wf, "gate_up_p") || check_packed(&down_p, I, Hd, wf, "down_p"))))
        goto done;
    ly.qkv_p = qkv_p.len ? qkv_p.buf : NULL, ly.o_p = o_p.len ? o_p.buf : NULL;
    ly.gate_up_p = E == 0 && gate_up_p.len ? gate_up_p.buf : NULL, ly.down_p = E == 0 && down_p.len ? down_p.buf : NULL;
    ly.route = (Route){NULL, router_w.buf, router_b.buf, NULL, NULL, T, Hd, E, ly.K, n_group, topk_group, norm, scaling};
    if (E > 0 && !route_sizes_valid(&ly.route)) {
        PyErr_SetString(PyExc_ValueError, ROUTE_SIZES_ERROR);
        goto done;
    }
    /* scratch, each part on a 64-byte boundary (MKL's sgemm ran ~30% slower at prefill sizes on
     * malloc's 16-byte alignment): h [T, max(hidden, 2I)], g [T, hidden], qkv [T, qkv_dim],
     * a [T, H * Dv], then for the routing its weights [T, K] and work; experts int64 [T, K] apart */
    const Py_ssize_t h_width = Hd > 2 * I ? Hd : 2 * I, route_floats = (Py_ssize_t)(route_work_bytes(&ly.route) / f);
    const Py_ssize_t part[6] = {T * h_width, T * Hd, T * ly.qkv_dim, T * H * Dv, E > 0 ? T * ly.K : 0,
                                E > 0 ? route_floats * pool_size() : 0};
    Py_ssize_t offset[7] = {0};
    for (int i = 0; i < 6; i++) offset[i + 1] = offset[i] + (part[i] + 15) / 16 * 16;
    scratch = aligned_alloc(64, (size_t)(offset[6] ? offset[6] : 16) * sizeof(float));
    experts = E > 0 ? malloc((size_t)(T * ly.K > 0 ? T * ly.K : 1) * sizeof(int64_t)) : NULL;
    if (scratch == NULL || (E > 0 && experts == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    ly.h = scratch + offset[0], ly.g = scratch + offset[1], ly.qkv = scratch + offset[2], ly.a = scratch + offset[3];
    if (E > 0) {
        ly.experts = experts, ly.weights = scratch + offset[4], ly.route_work = scratch + offset[5];
        ly.route_floats = route_floats;
        ly.route.experts = ly.experts, ly.route.weights = ly.weights;
    }
    if (attention_setup_fused(&ly.attn, ly.qkv, &cos, &sin, &slots, v_scale)) goto done;
    ly.attn.out = ly.a;
    ly.x = x.buf, ly.residual = residual.buf, ly.ln1 = ln1.buf, ly.ln2 = ln2.buf;
    ly.qkv_w = qkv_w.buf, ly.qkv_b = qkv_b.len ? qkv_b.buf : NULL, ly.o_w = o_w.buf;
    ly.gate_up = gate_up.buf, ly.down = down.buf;
    const char *err = NULL;
    if (T > 0) {
        Py_BEGIN_ALLOW_THREADS
        err = layer_run(&ly);
        Py_END_ALLOW_THREADS
    }
    if (err != NULL) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    free(scratch);
    free(experts);
    release_buffers((Py_buffer *[]){&x, &residual, &cos, &sin, &slots, &table, &cu, &lens, &k, &v, &ln1, &ln2, &qkv_w,
                                    &qkv_b, &o_w, &sinks, &gate_up, &down, &router_w, &router_b, &qkv_p, &o_p,
                                    &gate_up_p, &down_p},
                    24);
    return result;
}

/* set_threads(n): threads (the caller included) each layer's regions use from now on. */
static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    int n;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    pool_set_size(n);
    return PyLong_FromLong(pool_size());
}

/* profile(on): add up each phase's time from now on (True) or stop (False); the sums are kept. */
static PyObject *py_profile(PyObject *self, PyObject *args) {
    int on;
    (void)self;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    profiling = on;
    Py_RETURN_NONE;
}

/* phase_seconds(reset) -> {phase: seconds}: the sums so far (zeroed after, with reset). */
static PyObject *py_phase_seconds(PyObject *self, PyObject *args) {
    int reset;
    (void)self;
    if (!PyArg_ParseTuple(args, "p", &reset)) return NULL;
    PyObject *d = PyDict_New();
    for (int i = 0; d != NULL && i < PH_COUNT; i++) {
        PyObject *v = PyFloat_FromDouble((double)phase_ns[i] * 1e-9);
        if (v == NULL || PyDict_SetItemString(d, phase_names[i], v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    if (d != NULL && reset) memset(phase_ns, 0, sizeof(phase_ns));
    return d;
}

static PyMethodDef methods[] = {
    {"profile", py_profile, METH_VARARGS,
     "profile(on): add up the wall time of each layer phase (norms, projections, attention, router, experts) "
     "from now on, or stop."},
    {"phase_seconds", py_phase_seconds, METH_VARARGS,
     "phase_seconds(reset) -> {phase: seconds} summed over layer calls while profiling; reset zeroes them."},
    {"decoder_layer", py_decoder_layer, METH_VARARGS,
     "decoder_layer(x, residual, first, cos, sin, slots, page_table, cu_seqlens_q, seq_lens, k, v, page_size, "
     "kv_bf16, ln1, ln2, eps, qkv_w, qkv_b, o_w, sinks, H, Hkv, D, Dv, window, scale, v_scale, gate_up, down, "
     "router_w, router_b, E, I, K, n_group, topk_group, norm, scaling, qkv_p, o_p, gate_up_p, down_p, w_bf16): one "
     "decoder layer (float32 activations; weights and KV pools float32 or bf16); x and residual [T, hidden] updated "
     "in place (x: the MLP output, residual: the stream before it); releases the GIL."},
    {"set_threads", py_set_threads, METH_VARARGS,
     "set_threads(n) -> threads: how many threads (the caller included) a layer's attention, MoE experts and "
     "decode-sized projections are split over (workers are created on first need)."},
    BIND_SGEMM_METHOD,
    SET_BLAS_MIN_ROWS_METHOD,
    SET_BF16_GEMM_METHOD,
    {"set_bf16_products", py_set_bf16_products, METH_VARARGS,
     "set_bf16_products(on): with bf16 weights, round every product's input rows to bf16 (a bf16 model's "
     "activations), sums in float32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_decoder_layer", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* EPD_SOURCE_HASH: the hash of this extension's sources, defined by setup.py (epd_common/native.py
   compares it with the tree at import, so a stale build is not used). */
PyMODINIT_FUNC PyInit__decoder_layer(void) {
    attention_use_avx2(1);
    moe_use_level(2);
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "PACKED_MAX_ROWS", PACKED_MAX_ROWS) < 0) Py_CLEAR(m);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_HASH", EPD_SOURCE_HASH) < 0) Py_CLEAR(m);
    return m;
}
