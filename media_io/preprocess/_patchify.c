/*
 * One-pass normalize + patchify of uint8 RGB frames into Qwen2-VL-layout patch rows (any patch,
 * merge and temporal size; Qwen2-VL: 14 / 2 / 2, MiMo-V2.5: 16 / 2 / 2).
 *
 * The numpy path in patchify.py does the same work as a uint8 reorder, a float convert, a
 * multiply-add and a copy per temporal slot: five passes over arrays larger than the L2 cache.
 * This kernel reads every source pixel once and writes every output float once, straight into
 * the caller's buffer, with the GIL released (callers run images in parallel threads).
 *
 * Normalization is a table lookup: lut[c * 256 + v] is (v / 255 - mean[c]) / std[c] as float32,
 * computed by the caller with numpy, so this kernel and the numpy path give identical bits.
 *
 * Layout (see patchify.py for the picture):
 *   frames  [T, H, W, S] uint8, C-contiguous, S >= C bytes per pixel (RGBX: S = 4, C = 3)
 *   out     [gt * gh * gw, C * tp * p * p] float32, C-contiguous
 *   rows:   t -> h/m -> w/m -> m (merge row) -> m (merge col)
 *   cols:   c -> temporal slot -> y -> x
 * Temporal slot s of row group t reads frame min(t * tp + s, T - 1): an image (T = 1) repeats its
 * only frame, a video with T % tp != 0 repeats its last one (what transformers does).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define MAX_BLOCK 1024 /* floats of one (channel, slot) block: p * p <= 1024, checked by the caller */

/* Copy one finished block of n floats to dst. With SSE2 and 16-byte alignment the stores bypass
 * the cache: the output is several MB, is written once here and read much later (by the
 * encoder), so loading its lines first (what an ordinary store does) would double the memory
 * traffic of the kernel. */
static inline void store_block(float *restrict dst, const float *restrict block, Py_ssize_t n) {
#ifdef __SSE2__
    if (((uintptr_t)dst & 15) == 0 && (n & 3) == 0) {
        for (Py_ssize_t i = 0; i < n; i += 4) _mm_stream_ps(dst + i, _mm_load_ps(block + i));
        return;
    }
#endif
    memcpy(dst, block, (size_t)n * sizeof(float));
}

/* Normalize one p x p patch of C interleaved channels into C planar blocks. Always inlined, so
 * the calls with literal (C, S, p) (Qwen2-VL's 14, MiMo-V2.5's 16) get fully unrolled inner
 * loops. m is the merge size, used only for the prefetch distance. */
static inline __attribute__((always_inline)) void fill_blocks(const uint8_t *restrict src,
                                                              const float *restrict lut,
                                                              float (*restrict blocks)[MAX_BLOCK],
                                                              Py_ssize_t line_stride, Py_ssize_t C,
                                                              Py_ssize_t S, Py_ssize_t p, Py_ssize_t m) {
    for (Py_ssize_t y = 0; y < p; y++, src += line_stride) {
        /* The next merge group's pixels start m * p pixels to the right: fetch this row's part
         * of it now (p rows at a stride are too many streams for the hardware prefetcher). */
        __builtin_prefetch(src + m * p * S);
        __builtin_prefetch(src + m * p * S + 64);
        for (Py_ssize_t x = 0; x < p; x++)
            for (Py_ssize_t c = 0; c < C; c++) blocks[c][y * p + x] = lut[c * 256 + src[x * S + c]];
    }
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86_SIMD 1

/* fill_blocks for C = 3, S = 4 (RGBX) and a patch side p >= 4 with SSE4.1: per image row, the
 * 4-pixel groups at x = 0, 4, 8, ... (the last one moved left to end at p when p is not a
 * multiple of 4: x = 0, 4, 8, 10 for p = 14; 0, 4, 8, 12 for p = 16) are split into R, G, B
 * lanes by one byte shuffle each, widened to float and normalized as v * scale + bias: a
 * multiply, then an add, each rounded, exactly the arithmetic that built the table, so the bits
 * are the table's (the tests compare against the numpy path bit for bit). No FMA: this target
 * has none to contract into. Always inlined into the per-size wrappers below, whose literal p
 * unrolls the loops. */
static inline __attribute__((always_inline, target("sse4.1"))) void fill_blocks_rgbx_sse41(
    const uint8_t *restrict src, const float *restrict affine, float (*restrict blocks)[MAX_BLOCK],
    Py_ssize_t line_stride, const Py_ssize_t p, const Py_ssize_t m) {
    const __m128i pick[3] = {
        _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
        _mm_setr_epi8(1, 5, 9, 13, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
        _mm_setr_epi8(2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
    };
    __m128 scale[3], bias[3];
    for (int c = 0; c < 3; c++) {
        scale[c] = _mm_set1_ps(affine[c]);
        bias[c] = _mm_set1_ps(affine[3 + c]);
    }
    const Py_ssize_t groups = (p + 3) / 4;
    for (Py_ssize_t y = 0; y < p; y++, src += line_stride) {
        __builtin_prefetch(src + 4 * m * p); /* the next merge group, as in fill_blocks */
        __builtin_prefetch(src + 4 * m * p + 64);
        for (Py_ssize_t g = 0; g < groups; g++) {
            const Py_ssize_t x0 = 4 * g + 4 <= p ? 4 * g : p - 4;
            const __m128i px = _mm_loadu_si128((const __m128i *)(src + 4 * x0));
            for (int c = 0; c < 3; c++) {
                const __m128 v = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_shuffle_epi8(px, pick[c])));
                _mm_storeu_ps(&blocks[c][y * p + x0], _mm_add_ps(_mm_mul_ps(v, scale[c]), bias[c]));
            }
        }
    }
}

/* Qwen2-VL's patch side (14) and MiMo-V2.5's (16). */
__attribute__((target("sse4.1"))) static void fill_blocks_rgbx14(const uint8_t *restrict src,
                                                                  const float *restrict affine,
                                                                  float (*restrict blocks)[MAX_BLOCK],
                                                                  Py_ssize_t line_stride, Py_ssize_t m) {
    fill_blocks_rgbx_sse41(src, affine, blocks, line_stride, 14, m);
}

__attribute__((target("sse4.1"))) static void fill_blocks_rgbx16(const uint8_t *restrict src,
                                                                  const float *restrict affine,
                                                                  float (*restrict blocks)[MAX_BLOCK],
                                                                  Py_ssize_t line_stride, Py_ssize_t m) {
    fill_blocks_rgbx_sse41(src, affine, blocks, line_stride, 16, m);
}

static int use_sse41; /* set once at import */
#endif

/* One patch's C blocks through the fastest loop for (C, S, p): the loops are specialized for
 * the patch sides of the models served here (14: Qwen2-VL; 16: MiMo-V2.5), in RGB (S = 3) and
 * Pillow's RGBX (S = 4, SIMD when the CPU has SSE4.1); any other shape takes the general loop,
 * which gives the same bits. */
static inline __attribute__((always_inline)) void fill(const uint8_t *restrict src, const float *restrict lut,
                                                       const float *restrict affine,
                                                       float (*restrict blocks)[MAX_BLOCK],
                                                       Py_ssize_t line_stride, Py_ssize_t C, Py_ssize_t S,
                                                       Py_ssize_t p, Py_ssize_t m) {
#ifdef HAVE_X86_SIMD
    if (use_sse41 && C == 3 && S == 4 && p == 14) {
        fill_blocks_rgbx14(src, affine, blocks, line_stride, m);
        return;
    }
    if (use_sse41 && C == 3 && S == 4 && p == 16) {
        fill_blocks_rgbx16(src, affine, blocks, line_stride, m);
        return;
    }
#else
    (void)affine;
#endif
    if (C == 3 && S == 3 && p == 14)
        fill_blocks(src, lut, blocks, line_stride, 3, 3, 14, m);
    else if (C == 3 && S == 3 && p == 16)
        fill_blocks(src, lut, blocks, line_stride, 3, 3, 16, m);
    else if (C == 3 && S == 4 && p == 14)
        fill_blocks(src, lut, blocks, line_stride, 3, 4, 14, m);
    else if (C == 3 && S == 4 && p == 16)
        fill_blocks(src, lut, blocks, line_stride, 3, 4, 16, m);
    else
        fill_blocks(src, lut, blocks, line_stride, C, S, p, m);
}

static void patchify_rows(const uint8_t *restrict frames, const float *restrict lut,
                          const float *restrict affine,
                          float *restrict out, Py_ssize_t T, Py_ssize_t H, Py_ssize_t W,
                          Py_ssize_t C, Py_ssize_t S, Py_ssize_t p, Py_ssize_t m, Py_ssize_t tp) {
    const Py_ssize_t gh = H / p, gw = W / p, gt = (T + tp - 1) / tp;
    const Py_ssize_t pp = p * p, row_len = C * tp * pp;
    const Py_ssize_t frame_stride = H * W * S, line_stride = W * S;
    /* One normalized p x p block per channel, rebuilt when the slot's frame changes. */
    _Alignas(16) float blocks[4][MAX_BLOCK];
    float *row = out;
    for (Py_ssize_t t = 0; t < gt; t++) {
        for (Py_ssize_t bh = 0; bh < gh / m; bh++) {
            for (Py_ssize_t bw = 0; bw < gw / m; bw++) {
                for (Py_ssize_t mi = 0; mi < m; mi++) {
                    for (Py_ssize_t mj = 0; mj < m; mj++, row += row_len) {
                        const Py_ssize_t y0 = (bh * m + mi) * p, x0 = (bw * m + mj) * p;
                        Py_ssize_t prev = -1;
                        for (Py_ssize_t s = 0; s < tp; s++) {
                            const Py_ssize_t f = t * tp + s < T ? t * tp + s : T - 1;
                            if (f != prev) { /* an image repeats its frame: build once */
                                const uint8_t *src = frames + f * frame_stride + y0 * line_stride + x0 * S;
                                fill(src, lut, affine, blocks, line_stride, C, S, p, m);
                                prev = f;
                            }
                            for (Py_ssize_t c = 0; c < C; c++)
                                store_block(row + (c * tp + s) * pp, blocks[c], pp);
                        }
                    }
                }
            }
        }
    }
#ifdef __SSE2__
    _mm_sfence(); /* streaming stores are weakly ordered: publish them before returning */
#endif
}

/* patchify(frames, lut, affine, out, T, H, W, C, S, patch, merge, temporal) -> None
 * S: bytes per pixel in frames (>= C; 4 for RGBX, whose 4th byte is skipped).
 * affine: float32 [2, C], the per-channel scale and bias the lut was computed from (lut[c][v] ==
 * v * scale[c] + bias[c] in float32), for the SIMD path.
 * Buffers are checked for size and contiguity here; the shape arithmetic is the caller's. */
static PyObject *py_patchify(PyObject *self, PyObject *args) {
    Py_buffer frames, lut, affine, out;
    Py_ssize_t T, H, W, C, S, p, m, tp;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnnnnnnn", &frames, &lut, &affine, &out, &T, &H, &W, &C, &S, &p,
                          &m, &tp))
        return NULL;
    PyObject *result = NULL;
    if (T < 1 || H < 1 || W < 1 || C < 1 || C > 4 || S < C || p < 1 || p * p > MAX_BLOCK || m < 1 || tp < 1 ||
        H % (p * m) || W % (p * m)) {
        PyErr_SetString(PyExc_ValueError, "patchify: invalid shape");
    } else if (frames.len != T * H * W * S) {
        PyErr_SetString(PyExc_ValueError, "patchify: frames buffer size does not match T*H*W*S");
    } else if (lut.len != (Py_ssize_t)(C * 256 * sizeof(float))) {
        PyErr_SetString(PyExc_ValueError, "patchify: lut must be C*256 float32");
    } else if (affine.len != (Py_ssize_t)(2 * C * sizeof(float))) {
        PyErr_SetString(PyExc_ValueError, "patchify: affine must be 2*C float32");
    } else if (out.len != (Py_ssize_t)(((T + tp - 1) / tp) * (H / p) * (W / p) * C * tp * p * p *
                                       (Py_ssize_t)sizeof(float))) {
        PyErr_SetString(PyExc_ValueError, "patchify: out buffer size does not match the patch rows");
    } else if (!PyBuffer_IsContiguous(&frames, 'C') || !PyBuffer_IsContiguous(&out, 'C') ||
               !PyBuffer_IsContiguous(&lut, 'C') || !PyBuffer_IsContiguous(&affine, 'C')) {
        PyErr_SetString(PyExc_ValueError, "patchify: buffers must be C-contiguous");
    } else {
        Py_BEGIN_ALLOW_THREADS
        patchify_rows((const uint8_t *)frames.buf, (const float *)lut.buf, (const float *)affine.buf,
                      (float *)out.buf, T, H, W, C, S, p, m, tp);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&frames);
    PyBuffer_Release(&lut);
    PyBuffer_Release(&affine);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"patchify", py_patchify, METH_VARARGS,
     "patchify(frames, lut, affine, out, T, H, W, C, S, patch, merge, temporal): uint8 [T,H,W,S] "
     "(S >= C bytes per pixel, the first C used) -> float32 patch rows, normalized through lut "
     "[C, 256] (affine [2, C]: the scale and bias it was built from); releases the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_patchify", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* EPD_SOURCE_HASH: the hash of this extension's sources, defined by setup.py (epd_common/native.py
   compares it with the tree at import, so a stale build is not used). */
PyMODINIT_FUNC PyInit__patchify(void) {
#ifdef HAVE_X86_SIMD
    __builtin_cpu_init();
    use_sse41 = __builtin_cpu_supports("sse4.1");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_HASH", EPD_SOURCE_HASH) < 0) Py_CLEAR(m);
    return m;
}
