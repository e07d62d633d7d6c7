/* Decode attention over the paged KV cache, on CPU (a float32 or bfloat16 cache; float32 math), for
 * kernels/cpu_decode_attention.py.
 *
 * Semantics (the torch twin is kernels.reference.paged_attention_ref with one query token per request):
 *
 *     for r in range(num_reqs):                 # request r: one query token at position seq_lens[r] - 1
 *       for h in range(num_heads):              # query head h reads KV head h / (num_heads / num_kv_heads)
 *         keys = slots max(0, seq_lens[r] - window) .. seq_lens[r] - 1 of blocks block_tables[r, :]
 *                (window <= 0: from slot 0; blocks before the window's first are never read)
 *         out[r, h] = softmax(q[r, h] . k_cache[keys, h_kv] * scale) @ v_cache[keys, h_kv]
 *
 * Work: each request's blocks are cut into chunks of chunk_blocks blocks; one work item (request, chunk) reads
 * its blocks once, front to back, for all heads (a block's K or V rows are one contiguous run of memory; the
 * next block is prefetched while one computes), and keeps an online softmax per head: its running max m, sum
 * l and unnormalized output acc go to the scratch buffers. A second pass merges the chunks of each (request, head). Items are spread over OpenMP threads
 * (the process's OpenMP runtime: torch's).
 *
 * Vectors are vec.h's 8 floats; head_dim must be a multiple of 8 and block_size a multiple of 8 (scores are
 * computed 8 slots at a time; the slots of a last block's tail are read but never weighted). exp is vec.h's
 * exp8 (relative error ~2e-7, like expf; 0 below -87).
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define MAX_HEADS 256
#define MAX_BLOCK_SIZE 256

/* One work item: blocks [b0, b1) of a request of seq_len keys, all heads, keys before lo not weighted. q: [H, D];
 * acc: [H, D] (unnormalized output); ml: [H, 2] (running max, sum of weights). D8 = head_dim / 8 (a constant in
 * the specialized copies, so the accumulators live in registers). */
#define DEFINE_CHUNK(NAME, D8_EXPR, T, LOAD)                                                                  \
    static void NAME(const float* q, const T* k_cache, const T* v_cache, const int32_t* block_row,            \
                     int64_t seq_len, int64_t lo, int64_t b0, int64_t b1, int64_t H, int64_t KVH, int64_t D,  \
                     int64_t BS, float scale, float* acc, float* ml) {                                        \
        const int64_t D8 = D8_EXPR, group = H / KVH, tok_stride = KVH * D, blk_stride = BS * KVH * D;         \
        float m[MAX_HEADS], l[MAX_HEADS];                                                                    \
        float s[MAX_BLOCK_SIZE] __attribute__((aligned(32)));                                                \
        for (int64_t h = 0; h < H; ++h) { m[h] = -FLT_MAX; l[h] = 0.f; }                                     \
        memset(acc, 0, sizeof(float) * H * D);                                                              \
        for (int64_t b = b0; b < b1; ++b) {                                                                  \
            const int64_t ntok = (b + 1) * BS <= seq_len ? BS : seq_len - b * BS;                            \
            if (b + 1 < b1) {                               /* the next block, while this one computes */   \
                const char* kn = (const char*)(k_cache + (int64_t)block_row[b + 1] * blk_stride);            \
                const char* vn = (const char*)(v_cache + (int64_t)block_row[b + 1] * blk_stride);            \
                for (int64_t off = 0; off < blk_stride * (int64_t)sizeof(T); off += 64) {                    \
                    __builtin_prefetch(kn + off);                                                            \
                    __builtin_prefetch(vn + off);                                                            \
                }                                                                                            \
            }                                                                                                \
            const int64_t npad = (ntok + 7) / 8 * 8;                                                         \
            const int64_t t0 = lo > b * BS ? lo - b * BS : 0;         /* the window's first slot here */     \
            const T* kb = k_cache + (int64_t)block_row[b] * blk_stride;                                      \
            const T* vb = v_cache + (int64_t)block_row[b] * blk_stride;                                      \
            for (int64_t h = 0; h < H; ++h) {                                                                \
                const float* qh = q + h * D;                                                                 \
                const T* kh = kb + (h / group) * D;                                                          \
                const T* vh = vb + (h / group) * D;                                                          \
                for (int64_t t = 0; t < npad; t += 8) {           /* scores, 8 slots at a time */           \
                    v8 a[8];                                                                                 \
                    for (int u = 0; u < 8; ++u) a[u] = splat8(0.f);                                          \
                    for (int64_t j = 0; j < D8; ++j) {                                                       \
                        const v8 qj = ld8(qh + 8 * j);                                                       \
                        for (int u = 0; u < 8; ++u) a[u] += qj * LOAD(kh + (t + u) * tok_stride + 8 * j);    \
                    }                                                                                        \
                    st8(s + t, hsum8x8(a) * scale);                                                          \
                }                                                                                            \
                for (int64_t t = ntok; t < npad; ++t) s[t] = -FLT_MAX;                                       \
                for (int64_t t = 0; t < t0; ++t) s[t] = -FLT_MAX;                                            \
                float mx = m[h];                                                                             \
                for (int64_t t = 0; t < ntok; ++t) mx = s[t] > mx ? s[t] : mx;                               \
                v8 sum = splat8(0.f);                                                                        \
                for (int64_t t = 0; t < npad; t += 8) {                                                      \
                    const v8 p = exp8(ld8(s + t) - mx);                                                      \
                    st8(s + t, p);                                                                           \
                    sum += p;                                                                                \
                }                                                                                            \
                const float alpha = exp1(m[h] - mx);                                                         \
                m[h] = mx;                                                                                   \
                l[h] = l[h] * alpha + hsum8(sum);                                                              \
                float* ah = acc + h * D;                                                                     \
                v8 o[D8];                                                                                    \
                for (int64_t j = 0; j < D8; ++j) o[j] = ld8(ah + 8 * j) * alpha;                             \
                for (int64_t t = t0; t < ntok; ++t) {   /* only real slots in the window: the tail may be stale */ \
                    const v8 p = splat8(s[t]);                                                               \
                    const T* vt = vh + t * tok_stride;                                                       \
                    for (int64_t j = 0; j < D8; ++j) o[j] += p * LOAD(vt + 8 * j);                           \
                }                                                                                            \
                for (int64_t j = 0; j < D8; ++j) st8(ah + 8 * j, o[j]);                                      \
            }                                                                                                \
        }                                                                                                    \
        for (int64_t h = 0; h < H; ++h) { ml[2 * h] = m[h]; ml[2 * h + 1] = l[h]; }                          \
    }

DEFINE_CHUNK(chunk_d64_f32, 8, float, ld8)
DEFINE_CHUNK(chunk_d128_f32, 16, float, ld8)
DEFINE_CHUNK(chunk_any_f32, D / 8, float, ld8)
DEFINE_CHUNK(chunk_d64_bf16, 8, uint16_t, ld8_bf16)
DEFINE_CHUNK(chunk_d128_bf16, 16, uint16_t, ld8_bf16)
DEFINE_CHUNK(chunk_any_bf16, D / 8, uint16_t, ld8_bf16)

/* One work item's chunk, dispatched on the cache's element type and the head size. */
static void attend_chunk(int cache_bf16, const float* q, const void* k_cache, const void* v_cache,
                         const int32_t* block_row, int64_t seq_len, int64_t lo, int64_t b0, int64_t b1, int64_t H,
                         int64_t KVH, int64_t D, int64_t BS, float scale, float* acc, float* ml) {
#define CALL(FN, T) \
    FN(q, (const T*)k_cache, (const T*)v_cache, block_row, seq_len, lo, b0, b1, H, KVH, D, BS, scale, acc, ml)
    if (cache_bf16) {
        if (D == 64) CALL(chunk_d64_bf16, uint16_t);
        else if (D == 128) CALL(chunk_d128_bf16, uint16_t);
        else CALL(chunk_any_bf16, uint16_t);
    } else {
        if (D == 64) CALL(chunk_d64_f32, float);
        else if (D == 128) CALL(chunk_d128_f32, float);
        else CALL(chunk_any_f32, float);
    }
#undef CALL
}

/* The first key a request of seq_len keys reads under a sliding window (<= 0: none). */
static int64_t window_start(int64_t seq_len, int64_t window) {
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

/* q: [R, H, D], each request's row contiguous, rows q_stride floats apart; k_cache, v_cache: [num_blocks, BS,
 * KVH, D] contiguous, float32 or (cache_bf16) bfloat16; block_tables: [R, *] int32 with row stride bt_stride;
 * seq_lens: [R] int32 (>= 1); out: [R, H, D] contiguous; part_acc: [R * max_chunks, H, D] and part_ml:
 * [R * max_chunks, H, 2] scratch, max_chunks >= every request's chunk count; window: a sliding window's keys
 * (<= 0: none). */
void chorus_decode_attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                             int32_t cache_bf16, const int32_t* block_tables, int64_t bt_stride,
                             const int32_t* seq_lens, float* out, int64_t R, int64_t H, int64_t KVH, int64_t D,
                             int64_t BS, float scale, int64_t chunk_blocks, int64_t max_chunks, float* part_acc,
                             float* part_ml, int32_t num_threads, int64_t window) {
    const int64_t items = R * max_chunks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t r = it / max_chunks, seq_len = seq_lens[r], nblk = (seq_len + BS - 1) / BS;
        const int64_t lo = window_start(seq_len, window);
        const int64_t b0 = lo / BS + (it % max_chunks) * chunk_blocks;
        if (b0 >= nblk) continue;
        const int64_t b1 = b0 + chunk_blocks < nblk ? b0 + chunk_blocks : nblk;
        attend_chunk(cache_bf16, q + r * q_stride, k_cache, v_cache, block_tables + r * bt_stride, seq_len, lo, b0,
                     b1, H, KVH, D, BS, scale, part_acc + it * H * D, part_ml + it * H * 2);
    }
#pragma omp parallel for num_threads(num_threads)
    for (int64_t rh = 0; rh < R * H; ++rh) {              /* merge each (request, head)'s chunks */
        const int64_t r = rh / H, h = rh % H;
        const int64_t nblk = (seq_lens[r] + BS - 1) / BS - window_start(seq_lens[r], window) / BS;
        const int64_t nchunks = (nblk + chunk_blocks - 1) / chunk_blocks;
        float mx = -FLT_MAX, denom = 0.f;
        for (int64_t c = 0; c < nchunks; ++c) {
            const float mc = part_ml[((r * max_chunks + c) * H + h) * 2];
            mx = mc > mx ? mc : mx;
        }
        float* o = out + rh * D;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
        for (int64_t c = 0; c < nchunks; ++c) {
            const int64_t it = r * max_chunks + c;
            const float w = exp1(part_ml[(it * H + h) * 2] - mx);
            const float* pa = part_acc + (it * H + h) * D;
            denom += w * part_ml[(it * H + h) * 2 + 1];
            for (int64_t d = 0; d < D; ++d) o[d] += w * pa[d];
        }
        const float inv = 1.f / denom;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
}
