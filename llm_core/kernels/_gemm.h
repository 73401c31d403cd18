/*
 * The small-M product the CPU kernels share (MoE experts, the decoder layer's decode projections,
 * prefill attention's score and value products). Include after Python.h and _kernels.h; each
 * extension has its own copy of the dispatch (gemm_use_avx2).
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
/* Where column j, row k of W is: the strip of 16 columns holding j starts at W + (j / 16) * step,
 * its rows are ld apart. Row-major [in, n]: {16, n}. Strip-packed [n / 16, in, 16] (each strip
 * one contiguous stream; n a multiple of 16): {in * 16, 16}. */
typedef struct Strips {
    Py_ssize_t step, ld;
} Strips;

typedef void (*gemm_rows_fn)(const float *const *x, Py_ssize_t M, const float *W, Py_ssize_t in, Py_ssize_t n,
                             float *y, Py_ssize_t ldy, const float *next, const Strips *strips);

static inline const float *strip_at(const float *W, const Strips *st, Py_ssize_t k, Py_ssize_t j) {
    return W + (j / 16) * st->step + k * st->ld + j % 16;
}

static void gemm_rows_scalar(const float *const *x, Py_ssize_t M, const float *W, Py_ssize_t in, Py_ssize_t n,
                             float *y, Py_ssize_t ldy, const float *next, const Strips *strips) {
    (void)next;
    for (Py_ssize_t r = 0; r < M; r++) {
        float *yr = y + r * ldy;
        memset(yr, 0, (size_t)n * sizeof(float));
        for (Py_ssize_t k = 0; k < in; k++) {
            const float xk = x[r][k];
            for (Py_ssize_t j = 0; j < n; j++) yr[j] += xk * *strip_at(W, strips, k, j);
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

/* y rows (ldy apart) = R rows x[0 .. R) times one 16-column strip w (rows ld apart), in registers:
 * R x 2 accumulators, one FMA chain per accumulator over k. R is a constant at every call (the
 * unused accumulators and branches fold away; named variables, not an array, which GCC would keep
 * in memory); rows >= n_out (padding: x repeats a real row) are not stored. */
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
static inline AVX2 __attribute__((always_inline)) void gemm_tile(const int R, const float *const *x, const float *w,
                                                                 Py_ssize_t in, Py_ssize_t ld, float *y, Py_ssize_t ldy,
                                                                 int n_out, const TileFetch *fetch) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
           a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float *const x0 = x[0], *const x1 = x[R > 1 ? 1 : 0], *const x2 = x[R > 2 ? 2 : 0],
                       *const x3 = x[R > 3 ? 3 : 0], *const x4 = x[R > 4 ? 4 : 0], *const x5 = x[R > 5 ? 5 : 0];
    const int fetching = fetch != NULL;
    const Py_ssize_t next_strip = fetching ? fetch->next_strip : 0, pf_step = fetching ? fetch->pf_step : 0;
    const char *pf = fetching ? fetch->pf : NULL, *const pf_end = fetching ? fetch->pf_end : NULL;
    for (Py_ssize_t k = 0; k < in; k++, w += ld) {
        if (fetching) {
            if (next_strip) _mm_prefetch((const char *)(w + next_strip), _MM_HINT_T0);
            if (pf != NULL && pf < pf_end) {
                for (Py_ssize_t b = 0; b < pf_step; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
                pf += pf_step;
            }
        }
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
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
static AVX2 void gemm_rows_avx2(const float *const *x, Py_ssize_t M, const float *W, Py_ssize_t in, Py_ssize_t n,
                                float *y, Py_ssize_t ldy, const float *next, const Strips *st) {
    const Py_ssize_t strips = n / 16, bytes = in * n * (Py_ssize_t)sizeof(float);
    for (Py_ssize_t s = 0; s < strips; s++) {
        const Py_ssize_t j = s * 16;
        /* the first row tile fetches the next strip, one line per k, and its share of ``next``,
         * lines [s, s + 1) / strips, spread over the same k loop */
        TileFetch fetch = {s + 1 < strips ? st->step : 0, NULL, NULL, 0};
        if (next != NULL) {
            fetch.pf = (const char *)next + s * bytes / strips / 64 * 64;
            fetch.pf_end = (const char *)next + (s + 1) * bytes / strips;
            fetch.pf_step = ((fetch.pf_end - fetch.pf) / in + 63) / 64 * 64;
        }
        const float *w = W + s * st->step;
        for (Py_ssize_t r0 = 0; r0 < M;) {
            const Py_ssize_t left = M - r0;
            const float *rows[6];
            for (int i = 0; i < 6; i++) rows[i] = x[r0 + (i < left ? i : left - 1)];
            const TileFetch *f = r0 == 0 ? &fetch : NULL;
            float *yr = y + r0 * ldy + j;
            const int n_out = left < 6 ? (int)left : 6;
            if (left >= 5) gemm_tile(6, rows, w, in, st->ld, yr, ldy, n_out, f);
            else if (left >= 3) gemm_tile(4, rows, w, in, st->ld, yr, ldy, n_out, f);
            else gemm_tile(2, rows, w, in, st->ld, yr, ldy, n_out, f);
            r0 += left >= 5 ? 6 : left >= 3 ? 4 : 2;
        }
    }
    for (Py_ssize_t r = 0; r < M; r++) /* columns past the last full strip, one at a time */
        for (Py_ssize_t c = strips * 16; c < n; c++) {
            float acc = 0.0f;
            for (Py_ssize_t k = 0; k < in; k++) acc += x[r][k] * *strip_at(W, st, k, c);
            y[r * ldy + c] = acc;
        }
}

#endif

static gemm_rows_fn gemm_rows = gemm_rows_scalar;

static void gemm_use_avx2(int on) {
#ifdef HAVE_AVX2_PATH
    if (on && cpu_has_avx2()) {
        gemm_rows = gemm_rows_avx2;
        return;
    }
#endif
    gemm_rows = gemm_rows_scalar;
}

#endif
