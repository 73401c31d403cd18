/*
 * Loaded before torch (epd_common/mkl_dispatch.py, RTLD_GLOBAL) on AMD CPUs with AVX-512: MKL, which
 * torch's CPU wheels link statically, picks its code path by CPU vendor first and runs its AVX2
 * code on any non-Intel CPU, whatever the CPU supports. It asks through this exported function;
 * the global definition loaded first answers "yes", and MKL then picks its code path from the
 * CPU's features (cpuid) as it does on Intel CPUs. On a Zen 4/5 core its AVX-512 sgemm is ~2x its
 * AVX2 one (docs/performance.md). Nothing else here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

__attribute__((visibility("default"))) int mkl_serv_intel_cpu_true(void) { return 1; }

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mkl_cpu", NULL, -1, NULL, NULL, NULL, NULL, NULL};

/* EPD_SOURCE_HASH: the hash of this extension's sources, defined by setup.py (epd_common/native.py
 * compares it with the tree at load time). */
PyMODINIT_FUNC PyInit__mkl_cpu(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_HASH", EPD_SOURCE_HASH) < 0) Py_CLEAR(m);
    return m;
}
