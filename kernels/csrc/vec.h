/* 8-float vectors (GCC vector extensions: AVX2 or AVX-512 under -march=native, SSE pairs elsewhere) and the
 * exp the CPU kernels share. */
#ifndef CHORUS_VEC_H
#define CHORUS_VEC_H

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 ld8(const float* p) { return *(const v8u*)p; }
static inline void st8(float* p, v8 x) { *(v8u*)p = x; }
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline float hsum8(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* Lane u of the result: the sum of a[u]'s eight lanes (eight horizontal sums in 7 shuffles and adds). */
static inline v8 hsum8x8(const v8* a) {
#define EVEN_ODD(x, y) (__builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) + \
                        __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15))
#define PAIRS(x, y) (__builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + \
                     __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15))
    const v8 s01 = EVEN_ODD(a[0], a[1]), s23 = EVEN_ODD(a[2], a[3]);
    const v8 s45 = EVEN_ODD(a[4], a[5]), s67 = EVEN_ODD(a[6], a[7]);
    const v8 t0 = PAIRS(s01, s23), t1 = PAIRS(s45, s67);
    return __builtin_shufflevector(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15);
#undef EVEN_ODD
#undef PAIRS
}

/* e^x per lane for x <= 0 (softmax weights; 0 below -87, where e^x is under float's normal range):
 * 2^n * 2^f, f in [0, 1). */
static inline v8 exp8(v8 x) {
    const v8 lo = splat8(-87.f);
    const v8i below = x < lo;
    x = (v8)(((v8i)x & ~below) | ((v8i)lo & below));
    const v8 t = x * 1.44269504088896341f;
    v8i n = __builtin_convertvector(t, v8i);                  /* toward zero ... */
    n += (v8i)(__builtin_convertvector(n, v8) > t);           /* ... then down: floor */
    const v8 f = t - __builtin_convertvector(n, v8);
    v8 y = splat8(1.535336188319500e-4f);
    y = y * f + 1.339887440266574e-3f;
    y = y * f + 9.618437357674640e-3f;
    y = y * f + 5.550332471162809e-2f;
    y = y * f + 2.402264791363012e-1f;
    y = y * f + 6.931472028550421e-1f;
    y = y * f + 1.0f;
    return (v8)((v8i)(y * (v8)((n + 127) << 23)) & ~below);
}

static inline float exp1(float x) { return exp8(splat8(x))[0]; }

/* Eight bfloat16 values (the top halves of floats) as floats. */
#ifdef __AVX2__
#include <immintrin.h>
static inline v8 ld8_bf16(const uint16_t* p) {
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#else
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
static inline v8 ld8_bf16(const uint16_t* p) { return (v8)(__builtin_convertvector(*(const v8h*)p, v8i) << 16); }
#endif

#endif
