/* The grammar's token bitmask applied to float32 logits in place, for kernels/cpu_token_bitmask.py.
 *
 * Semantics (torch twin: engine.structured_output.bitmask.apply_token_bitmask_torch):
 *
 *     for r in rows:                           # rows[i]: a logits row, masked by bitmask row rows[i]
 *       for v in range(vocab):                 # vocab <= 32 * words
 *         if not (bitmask[r, v / 32] >> (v % 32)) & 1: logits[r, v] = -inf
 *
 * Logits rows are logits_stride floats apart, bitmask rows bitmask_stride int32 words apart. A word of all
 * ones (32 allowed tokens: most of a row inside a JSON string) is skipped and a zero word is 32 stores, so a
 * row costs about its disallowed tokens' stores. Work is cut into (row, WORDS_PER_CHUNK words) chunks spread
 * over OpenMP threads, so a few rows still use every thread.
 */
#include <math.h>
#include <stdint.h>

#define WORDS_PER_CHUNK 256

void chorus_apply_token_bitmask(float* logits, int64_t logits_stride, const int32_t* bitmask,
                                int64_t bitmask_stride, const int64_t* rows, int64_t num_rows, int64_t vocab,
                                int32_t num_threads) {
    const int64_t words = (vocab + 31) / 32;
    const int64_t chunks = (words + WORDS_PER_CHUNK - 1) / WORDS_PER_CHUNK;
    const int64_t total = num_rows * chunks;
    const int threads = total >= 2 * num_threads ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < total; ++item) {
        const int64_t r = rows[item / chunks];
        const int64_t first = (item % chunks) * WORDS_PER_CHUNK;
        const int64_t last = first + WORDS_PER_CHUNK < words ? first + WORDS_PER_CHUNK : words;
        float* row = logits + r * logits_stride;
        const uint32_t* mask = (const uint32_t*)(bitmask + r * bitmask_stride);
        for (int64_t w = first; w < last; ++w) {
            const uint32_t bits = mask[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int64_t n = vocab - base < 32 ? vocab - base : 32;
            float* x = row + base;
            if (bits == 0) {
                for (int64_t j = 0; j < n; ++j) x[j] = -INFINITY;
            } else {
                for (int64_t j = 0; j < n; ++j)
                    if (!((bits >> j) & 1u)) x[j] = -INFINITY;
            }
        }
    }
}
