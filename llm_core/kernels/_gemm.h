/*
 * The small-M product the CPU kernels share (MoE experts, the decoder layer's decode projections,
 * prefill attention's score and value products). Include after Python.h and _kernels.h; each
 * extension has its own copy of the dispatch (gemm_use_level).
 */
#ifndef LLM_CORE_GEMM_H
#define LLM_CORE_GEMM_H

#include <string.h>

/* Small-M products: Y[r] = X[r] @ W for a few rows (those routed to one expert, a decode batch, a
 * tile of attention queries), W [in, n] row-major or strip-packed (Strips).
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
/* Where column j, row k of W is: the strip of 16 columns holding j starts at element
 * (j / 16) * step, its rows are ld elements apart. Row-major [in, n]: {16, n}. Strip-packed
 * [n / 16, in, 16] (each strip one contiguous stream; n a multiple of 16): {in * 16, 16}. bf16:
 * W's elements are bfloat16 (widened to float32 as they are loaded; the products, the sums and
 * their order are those of a float32 W holding the same values, so the results are the same bits),
 * else float32. */
typedef struct Strips {
    Py_ssize_t step, ld;
    int bf16;
} Strips;

typedef void (*gemm_rows_fn)(const float *const *x, Py_ssize_t M, const void *W, Py_ssize_t in, Py_ssize_t n,
                             float *y, Py_ssize_t ldy, const void *next, const Strips *strips);

static inline Py_ssize_t strip_index(const Strips *st, Py_ssize_t k, Py_ssize_t j) {
    return (j / 16) * st->step + k * st->ld + j % 16;
}

/* Columns c0 .. n - 1 (past the last whole strip) of every row, one at a time. */
static void gemm_tail_columns(const float *const *x, Py_ssize_t M, const void *W, Py_ssize_t in, Py_ssize_t c0,
                              Py_ssize_t n, float *y, Py_ssize_t ldy, const Strips *st) {
    for (Py_ssize_t r = 0; r < M; r++)
        for (Py_ssize_t c = c0; c < n; c++) {
            float acc = 0.0f;
            for (Py_ssize_t k = 0; k < in; k++) acc += x[r][k] * elem_at(W, strip_index(st, k, c), st->bf16);
            y[r * ldy + c] = acc;
        }
}

static void gemm_rows_scalar(const float *const *x, Py_ssize_t M, const void *W, Py_ssize_t in, Py_ssize_t n,
                             float *y, Py_ssize_t ldy, const void *next, const Strips *strips) {
    (void)next;
    for (Py_ssize_t r = 0; r < M; r++) {
        float *yr = y + r * ldy;
        memset(yr, 0, (size_t)n * sizeof(float));
        for (Py_ssize_t k = 0; k < in; k++) {
            const float xk = x[r][k];
            for (Py_ssize_t j = 0; j < n; j++) yr[j] += xk * elem_at(W, strip_index(strips, k, j), strips->bf16);
        }
    }
}

#ifdef HAVE_AVX2_PATH
/* The fetches the first row tile of a strip issues while it runs: the next strip, one line per k
 * (next_strip; 0: none), and lines [pf, pf_end) of the next matrix, pf_step bytes per k. */
typedef struct {
    Py_ssize_t next_strip;
    const char *pf, *pf_end;
    Py_ssize_t pf_step;
} TileFetch;

/* The fetches of the first row tile over strips [s0, s1) of ``strips``: next_strip as given, and
 * that range's share of ``next`` (bytes long, or NULL), lines [s0, s1) / strips, over in steps. */
static inline TileFetch tile_fetch(Py_ssize_t next_strip, const void *next, Py_ssize_t bytes, Py_ssize_t strips,
                                   Py_ssize_t s0, Py_ssize_t s1, Py_ssize_t in) {
    TileFetch fetch = {next_strip, NULL, NULL, 0};
    if (next != NULL) {
        fetch.pf = (const char *)next + s0 * bytes / strips / 64 * 64;
        fetch.pf_end = (const char *)next + s1 * bytes / strips;
        fetch.pf_step = ((fetch.pf_end - fetch.pf) / in + 63) / 64 * 64;
    }
    return fetch;
}

/* y rows (ldy apart) = R rows x[0 .. R) times one 16-column strip w (rows ld elements apart, bf16
 * or float32 elements), in registers: R x 2 accumulators, one FMA chain per accumulator over k. R
 * and bf16 are constants at every call (the unused accumulators and branches fold away; named
 * variables, not an array, which GCC would keep in memory); rows >= n_out (padding: x repeats a
 * real row) are not stored. */
#define TILE_ROW(i, a0, a1)                                       \
    if (R > i) {                                                  \
        const __m256 xr = _mm256_broadcast_ss(x##i + k);          \
        a0 = _mm256_fmadd_ps(xr, w0, a0);                         \
        a1 = _mm256_fmadd_ps(xr, w1, a1);                         \
    }
#define TILE_STORE(i, a0, a1)                                     \
    if (R > i && n_out > i) {                                     \
        _mm256_storeu_ps(y + i * ldy, a0);                        \
        _mm256_storeu_ps(y + i * ldy + 8, a1);                    \
    }
static inline AVX2 __attribute__((always_inline)) void gemm_tile(const int R, const int bf16, const float *const *x,
                                                                 const void *w, Py_ssize_t in, Py_ssize_t ld, float *y,
                                                                 Py_ssize_t ldy, int n_out, const TileFetch *fetch) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
           a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float *const x0 = x[0], *const x1 = x[R > 1 ? 1 : 0], *const x2 = x[R > 2 ? 2 : 0],
                       *const x3 = x[R > 3 ? 3 : 0], *const x4 = x[R > 4 ? 4 : 0], *const x5 = x[R > 5 ? 5 : 0];
    const int fetching = fetch != NULL;
    const Py_ssize_t next_strip = fetching ? fetch->next_strip : 0, pf_step = fetching ? fetch->pf_step : 0;
    const char *pf = fetching ? fetch->pf : NULL, *const pf_end = fetching ? fetch->pf_end : NULL;
    const Py_ssize_t es = bf16 ? 2 : 4; /* bytes per element */
    const char *wk = w;
    for (Py_ssize_t k = 0; k < in; k++, wk += ld * es) {
        if (fetching) {
            if (next_strip) _mm_prefetch(wk + next_strip * es, _MM_HINT_T0);
            if (pf != NULL && pf < pf_end) {
                for (Py_ssize_t b = 0; b < pf_step; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
                pf += pf_step;
            }
        }
        const __m256 w0 = load8(wk, 0, bf16), w1 = load8(wk, 8, bf16);
        TILE_ROW(0, a00, a01)
        TILE_ROW(1, a10, a11)
        TILE_ROW(2, a20, a21)
        TILE_ROW(3, a30, a31)
        TILE_ROW(4, a40, a41)
        TILE_ROW(5, a50, a51)
    }
    TILE_STORE(0, a00, a01)
    TILE_STORE(1, a10, a11)
    TILE_STORE(2, a20, a21)
    TILE_STORE(3, a30, a31)
    TILE_STORE(4, a40, a41)
    TILE_STORE(5, a50, a51)
}
#undef TILE_ROW
#undef TILE_STORE

/* Tiles of 6 rows (12 FMA chains), and the last few rows in a tile of 4 or 2 (a decode step gives
 * an expert ~8 rows: 6 + 2 computes 8 rows, where 6 + 6 computed 12). Each row's sums run in the
 * same order whatever its tile, so results do not depend on the tiling. */
static inline AVX2 __attribute__((always_inline)) void gemm_rows_avx2_t(const int bf16, const float *const *x,
                                                                        Py_ssize_t M, const void *W, Py_ssize_t in,
                                                                        Py_ssize_t n, float *y, Py_ssize_t ldy,
                                                                        const void *next, const Strips *st) {
    const Py_ssize_t es = bf16 ? 2 : 4, strips = n / 16, bytes = in * n * es;
    for (Py_ssize_t s = 0; s < strips; s++) {
        const Py_ssize_t j = s * 16;
        /* the first row tile fetches the next strip, one line per k, and its share of ``next``,
         * lines [s, s + 1) / strips, spread over the same k loop */
        const TileFetch fetch = tile_fetch(s + 1 < strips ? st->step : 0, next, bytes, strips, s, s + 1, in);
        const char *w = (const char *)W + s * st->step * es;
        for (Py_ssize_t r0 = 0; r0 < M;) {
            const Py_ssize_t left = M - r0;
            const float *rows[6];
            for (int i = 0; i < 6; i++) rows[i] = x[r0 + (i < left ? i : left - 1)];
            const TileFetch *f = r0 == 0 ? &fetch : NULL;
            float *yr = y + r0 * ldy + j;
            const int n_out = left < 6 ? (int)left : 6;
            if (left >= 5) gemm_tile(6, bf16, rows, w, in, st->ld, yr, ldy, n_out, f);
            else if (left >= 3) gemm_tile(4, bf16, rows, w, in, st->ld, yr, ldy, n_out, f);
            else gemm_tile(2, bf16, rows, w, in, st->ld, yr, ldy, n_out, f);
            r0 += left >= 5 ? 6 : left >= 3 ? 4 : 2;
        }
    }
    gemm_tail_columns(x, M, W, in, strips * 16, n, y, ldy, st);
}

/* One specialisation per weight type. */
static AVX2 void gemm_rows_avx2(const float *const *x, Py_ssize_t M, const void *W, Py_ssize_t in, Py_ssize_t n,
                                float *y, Py_ssize_t ldy, const void *next, const Strips *st) {
    if (st->bf16) gemm_rows_avx2_t(1, x, M, W, in, n, y, ldy, next, st);
    else gemm_rows_avx2_t(0, x, M, W, in, n, y, ldy, next, st);
}

/* ---- AVX-512: a tile spans several strips ------------------------------------------------------
 * One 16-column strip is one 512-bit register, so a tile of R rows x S strips keeps R x S
 * accumulators, each its own FMA chain over k. With the one or two rows a decode step gives an
 * expert, one strip at a time would leave one or two chains (the FMA latency unhidden: the AVX2
 * tile computes 2 rows at the least for the same reason); S strips side by side give R x S >= 8
 * chains, and each k step reads S x 16 consecutive weights of a row-major matrix. Each output is
 * the same FMA chain over k in the same order as the AVX2 tile's, so the bits are the same. */
#define AVX512 __attribute__((target("avx512f,avx2,fma")))

static inline AVX512 __attribute__((always_inline)) __m512 load16(const void *base, Py_ssize_t i, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#define W16(s) (S > s ? load16(wk + (s) * sstep, 0, bf16) : zero)
#define ROW16(i)                                                                                                 \
    if (R > i) {                                                                                                 \
        const __m512 xb = _mm512_set1_ps(x##i[k]);                                                               \
        c##i##0 = _mm512_fmadd_ps(xb, w0, c##i##0);                                                              \
        if (S > 1) c##i##1 = _mm512_fmadd_ps(xb, w1, c##i##1);                                                   \
        if (S > 2) c##i##2 = _mm512_fmadd_ps(xb, w2, c##i##2), c##i##3 = _mm512_fmadd_ps(xb, w3, c##i##3);       \
        if (S > 4)                                                                                               \
            c##i##4 = _mm512_fmadd_ps(xb, w4, c##i##4), c##i##5 = _mm512_fmadd_ps(xb, w5, c##i##5),              \
            c##i##6 = _mm512_fmadd_ps(xb, w6, c##i##6), c##i##7 = _mm512_fmadd_ps(xb, w7, c##i##7);              \
    }
#define STORE16(i)                                                                                               \
    if (R > i && n_out > i) {                                                                                    \
        float *yi = y + (i) * ldy;                                                                               \
        _mm512_storeu_ps(yi, c##i##0);                                                                           \
        if (S > 1) _mm512_storeu_ps(yi + 16, c##i##1);                                                           \
        if (S > 2) _mm512_storeu_ps(yi + 32, c##i##2), _mm512_storeu_ps(yi + 48, c##i##3);                       \
        if (S > 4)                                                                                               \
            _mm512_storeu_ps(yi + 64, c##i##4), _mm512_storeu_ps(yi + 80, c##i##5),                              \
            _mm512_storeu_ps(yi + 96, c##i##6), _mm512_storeu_ps(yi + 112, c##i##7);                             \
    }

/* y rows (ldy apart; S x 16 columns) = R rows of x times S strips starting at w (strip s at byte
 * offset s * sstep, rows ld elements apart). R in {1, 2, 4}, S in {1, 2, 4, 8} with R x S <= 16;
 * both constants at every call. Rows >= n_out (padding: x repeats a real row) are not stored. */
static inline AVX512 __attribute__((always_inline)) void gemm_tile16(const int R, const int S, const int bf16,
                                                                    const float *const *x, const char *w,
                                                                    Py_ssize_t sstep, Py_ssize_t in, Py_ssize_t ld,
                                                                    float *y, Py_ssize_t ldy, int n_out,
                                                                    const TileFetch *fetch) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 c00 = zero, c01 = zero, c02 = zero, c03 = zero, c04 = zero, c05 = zero, c06 = zero, c07 = zero;
    __m512 c10 = zero, c11 = zero, c12 = zero, c13 = zero, c20 = zero, c21 = zero, c22 = zero, c23 = zero;
    __m512 c30 = zero, c31 = zero, c32 = zero, c33 = zero;
    /* unused in every tile shape (R x S <= 16), declared so that the macros compile */
    __m512 c14 = zero, c15 = zero, c16 = zero, c17 = zero, c24 = zero, c25 = zero, c26 = zero, c27 = zero;
    __m512 c34 = zero, c35 = zero, c36 = zero, c37 = zero;
    const float *const x0 = x[0], *const x1 = x[R > 1 ? 1 : 0], *const x2 = x[R > 2 ? 2 : 0],
                       *const x3 = x[R > 3 ? 3 : 0];
    const int fetching = fetch != NULL;
    const Py_ssize_t next_block = fetching ? fetch->next_strip : 0, pf_step = fetching ? fetch->pf_step : 0;
    const char *pf = fetching ? fetch->pf : NULL, *const pf_end = fetching ? fetch->pf_end : NULL;
    const Py_ssize_t es = bf16 ? 2 : 4, row_bytes = S * 16 * es; /* a row-major block's bytes per k */
    const char *wk = w;
    for (Py_ssize_t k = 0; k < in; k++, wk += ld * es) {
        if (fetching) {
            if (next_block)
                for (Py_ssize_t b = 0; b < (sstep == 16 * es ? row_bytes : 16 * es); b += 64)
                    _mm_prefetch(wk + next_block + b, _MM_HINT_T0);
            if (pf != NULL && pf < pf_end) {
                for (Py_ssize_t b = 0; b < pf_step; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
                pf += pf_step;
            }
        }
        const __m512 w0 = W16(0), w1 = W16(1), w2 = W16(2), w3 = W16(3), w4 = W16(4), w5 = W16(5), w6 = W16(6),
                     w7 = W16(7);
        ROW16(0)
        ROW16(1)
        ROW16(2)
        ROW16(3)
    }
    STORE16(0)
    STORE16(1)
    STORE16(2)
    STORE16(3)
}
#undef W16
#undef ROW16
#undef STORE16

/* A few rows (M <= STREAM_MAX_ROWS) times a row-major W [in, n]: k outer, every column inner, the
 * output rows (n floats each, L1-resident) as the accumulators. W is then read front to back, one
 * whole row per k, as the hardware prefetcher streams best; a register tile reads a block's S x 64
 * bytes per k from a row n x 4 bytes further on (a new 4 KB page every few k), which measured half
 * the bandwidth MKL reached on a decode-sized expert. Each output is still one FMA chain over k in
 * order (a float32 store and reload is exact): the register tiles' bits. ``next`` is fetched a
 * share per k. */
#define STREAM_MAX_ROWS 4

static inline AVX512 __attribute__((always_inline)) void gemm_stream_t(const int R, const int bf16,
                                                                       const float *const *x, const char *W,
                                                                       Py_ssize_t in, Py_ssize_t n16, Py_ssize_t ld,
                                                                       float *y, Py_ssize_t ldy, const char *pf,
                                                                       const char *pf_end, Py_ssize_t pf_step) {
    const Py_ssize_t es = bf16 ? 2 : 4, row = ld * es;
    float *const y0 = y, *const y1 = y + (R > 1 ? ldy : 0), *const y2 = y + (R > 2 ? 2 * ldy : 0),
                 *const y3 = y + (R > 3 ? 3 * ldy : 0);
    const float *const x0 = x[0], *const x1 = x[R > 1 ? 1 : 0], *const x2 = x[R > 2 ? 2 : 0],
                       *const x3 = x[R > 3 ? 3 : 0];
    for (int r = 0; r < R; r++) memset(y + r * ldy, 0, (size_t)n16 * sizeof(float));
    Py_ssize_t k = 0;
    /* four rows of W per pass: each output loaded and stored once per four FMAs (in k order) */
    for (; k + 4 <= in; k += 4) {
        const char *wk = W + k * row;
        if (pf != NULL && pf < pf_end) {
            for (Py_ssize_t b = 0; b < 4 * pf_step; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
            pf += 4 * pf_step;
        }
#define BCAST(i) const __m512 b##i##0 = _mm512_set1_ps(x##i[k]), b##i##1 = _mm512_set1_ps(x##i[k + 1]), \
                              b##i##2 = _mm512_set1_ps(x##i[k + 2]), b##i##3 = _mm512_set1_ps(x##i[k + 3]);
        BCAST(0)
        BCAST(1)
        BCAST(2)
        BCAST(3)
#undef BCAST
        for (Py_ssize_t c = 0; c < n16; c += 16) {
            const __m512 w0 = load16(wk, c, bf16), w1 = load16(wk + row, c, bf16), w2 = load16(wk + 2 * row, c, bf16),
                         w3 = load16(wk + 3 * row, c, bf16);
#define ACC4(i)                                                                                                    \
    if (R > i) {                                                                                                   \
        __m512 a = _mm512_loadu_ps(y##i + c);                                                                      \
        a = _mm512_fmadd_ps(b##i##0, w0, a);                                                                       \
        a = _mm512_fmadd_ps(b##i##1, w1, a);                                                                       \
        a = _mm512_fmadd_ps(b##i##2, w2, a);                                                                       \
        _mm512_storeu_ps(y##i + c, _mm512_fmadd_ps(b##i##3, w3, a));                                               \
    }
            ACC4(0)
            ACC4(1)
            ACC4(2)
            ACC4(3)
#undef ACC4
        }
    }
    for (; k < in; k++) {
        const char *wk = W + k * row;
        for (Py_ssize_t c = 0; c < n16; c += 16) {
            const __m512 w = load16(wk, c, bf16);
            _mm512_storeu_ps(y0 + c, _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), w, _mm512_loadu_ps(y0 + c)));
            if (R > 1) _mm512_storeu_ps(y1 + c, _mm512_fmadd_ps(_mm512_set1_ps(x1[k]), w, _mm512_loadu_ps(y1 + c)));
            if (R > 2) _mm512_storeu_ps(y2 + c, _mm512_fmadd_ps(_mm512_set1_ps(x2[k]), w, _mm512_loadu_ps(y2 + c)));
            if (R > 3) _mm512_storeu_ps(y3 + c, _mm512_fmadd_ps(_mm512_set1_ps(x3[k]), w, _mm512_loadu_ps(y3 + c)));
        }
    }
}

/* Rows in tiles of 4 (4 strips wide: 16 chains), then a tile of 2 (4 strips) or 1 (8 strips) for
 * the rest; strips left over after the widest blocks run one at a time in the same row tiles. A few
 * rows of a row-major W stream it instead (gemm_stream_t). */
static inline AVX512 __attribute__((always_inline)) void gemm_rows_avx512_t(const int bf16, const float *const *x,
                                                                          Py_ssize_t M, const void *W,
                                                                          Py_ssize_t in, Py_ssize_t n, float *y,
                                                                          Py_ssize_t ldy, const void *next,
                                                                          const Strips *st) {
    const Py_ssize_t es = bf16 ? 2 : 4, strips = n / 16, bytes = in * n * es, sstep = st->step * es;
    const int width = M == 1 ? 8 : 4; /* strips per block for the widest tiles */
    Py_ssize_t s = 0;
    if (M <= STREAM_MAX_ROWS && st->step == 16 && st->ld == n && strips > 0) { /* row-major, few rows */
        const char *pf = next, *pf_end = next != NULL ? (const char *)next + bytes : NULL;
        const Py_ssize_t pf_step = (bytes / in + 63) / 64 * 64;
        if (M == 1) gemm_stream_t(1, bf16, x, W, in, strips * 16, n, y, ldy, pf, pf_end, pf_step);
        else if (M == 2) gemm_stream_t(2, bf16, x, W, in, strips * 16, n, y, ldy, pf, pf_end, pf_step);
        else if (M == 3) gemm_stream_t(3, bf16, x, W, in, strips * 16, n, y, ldy, pf, pf_end, pf_step);
        else gemm_stream_t(4, bf16, x, W, in, strips * 16, n, y, ldy, pf, pf_end, pf_step);
        s = strips;
    }
    while (s < strips) {
        const int S = strips - s >= width ? width : 1;
        /* the first row tile fetches the next block's first lines, one row per k, and its share of
         * ``next``, lines [s, s + S) / strips, spread over the same k loop */
        const TileFetch fetch = tile_fetch(s + S < strips ? S * sstep : 0, next, bytes, strips, s, s + S, in);
        const char *w = (const char *)W + s * sstep;
        for (Py_ssize_t r0 = 0; r0 < M;) {
            const Py_ssize_t left = M - r0;
            const float *rows[4];
            for (int i = 0; i < 4; i++) rows[i] = x[r0 + (i < left ? i : left - 1)];
            const TileFetch *f = r0 == 0 ? &fetch : NULL;
            float *yr = y + r0 * ldy + s * 16;
            const int n_out = left < 4 ? (int)left : 4;
            if (S == 8) gemm_tile16(1, 8, bf16, rows, w, sstep, in, st->ld, yr, ldy, n_out, f);
            else if (S == 4 && left >= 3) gemm_tile16(4, 4, bf16, rows, w, sstep, in, st->ld, yr, ldy, n_out, f);
            else if (S == 4) gemm_tile16(2, 4, bf16, rows, w, sstep, in, st->ld, yr, ldy, n_out, f);
            else if (left >= 3) gemm_tile16(4, 1, bf16, rows, w, sstep, in, st->ld, yr, ldy, n_out, f);
            else if (left == 2) gemm_tile16(2, 1, bf16, rows, w, sstep, in, st->ld, yr, ldy, n_out, f);
            else gemm_tile16(1, 1, bf16, rows, w, sstep, in, st->ld, yr, ldy, n_out, f);
            r0 += S == 8 ? 1 : left >= 3 ? 4 : left == 2 ? 2 : 1;
        }
        s += S;
    }
    gemm_tail_columns(x, M, W, in, strips * 16, n, y, ldy, st);
}

static AVX512 void gemm_rows_avx512(const float *const *x, Py_ssize_t M, const void *W, Py_ssize_t in, Py_ssize_t n,
                                    float *y, Py_ssize_t ldy, const void *next, const Strips *st) {
    if (st->bf16) gemm_rows_avx512_t(1, x, M, W, in, n, y, ldy, next, st);
    else gemm_rows_avx512_t(0, x, M, W, in, n, y, ldy, next, st);
}

static inline int cpu_has_avx512(void) {
    __builtin_cpu_init();
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f");
}

#endif

static gemm_rows_fn gemm_rows = gemm_rows_scalar;

/* The small-M product for SIMD level 2 (AVX-512, where the CPU has it), 1 (AVX2 + FMA) or 0
 * (scalar); returns the level in use (at most the one asked for). */
static int gemm_use_level(int level) {
#ifdef HAVE_AVX2_PATH
    if (level >= 2 && cpu_has_avx512()) {
        gemm_rows = gemm_rows_avx512;
        return 2;
    }
    if (level >= 1 && cpu_has_avx2()) {
        gemm_rows = gemm_rows_avx2;
        return 1;
    }
#endif
    gemm_rows = gemm_rows_scalar;
    return 0;
}

static inline int gemm_level(void) {
#ifdef HAVE_AVX2_PATH
    if (gemm_rows == gemm_rows_avx512) return 2;
#endif
    return gemm_rows == gemm_rows_scalar ? 0 : 1;
}

#endif
