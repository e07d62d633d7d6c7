/* Weight-only int4 and int8 GEMMs on AMX tiles, for kernels/cpu_amx_gemm.py: out = x @ W.T with W's tiles
 * dequantized to bfloat16 in registers one by one, so that a decode step reads the quantized bytes (0.75 per
 * int4 weight with its group's scale and low value, 1 per int8 weight) instead of a bfloat16 copy's two.
 *
 * Semantics (torch twins: kernels.reference.int4_gemm_ref, int8_gemm_ref):
 *
 *     int4:  W[n, k] = bf16(q[n, k] * scale[n, k / 32] + low[n, k / 32])   q in 0..15, float32 math (the
 *                                                                           multiply-add may be fused), rounded
 *            out[m, n] = sum_k bf16(x[m, k]) * W[n, k]
 *     int8:  out[m, n] = scale[n] * sum_k bf16(x[m, k]) * q[n, k]          q in -128..127 (exact in bfloat16)
 *
 * float32 sums and outputs. x: [M, K] float32, rows x_stride floats apart; out: [M, N] float32 contiguous;
 * N % 16 == 0, K % 32 == 0.
 *
 * Layout of `records` (written by kernels/cpu_amx_gemm.py): one record per (16 columns of W, 32 k), i.e. per
 * AMX B tile, whose rows r hold k = 2r, 2r + 1 for each of the 16 columns (VNNI: element e = 2 column + k % 2).
 * - int4, 384 bytes: 256 of nibbles, 16 per row pair (2p, 2p + 1) and half row: bytes 32p + i (elements
 *   0-15) and 32p + 16 + i (elements 16-31) hold row 2p's element | row 2p + 1's element << 4; then the 16
 *   columns' float32 scales and their low values.
 * - int8, 512 bytes: the tile's 16 rows of 32 int8 elements.
 * Records are grouped by work item: columns in groups of GROUP_BLOCKS blocks of 16 (the last group may be
 * smaller), each group's records ordered [k / 32][block], so that one work item reads one sequential stream.
 *
 * Without AMX (no __AMX_TILE__ / __AMX_BF16__ under -march=native) the file builds a stub whose init fails:
 * the caller keeps its other paths.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP_BLOCKS 4

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 0 where this process may use AMX tiles (Linux grants them on request), else nonzero. */
int chorus_amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Tiles 0-3: the C accumulators of a group's column blocks; 4: A (x rows); 5: B (one dequantized record). */
static void configure_tiles(int64_t rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 5; ++t) {
        cfg.rows[t] = (uint8_t)rows;
        cfg.colsb[t] = 64;
    }
    cfg.rows[5] = 16;
    cfg.colsb[5] = 64;
    _tile_loadconfig(&cfg);
}

/* One int4 record to a bfloat16 B tile in VNNI order ([16 rows][32]). */
static inline void dequantize_int4_record(const uint8_t* record, uint16_t* b) {
    const __m512i idx_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i idx_hi = _mm512_add_epi32(idx_lo, _mm512_set1_epi32(8));
    const __m512i mask = _mm512_set1_epi32(0xF);
    const float* sl = (const float*)(record + 256);
    const __m512 scale = _mm512_loadu_ps(sl), low = _mm512_loadu_ps(sl + 16);
    /* elements 0-15 are columns 0-7 (each twice), 16-31 columns 8-15 */
    const __m512 s0 = _mm512_permutexvar_ps(idx_lo, scale), s1 = _mm512_permutexvar_ps(idx_hi, scale);
    const __m512 l0 = _mm512_permutexvar_ps(idx_lo, low), l1 = _mm512_permutexvar_ps(idx_hi, low);
    for (int r = 0; r < 16; r += 2) {
        const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(record + r * 16)));
        const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(record + r * 16 + 16)));
        const __m512 a0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(c0, mask)), s0), l0);
        const __m512 a1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(c1, mask)), s1), l1);
        const __m512 b0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c0, 4)), s0), l0);
        const __m512 b1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c1, 4)), s1), l1);
        _mm512_store_si512((__m512i*)(b + r * 32), (__m512i)_mm512_cvtne2ps_pbh(a1, a0));
        _mm512_store_si512((__m512i*)(b + r * 32 + 32), (__m512i)_mm512_cvtne2ps_pbh(b1, b0));
    }
}

/* One int8 record to a bfloat16 B tile (exact: |q| <= 128). */
static inline void dequantize_int8_record(const uint8_t* record, uint16_t* b) {
    for (int r = 0; r < 16; ++r) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(record + r * 32))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(record + r * 32 + 16))));
        _mm512_store_si512((__m512i*)(b + r * 32), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* The shared loop; `int8` is a constant in each caller, so each gets its own inlined dequantization. */
static inline __attribute__((always_inline)) void amx_gemm(const float* x, int64_t x_stride, const uint8_t* records,
                                                           const float* col_scales, float* out, int64_t M, int64_t N,
                                                           int64_t K, int32_t num_threads, const int int8) {
    const int64_t record_bytes = int8 ? 512 : 384;
    const int64_t KT = K / 32, NB = N / 16, groups = (NB + GROUP_BLOCKS - 1) / GROUP_BLOCKS;
    const int64_t row_blocks = (M + 15) / 16;
    /* x as bfloat16 A tiles: [row_block][k / 32][16 rows][32], rounded to nearest even */
    uint16_t* a = (uint16_t*)aligned_alloc(64, (size_t)(row_blocks * KT * 1024));
    if (a == NULL) return;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t kt = 0; kt < KT; ++kt) {
            const float* src = x + m * x_stride + kt * 32;
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
            _mm512_store_si512((__m512i*)(a + ((m / 16) * KT + kt) * 512 + (m % 16) * 32), (__m512i)v);
        }
#pragma omp parallel num_threads(num_threads)
    {
        /* B tiles of two k steps: a step's records are dequantized while the previous step's multiply, so that
         * a tile load never waits for stores just issued (AMX loads do not forward from the store buffer) */
        uint16_t b[2][GROUP_BLOCKS][16 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < row_blocks * groups; ++item) {
            const int64_t rb = item / groups, g = item % groups;
            const int64_t rows = M - rb * 16 < 16 ? M - rb * 16 : 16;
            const int64_t nb0 = g * GROUP_BLOCKS;
            const int64_t nbs = NB - nb0 < GROUP_BLOCKS ? NB - nb0 : GROUP_BLOCKS;
            configure_tiles(rows);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            const uint8_t* group = records + nb0 * KT * record_bytes;    /* [k / 32][block] records */
            for (int64_t kt = 0; kt <= KT; ++kt) {
                if (kt < KT)                  /* this step's records; the multiply below is the previous step's */
                    for (int64_t j = 0; j < nbs; ++j) {
                        const uint8_t* record = group + (kt * nbs + j) * record_bytes;
                        if (int8)
                            dequantize_int8_record(record, b[kt & 1][j]);
                        else
                            dequantize_int4_record(record, b[kt & 1][j]);
                    }
                if (kt == 0) continue;
                const int64_t prev = kt - 1;
                _tile_loadd(4, a + (rb * KT + prev) * 512, 64);
                uint16_t(*bk)[16 * 32] = b[prev & 1];
                _tile_loadd(5, bk[0], 64);
                _tile_dpbf16ps(0, 4, 5);
                if (nbs > 1) {
                    _tile_loadd(5, bk[1], 64);
                    _tile_dpbf16ps(1, 4, 5);
                }
                if (nbs > 2) {
                    _tile_loadd(5, bk[2], 64);
                    _tile_dpbf16ps(2, 4, 5);
                }
                if (nbs > 3) {
                    _tile_loadd(5, bk[3], 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            float* o = out + rb * 16 * N + nb0 * 16;
            _tile_stored(0, o, N * 4);
            if (nbs > 1) _tile_stored(1, o + 16, N * 4);
            if (nbs > 2) _tile_stored(2, o + 32, N * 4);
            if (nbs > 3) _tile_stored(3, o + 48, N * 4);
            if (col_scales)                   /* int8: each column's scale */
                for (int64_t m = 0; m < rows; ++m)
                    for (int64_t j = 0; j < nbs; ++j) {
                        float* orow = o + m * N + j * 16;
                        _mm512_storeu_ps(orow, _mm512_mul_ps(_mm512_loadu_ps(orow),
                                                             _mm512_loadu_ps(col_scales + (nb0 + j) * 16)));
                    }
        }
        _tile_release();
    }
    free(a);
}

void chorus_int4_amx_gemm(const float* x, int64_t x_stride, const uint8_t* records, float* out, int64_t M, int64_t N,
                          int64_t K, int32_t num_threads) {
    amx_gemm(x, x_stride, records, NULL, out, M, N, K, num_threads, 0);
}

void chorus_int8_amx_gemm(const float* x, int64_t x_stride, const uint8_t* records, const float* scales, float* out,
                          int64_t M, int64_t N, int64_t K, int32_t num_threads) {
    amx_gemm(x, x_stride, records, scales, out, M, N, K, num_threads, 1);
}

#else

int chorus_amx_init(void) { return -1; }

void chorus_int4_amx_gemm(const float* x, int64_t x_stride, const uint8_t* records, float* out, int64_t M, int64_t N,
                          int64_t K, int32_t num_threads) {
    (void)x, (void)x_stride, (void)records, (void)out, (void)M, (void)N, (void)K, (void)num_threads;
}

void chorus_int8_amx_gemm(const float* x, int64_t x_stride, const uint8_t* records, const float* scales, float* out,
                          int64_t M, int64_t N, int64_t K, int32_t num_threads) {
    (void)x, (void)x_stride, (void)records, (void)scales, (void)out, (void)M, (void)N, (void)K, (void)num_threads;
}

#endif
