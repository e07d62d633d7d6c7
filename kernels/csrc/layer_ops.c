/* Elementwise layer ops of a CPU step, for kernels/cpu_layer_ops.py: one pass over each row instead of torch's
 * 2-4 kernels with a float32 intermediate each. All float32.
 *
 * Semantics (torch twins: kernels.reference.rms_norm_ref, silu_and_mul_ref and rotary_write_kv_ref):
 *
 *     add_rms_norm:  for t in range(T):
 *                      s = x[t] + residual[t] if residual else x[t]
 *                      if residual: residual[t] = s                           # written back in place
 *                      out[t] = s * rsqrt(mean(s * s) + eps) * weight
 *     silu_mul:      for t in range(T): out[t] = silu(x[t, :d]) * x[t, d:]  # x = gate | up
 *
 * x rows are x_stride floats apart; residual and out rows are contiguous. Rows are spread over OpenMP threads
 * (torch's runtime) only from MIN_ROWS_PER_THREAD rows per thread: below that a parallel region costs more
 * than it saves. rotary_write_kv is at the end of the file.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define MIN_ROWS_PER_THREAD 64

static inline int row_threads(int64_t T, int32_t num_threads) {
    return T >= (int64_t)MIN_ROWS_PER_THREAD * num_threads ? num_threads : 1;
}

void chorus_add_rms_norm(const float* x, int64_t x_stride, float* residual, const float* weight, float eps,
                         float* out, int64_t T, int64_t N, int32_t num_threads) {
#pragma omp parallel for num_threads(row_threads(T, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const float* xr = x + t * x_stride;
        float* orow = out + t * N;
        const float* s = xr;
        float sum_sq = 0.f;
        if (residual) {
            float* rr = residual + t * N;
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t i = 0; i < N; ++i) {
                const float v = xr[i] + rr[i];
                rr[i] = v;
                sum_sq += v * v;
            }
            s = rr;
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t i = 0; i < N; ++i) sum_sq += xr[i] * xr[i];
        }
        const float inv = 1.f / sqrtf(sum_sq / (float)N + eps);
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) orow[i] = s[i] * inv * weight[i];
    }
}

/* silu(g) = g * sigmoid(g), sigmoid from e^-|g| (vec.h's exp takes x <= 0). */
static inline v8 silu8(v8 g) {
    const v8i neg = g < splat8(0.f);
    const v8 e = exp8((v8)((v8i)g | (v8i)splat8(-0.f)));            /* e^-|g|: the sign bit set */
    const v8 one = splat8(1.f), inv = one / (one + e);
    return g * (v8)(((v8i)inv & ~neg) | ((v8i)(e * inv) & neg));      /* sigmoid(g) */
}

void chorus_silu_mul(const float* x, int64_t x_stride, float* out, int64_t T, int64_t d, int32_t num_threads) {
#pragma omp parallel for num_threads(row_threads(T, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const float* gate = x + t * x_stride;
        const float* up = gate + d;
        float* orow = out + t * d;
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) st8(orow + i, silu8(ld8(gate + i)) * ld8(up + i));
        for (; i < d; ++i) orow[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}

/* rotary_write_kv:  for t in range(T):
 *                     rotate q[t] and k[t] in place (neox / rotate-half: for i < rot_dim / 2, with
 *                       c, s = cos[positions[t], i], sin[positions[t], i]:
 *                       x[i], x[i + rot_dim / 2] = x[i] c - x[i + rot_dim / 2] s, x[i + rot_dim / 2] c + x[i] s;
 *                       dims from rot_dim on pass through)
 *                     if slot_mapping[t] >= 0: k_cache[slot], v_cache[slot] = k[t], v[t]   (all KV heads)
 * q: [T, H, D], k and v: [T, KVH, D] float32, each row's heads contiguous, rows q/k/v_stride floats apart;
 * cos, sin: [*, rot_dim / 2] rows cs_stride apart; caches: [num_blocks * block_size, KVH, D], float32 or
 * (cache_bf16) bfloat16, rounded to nearest even. */
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

static inline uint16_t f32_to_bf16(float f) {       /* round to nearest even; NaN stays a (quiet) NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void store_row(void* cache, int cache_bf16, int64_t offset, const float* src, int64_t n) {
    if (cache_bf16) {
        uint16_t* dst = (uint16_t*)cache + offset;
        for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float*)cache + offset, src, sizeof(float) * n);
    }
}

void chorus_rotary_write_kv(float* q, int64_t q_stride, float* k, int64_t k_stride, const float* v, int64_t v_stride,
                            int64_t T, int64_t H, int64_t KVH, int64_t D, const int64_t* positions, const float* cos,
                            const float* sin, int64_t cs_stride, int64_t rot_dim, void* k_cache, void* v_cache,
                            int32_t cache_bf16, const int64_t* slot_mapping, int32_t num_threads) {
    const int64_t half = rot_dim / 2, row = KVH * D;
#pragma omp parallel for num_threads(row_threads(T, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos + positions[t] * cs_stride;
        const float* s = sin + positions[t] * cs_stride;
        rotate_heads(q + t * q_stride, H, D, c, s, half);
        rotate_heads(k + t * k_stride, KVH, D, c, s, half);
        const int64_t slot = slot_mapping[t];
        if (slot >= 0) {
            store_row(k_cache, cache_bf16, slot * row, k + t * k_stride, row);
            store_row(v_cache, cache_bf16, slot * row, v + t * v_stride, row);
        }
    }
}
