/*
 * What the llm_core C kernels share: the buffer check of their Python entry points, a dot product,
 * and the AVX2 + FMA helpers. Each kernel compiles its vector code with the AVX2 target attribute
 * and picks it at import when the CPU has AVX2 and FMA, so the extensions build and run on any
 * x86-64 (and, without HAVE_AVX2_PATH, on other CPUs). Include after Python.h.
 */
#ifndef LLM_CORE_KERNELS_H
#define LLM_CORE_KERNELS_H

#include <stdint.h>
#include <string.h>

/* 0 when buf is C-contiguous and expect_len bytes long; else -1 with a ValueError naming the
 * kernel and the argument. */
static int check_buffer(const Py_buffer *buf, const char *kernel, Py_ssize_t expect_len, const char *name) {
    if (!PyBuffer_IsContiguous(buf, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be C-contiguous", kernel, name);
        return -1;
    }
    if (buf->len != expect_len) {
        PyErr_Format(PyExc_ValueError, "%s: %s has %zd bytes, expected %zd", kernel, name, buf->len, expect_len);
        return -1;
    }
    return 0;
}

/* Releases the n buffers an entry point parsed ("y*" / "w*" arguments), e.g.
 * release_buffers((Py_buffer *[]){&x, &out}, 2). */
static inline void release_buffers(Py_buffer *const *bufs, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(bufs[i]);
}

/* sum_i a[i] * b[i] for i < n, in 8 partial sums combined pairwise (a loop the compiler vectorizes
 * at any SIMD level; the order is fixed, so results do not depend on the CPU). */
static inline float dot8(const float *a, const float *b, Py_ssize_t n) {
    float part[8] = {0};
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) part[j] += a[i + j] * b[i + j];
    float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* ---- bfloat16: the top 16 bits of a float32 ------------------------------------------------
 * Weights and KV pages may be stored as bf16 (half the bytes a decode step streams); every
 * product and sum still runs in float32: a bf16 value widens to float32 exactly (a shift). */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Rounded to nearest, ties to even, NaN to the quiet NaN 0x7fc0: torch's .to(torch.bfloat16), so
 * pages the kernels store hold the bits the torch path stores. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of a float32 (bf16 = 0) or bf16 (bf16 = 1) array, as float32. */
static inline float elem_at(const void *base, Py_ssize_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2_PATH 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))

/* [sum(a0), ..., sum(a7)] in one register. */
static inline AVX2 __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                                __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    __m256 u0 = _mm256_hadd_ps(t0, t1); /* [a0..a3 lanes 0-3 | a0..a3 lanes 4-7] */
    __m256 u1 = _mm256_hadd_ps(t2, t3); /* same for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Elements i .. i + 7 of a float32 (bf16 = 0) or bf16 array as float32. Called with a constant
 * bf16 from always-inline code, so each specialisation keeps one load. */
static inline AVX2 __attribute__((always_inline)) __m256 load8(const void *base, Py_ssize_t i, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline AVX2 float hsum(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* e^x for x in [-87.3, 88.7] (clamped outside), within ~2 ulp of expf: x = n ln2 + r, |r| <= ln2 / 2,
 * e^r by a degree-6 polynomial (the classic Cephes coefficients), times 2^n built in the exponent. */
static inline AVX2 __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447505531f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
static inline int cpu_has_avx2(void) { return 0; }
#endif

#endif
