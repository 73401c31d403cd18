/*
 * JPEG -> RGBX with libjpeg(-turbo), decoded straight into a buffer the caller owns and reuses.
 *
 * Pillow's own decode allocates a fresh image per call and feeds libjpeg through its generic
 * chunked decoder loop; here the whole file is one memory source and the rows land in a buffer
 * that Pillow can map without a copy (`Image.frombuffer("RGBX", ...)`): 4 bytes per pixel is
 * Pillow's layout for RGB. scale_num / 8 picks libjpeg's reduced IDCT; only 8, 4, 2 and 1 have
 * SIMD kernels in libjpeg-turbo (6/8 decodes slower than 8/8), so the caller uses those.
 *
 * Decoder settings are libjpeg's defaults, which are Pillow's too (accurate integer IDCT, fancy
 * chroma upsampling), so an 8/8 decode gives the same pixels as `Image.open(...).convert("RGB")`.
 *
 * This is a fast path, not a validator: every libjpeg error *and warning* (corrupt data,
 * premature end of file, ...) makes decode() raise ValueError, and the caller falls back to the
 * Pillow path, which owns the typed errors for bad input.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h> /* jpeglib.h needs FILE and size_t */
#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr base;
    jmp_buf escape;
    int warnings;
    char message[JMSG_LENGTH_MAX];
} ErrorState;

static void on_error(j_common_ptr cinfo) {
    ErrorState *err = (ErrorState *)cinfo->err;
    err->base.format_message(cinfo, err->message);
    longjmp(err->escape, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    ErrorState *err = (ErrorState *)cinfo->err;
    if (level < 0 && err->warnings++ == 0) err->base.format_message(cinfo, err->message);
}

typedef struct {
    Py_ssize_t height, width;
    int failed; /* 0: ok; 1: libjpeg error or warning (message set); 2: output buffer too small */
} Decoded;

/* Decode `size` bytes at scale_num/8 into `out` (RGBX rows). Runs without the GIL. */
static Decoded decode_rgbx(const unsigned char *data, size_t size, int scale_num, unsigned char *out,
                          Py_ssize_t capacity, ErrorState *err) {
    struct jpeg_decompress_struct cinfo;
    /* volatile: read after longjmp */
    volatile Decoded result = {0, 0, 1};
    JSAMPROW *volatile rows = NULL;
    cinfo.err = jpeg_std_error(&err->base);
    err->base.error_exit = on_error;
    err->base.emit_message = on_message;
    err->warnings = 0;
    err->message[0] = '\0';
    if (setjmp(err->escape)) {
        jpeg_destroy_decompress(&cinfo);
        free(rows);
        return result;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.scale_num = (unsigned int)scale_num;
    cinfo.scale_denom = 8;
    cinfo.out_color_space = JCS_EXT_RGBX; /* from YCbCr, RGB or greyscale; CMYK/YCCK raise */
    jpeg_start_decompress(&cinfo);
    const Py_ssize_t height = cinfo.output_height, width = cinfo.output_width;
    if (cinfo.output_components != 4 || height * width * 4 > capacity) {
        result.failed = 2;
        longjmp(err->escape, 1);
    }
    rows = malloc((size_t)height * sizeof(JSAMPROW));
    if (rows == NULL) {
        snprintf(err->message, sizeof(err->message), "out of memory");
        longjmp(err->escape, 1);
    }
    for (Py_ssize_t y = 0; y < height; y++) rows[y] = out + y * width * 4;
    while (cinfo.output_scanline < cinfo.output_height)
        jpeg_read_scanlines(&cinfo, rows + cinfo.output_scanline, cinfo.output_height - cinfo.output_scanline);
    jpeg_finish_decompress(&cinfo);
    if (err->warnings) longjmp(err->escape, 1);
    result.height = height;
    result.width = width;
    result.failed = 0;
    jpeg_destroy_decompress(&cinfo);
    free(rows);
    return result;
}

/* decode(data, scale_num, out) -> (height, width) of the RGBX written to out[:height*width*4] */
static PyObject *py_decode(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    int scale_num;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iw*", &data, &scale_num, &out)) return NULL;
    PyObject *result = NULL;
    if (scale_num < 1 || scale_num > 8) {
        PyErr_SetString(PyExc_ValueError, "jpeg decode: scale_num must be in 1..8");
    } else if (!PyBuffer_IsContiguous(&out, 'C')) {
        PyErr_SetString(PyExc_ValueError, "jpeg decode: out must be C-contiguous");
    } else {
        ErrorState err;
        Decoded d;
        Py_BEGIN_ALLOW_THREADS
        d = decode_rgbx((const unsigned char *)data.buf, (size_t)data.len, scale_num,
                       (unsigned char *)out.buf, out.len, &err);
        Py_END_ALLOW_THREADS
        if (d.failed == 2)
            PyErr_SetString(PyExc_ValueError, "jpeg decode: out buffer is smaller than the scaled image");
        else if (d.failed)
            PyErr_Format(PyExc_ValueError, "jpeg decode: %s", err.message);
        else
            result = Py_BuildValue("nn", d.height, d.width);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", py_decode, METH_VARARGS,
     "decode(data, scale_num, out) -> (height, width): JPEG bytes to RGBX rows at scale_num/8 "
     "into out; raises ValueError on any libjpeg error or warning; releases the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* EPD_SOURCE_HASH: the hash of this extension's sources, defined by setup.py (epd_common/native.py
   compares it with the tree at import, so a stale build is not used). */
PyMODINIT_FUNC PyInit__jpeg(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_HASH", EPD_SOURCE_HASH) < 0) Py_CLEAR(m);
    return m;
}
