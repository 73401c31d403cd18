/*
 * The RMSNorm kernel (see _rms_norm.c), without its Python entry point, so that the decoder-layer
 * kernel (_decoder_layer.c) runs the same code. Include after Python.h and _kernels.h.
 */
#ifndef LLM_CORE_RMS_NORM_H
#define LLM_CORE_RMS_NORM_H

#include <math.h>

static void rms_norm_row(const float *x, const float *w, float *out, Py_ssize_t dim, float eps) {
    const float rstd = 1.0f / sqrtf(dot8(x, x, dim) / (float)dim + eps);
    for (Py_ssize_t i = 0; i < dim; i++) out[i] = w[i] * (x[i] * rstd);
}

/* out = rms_norm(x) row by row, or with residual: sum = x + residual, out = rms_norm(sum). sum may
 * be residual itself (the add in place); out must not alias x, residual or sum. */
static void rms_norm_rows(const float *x, const float *residual, const float *w, float *out, float *sum,
                          Py_ssize_t rows, Py_ssize_t dim, float eps) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        if (residual != NULL) {
            float *sr = sum + r * dim;
            const float *rr = residual + r * dim;
            for (Py_ssize_t i = 0; i < dim; i++) sr[i] = xr[i] + rr[i];
            xr = sr;
        }
        rms_norm_row(xr, w, out + r * dim, dim, eps);
    }
}

#endif
