/* Elementwise layer ops of a CPU decode step, for kernels/cpu_layer_ops.py: one pass over each row instead of
 * torch's 3-6 kernels with a float32 intermediate each (casts included).
 *
 * Semantics (torch twins: kernels.reference.rms_norm_ref and silu_and_mul_ref, float32 math, round to nearest
 * even where a bfloat16 is stored):
 *
 *     add_rms_norm:  for t in range(T):
 *                      s = x[t] + residual[t] if residual else x[t]          # float32
 *                      if residual: residual[t] = s                           # written back in place
 *                      out[t] = s * rsqrt(mean(s * s) + eps) * weight
 *     silu_mul:      for t in range(T): out[t] = silu(x[t, :d]) * x[t, d:]  # x = gate | up
 *
 * x and out are float32 or bfloat16 (flags), rows x_stride / out_stride elements apart; residual and weight
 * are float32 (residual contiguous rows). Rows are spread over OpenMP threads (torch's runtime) when there are
 * enough of them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {       /* round to nearest even; NaN stays a (quiet) NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load(const void* p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void store(void* p, int bf16, int64_t i, float v) {
    if (bf16) ((uint16_t*)p)[i] = f32_to_bf16(v);
    else ((float*)p)[i] = v;
}

/* Rows per thread below which one thread does all: a parallel region costs more than a short row. */
#define MIN_ROWS_PER_THREAD 4

void chorus_add_rms_norm(const void* x, int32_t x_bf16, int64_t x_stride, float* residual, const float* weight,
                         float eps, void* out, int32_t out_bf16, int64_t out_stride, int64_t T, int64_t N,
                         int32_t num_threads) {
    const int threads = T >= (int64_t)MIN_ROWS_PER_THREAD * num_threads ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const void* xr = x_bf16 ? (const void*)((const uint16_t*)x + t * x_stride)
                                : (const void*)((const float*)x + t * x_stride);
        float* rr = residual ? residual + t * N : NULL;
        float sum_sq = 0.f;
        if (rr) {
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t i = 0; i < N; ++i) {
                const float s = load(xr, x_bf16, i) + rr[i];
                rr[i] = s;
                sum_sq += s * s;
            }
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t i = 0; i < N; ++i) {
                const float s = load(xr, x_bf16, i);
                sum_sq += s * s;
            }
        }
        const float inv = 1.f / sqrtf(sum_sq / (float)N + eps);
        void* orow = out_bf16 ? (void*)((uint16_t*)out + t * out_stride) : (void*)((float*)out + t * out_stride);
        if (rr) {
            for (int64_t i = 0; i < N; ++i) store(orow, out_bf16, i, rr[i] * inv * weight[i]);
        } else {
            for (int64_t i = 0; i < N; ++i) store(orow, out_bf16, i, load(xr, x_bf16, i) * inv * weight[i]);
        }
    }
}

void chorus_silu_mul(const void* x, int32_t x_bf16, int64_t x_stride, void* out, int32_t out_bf16,
                     int64_t out_stride, int64_t T, int64_t d, int32_t num_threads) {
    const int threads = T >= (int64_t)MIN_ROWS_PER_THREAD * num_threads ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const void* xr = x_bf16 ? (const void*)((const uint16_t*)x + t * x_stride)
                                : (const void*)((const float*)x + t * x_stride);
        void* orow = out_bf16 ? (void*)((uint16_t*)out + t * out_stride) : (void*)((float*)out + t * out_stride);
        for (int64_t i0 = 0; i0 < d; i0 += 8) {                  /* 8 at a time: vec.h's exp */
            const int64_t n = d - i0 < 8 ? d - i0 : 8;
            float g[8] = {0}, u[8] = {0}, y[8];
            for (int64_t i = 0; i < n; ++i) {
                g[i] = load(xr, x_bf16, i0 + i);
                u[i] = load(xr, x_bf16, d + i0 + i);
            }
            const v8 gv = ld8(g);
            const v8i neg = gv < splat8(0.f);
            const v8 e = exp8((v8)((v8i)gv | (v8i)splat8(-0.f)));            /* e^-|g|: the sign bit set */
            const v8 one = splat8(1.f);
            const v8 sig = (v8)(((v8i)(one / (one + e)) & ~neg) | ((v8i)(e / (one + e)) & neg));  /* sigmoid(g) */
            st8(y, gv * sig * ld8(u));
            for (int64_t i = 0; i < n; ++i) store(orow, out_bf16, i0 + i, y[i]);
        }
    }
}
