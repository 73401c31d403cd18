/*
 * The paged attention kernel (see _paged_attention.c for what it computes and the layouts), without
 * its Python entry points, so that the decoder-layer kernel (_decoder_layer.c) runs the same code.
 * Include after Python.h and _kernels.h. Each extension that includes it has its own copy of the
 * SIMD dispatch (attention_use_avx2).
 */
#ifndef LLM_CORE_PAGED_ATTENTION_H
#define LLM_CORE_PAGED_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ATTENTION_KERNEL "paged_attention" /* error messages start with this */

#define KEY_BLOCK 128 /* keys per online-softmax block: one block covers a 128-token window */

/* A block's view of the problem: nb keys at slots[0 .. nb) and one query q [H, D]. Scores land
 * in s [H][KEY_BLOCK]; the weighted values accumulate into acc [H, Dv]. Keys are the outer loop
 * and heads the inner one, so each key's pool row (all KV heads, contiguous) is read once, in
 * slot order: pages stream through the cache instead of being walked once per head. */
typedef struct {
    const float *q;
    const void *k, *v; /* the pools: float32, or bf16 with bf16 (widened as they are read) */
    const int64_t *slots;
    Py_ssize_t nb, H, group, D, Dv, kstride, vstride; /* group: query heads per KV head; strides in elements */
    float scale;
    struct Prefetch *pf; /* or NULL */
    int bf16;
} Block;

/* The pool rows the next query will read, requested while this one computes. Decode queries
 * belong to different sequences whose pages are scattered over the pools, so every query starts
 * on cold rows. Their lines (keys first, then values) are requested a few at a time from inside
 * this query's compute loops, ``per_step`` lines per step, sized so that the last line goes out
 * as this query's compute ends: the memory stays busy the whole time, and the core never waits
 * on a burst of requests (a burst of hundreds of prefetches fills the miss buffers and stalls the
 * loads behind it). Only used across sequences: the next query of the same sequence reads the
 * rows just read. */
typedef struct Prefetch {
    const int64_t *slots;
    const char *k, *v;               /* pool bases */
    Py_ssize_t n;                    /* rows (keys) of the next query */
    Py_ssize_t k_lines, v_lines;     /* 64-byte lines per key row, per value row */
    Py_ssize_t k_bytes, v_bytes;     /* row strides */
    Py_ssize_t row, line, per_step;  /* cursor: rows 0 .. n - 1 are keys, n .. 2n - 1 values */
} Prefetch;

static inline void prefetch_step(Prefetch *pf) {
    if (pf == NULL) return;
    for (Py_ssize_t i = 0; i < pf->per_step && pf->row < 2 * pf->n; i++) {
        const int is_v = pf->row >= pf->n;
        const Py_ssize_t r = is_v ? pf->row - pf->n : pf->row;
        const char *row = is_v ? pf->v + pf->slots[r] * pf->v_bytes : pf->k + pf->slots[r] * pf->k_bytes;
        __builtin_prefetch(row + pf->line * 64);
        if (++pf->line == (is_v ? pf->v_lines : pf->k_lines)) pf->line = 0, pf->row++;
    }
}

/* ---- primitives: scalar versions ---------------------------------------------------------- */

static void block_scores_scalar(const Block *bk, float *s) {
    for (Py_ssize_t j = 0; j < bk->nb; j++) {
        const Py_ssize_t row = bk->slots[j] * bk->kstride;
        for (Py_ssize_t h = 0; h < bk->H; h++) {
            const float *qh = bk->q + h * bk->D;
            const Py_ssize_t kh = row + (h / bk->group) * bk->D;
            float acc = 0.0f;
            for (Py_ssize_t d = 0; d < bk->D; d++) acc += qh[d] * elem_at(bk->k, kh + d, bk->bf16);
            s[h * KEY_BLOCK + j] = bk->scale * acc;
        }
    }
}

/* s[j] = e^(s[j] - m) for j < n; returns the sum. */
static float exp_shift_scalar(float *s, Py_ssize_t n, float m) {
    float sum = 0.0f;
    for (Py_ssize_t j = 0; j < n; j++) sum += (s[j] = expf(s[j] - m));
    return sum;
}

/* max_j s[j] for 0 <= j < n (n >= 1) */
static float max_of_scalar(const float *s, Py_ssize_t n) {
    float m = s[0];
    for (Py_ssize_t j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* acc[h] += sum_j p[h][j] * v_j[h / group] */
static void block_accumulate_scalar(const Block *bk, const float *p, float *acc) {
    for (Py_ssize_t j = 0; j < bk->nb; j++) {
        const Py_ssize_t row = bk->slots[j] * bk->vstride;
        for (Py_ssize_t h = 0; h < bk->H; h++) {
            const Py_ssize_t vh = row + (h / bk->group) * bk->Dv;
            const float pj = p[h * KEY_BLOCK + j];
            float *ah = acc + h * bk->Dv;
            for (Py_ssize_t d = 0; d < bk->Dv; d++) ah[d] += pj * elem_at(bk->v, vh + d, bk->bf16);
        }
    }
}

/* ---- primitives: AVX2 + FMA versions ------------------------------------------------------ */

#ifdef HAVE_AVX2_PATH
/* bf16: a constant at each call (block_scores_avx2), so each pool type gets its own loop. */
static inline AVX2 __attribute__((always_inline)) void block_scores_avx2_t(const Block *bk, float *s, const int bf16) {
    const Py_ssize_t D = bk->D, es = bf16 ? 2 : 4;
    const char *const pool = bk->k;
    const __m256 vscale = _mm256_set1_ps(bk->scale);
    Py_ssize_t j = 0;
    for (; j + 8 <= bk->nb; j += 8) { /* 8 keys, every head: 8 independent FMA chains per head */
        const char *r[8];
        for (int i = 0; i < 8; i++) r[i] = pool + bk->slots[j + i] * bk->kstride * es;
        for (Py_ssize_t h = 0; h < bk->H; h++) {
            prefetch_step(bk->pf);
            const float *qh = bk->q + h * D;
            const Py_ssize_t off = (h / bk->group) * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (Py_ssize_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                a0 = _mm256_fmadd_ps(qv, load8(r[0], off + d, bf16), a0);
                a1 = _mm256_fmadd_ps(qv, load8(r[1], off + d, bf16), a1);
                a2 = _mm256_fmadd_ps(qv, load8(r[2], off + d, bf16), a2);
                a3 = _mm256_fmadd_ps(qv, load8(r[3], off + d, bf16), a3);
                a4 = _mm256_fmadd_ps(qv, load8(r[4], off + d, bf16), a4);
                a5 = _mm256_fmadd_ps(qv, load8(r[5], off + d, bf16), a5);
                a6 = _mm256_fmadd_ps(qv, load8(r[6], off + d, bf16), a6);
                a7 = _mm256_fmadd_ps(qv, load8(r[7], off + d, bf16), a7);
            }
            _mm256_storeu_ps(s + h * KEY_BLOCK + j, _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), vscale));
        }
    }
    for (; j < bk->nb; j++) {
        const char *row = pool + bk->slots[j] * bk->kstride * es;
        for (Py_ssize_t h = 0; h < bk->H; h++) {
            const float *qh = bk->q + h * D;
            const Py_ssize_t kh = (h / bk->group) * D;
            __m256 a = _mm256_setzero_ps();
            for (Py_ssize_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(row, kh + d, bf16), a);
            s[h * KEY_BLOCK + j] = bk->scale * hsum(a);
        }
    }
}

static AVX2 void block_scores_avx2(const Block *bk, float *s) {
    if (bk->D & 7) block_scores_scalar(bk, s);
    else if (bk->bf16) block_scores_avx2_t(bk, s, 1);
    else block_scores_avx2_t(bk, s, 0);
}

/* A scalar max is one dependent compare per key; here eight lanes in two registers (a max is
 * exact in any order: same result). */
static AVX2 float max_of_avx2(const float *s, Py_ssize_t n) {
    if (n < 16) return max_of_scalar(s, n);
    __m256 a = _mm256_loadu_ps(s), b = _mm256_loadu_ps(s + 8);
    Py_ssize_t j = 16;
    for (; j + 16 <= n; j += 16) {
        a = _mm256_max_ps(a, _mm256_loadu_ps(s + j));
        b = _mm256_max_ps(b, _mm256_loadu_ps(s + j + 8));
    }
    if (j + 8 <= n) a = _mm256_max_ps(a, _mm256_loadu_ps(s + j)), j += 8;
    a = _mm256_max_ps(a, b);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    float m = _mm_cvtss_f32(x);
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

static AVX2 float exp_shift_avx2(float *s, Py_ssize_t n, float m) {
    Py_ssize_t j = 0;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    if (j < n) { /* the tail through the same polynomial; padding lanes are discarded */
        float tail[8];
        for (int i = 0; i < 8; i++) tail[i] = j + i < n ? s[j + i] - m : -100.0f;
        _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
        for (Py_ssize_t i = 0; j + i < n; i++) {
            s[j + i] = tail[i];
            sum += tail[i];
        }
    }
    return sum;
}

/* One head at a time, the output chunk in registers across the block's keys, and two keys per
 * step into separate accumulators: eight independent FMA chains, so the FMA latency is hidden
 * (one chain per output register would leave the units idle three cycles in four). */
static inline AVX2 __attribute__((always_inline)) void block_accumulate_avx2_t(const Block *bk, const float *p,
                                                                               float *acc, const int bf16) {
    const Py_ssize_t Dv = bk->Dv, nb = bk->nb, vstride = bk->vstride;
    for (Py_ssize_t h = 0; h < bk->H; h++) {
        const float *ph = p + h * KEY_BLOCK;
        const Py_ssize_t base = (h / bk->group) * Dv; /* this head's offset in a pool row */
        const void *const pool = bk->v;
        float *ah = acc + h * Dv;
        Py_ssize_t d0 = 0;
        for (; d0 + 32 <= Dv; d0 += 32) {
            __m256 a0 = _mm256_loadu_ps(ah + d0), a1 = _mm256_loadu_ps(ah + d0 + 8);
            __m256 a2 = _mm256_loadu_ps(ah + d0 + 16), a3 = _mm256_loadu_ps(ah + d0 + 24);
            __m256 b0 = _mm256_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
            Py_ssize_t j = 0;
            for (; j + 2 <= nb; j += 2) {
                if ((j & 7) == 0) prefetch_step(bk->pf);
                const Py_ssize_t r0 = base + bk->slots[j] * vstride + d0, r1 = base + bk->slots[j + 1] * vstride + d0;
                const __m256 p0 = _mm256_broadcast_ss(ph + j), p1 = _mm256_broadcast_ss(ph + j + 1);
                a0 = _mm256_fmadd_ps(p0, load8(pool, r0, bf16), a0);
                a1 = _mm256_fmadd_ps(p0, load8(pool, r0 + 8, bf16), a1);
                a2 = _mm256_fmadd_ps(p0, load8(pool, r0 + 16, bf16), a2);
                a3 = _mm256_fmadd_ps(p0, load8(pool, r0 + 24, bf16), a3);
                b0 = _mm256_fmadd_ps(p1, load8(pool, r1, bf16), b0);
                b1 = _mm256_fmadd_ps(p1, load8(pool, r1 + 8, bf16), b1);
                b2 = _mm256_fmadd_ps(p1, load8(pool, r1 + 16, bf16), b2);
                b3 = _mm256_fmadd_ps(p1, load8(pool, r1 + 24, bf16), b3);
            }
            if (j < nb) {
                const Py_ssize_t r0 = base + bk->slots[j] * vstride + d0;
                const __m256 p0 = _mm256_broadcast_ss(ph + j);
                a0 = _mm256_fmadd_ps(p0, load8(pool, r0, bf16), a0);
                a1 = _mm256_fmadd_ps(p0, load8(pool, r0 + 8, bf16), a1);
                a2 = _mm256_fmadd_ps(p0, load8(pool, r0 + 16, bf16), a2);
                a3 = _mm256_fmadd_ps(p0, load8(pool, r0 + 24, bf16), a3);
            }
            _mm256_storeu_ps(ah + d0, _mm256_add_ps(a0, b0));
            _mm256_storeu_ps(ah + d0 + 8, _mm256_add_ps(a1, b1));
            _mm256_storeu_ps(ah + d0 + 16, _mm256_add_ps(a2, b2));
            _mm256_storeu_ps(ah + d0 + 24, _mm256_add_ps(a3, b3));
        }
        for (; d0 < Dv; d0 += 8) { /* 8-wide tail: four keys per step, four chains */
            const __m256 zero = _mm256_setzero_ps();
            __m256 a[4] = {_mm256_loadu_ps(ah + d0), zero, zero, zero};
            Py_ssize_t j = 0;
            for (; j + 4 <= nb; j += 4)
                for (int i = 0; i < 4; i++)
                    a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(ph + j + i),
                                           load8(pool, base + bk->slots[j + i] * vstride + d0, bf16), a[i]);
            for (; j < nb; j++)
                a[0] = _mm256_fmadd_ps(_mm256_broadcast_ss(ph + j), load8(pool, base + bk->slots[j] * vstride + d0, bf16),
                                       a[0]);
            _mm256_storeu_ps(ah + d0, _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
        }
    }
}

static AVX2 void block_accumulate_avx2(const Block *bk, const float *p, float *acc) {
    if (bk->Dv & 7) block_accumulate_scalar(bk, p, acc);
    else if (bk->bf16) block_accumulate_avx2_t(bk, p, acc, 1);
    else block_accumulate_avx2_t(bk, p, acc, 0);
}
#endif

typedef void (*block_scores_fn)(const Block *, float *);
typedef float (*exp_shift_fn)(float *, Py_ssize_t, float);
typedef float (*max_of_fn)(const float *, Py_ssize_t);
typedef void (*block_accumulate_fn)(const Block *, const float *, float *);

static block_scores_fn block_scores = block_scores_scalar;
static exp_shift_fn exp_shift = exp_shift_scalar;
static max_of_fn max_of = max_of_scalar;
static block_accumulate_fn block_accumulate = block_accumulate_scalar;

/* ---- the kernel --------------------------------------------------------------------------- */

typedef struct {
    const float *q, *sinks; /* sinks: NULL for none */
    void *k, *v;            /* float32, or bf16 with kv_bf16; written only by the fused entry (new tokens' rows) */
    int kv_bf16;
    const int32_t *table, *cu, *lens;
    float *out;
    Py_ssize_t B, H, Hkv, D, Dv, page, P, num_pages, window;
    Py_ssize_t q_stride; /* floats from one query row to the next: H * D, or a whole qkv row */
    float scale;
    /* fused entry only (new_slots NULL otherwise): rotate q and k in the qkv rows, then store k
     * and v_scale * v at new_slots; cos/sin [T, width] */
    float *qkv;
    const float *cos, *sin;
    const int64_t *new_slots;
    Py_ssize_t width;
    float v_scale;
} AttnProblem;

/* Rows t0 .. t1 - 1 of qkv [T, (H + Hkv) * D + Hkv * Dv]: rotate the first ``width`` dims of every
 * q and k head (half-split pairs (i, i + width / 2)), then copy k and v_scale * v into the pools at
 * the token's slot. The products and sums are those of rope.apply_partial_rotary_ in the same
 * order (this file is compiled without FMA contraction), so the pools get the same bits as the
 * torch path writes. */
static void rope_and_store(const AttnProblem *pb, Py_ssize_t t0, Py_ssize_t t1) {
    const Py_ssize_t heads = pb->H + pb->Hkv, D = pb->D, half = pb->width / 2;
    const Py_ssize_t kdim = pb->Hkv * D, vdim = pb->Hkv * pb->Dv;
    for (Py_ssize_t t = t0; t < t1; t++) {
        float *row = pb->qkv + t * pb->q_stride;
        const float *c = pb->cos + t * pb->width, *s = pb->sin + t * pb->width;
        for (Py_ssize_t h = 0; h < heads; h++) {
            float *x1 = row + h * D, *x2 = x1 + half;
            for (Py_ssize_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i], as = a * s[i], bs = b * s[i];
                x1[i] = a * c[i] - bs;
                x2[i] = b * c[i] + as;
            }
        }
        const int64_t slot = pb->new_slots[t];
        const float *kin = row + pb->H * D, *vin = row + heads * D;
        if (pb->kv_bf16) { /* rounded as torch's .to(torch.bfloat16) */
            uint16_t *kout = (uint16_t *)pb->k + slot * kdim, *vout = (uint16_t *)pb->v + slot * vdim;
            for (Py_ssize_t i = 0; i < kdim; i++) kout[i] = float_to_bf16(kin[i]);
            for (Py_ssize_t i = 0; i < vdim; i++) vout[i] = float_to_bf16(vin[i] * pb->v_scale);
        } else {
            float *kout = (float *)pb->k + slot * kdim, *vout = (float *)pb->v + slot * vdim;
            memcpy(kout, kin, (size_t)kdim * sizeof(float));
            for (Py_ssize_t i = 0; i < vdim; i++) vout[i] = vin[i] * pb->v_scale;
        }
    }
}

/* Attention of one query (packed row t) whose keys are slots[0 .. nk); pf: the next query's rows
 * to fetch meanwhile, or NULL. */
static void attend_query(const AttnProblem *pb, Py_ssize_t t, const int64_t *slots, Py_ssize_t nk, Prefetch *pf,
                         float *s, float *m, float *l, float *acc) {
    const Py_ssize_t H = pb->H, Dv = pb->Dv;
    Block bk = {pb->q + t * pb->q_stride, pb->k, pb->v, slots, 0, H, H / pb->Hkv, pb->D, Dv,
                pb->Hkv * pb->D, pb->Hkv * Dv, pb->scale, pf, pb->kv_bf16};
    if (pf != NULL) { /* prefetch_step calls: one per head and 8 keys in the score pass, and per head,
                       * 8 keys and 32 value dims in the value pass */
        const Py_ssize_t steps = H * ((nk + 7) / 8) * (1 + Dv / 32);
        pf->per_step = (pf->n * (pf->k_lines + pf->v_lines) + steps - 1) / steps;
    }
    for (Py_ssize_t h = 0; h < H; h++) m[h] = -INFINITY, l[h] = 0.0f;
    memset(acc, 0, (size_t)(H * Dv) * sizeof(float));
    for (Py_ssize_t j0 = 0; j0 < nk; j0 += KEY_BLOCK) {
        bk.slots = slots + j0;
        bk.nb = nk - j0 < KEY_BLOCK ? nk - j0 : KEY_BLOCK;
        block_scores(&bk, s);
        for (Py_ssize_t h = 0; h < H; h++) {
            float *sh = s + h * KEY_BLOCK, *ah = acc + h * Dv;
            const float bm = max_of(sh, bk.nb);
            if (bm > m[h]) { /* a new running max: rescale what was summed so far */
                if (l[h] > 0.0f) {
                    const float alpha = expf(m[h] - bm);
                    l[h] *= alpha;
                    for (Py_ssize_t d = 0; d < Dv; d++) ah[d] *= alpha;
                }
                m[h] = bm;
            }
            l[h] += exp_shift(sh, bk.nb, m[h]);
        }
        block_accumulate(&bk, s, acc);
    }
    float *o = pb->out + t * H * Dv;
    for (Py_ssize_t h = 0; h < H; h++) {
        float c = 1.0f, denom = l[h];
        if (pb->sinks != NULL) { /* the sink joins the softmax denominator only */
            const float mf = m[h] > pb->sinks[h] ? m[h] : pb->sinks[h];
            c = expf(m[h] - mf);
            denom = l[h] * c + expf(pb->sinks[h] - mf);
        }
        const float f = c / denom;
        for (Py_ssize_t d = 0; d < Dv; d++) o[h * Dv + d] = acc[h * Dv + d] * f;
    }
}

/* The first position some query of sequence b reads (its first new token's window start). */
static inline Py_ssize_t first_read(const AttnProblem *pb, Py_ssize_t b) {
    const Py_ssize_t first = pb->lens[b] - (pb->cu[b + 1] - pb->cu[b]);
    return pb->window > 0 && first - pb->window + 1 > 0 ? first - pb->window + 1 : 0;
}

/* Slots of every key some query of sequence b reads (positions lo .. len - 1) into slots;
 * returns lo, or -1 when a page is not in the pool. */
static Py_ssize_t sequence_slots(const AttnProblem *pb, Py_ssize_t b, int64_t *slots) {
    const Py_ssize_t len = pb->lens[b], lo = first_read(pb, b);
    for (Py_ssize_t pos = lo; pos < len; pos++) {
        const Py_ssize_t logical = pos / pb->page;
        const int32_t phys = logical < pb->P ? pb->table[b * pb->P + logical] : -1;
        if (phys < 0 || phys >= pb->num_pages) return -1;
        slots[pos - lo] = (int64_t)phys * pb->page + pos % pb->page;
    }
    return lo;
}

/* First key of the query at position pos (keys before lo are not in its sequence's slots). */
static inline Py_ssize_t first_key(const AttnProblem *pb, Py_ssize_t pos, Py_ssize_t lo) {
    return pb->window > 0 && pos - pb->window + 1 > lo ? pos - pb->window + 1 : lo;
}

/* The first sequence from b (before end) with new tokens, or end. */
static Py_ssize_t next_nonempty(const AttnProblem *pb, Py_ssize_t b, Py_ssize_t end) {
    while (b < end && pb->cu[b + 1] == pb->cu[b]) b++;
    return b;
}

/* 0 when every page some query of the batch reads is in the pool, else -1: checked for the whole
 * batch before any key is stored, so an error leaves the pools as they were. */
static int attention_resident(const AttnProblem *pb) {
    for (Py_ssize_t b = 0; b < pb->B; b++) {
        if (pb->cu[b + 1] == pb->cu[b]) continue;
        const Py_ssize_t last = (pb->lens[b] - 1) / pb->page; /* the last logical page read */
        for (Py_ssize_t logical = first_read(pb, b) / pb->page; logical <= last; logical++) {
            const int32_t phys = logical < pb->P ? pb->table[b * pb->P + logical] : -1;
            if (phys < 0 || phys >= pb->num_pages) return -1;
        }
    }
    return 0;
}

#define NOT_RESIDENT "paged_attention: a page some query reads is not in the pool (page table entry out of range or -1)"

/* The sequence holding packed row t (cu[b] <= t < cu[b + 1]). */
static Py_ssize_t sequence_of_row(const AttnProblem *pb, Py_ssize_t t) {
    Py_ssize_t lo = 0, hi = pb->B - 1;
    while (lo < hi) {
        const Py_ssize_t mid = (lo + hi) / 2;
        if (pb->cu[mid + 1] > t) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* Attends the queries of packed rows t0 .. t1 - 1 (whole sequences or a part of one), their keys
 * already stored (attention_store). Returns NULL or a static error message. Called without the
 * GIL; row ranges that do not overlap may run at the same time (each writes its own output rows),
 * and a query's result does not depend on its range: any split gives the same bits. */
static const char *attention_run_rows(const AttnProblem *pb, Py_ssize_t t0, Py_ssize_t t1) {
    if (t1 <= t0) return NULL;
    const char *err = NULL;
    const Py_ssize_t b0 = sequence_of_row(pb, t0), b1 = sequence_of_row(pb, t1 - 1) + 1;
    Py_ssize_t max_keys = 1;
    for (Py_ssize_t b = b0; b < b1; b++) max_keys = pb->lens[b] > max_keys ? pb->lens[b] : max_keys;
    int64_t *const slot_buf = malloc(2 * (size_t)max_keys * sizeof(int64_t));
    int64_t *cur = slot_buf, *nxt = slot_buf + max_keys; /* this sequence's slots, the next one's */
    float *work = malloc((size_t)(pb->H * (KEY_BLOCK + 2 + pb->Dv)) * sizeof(float));
    if (slot_buf == NULL || work == NULL) {
        err = "paged_attention: out of memory";
        goto done;
    }
    float *s = work, *m = s + pb->H * KEY_BLOCK, *l = m + pb->H, *acc = l + pb->H;
    Py_ssize_t b = next_nonempty(pb, b0, b1), lo = b < b1 ? sequence_slots(pb, b, cur) : 0;
    while (b < b1) {
        if (lo < 0) {
            err = NOT_RESIDENT;
            goto done;
        }
        const Py_ssize_t n = pb->cu[b + 1] - pb->cu[b], first = pb->lens[b] - n;
        const Py_ssize_t i0 = t0 > pb->cu[b] ? t0 - pb->cu[b] : 0, i1 = t1 < pb->cu[b + 1] ? t1 - pb->cu[b] : n;
        const Py_ssize_t nb = next_nonempty(pb, b + 1, b1);
        Py_ssize_t lo_next = 0;
        Prefetch pf = {0}, *last_pf = NULL;
        if (nb < b1) { /* the next sequence's slots now, so its first query's rows can be fetched */
            lo_next = sequence_slots(pb, nb, nxt);
            const Py_ssize_t q0 = pb->cu[nb] > t0 ? 0 : t0 - pb->cu[nb]; /* its first query in range */
            if (lo_next >= 0) {
                const Py_ssize_t pos = pb->lens[nb] - (pb->cu[nb + 1] - pb->cu[nb]) + q0;
                const Py_ssize_t start = first_key(pb, pos, lo_next);
                pf.slots = nxt + (start - lo_next);
                pf.n = pos - start + 1;
                pf.k = (const char *)pb->k, pf.v = (const char *)pb->v;
                const Py_ssize_t es = pb->kv_bf16 ? 2 : (Py_ssize_t)sizeof(float);
                pf.k_bytes = pb->Hkv * pb->D * es;
                pf.v_bytes = pb->Hkv * pb->Dv * es;
                pf.k_lines = (pf.k_bytes + 63) / 64, pf.v_lines = (pf.v_bytes + 63) / 64;
                last_pf = &pf;
            }
        }
        for (Py_ssize_t i = i0; i < i1; i++) {
            const Py_ssize_t pos = first + i, start = first_key(pb, pos, lo);
            attend_query(pb, pb->cu[b] + i, cur + (start - lo), pos - start + 1, i == i1 - 1 ? last_pf : NULL, s,
                         m, l, acc);
        }
        int64_t *swap = cur;
        cur = nxt, nxt = swap;
        b = nb, lo = lo_next;
    }
done:
    free(slot_buf);
    free(work);
    return err;
}

/* The fused entry's rotary and KV store of every new token (nothing without new_slots). */
static inline void attention_store(const AttnProblem *pb, Py_ssize_t t0, Py_ssize_t t1) {
    if (pb->new_slots != NULL) rope_and_store(pb, t0, t1);
}

/* The whole batch on one thread: the pages checked, the new keys stored, every query attended. */
static inline const char *attention_run(const AttnProblem *pb) {
    if (attention_resident(pb) < 0) return NOT_RESIDENT;
    const Py_ssize_t T = pb->B ? pb->cu[pb->B] : 0;
    attention_store(pb, 0, T);
    return attention_run_rows(pb, 0, T);
}

/* The work of the query at position pos: the keys it reads (a window's worth at most) plus a fixed
 * share. */
static inline double query_cost(const AttnProblem *pb, Py_ssize_t pos) {
    const Py_ssize_t keys = pb->window > 0 && pb->window < pos + 1 ? pb->window : pos + 1;
    return (double)(keys + 16);
}

/* Row ranges of about equal work (query_cost) for `parts` threads: bounds[p] .. bounds[p + 1]. A
 * long prompt's queries are split too, so one sequence's prefill uses every thread. */
static inline void attention_split(const AttnProblem *pb, int parts, Py_ssize_t *bounds) {
    double total = 0.0;
    for (Py_ssize_t b = 0; b < pb->B; b++) {
        const Py_ssize_t first = pb->lens[b] - (pb->cu[b + 1] - pb->cu[b]);
        for (Py_ssize_t pos = first; pos < pb->lens[b]; pos++) total += query_cost(pb, pos);
    }
    const Py_ssize_t T = pb->B ? pb->cu[pb->B] : 0;
    bounds[0] = 0;
    double acc = 0.0;
    Py_ssize_t b = 0, t = 0;
    for (int p = 1; p < parts; p++) {
        const double target = total * p / parts;
        while (t < T && acc < target) {
            while (pb->cu[b + 1] <= t) b++;
            acc += query_cost(pb, pb->lens[b] - (pb->cu[b + 1] - t));
            t++;
        }
        bounds[p] = t;
    }
    bounds[parts] = T;
}

/* The checks and fields both entry points share: sizes, cu/lens, pools, page table, sinks (each
 * entry checks its queries, then out: see check_out). Returns 0, or -1 with a ValueError set. */
static int attention_setup(AttnProblem *pb, Py_buffer *k, Py_buffer *v, Py_buffer *table, Py_buffer *cu, Py_buffer *lens,
                         Py_buffer *sinks, Py_ssize_t H, Py_ssize_t Hkv, Py_ssize_t D, Py_ssize_t Dv,
                         Py_ssize_t page, Py_ssize_t window, float scale, int kv_bf16) {
    const Py_ssize_t f = (Py_ssize_t)sizeof(float), i32 = (Py_ssize_t)sizeof(int32_t);
    if (H < 1 || Hkv < 1 || H % Hkv || D < 1 || Dv < 1 || page < 1) {
        PyErr_SetString(PyExc_ValueError, "paged_attention: invalid head counts, head dims or page size");
        return -1;
    }
    pb->B = lens->len / i32;
    if (lens->len % i32 || check_buffer(cu, ATTENTION_KERNEL, (pb->B + 1) * i32, "cu_seqlens_q") ||
        check_buffer(lens, ATTENTION_KERNEL, pb->B * i32, "seq_lens"))
        return -1;
    pb->cu = cu->buf;
    pb->lens = lens->buf;
    if (pb->cu[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "paged_attention: cu_seqlens_q must start at 0");
        return -1;
    }
    for (Py_ssize_t b = 0; b < pb->B; b++) {
        const Py_ssize_t n = pb->cu[b + 1] - pb->cu[b];
        if (n < 0 || n > pb->lens[b]) {
            PyErr_Format(PyExc_ValueError, "paged_attention: sequence %zd has %zd new tokens of %d", b, n,
                         (int)pb->lens[b]);
            return -1;
        }
    }
    const Py_ssize_t es = kv_bf16 ? 2 : f, row_k = Hkv * D * es, row_v = Hkv * Dv * es;
    if (k->len % (row_k * page) || v->len / row_v != k->len / row_k || v->len % row_v) {
        PyErr_SetString(PyExc_ValueError, "paged_attention: k and v pools must hold the same whole pages");
        return -1;
    }
    pb->num_pages = k->len / (row_k * page);
    pb->P = pb->B ? table->len / (pb->B * i32) : 0;
    if (check_buffer(k, ATTENTION_KERNEL, k->len, "k") ||
        check_buffer(v, ATTENTION_KERNEL, v->len, "v") || check_buffer(table, ATTENTION_KERNEL, pb->B * pb->P * i32, "page_table") ||
        (sinks->len != 0 && check_buffer(sinks, ATTENTION_KERNEL, H * f, "sinks")))
        return -1;
    pb->k = k->buf, pb->v = v->buf, pb->kv_bf16 = kv_bf16, pb->table = table->buf;
    pb->sinks = sinks->len ? sinks->buf : NULL;
    pb->H = H, pb->Hkv = Hkv, pb->D = D, pb->Dv = Dv, pb->page = page, pb->window = window, pb->scale = scale;
    return 0;
}

/* The fused entry's part of the set-up, after attention_setup: qkv [T, (H + Hkv) * D + Hkv * Dv]
 * (sized by the caller; rotated in place and read as the queries), cos/sin [T, width], the write
 * slots [T] (each checked to be inside the pools, so nothing is written before an error) and the
 * value scale. Returns 0, or -1 with a ValueError set. */
static int attention_setup_fused(AttnProblem *pb, float *qkv, Py_buffer *cos, Py_buffer *sin, Py_buffer *slots,
                                 float v_scale) {
    const Py_ssize_t f = (Py_ssize_t)sizeof(float), T = pb->B ? pb->cu[pb->B] : 0;
    pb->q_stride = (pb->H + pb->Hkv) * pb->D + pb->Hkv * pb->Dv;
    pb->width = T ? cos->len / (T * f) : 0;
    if (check_buffer(slots, ATTENTION_KERNEL, T * (Py_ssize_t)sizeof(int64_t), "slots") ||
        check_buffer(cos, ATTENTION_KERNEL, T * pb->width * f, "cos") ||
        check_buffer(sin, ATTENTION_KERNEL, T * pb->width * f, "sin"))
        return -1;
    if (pb->width % 2 || pb->width > pb->D) {
        PyErr_Format(PyExc_ValueError, "paged_attention: rotary width %zd must be even and at most %zd", pb->width,
                     pb->D);
        return -1;
    }
    const int64_t *new_slots = slots->buf;
    for (Py_ssize_t t = 0; t < T; t++)
        if (new_slots[t] < 0 || new_slots[t] >= pb->num_pages * pb->page) {
            PyErr_Format(PyExc_ValueError, "paged_attention: write slot %lld of token %zd is outside the pool",
                         (long long)new_slots[t], t);
            return -1;
        }
    pb->new_slots = new_slots;
    pb->qkv = qkv, pb->q = qkv, pb->cos = cos->buf, pb->sin = sin->buf, pb->v_scale = v_scale;
    return 0;
}

/* The primitives in use: the AVX2 + FMA ones (where the CPU has them) or the scalar ones. */
static int attention_use_avx2(int on) {
#ifdef HAVE_AVX2_PATH
    if (on && cpu_has_avx2()) {
        block_scores = block_scores_avx2;
        exp_shift = exp_shift_avx2;
        max_of = max_of_avx2;
        block_accumulate = block_accumulate_avx2;
        return 1;
    }
#endif
    block_scores = block_scores_scalar;
    exp_shift = exp_shift_scalar;
    max_of = max_of_scalar;
    block_accumulate = block_accumulate_scalar;
    return !on;
}

static inline int attention_uses_avx2(void) { return block_scores != block_scores_scalar; }

#endif
