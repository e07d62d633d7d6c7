/* Elementwise layer ops of a CPU step, for kernels/cpu_layer_ops.py: one pass over each row instead of torch's
 * 3-6 kernels with a float32 intermediate each (casts included). rotary_write_kv is at the end of the file.
 *
 * Semantics (torch twins: kernels.reference.rms_norm_ref, silu_and_mul_ref and rotary_write_kv_ref; float32
 * math, round to nearest even where a bfloat16 is stored):
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

/* rotary_write_kv:  for t in range(T):
 *                     rotate q[t] and k[t] in place (neox / rotate-half: for i < rot_dim / 2, with
 *                       c, s = cos[positions[t], i], sin[positions[t], i]:
 *                       x[i], x[i + rot_dim / 2] = x[i] c - x[i + rot_dim / 2] s, x[i + rot_dim / 2] c + x[i] s;
 *                       dims from rot_dim on pass through)
 *                     if slot_mapping[t] >= 0: k_cache[slot], v_cache[slot] = k[t], v[t]   (all KV heads)
 * q: [T, H, D], k and v: [T, KVH, D] float32, each row's heads contiguous, rows q/k/v_stride floats apart;
 * cos, sin: [*, rot_dim / 2] rows cs_stride apart; caches: [num_blocks * block_size, KVH, D] float32. */
static inline void rotate_heads(float* x, int64_t heads, int64_t D, const float* c, const float* s, int64_t half) {
    for (int64_t h = 0; h < heads; ++h) {
        float* xh = x + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = xh[i], x2 = xh[i + half];
            xh[i] = x1 * c[i] - x2 * s[i];
            xh[i + half] = x2 * c[i] + x1 * s[i];
        }
    }
}

void chorus_rotary_write_kv(float* q, int64_t q_stride, float* k, int64_t k_stride, const float* v, int64_t v_stride,
                            int64_t T, int64_t H, int64_t KVH, int64_t D, const int64_t* positions, const float* cos,
                            const float* sin, int64_t cs_stride, int64_t rot_dim, float* k_cache, float* v_cache,
                            const int64_t* slot_mapping, int32_t num_threads) {
    const int threads = T >= (int64_t)MIN_ROWS_PER_THREAD * num_threads ? num_threads : 1;
    const int64_t half = rot_dim / 2, row = KVH * D;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos + positions[t] * cs_stride;
        const float* s = sin + positions[t] * cs_stride;
        rotate_heads(q + t * q_stride, H, D, c, s, half);
        rotate_heads(k + t * k_stride, KVH, D, c, s, half);
        const int64_t slot = slot_mapping[t];
        if (slot >= 0) {
            memcpy(k_cache + slot * row, k + t * k_stride, sizeof(float) * row);
            memcpy(v_cache + slot * row, v + t * v_stride, sizeof(float) * row);
        }
    }
}
