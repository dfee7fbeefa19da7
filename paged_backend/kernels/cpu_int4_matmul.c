/* Rows times an int4 weight (Q4_1 groups of 32) on a CPU with AVX512-BF16 (or AVX2, with the rows rounded to
 * integers: at the end). See cpu_int4_matmul.py for when and why.
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

/* Where a block of rows gets the tile's code vectors: widened from the codes (and kept in the panel for the
 * next blocks, or not when there are none), or read back from the panel. */
enum source { WIDEN, WIDEN_AND_KEEP, PANEL };

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

/* What the shared driver below needs from this build: rows per block (the first, and those that read the panel),
 * the panel's vectors per input pair, the rows as multiplied (bf16, read in place) and the floats kept per row and
 * group (its sum). */
#define HAS_KERNEL
enum { BLOCK_ROWS = ROW_BLOCK, PANEL_BLOCK_ROWS = ROW_BLOCK, PANEL_VECTORS = 1, ROWS_COPIED = 0, FLOATS_PER_GROUP = 1, ROW_LEVELS = 0 };
typedef uint16_t row_t;
typedef __m512i panel_t;

static void prepare_row(const uint16_t *x, int64_t row, int64_t k, row_t *copy, float *sums) {
    (void)copy;
    sum_groups(x, row, k, sums);
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <string.h>

/* AVX2: the same layout, with integer products. AVX2 has no bf16 dot product, and widening every code to fp32
 * for fp32 FMAs bound the one-row step (a one-row pass took as long on weights held in the caches). So each call
 * rounds every row to integers per group of 32 inputs, v = round(x * LEVELS / max|x|) (x ~ v * step, step =
 * max|x| / LEVELS in fp32, beside the group's exact fp32 sum), and splits each as v = 128 * high + low (high in
 * -127..127, low in -64..63): two signed bytes. The codes, 0..15 as they are, multiply both by `vpmaddubsw`
 * (unsigned times signed bytes, 32 a time, pairs summed in 16 bits) into exact integer sums, and a group adds
 * scale * step * sum(code * v) + (zero - 8 * scale) * sum(x) in fp32. With LEVELS = 127 * 128 an input is off
 * by at most max|x| / 32512: finer than the bf16 rows of the other build for all but the group's smallest
 * inputs. (One byte per input, as llama.cpp rounds its activations, was faster still at many rows, but moved
 * the default model's logits past the engine's own check against the dense forward.)
 *
 * Per two input pairs, the 16 rows' 32 bytes of codes become two vectors of (code 2p, code 2p + 1) byte pairs:
 * rows 0..7 and 8..15, pair p in the low 128 bits and p + 1 in the high (`vpunpck*bw` work within the halves);
 * a row's four inputs' high (or low) bytes are laid out to match. A 16-bit lane adds the 8 pairs of a group's
 * half: at most 8 * 2 * 15 * 127, no overflow. 16 vector registers: a row takes four accumulators, so a block
 * is two rows (with four, 32 rows took longer). Past the first block, the rows multiply the codes kept widened
 * to int16 by `vpmaddwd` with their values as int16 (the same integer sums; 1.15x faster at 32 rows than
 * repeating the byte products), six rows a block. */
enum { AVX2_ROWS = 2, PANEL_ROWS = 6, LEVELS = 127 * 128 };

static inline __m256 load_bf16x8(const uint16_t *values) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)values)), 16));
}

/* 8 floats rounded to bf16 (to nearest even, as torch rounds; a NaN stays a NaN). */
static inline __m128i to_bf16x8(__m256 values) {
    __m256i bits = _mm256_castps_si256(values);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    rounded = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(values, values, _CMP_UNORD_Q)));
    __m256i high = _mm256_srli_epi32(rounded, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}

/* Input pairs p and p + 1 of the 16 rows (32 bytes of codes) as byte pairs (code 2p, code 2p + 1):
 * w[0] rows 0..7, w[1] rows 8..15, pair p in the low 128 bits and pair p + 1 in the high. */
static inline void widen_pairs(const uint8_t *codes, __m256i *w) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i bytes = _mm256_loadu_si256((const __m256i *)codes);
    __m256i first = _mm256_and_si256(bytes, low), second = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    w[0] = _mm256_unpacklo_epi8(first, second);
    w[1] = _mm256_unpackhi_epi8(first, second);
}

/* A row's inputs 4q..4q + 3 as stored by round_row() (their four high bytes, then their four low ones) laid out
 * against widen_pairs(): parts[0] the high bytes, parts[1] the low, each with inputs (4q, 4q + 1) in every
 * 16-bit lane of the low 128 bits and (4q + 2, 4q + 3) in the high. */
static inline void spread_quad(const int8_t *quad, __m256i *parts) {
    const __m256i high = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    const __m256i low = _mm256_setr_epi8(4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5,
                                         6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7);
    int64_t bytes;
    memcpy(&bytes, quad, sizeof bytes);
    __m256i all = _mm256_set1_epi64x(bytes);
    parts[0] = _mm256_shuffle_epi8(all, high);
    parts[1] = _mm256_shuffle_epi8(all, low);
}

/* 16 lanes of sums (lane j: a row's for pair p in the low half, p + 1 in the high) as the 8 rows' int32 sums. */
static inline __m256i add_halves(__m256i sums) {
    return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(sums)),
                            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(sums, 1)));
}

/* A row's bytes from round_row(): per four inputs their high bytes, then their low ones (2k bytes), then its
 * values as int16 (2k bytes more). */
static inline const int8_t *row_bytes(const int32_t *x, int r, int64_t k) { return (const int8_t *)(x + r * k); }
static inline const int32_t *row_value_pairs(const int32_t *x, int r, int64_t k) {
    return (const int32_t *)(row_bytes(x, r, k) + 2 * k);
}

/* One group's scales and shifted zeros (zero - 8 * scale: the codes are taken as 0..15) for output rows 0..7
 * (half 0) or 8..15 of the tile. */
static inline void load_group(const uint16_t *scales, const uint16_t *zeros, int64_t group, int half, __m256 *scale,
                              __m256 *shifted_zero) {
    *scale = load_bf16x8(scales + group * TILE + 8 * half);
    *shifted_zero = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), *scale, load_bf16x8(zeros + group * TILE + 8 * half));
}

/* A row's total for 8 output rows plus one group: scale * step * products + (zero - 8 * scale) * sum(x), where
 * `shifted_zero` is zero - 8 * scale and `row_steps` the group's (sum, step). */
static inline __m256 add_group(__m256 total, __m256i products, __m256 scale, __m256 shifted_zero, const float *row_steps) {
    return _mm256_fmadd_ps(shifted_zero, _mm256_set1_ps(row_steps[0]),
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), _mm256_mul_ps(scale, _mm256_set1_ps(row_steps[1])),
                                           total));
}

/* out[r, 0..15] for `rows` (1..AVX2_ROWS) rows of x times one tile, widening the tile's codes to byte pairs
 * (and, for WIDEN_AND_KEEP, keeping them widened to int16 in `panel`, two vectors per input pair, for the next
 * blocks); `steps` holds each row's (sum, step) per group. */
static inline __attribute__((always_inline)) void multiply_block(
        const int32_t *x, const float *steps, int64_t k, int rows, enum source source, const uint8_t *codes,
        const uint16_t *scales, const uint16_t *zeros, __m256i *panel, uint16_t *out, int64_t n) {
    int64_t groups = k / GROUP;
    __m256 total[AVX2_ROWS][2];
    for (int r = 0; r < rows; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();
    for (int64_t group = 0; group < groups; group++) {
        const char *ahead = (const char *)(codes + group * 16 * TILE) + PREFETCH_BYTES;
        for (int line = 0; line < 4; line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
        /* Per row, the high and the low bytes' sums for rows 0..7 and 8..15. */
        __m256i high[AVX2_ROWS][2], low[AVX2_ROWS][2];
        for (int r = 0; r < rows; r++) high[r][0] = high[r][1] = low[r][0] = low[r][1] = _mm256_setzero_si256();
        for (int64_t q = 8 * group; q < 8 * group + 8; q++) {  /* input pairs 2q and 2q + 1 */
            __m256i w[2];
            widen_pairs(codes + 2 * q * TILE, w);
            if (source == WIDEN_AND_KEEP)
                for (int half = 0; half < 2; half++) {
                    panel[4 * q + half] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w[half]));
                    panel[4 * q + 2 + half] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w[half], 1));
                }
            for (int r = 0; r < rows; r++) {
                __m256i parts[2];
                spread_quad(row_bytes(x, r, k) + 8 * q, parts);
                for (int half = 0; half < 2; half++) {
                    high[r][half] = _mm256_add_epi16(high[r][half], _mm256_maddubs_epi16(w[half], parts[0]));
                    low[r][half] = _mm256_add_epi16(low[r][half], _mm256_maddubs_epi16(w[half], parts[1]));
                }
            }
        }
        for (int half = 0; half < 2; half++) {
            __m256 scale, zero;
            load_group(scales, zeros, group, half, &scale, &zero);
            for (int r = 0; r < rows; r++) {
                __m256i products = _mm256_add_epi32(_mm256_slli_epi32(add_halves(high[r][half]), 7), add_halves(low[r][half]));
                total[r][half] = add_group(total[r][half], products, scale, zero, steps + 2 * (r * groups + group));
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int half = 0; half < 2; half++) _mm_storeu_si128((__m128i *)(out + r * n + 8 * half), to_bf16x8(total[r][half]));
}

/* The same for `rows` (1..PANEL_ROWS) rows from the panel's int16 codes: per input pair and row, `vpmaddwd`
 * multiplies the 8 output rows' (code 2p, code 2p + 1) by the row's (v 2p, v 2p + 1) into int32 sums. The same
 * integer sums as multiply_block's, in fewer instructions once the codes are widened. */
static inline __attribute__((always_inline)) void multiply_panel_block(
        const int32_t *x, const float *steps, int64_t k, int rows, const uint16_t *scales, const uint16_t *zeros,
        const __m256i *panel, uint16_t *out, int64_t n) {
    int64_t groups = k / GROUP;
    __m256 total[PANEL_ROWS][2];
    for (int r = 0; r < rows; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();
    for (int64_t group = 0; group < groups; group++) {
        __m256i acc[PANEL_ROWS][2];
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int64_t p = 16 * group; p < 16 * group + 16; p++) {
            __m256i w0 = panel[2 * p], w1 = panel[2 * p + 1];
            for (int r = 0; r < rows; r++) {
                __m256i pair = _mm256_set1_epi32(row_value_pairs(x, r, k)[p]);
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, pair));
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, pair));
            }
        }
        for (int half = 0; half < 2; half++) {
            __m256 scale, zero;
            load_group(scales, zeros, group, half, &scale, &zero);
            for (int r = 0; r < rows; r++)
                total[r][half] = add_group(total[r][half], acc[r][half], scale, zero, steps + 2 * (r * groups + group));
        }
    }
    for (int r = 0; r < rows; r++)
        for (int half = 0; half < 2; half++) _mm_storeu_si128((__m128i *)(out + r * n + 8 * half), to_bf16x8(total[r][half]));
}

static void multiply_rows(const int32_t *x, const float *steps, int64_t k, int rows, enum source source,
                          const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, __m256i *panel,
                          uint16_t *out, int64_t n) {
    switch (source * 100 + rows) {
#define BLOCK(S, R) case S * 100 + R: multiply_block(x, steps, k, R, S, codes, scales, zeros, panel, out, n); break;
#define PANEL_BLOCK(R) case PANEL * 100 + R: multiply_panel_block(x, steps, k, R, scales, zeros, panel, out, n); break;
        BLOCK(WIDEN, 1) BLOCK(WIDEN, 2) BLOCK(WIDEN_AND_KEEP, AVX2_ROWS)
        PANEL_BLOCK(1) PANEL_BLOCK(2) PANEL_BLOCK(3) PANEL_BLOCK(4) PANEL_BLOCK(5) PANEL_BLOCK(6)
#undef PANEL_BLOCK
#undef BLOCK
    }
}

static inline float add_lanes(__m256 values) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(values), _mm256_extractf128_ps(values, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

static inline float largest_lane(__m256 values) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(values), _mm256_extractf128_ps(values, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

/* 32 int32 values (four vectors of 8, in order) saturated to bytes, in order. */
static inline __m256i pack_bytes(const __m256i *values) {
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(values[0], values[1]), _mm256_packs_epi32(values[2], values[3]));
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  /* the packs work per half */
}

/* Row `row` of x rounded per group (see above) into its 2k bytes of `rounded` (per four inputs, their high bytes
 * then their low ones), and each group's (fp32 sum, step) into `steps`. */
static void round_row(const uint16_t *x, int64_t row, int64_t k, int32_t *rounded, float *steps) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m256 values[4], sum = _mm256_setzero_ps(), largest = _mm256_setzero_ps();
        for (int part = 0; part < 4; part++) {
            values[part] = load_bf16x8(x + row * k + g * GROUP + 8 * part);
            sum = _mm256_add_ps(sum, values[part]);
            largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, values[part]));
        }
        float most = largest_lane(largest);
        __m256 inverse = _mm256_set1_ps(most > 0.0f ? (float)LEVELS / most : 0.0f);
        __m256i high[4], low[4], v[4];
        for (int part = 0; part < 4; part++) {
            v[part] = _mm256_cvtps_epi32(_mm256_mul_ps(values[part], inverse));
            high[part] = _mm256_srai_epi32(_mm256_add_epi32(v[part], _mm256_set1_epi32(64)), 7);  /* round(v / 128) */
            low[part] = _mm256_sub_epi32(v[part], _mm256_slli_epi32(high[part], 7));
        }
        __m256i highs = pack_bytes(high), lows = pack_bytes(low);
        /* Per four inputs, four high bytes then four low: unpack works per 128-bit half (quads 0, 1, 4, 5 in the
         * first vector, 2, 3, 6, 7 in the second). */
        __m256i first = _mm256_unpacklo_epi32(highs, lows), second = _mm256_unpackhi_epi32(highs, lows);
        int8_t *out = (int8_t *)(rounded + row * k) + 2 * g * GROUP;
        _mm256_storeu_si256((__m256i *)out, _mm256_permute2x128_si256(first, second, 0x20));
        _mm256_storeu_si256((__m256i *)(out + 32), _mm256_permute2x128_si256(first, second, 0x31));
        /* The values as int16, in order (packs work per 128-bit half). */
        int16_t *values16 = (int16_t *)((int8_t *)(rounded + row * k) + 2 * k) + g * GROUP;
        for (int part = 0; part < 4; part += 2)
            _mm256_storeu_si256((__m256i *)(values16 + 8 * part),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(v[part], v[part + 1]), 0xD8));
        steps[2 * (row * (k / GROUP) + g)] = add_lanes(sum);
        steps[2 * (row * (k / GROUP) + g) + 1] = most / (float)LEVELS;
    }
}

/* The driver's needs, as above: each row rounded to four bytes per input (its high and low bytes, and its
 * value as int16), a group's sum and step kept. */
#define HAS_KERNEL
enum { BLOCK_ROWS = AVX2_ROWS, PANEL_BLOCK_ROWS = PANEL_ROWS, PANEL_VECTORS = 2, ROWS_COPIED = 1, FLOATS_PER_GROUP = 2, ROW_LEVELS = LEVELS };
typedef int32_t row_t;
typedef __m256i panel_t;

static void prepare_row(const uint16_t *x, int64_t row, int64_t k, row_t *copy, float *steps) {
    round_row(x, row, k, copy, steps);
}

#endif

#ifdef HAS_KERNEL
int available(void) { return 1; }

/* LEVELS where the rows are rounded to integers per group (the AVX2 build), 0 where they are multiplied as bf16. */
int row_levels(void) { return ROW_LEVELS; }

/* out [rows, n] (bf16) = x [rows, k] (bf16, contiguous) times the tiled weight (n / 16 tiles; k a multiple of 32):
 * `codes` [n / 16, k / 2, 16] bytes, `scales` and `zeros` [n / 16, k / 32, 16] bf16. Returns 0, or -1 when
 * memory could not be allocated or the shapes are not the kernel's. */
int int4_matmul(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *codes, const uint16_t *scales,
                const uint16_t *zeros, int64_t n, uint16_t *out, int threads) {
    if (rows < 1 || k % GROUP || n % TILE) return -1;
    int64_t tiles = n / TILE, pairs = k / 2, groups = k / GROUP;
    float *sums = malloc(sizeof(float) * FLOATS_PER_GROUP * (size_t)(rows * groups));
    /* The rows as this build multiplies them: x itself, or a copy rounded to integers. */
    row_t *copy = ROWS_COPIED ? aligned_alloc(64, (sizeof(row_t) * (size_t)(rows * k) + 63) / 64 * 64) : NULL;
    const row_t *xr = ROWS_COPIED ? copy : (const row_t *)(const void *)x;
    if (sums == NULL || (ROWS_COPIED && copy == NULL)) {
        free(sums);
        free(copy);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) prepare_row(x, r, k, copy, sums);
        /* More rows than a block: the first block keeps the tile's widened codes for the others. */
        panel_t *panel = rows > BLOCK_ROWS ? aligned_alloc(64, sizeof(panel_t) * PANEL_VECTORS * (size_t)pairs) : NULL;
        if (rows > BLOCK_ROWS && panel == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (rows > BLOCK_ROWS && panel == NULL) continue;
            const uint8_t *tile_codes = codes + t * pairs * TILE;
            const uint16_t *tile_scales = scales + t * groups * TILE, *tile_zeros = zeros + t * groups * TILE;
            for (int64_t r = 0, block; r < rows; r += block) {
                enum source source = rows <= BLOCK_ROWS ? WIDEN : r == 0 ? WIDEN_AND_KEEP : PANEL;
                int most = source == PANEL ? PANEL_BLOCK_ROWS : BLOCK_ROWS;
                block = rows - r < most ? rows - r : most;
                multiply_rows(xr + r * k, sums + r * groups * FLOATS_PER_GROUP, k, (int)block, source, tile_codes,
                              tile_scales, tile_zeros, panel, out + r * n + t * TILE, n);
            }
        }
        free(panel);
    }
    free(sums);
    free(copy);
    return failed ? -1 : 0;
}

#else

int available(void) { return 0; }

int row_levels(void) { return 0; }

int int4_matmul(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *codes, const uint16_t *scales,
                const uint16_t *zeros, int64_t n, uint16_t *out, int threads) {
    (void)x; (void)rows; (void)k; (void)codes; (void)scales; (void)zeros; (void)n; (void)out; (void)threads;
    return -1;
}

#endif
