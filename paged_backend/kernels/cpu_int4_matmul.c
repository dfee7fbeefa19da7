/* Rows times an int4 weight (Q4_1 groups of 32) on a CPU with AVX512-BF16. See cpu_int4_matmul.py for when and why.
 *
 * The weight comes in tiles of 16 output rows: for each pair of inputs (2p, 2p+1), 16 bytes, byte j holding the
 * codes of output row 16t + j for input 2p (low nibble) and 2p + 1 (high nibble); beside them, per tile and
 * group of 32 inputs, the 16 rows' scales and zeros in bf16. A weight is (code - 8) * scale + zero, so a row x
 * times one group of an output row's weights is scale * sum(x * (code - 8)) + zero * sum(x).
 *
 * Each thread takes whole tiles. Per input pair, the 16 rows' codes become one vector of bf16 pairs holding
 * (code - 8) exactly, and one `vdpbf16ps` per input row multiplies them by the row's pair of inputs
 * (broadcast) into that row's group sum: products exact, sums in fp32. At the end of a group each row's
 * sum is scaled and the zero times the row's sum over the group added, in fp32. That is the arithmetic of
 * torch's int4 kernel (fp32 weights, bf16 rows), not of a bf16 weight. The codes stream from memory once per
 * call: with more than ROW_BLOCK rows the first block keeps the tile's code vectors in a per-thread panel
 * for the next blocks, so the widening is paid once per weight, and every lane of every multiply is used
 * whatever the number of rows. */

#include <stdint.h>
#include <stdlib.h>

/* ROW_BLOCK rows take two accumulators each: 24 of the 32 vector registers. */
enum { TILE = 16, GROUP = 32, ROW_BLOCK = 12, PREFETCH_BYTES = 1024 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* 16 bf16 values widened to fp32. */
static inline __m512 load_bf16(const uint16_t *values) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)values)), 16));
}

/* bf16 (code - 8) for code = 0..15, twice: vpermw picks by the low five bits of each 16-bit index. */
static const uint16_t CODE_VALUES[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};

/* The 16 rows' (code - 8) for inputs 2p and 2p + 1, as bf16 pairs, from their 16 bytes of codes. */
static inline __m512i widen_pair(const uint8_t *codes, __m512i code_values) {
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    /* Low nibble to the lane's low 16 bits, high nibble to its high 16 bits: (b | b << 12) & 0x000F000F. */
    __m512i nibbles = _mm512_ternarylogic_epi32(bytes, _mm512_slli_epi32(bytes, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    return _mm512_permutexvar_epi16(nibbles, code_values);
}

/* Where a block of rows gets the tile's code vectors: widened from the codes (and kept in the panel for the
 * next blocks, or not when there are none), or read back from the panel. */
enum source { WIDEN, WIDEN_AND_KEEP, PANEL };

/* out[r, 0..15] for `rows` (1..ROW_BLOCK) rows of x (bf16, `k` inputs each) times one tile; `sums` holds each
 * row's sum over each group of inputs (`k / 32` per row). Inlined with `rows` and `source` constants, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void multiply_block(
        const uint16_t *x, const float *sums, int64_t k, int rows, enum source source, const uint8_t *codes,
        const uint16_t *scales, const uint16_t *zeros, __m512i *panel, uint16_t *out, int64_t n) {
    const __m512i code_values = _mm512_loadu_si512(CODE_VALUES);
    const int32_t *pairs = (const int32_t *)x;  /* a row's inputs 2p and 2p + 1 as one 32-bit word */
    int64_t groups = k / GROUP;
    __m512 total[ROW_BLOCK];
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    for (int64_t group = 0; group < groups; group++) {
        if (source != PANEL) {
            /* Ask for the codes and scales PREFETCH_BYTES ahead (past this tile: the next one's, which follow). */
            const char *ahead = (const char *)(codes + group * 16 * TILE) + PREFETCH_BYTES;
            for (int line = 0; line < 4; line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
            _mm_prefetch((const char *)(scales + group * TILE) + PREFETCH_BYTES / 4, _MM_HINT_T0);
            _mm_prefetch((const char *)(zeros + group * TILE) + PREFETCH_BYTES / 4, _MM_HINT_T0);
        }
        __m512 acc[ROW_BLOCK];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t p = 16 * group; p < 16 * group + 16; p++) {
            __m512i w = source == PANEL ? panel[p] : widen_pair(codes + p * TILE, code_values);
            if (source == WIDEN_AND_KEEP) panel[p] = w;
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)w, (__m512bh)_mm512_set1_epi32(pairs[r * (k / 2) + p]));
        }
        __m512 scale = load_bf16(scales + group * TILE), zero = load_bf16(zeros + group * TILE);
        for (int r = 0; r < rows; r++)
            total[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(sums[r * groups + group]),
                                       _mm512_fmadd_ps(acc[r], scale, total[r]));
    }
    for (int r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(out + r * n), (__m256i)_mm512_cvtneps_pbh(total[r]));
}

static void multiply_rows(const uint16_t *x, const float *sums, int64_t k, int rows, enum source source,
                          const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, __m512i *panel,
                          uint16_t *out, int64_t n) {
    switch (source * 100 + rows) {
#define BLOCK(S, R) case S * 100 + R: multiply_block(x, sums, k, R, S, codes, scales, zeros, panel, out, n); break;
#define BLOCKS(S) BLOCK(S, 1) BLOCK(S, 2) BLOCK(S, 3) BLOCK(S, 4) BLOCK(S, 5) BLOCK(S, 6) \
        BLOCK(S, 7) BLOCK(S, 8) BLOCK(S, 9) BLOCK(S, 10) BLOCK(S, 11) BLOCK(S, 12)
        BLOCKS(WIDEN) BLOCK(WIDEN_AND_KEEP, ROW_BLOCK) BLOCKS(PANEL)
#undef BLOCKS
#undef BLOCK
    }
}

/* sums[r * groups + g]: row r's sum over group g of its inputs, in fp32. */
static void sum_groups(const uint16_t *x, int64_t row, int64_t k, float *sums) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint16_t *values = x + row * k + g * GROUP;
        sums[row * (k / GROUP) + g] = _mm512_reduce_add_ps(_mm512_add_ps(load_bf16(values), load_bf16(values + 16)));
    }
}

int available(void) { return 1; }

/* out [rows, n] (bf16) = x [rows, k] (bf16, contiguous) times the tiled weight (n / 16 tiles; k a multiple of 32):
 * `codes` [n / 16, k / 2, 16] bytes, `scales` and `zeros` [n / 16, k / 32, 16] bf16. Returns 0, or -1 when
 * memory could not be allocated or the shapes are not the kernel's. */
int int4_matmul(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *codes, const uint16_t *scales,
                const uint16_t *zeros, int64_t n, uint16_t *out, int threads) {
    if (rows < 1 || k % GROUP || n % TILE) return -1;
    int64_t tiles = n / TILE, pairs = k / 2, groups = k / GROUP;
    float *sums = malloc(sizeof(float) * (size_t)(rows * groups));
    if (sums == NULL) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) sum_groups(x, r, k, sums);
        /* More rows than a block: the first block keeps the tile's code vectors for the others. */
        __m512i *panel = rows > ROW_BLOCK ? aligned_alloc(64, sizeof(__m512i) * (size_t)pairs) : NULL;
        if (rows > ROW_BLOCK && panel == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (rows > ROW_BLOCK && panel == NULL) continue;
            const uint8_t *tile_codes = codes + t * pairs * TILE;
            const uint16_t *tile_scales = scales + t * groups * TILE, *tile_zeros = zeros + t * groups * TILE;
            for (int64_t r = 0; r < rows; r += ROW_BLOCK) {
                int block = rows - r < ROW_BLOCK ? (int)(rows - r) : ROW_BLOCK;
                enum source source = rows <= ROW_BLOCK ? WIDEN : r == 0 ? WIDEN_AND_KEEP : PANEL;
                multiply_rows(x + r * k, sums + r * groups, k, block, source, tile_codes, tile_scales,
                              tile_zeros, panel, out + r * n + t * TILE, n);
            }
        }
        free(panel);
    }
    free(sums);
    return failed ? -1 : 0;
}

#else

int available(void) { return 0; }

int int4_matmul(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *codes, const uint16_t *scales,
                const uint16_t *zeros, int64_t n, uint16_t *out, int threads) {
    (void)x; (void)rows; (void)k; (void)codes; (void)scales; (void)zeros; (void)n; (void)out; (void)threads;
    return -1;
}

#endif
