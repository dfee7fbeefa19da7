/* Rows times an int8 weight with one scale per output row, or times a 16-bit float weight (fp16 or bf16, no scale),
 * on CPU. See cpu_int8_matmul.py for when and why.
 *
 * With one to four rows the product is a pass over the weight's bytes: each output row's codes are read once,
 * widened to fp32 in registers and multiplied with every input row (kept in fp32, a few KB), so the weight
 * streams from memory once, in order. With more rows the output rows go QUAD at a time: their codes are widened
 * to fp32 once, into a small per-thread panel, and multiplied with the input rows BLOCK_ROWS at a time, twelve
 * sums in flight, so the widening is paid once per weight and the step is bound by the multiply-adds. Every
 * output is the same fp32 sum in the same order either way. The output rows are split between the threads of
 * torch's OpenMP runtime (the same libgomp, loaded by torch first). Arithmetic in fp32. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };
enum { MOST_ROWS = 4, PREFETCH_ROWS = 32, QUAD = 4, BLOCK_ROWS = 3 };

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
    if (exponent == 0) {  /* zero or subnormal: mantissa * 2^-24 */
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | mantissa << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The weight's element type: int8 codes (scaled per output row), or fp16 or bf16 values (unscaled). */
enum { WEIGHT_INT8 = 0, WEIGHT_F16 = 1, WEIGHT_BF16 = 2 };

static inline int64_t weight_size(int kind) { return kind == WEIGHT_INT8 ? 1 : 2; }

static inline float weight_at(const void *w, int64_t i, int kind) {
    if (kind == WEIGHT_INT8) return (float)((const int8_t *)w)[i];
    const uint16_t h = ((const uint16_t *)w)[i];
    return kind == WEIGHT_F16 ? f16_to_float(h) : bf16_to_float(h);
}

/* With AVX-512 or AVX2, 16 (8) codes are widened to fp32 per step by intrinsics: the compiler's own
 * vectorisation of these loops widened the codes through several shuffles and ran 3x slower. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vset(float v) { return _mm512_set1_ps(v); }
static inline vec vload(const float *x) { return _mm512_loadu_ps(x); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vcodes(const int8_t *c) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c))); }
static inline vec vhalves(const uint16_t *h) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)); }
static inline vec vbf16s(const uint16_t *h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
}
#define HAS_HALVES 1
static inline vec vfma(vec a, vec b, vec acc) { return _mm512_fmadd_ps(a, b, acc); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vset(float v) { return _mm256_set1_ps(v); }
static inline vec vload(const float *x) { return _mm256_loadu_ps(x); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vcodes(const int8_t *c) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c))); }
#if defined(__F16C__)
static inline vec vhalves(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)); }
#define HAS_HALVES 1
#endif
static inline vec vbf16s(const uint16_t *h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
}
static inline vec vfma(vec a, vec b, vec acc) { return _mm256_fmadd_ps(a, b, acc); }
static inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#ifdef LANES
/* LANES weights from element i, widened to fp32. `kind` is a constant where the callers are inlined. */
static inline __attribute__((always_inline)) vec vweights(const void *w, int64_t i, int kind) {
#ifdef HAS_HALVES
    if (kind == WEIGHT_F16) return vhalves((const uint16_t *)w + i);
#endif
    if (kind == WEIGHT_BF16) return vbf16s((const uint16_t *)w + i);
    return vcodes((const int8_t *)w + i);
}
#endif

/* Whether this build multiplies fp16 weights with vector conversions (F16C): without them it does not take them. */
int takes_f16(void) {
#ifdef HAS_HALVES
    return 1;
#else
    return 0;
#endif
}

/* The sums over i < k of x_r[i] * c_r[i] for r < pairs, where x_r = x + r * x_step and c_r = codes + r * code_step:
 * one input row against several code rows (x_step 0) or several input rows against one code row (code_step 0).
 * Each pair keeps its own vector sum, so the fused multiply-adds of the pairs do not wait on each other. */
static inline __attribute__((always_inline)) void pair_dots(const float *x, int64_t x_step, const void *codes,
                                                            int64_t code_step, int kind, int pairs, int64_t k,
                                                            float *acc) {
    int64_t i = 0;
#ifdef LANES
    vec a[MOST_ROWS] = {vzero(), vzero(), vzero(), vzero()};
    for (; i + LANES <= k; i += LANES)
        for (int r = 0; r < pairs; r++)
            a[r] = vfma(vload(x + r * x_step + i), vweights(codes, r * code_step + i, kind), a[r]);
    for (int r = 0; r < pairs; r++) acc[r] = vsum(a[r]);
#else
    for (int r = 0; r < pairs; r++) acc[r] = 0.0f;
#endif
    /* The tails as explicit fused multiply-adds here and in quad_dots: left to the compiler, one path's got
     * contracted and the other's not, and a row's outputs changed with the rows beside it. */
    for (; i < k; i++)
        for (int r = 0; r < pairs; r++)
            acc[r] = fmaf(x[r * x_step + i], weight_at(codes, r * code_step + i, kind), acc[r]);
}

/* Weights [QUAD, k] widened to fp32 into `panel` [QUAD, k]. */
static inline __attribute__((always_inline)) void widen_quad(const void *codes, int kind, int64_t k, float *panel) {
    int64_t i = 0;
#ifdef LANES
    for (; i + LANES <= k; i += LANES)
        for (int c = 0; c < QUAD; c++) vstore(panel + c * k + i, vweights(codes, c * k + i, kind));
#endif
    for (; i < k; i++)
        for (int c = 0; c < QUAD; c++) panel[c * k + i] = weight_at(codes, c * k + i, kind);
}

/* sums[r * QUAD + c] = x_r . panel_c for `rows` (1..BLOCK_ROWS) rows of x: per pair one vector sum over the
 * inputs in order, folded at the end, as pair_dots sums them. Inlined with `rows` constant, so the twelve sums
 * stay in registers. */
static inline __attribute__((always_inline)) void quad_dots(const float *x, int rows, int64_t k, const float *panel,
                                                            float *sums) {
    int64_t i = 0;
#ifdef LANES
    vec a[BLOCK_ROWS][QUAD];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < QUAD; c++) a[r][c] = vzero();
    for (; i + LANES <= k; i += LANES)
        for (int c = 0; c < QUAD; c++) {
            vec w = vload(panel + c * k + i);
            for (int r = 0; r < rows; r++) a[r][c] = vfma(vload(x + r * k + i), w, a[r][c]);
        }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < QUAD; c++) sums[r * QUAD + c] = vsum(a[r][c]);
#else
    for (int r = 0; r < rows * QUAD; r++) sums[r] = 0.0f;
#endif
    for (; i < k; i++)
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < QUAD; c++)
                sums[r * QUAD + c] = fmaf(x[r * k + i], panel[c * k + i], sums[r * QUAD + c]);
}

static void quad_block(const float *x, int rows, int64_t k, const float *panel, float *sums) {
    switch (rows) {
    case 1: quad_dots(x, 1, k, panel, sums); break;
    case 2: quad_dots(x, 2, k, panel, sums); break;
    default: quad_dots(x, BLOCK_ROWS, k, panel, sums); break;
    }
}

/* A weight row's scale: its bf16 scale for codes, 1 for float weights (no `scales`). */
static inline float scale_of(const uint16_t *scales, int64_t j) {
    return scales == NULL ? 1.0f : bf16_to_float(scales[j]);
}

/* out[r * n + c] for the QUAD output rows of `codes` [QUAD, k] (scaled by `scales` [QUAD]) and every row of xf:
 * the weights widened once into `panel`, then multiplied with the rows BLOCK_ROWS at a time. Kept out of line:
 * inlined into matmul_of_kind's loop, its twelve sums no longer stayed in registers, and 32 rows of the default
 * model's int8 head took 1.35x as long. */
static __attribute__((noinline)) void multiply_quad(const float *xf, int rows, int64_t k, const void *codes, int kind, const uint16_t *scales,
                          float *panel, float *out, int64_t n) {
    float sums[BLOCK_ROWS * QUAD], scale[QUAD];
    switch (kind) {  /* a constant kind for the inlined widening */
    case WEIGHT_F16: widen_quad(codes, WEIGHT_F16, k, panel); break;
    case WEIGHT_BF16: widen_quad(codes, WEIGHT_BF16, k, panel); break;
    default: widen_quad(codes, WEIGHT_INT8, k, panel); break;
    }
    for (int c = 0; c < QUAD; c++) scale[c] = scale_of(scales, c);
    for (int r = 0; r < rows; r += BLOCK_ROWS) {
        const int block = rows - r < BLOCK_ROWS ? rows - r : BLOCK_ROWS;
        quad_block(xf + r * k, block, k, panel, sums);
        for (int b = 0; b < block; b++)
            for (int c = 0; c < QUAD; c++) out[(r + b) * n + c] = sums[b * QUAD + c] * scale[c];
    }
}

/* out [rows, n] (fp32) = x [rows, k] (fp32 or bf16, contiguous) times w [n, k] (contiguous, of `kind`), each output
 * column j scaled by scales[j] (bf16) where there are scales (NULL: unscaled). Inlined with a constant kind. */
static inline __attribute__((always_inline)) int matmul_of_kind(const void *x, int x_dtype, int rows, int64_t k,
                                                                const void *w, int kind, const uint16_t *scales,
                                                                int64_t n, float *out, int threads) {
    if (rows < 1) return -1;
    float *xf = malloc(sizeof(float) * (size_t)(rows * k));
    if (xf == NULL) return -1;
    for (int64_t i = 0; i < rows * k; i++)
        xf[i] = x_dtype == DTYPE_BF16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    const char *bytes = (const char *)w;
    const int64_t row_bytes = k * weight_size(kind);
    /* Output rows QUAD at a time: for one input row, four independent sums; past MOST_ROWS rows, through the
     * panel. The output rows left over (all of them for 2..MOST_ROWS rows) one by one, MOST_ROWS rows at a time. */
    const int many = rows > MOST_ROWS;
    const int64_t quads = rows == 1 || many ? n / QUAD : 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float acc[MOST_ROWS];
        float *panel = many ? malloc(sizeof(float) * QUAD * (size_t)k) : NULL;
        if (many && panel == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t q = 0; q < quads; q++) {
            const int64_t j = QUAD * q;
            if (many) {
                if (panel != NULL)
                    multiply_quad(xf, rows, k, bytes + j * row_bytes, kind, scales == NULL ? NULL : scales + j, panel,
                                  out + j, n);
                continue;
            }
#ifdef LANES
            /* Ask for the weights PREFETCH_ROWS rows ahead: left to the hardware's prefetchers, a core's misses
             * in flight reached about half of the memory's rate (1.9 ms for the default model's head against
             * 1.0 ms with this, 2 threads of an AMD EPYC). Prefetching past the end reads nothing. */
            const char *ahead = bytes + (j + PREFETCH_ROWS) * row_bytes;
            for (int64_t b = 0; b < QUAD * row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
#endif
            pair_dots(xf, 0, bytes + j * row_bytes, k, kind, QUAD, k, acc);
            for (int c = 0; c < QUAD; c++) out[j + c] = acc[c] * scale_of(scales, j + c);
        }
        free(panel);
#pragma omp for schedule(static)
        for (int64_t j = QUAD * quads; j < n; j++) {
#ifdef LANES
            const char *ahead = bytes + (j + PREFETCH_ROWS) * row_bytes;
            for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
#endif
            const float scale = scale_of(scales, j);
            for (int r = 0; r < rows; r += MOST_ROWS) {
                const int block = rows - r < MOST_ROWS ? rows - r : MOST_ROWS;
                pair_dots(xf + r * k, k, bytes + j * row_bytes, 0, kind, block, k, acc);
                for (int b = 0; b < block; b++) out[(r + b) * n + j] = acc[b] * scale;
            }
        }
    }
    free(xf);
    return failed ? -1 : 0;
}

/* out [rows, n] (fp32) = x [rows, k] (fp32 or bf16, contiguous) times codes [n, k] (int8, contiguous), each
 * output column j scaled by scales[j] (bf16). Returns 0, or -1 when rows is out of range or memory could not be
 * allocated. */
int int8_matmul(const void *x, int x_dtype, int rows, int64_t k, const int8_t *codes, const uint16_t *scales,
                int64_t n, float *out, int threads) {
    return matmul_of_kind(x, x_dtype, rows, k, codes, WEIGHT_INT8, scales, n, out, threads);
}

/* The same for a 16-bit float weight [n, k] (WEIGHT_F16 or WEIGHT_BF16), unscaled: out = x times w^T, each output
 * the fp32 sum of the products of the rows as given and the weight's exact values. -1 as above, or for a kind this
 * build does not take (fp16 without F16C). */
int half_matmul(const void *x, int x_dtype, int rows, int64_t k, const uint16_t *w, int kind, int64_t n, float *out,
                int threads) {
    if (kind == WEIGHT_F16 && takes_f16())
        return matmul_of_kind(x, x_dtype, rows, k, w, WEIGHT_F16, NULL, n, out, threads);
    if (kind == WEIGHT_BF16) return matmul_of_kind(x, x_dtype, rows, k, w, WEIGHT_BF16, NULL, n, out, threads);
    return -1;
}

/* A checkpoint's 8-bit weight, `(codes - zeros) * scales` group by group along the inputs: codes int8, uint8 or
 * fp8 (e4m3fn), one fp32 scale (and zero point) per output row and group of `group` inputs. Each output row's
 * codes are read once per MOST_ROWS input rows, widened in registers and multiplied with the rows in fp32; a
 * group's sums are scaled as they close, and its zero point is taken off as zero * scale * (the group's sum of
 * the row's inputs). An fp8 byte 0x7f or 0xff (e4m3fn's NaN) reads as +-480: checkpoints hold finite weights. */
enum { CODES_INT8 = 0, CODES_UINT8 = 1, CODES_FP8 = 2 };

static float fp8_to_float(uint8_t c) {
    /* e4m3fn: exponent bias 7, no infinities; exponent 0 holds the subnormals m / 8 * 2^-6. */
    const uint32_t exponent = (c >> 3) & 15, mantissa = c & 7;
    float magnitude = (float)mantissa / 512.0f;
    if (exponent) {
        const uint32_t bits = (exponent + 120) << 23 | mantissa << 20;
        memcpy(&magnitude, &bits, sizeof magnitude);
    }
    return c & 0x80 ? -magnitude : magnitude;
}

static inline float code_value(const uint8_t *codes, int64_t i, int kind) {
    if (kind == CODES_INT8) return (float)((const int8_t *)codes)[i];
    return kind == CODES_UINT8 ? (float)codes[i] : fp8_to_float(codes[i]);
}

#if defined(LANES) && defined(__F16C__)
/* LANES codes widened to fp32. An e4m3fn byte's bits shifted into an fp16's are the same number times 2^-8
 * (subnormals included: fp16 keeps e4m3's 3 mantissa bits and 8 more exponent steps below), so fp16's own
 * conversion and one multiply widen it. */
static inline vec vcodes_of(const uint8_t *codes, int kind) {
    if (kind == CODES_INT8) return vcodes((const int8_t *)codes);
#if LANES == 16
    if (kind == CODES_UINT8) return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes)));
    const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)codes));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
#else
    if (kind == CODES_UINT8) return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes)));
    const __m128i wide = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)codes));
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x7f)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
#endif
}
#define GROUP_LANES LANES
#endif

/* The weight above, as pair_dots takes pairs: acc[p] = x_p . w_p for p < pairs (1..MOST_ROWS), x_p = x + p * x_step,
 * w_p the weight row of codes + p * code_step with scales and zeros + p * group_step (`groups` each); `xsums` + p *
 * xsum_step the row's input sums per group where there are zero points. One input row against several weight rows
 * (x_step 0) or several input rows against one (code_step and group_step 0): each pair keeps its own sums, so the
 * multiply-adds of the pairs do not wait on each other, and a pair's sums are the same in either arrangement. */
static inline __attribute__((always_inline)) void group_dots(
        const float *x, int64_t x_step, const uint8_t *codes, int64_t code_step, int kind, const float *scales,
        const float *zeros, int64_t group_step, const float *xsums, int64_t xsum_step, int pairs, int64_t k,
        int64_t group, int64_t groups, float *acc) {
    float tail[MOST_ROWS];
    for (int p = 0; p < pairs; p++) acc[p] = 0.0f;
#ifdef GROUP_LANES
    vec total[MOST_ROWS] = {vzero(), vzero(), vzero(), vzero()};
#endif
    for (int64_t g = 0; g < groups; g++) {
        const int64_t end = (g + 1) * group < k ? (g + 1) * group : k;
        int64_t i = g * group;
#ifdef GROUP_LANES
        vec part[MOST_ROWS] = {vzero(), vzero(), vzero(), vzero()};
        for (; i + GROUP_LANES <= end; i += GROUP_LANES)
            for (int p = 0; p < pairs; p++)
                part[p] = vfma(vload(x + p * x_step + i), vcodes_of(codes + p * code_step + i, kind), part[p]);
        for (int p = 0; p < pairs; p++) total[p] = vfma(part[p], vset(scales[p * group_step + g]), total[p]);
#endif
        if (i == end) continue;  /* the group's inputs fill whole vectors */
        /* Fused multiply-adds by name: left to the compiler, whether a product is contracted into its sum depended
         * on how this was inlined, and a row's sums differed alone and among others. */
        for (int p = 0; p < pairs; p++) tail[p] = 0.0f;
        for (; i < end; i++)
            for (int p = 0; p < pairs; p++)
                tail[p] = fmaf(x[p * x_step + i], code_value(codes + p * code_step, i, kind), tail[p]);
        for (int p = 0; p < pairs; p++) acc[p] = fmaf(tail[p], scales[p * group_step + g], acc[p]);
    }
#ifdef GROUP_LANES
    for (int p = 0; p < pairs; p++) acc[p] += vsum(total[p]);
#endif
    /* The zero points, after the groups: acc -= sum over groups of zero * scale * (the group's input sum). */
    if (zeros != NULL)
        for (int p = 0; p < pairs; p++) {
            float offset = 0.0f;
            for (int64_t g = 0; g < groups; g++)
                offset = fmaf(zeros[p * group_step + g] * scales[p * group_step + g], xsums[p * xsum_step + g], offset);
            acc[p] -= offset;
        }
}

/* group_dots inlined with `pairs` and `kind` constant, so the sums stay in registers and the widening is chosen
 * once. */
static void group_block(const float *x, int64_t x_step, const uint8_t *codes, int64_t code_step, int kind,
                        const float *scales, const float *zeros, int64_t group_step, const float *xsums,
                        int64_t xsum_step, int pairs, int64_t k, int64_t group, int64_t groups, float *acc) {
#define PAIRS(P, KIND) group_dots(x, x_step, codes, code_step, KIND, scales, zeros, group_step, xsums, xsum_step, P, \
                                  k, group, groups, acc)
#define KINDS(P) switch (kind) { case CODES_INT8: PAIRS(P, CODES_INT8); break; \
                                 case CODES_UINT8: PAIRS(P, CODES_UINT8); break; default: PAIRS(P, CODES_FP8); }
    switch (pairs) {
    case 1: KINDS(1); break;
    case 2: KINDS(2); break;
    case 3: KINDS(3); break;
    default: KINDS(MOST_ROWS); break;
    }
#undef KINDS
#undef PAIRS
}

/* out [rows, n] (fp32) = x [rows, k] (fp32 or bf16, contiguous) times the weight above: `codes` [n, k] (one byte
 * each, of `kind`), `scales` and `zeros` [n, groups] (fp32; zeros NULL where there are none), groups of `group`
 * inputs (the last may be short). Returns 0, or -1 when rows or kind is out of range or memory could not be
 * allocated. */
int codes_matmul(const void *x, int x_dtype, int rows, int64_t k, const uint8_t *codes, int kind, const float *scales,
                 const float *zeros, int64_t group, int64_t n, float *out, int threads) {
    if (rows < 1 || kind < CODES_INT8 || kind > CODES_FP8 || group < 1) return -1;
    const int64_t groups = (k + group - 1) / group;
    float *xf = malloc(sizeof(float) * (size_t)(rows * k));
    float *xsums = zeros != NULL ? calloc((size_t)(rows * groups), sizeof(float)) : NULL;
    if (xf == NULL || (zeros != NULL && xsums == NULL)) {
        free(xf);
        free(xsums);
        return -1;
    }
    for (int64_t i = 0; i < rows * k; i++)
        xf[i] = x_dtype == DTYPE_BF16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    if (xsums != NULL)
        for (int r = 0; r < rows; r++)
            for (int64_t i = 0; i < k; i++) xsums[r * groups + i / group] += xf[r * k + i];
    /* One input row: output rows QUAD at a time, four independent sums; the output rows left over, and every
     * output row of several input rows, one by one against MOST_ROWS input rows at a time. */
    const int64_t quads = rows == 1 ? n / QUAD : 0;
#pragma omp parallel num_threads(threads)
    {
        float acc[MOST_ROWS];
#pragma omp for schedule(static)
        for (int64_t q = 0; q < quads; q++) {
            const int64_t j = QUAD * q;
#ifdef LANES
            const char *ahead = (const char *)(codes + (j + PREFETCH_ROWS) * k);
            for (int64_t b = 0; b < QUAD * k; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
#endif
            group_block(xf, 0, codes + j * k, k, kind, scales + j * groups, zeros != NULL ? zeros + j * groups : NULL,
                        groups, xsums, 0, QUAD, k, group, groups, acc);
            for (int c = 0; c < QUAD; c++) out[j + c] = acc[c];
        }
#pragma omp for schedule(static)
        for (int64_t j = QUAD * quads; j < n; j++) {
#ifdef LANES
            const char *ahead = (const char *)(codes + (j + PREFETCH_ROWS) * k);
            for (int64_t b = 0; b < k; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
#endif
            for (int r = 0; r < rows; r += MOST_ROWS) {
                const int block = rows - r < MOST_ROWS ? rows - r : MOST_ROWS;
                group_block(xf + r * k, k, codes + j * k, 0, kind, scales + j * groups,
                            zeros != NULL ? zeros + j * groups : NULL, 0, xsums != NULL ? xsums + r * groups : NULL,
                            groups, block, k, group, groups, acc);
                for (int b = 0; b < block; b++) out[(r + b) * n + j] = acc[b];
            }
        }
    }
    free(xf);
    free(xsums);
    return 0;
}

/* Several rows (up to any number) on a CPU with AVX512-BF16: the codes tiled 16 output rows at a time,
 * `tiled` [n / 16, k / 2, 16, 2] (output row 16t + j's codes for inputs 2p and 2p + 1 side by side). Per input
 * pair, the 16 rows' codes become one vector of bf16 pairs (exact: |code| <= 127 fits bf16's 8 bits), and one
 * `vdpbf16ps` per input row multiplies them with the row's pair of inputs (broadcast): products exact, sums in
 * fp32, the scale applied at the end, as above. The rows go in blocks of TILED_ROWS, each block a pass over the
 * codes, so the widening is paid once per block, not per row. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
enum { TILE = 16, TILED_ROWS = 16, TILED_PREFETCH_BYTES = 1024 };

static inline __m512bh widen_tiled_pair(const int8_t *codes) {
    __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
    __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16))));
    return _mm512_cvtne2ps_pbh(high, low);  /* 16-bit word 2j + i: row j's code for input 2p + i */
}

static inline __attribute__((always_inline)) void multiply_tiled_block(
        const uint16_t *x, int64_t k, int rows, const int8_t *codes, const uint16_t *scales, float *out, int64_t n) {
    __m512 acc[TILED_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const int32_t *pairs = (const int32_t *)x;  /* a row's inputs 2p and 2p + 1 as one 32-bit word */
    for (int64_t p = 0; p < k / 2; p++) {
        if (p % 2 == 0) _mm_prefetch((const char *)(codes + 2 * TILE * p) + TILED_PREFETCH_BYTES, _MM_HINT_T0);
        __m512bh w = widen_tiled_pair(codes + 2 * TILE * p);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_set1_epi32(pairs[r * (k / 2) + p]));
    }
    __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)scales)), 16));
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * n, _mm512_mul_ps(acc[r], scale));
}

static void multiply_tiled_rows(const uint16_t *x, int64_t k, int rows, const int8_t *codes, const uint16_t *scales,
                                float *out, int64_t n) {
    switch (rows) {
#define BLOCK(R) case R: multiply_tiled_block(x, k, R, codes, scales, out, n); break;
        BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8)
        BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12) BLOCK(13) BLOCK(14) BLOCK(15) BLOCK(16)
#undef BLOCK
    }
}

int tiled_available(void) { return 1; }

/* out [rows, n] (fp32) = x [rows, k] (bf16, contiguous) times the tiled codes (n a multiple of 16, k even), each
 * output column j scaled by scales[j] (bf16). Returns 0, or -1 when the shapes are not the kernel's. */
int int8_matmul_tiled(const uint16_t *x, int64_t rows, int64_t k, const int8_t *tiled, const uint16_t *scales,
                      int64_t n, float *out, int threads) {
    if (rows < 1 || k % 2 || n % TILE) return -1;
    for (int64_t r = 0; r < rows; r += TILED_ROWS) {
        int block = rows - r < TILED_ROWS ? (int)(rows - r) : TILED_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < n / TILE; t++)
            multiply_tiled_rows(x + r * k, k, block, tiled + t * TILE * k, scales + t * TILE, out + r * n + t * TILE, n);
    }
    return 0;
}
#else
int tiled_available(void) { return 0; }

int int8_matmul_tiled(const uint16_t *x, int64_t rows, int64_t k, const int8_t *tiled, const uint16_t *scales,
                      int64_t n, float *out, int threads) {
    (void)x; (void)rows; (void)k; (void)tiled; (void)scales; (void)n; (void)out; (void)threads;
    return -1;
}
#endif
