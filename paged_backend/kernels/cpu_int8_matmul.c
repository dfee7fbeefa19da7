/* A few rows times an int8 weight with one scale per output row, on CPU. See cpu_int8_matmul.py for when and why.
 *
 * With one to four rows the product is a pass over the weight's bytes: each output row's codes are read once,
 * widened to fp32 in registers and multiplied with every input row (kept in fp32, a few KB), so the weight
 * streams from memory once, in order. The output rows are split into one contiguous range per thread of
 * torch's OpenMP runtime (the same libgomp, loaded by torch first). Arithmetic in fp32. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };
enum { MOST_ROWS = 4, PREFETCH_ROWS = 32 };

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* With AVX-512 or AVX2, 16 (8) codes are widened to fp32 per step by intrinsics: the compiler's own
 * vectorisation of these loops widened the codes through several shuffles and ran 3x slower. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *x) { return _mm512_loadu_ps(x); }
static inline vec vcodes(const int8_t *c) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c))); }
static inline vec vfma(vec a, vec b, vec acc) { return _mm512_fmadd_ps(a, b, acc); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *x) { return _mm256_loadu_ps(x); }
static inline vec vcodes(const int8_t *c) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c))); }
static inline vec vfma(vec a, vec b, vec acc) { return _mm256_fmadd_ps(a, b, acc); }
static inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* The sums over i < k of x_r[i] * c_r[i] for r < pairs, where x_r = x + r * x_step and c_r = codes + r * code_step:
 * one input row against several code rows (x_step 0) or several input rows against one code row (code_step 0).
 * Each pair keeps its own vector sum, so the fused multiply-adds of the pairs do not wait on each other. */
static inline void pair_dots(const float *x, int64_t x_step, const int8_t *codes, int64_t code_step, int pairs,
                             int64_t k, float *acc) {
    int64_t i = 0;
#ifdef LANES
    vec a[MOST_ROWS] = {vzero(), vzero(), vzero(), vzero()};
    for (; i + LANES <= k; i += LANES)
        for (int r = 0; r < pairs; r++) a[r] = vfma(vload(x + r * x_step + i), vcodes(codes + r * code_step + i), a[r]);
    for (int r = 0; r < pairs; r++) acc[r] = vsum(a[r]);
#else
    for (int r = 0; r < pairs; r++) acc[r] = 0.0f;
#endif
    for (; i < k; i++)
        for (int r = 0; r < pairs; r++) acc[r] += x[r * x_step + i] * (float)codes[r * code_step + i];
}

/* out [rows, n] (fp32) = x [rows, k] (fp32 or bf16, contiguous) times codes [n, k] (int8, contiguous), each
 * output column j scaled by scales[j] (bf16). rows is 1..MOST_ROWS. Returns 0, or -1 when rows is out of range. */
int int8_matmul(const void *x, int x_dtype, int rows, int64_t k, const int8_t *codes, const uint16_t *scales,
                int64_t n, float *out, int threads) {
    if (rows < 1 || rows > MOST_ROWS) return -1;
    float *xf = malloc(sizeof(float) * (size_t)(rows * k));
    if (xf == NULL) return -1;
    for (int64_t i = 0; i < rows * k; i++)
        xf[i] = x_dtype == DTYPE_BF16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    /* One input row: output rows four at a time (four independent sums), the last few one by one. */
    int64_t quads = rows == 1 ? n / 4 : 0;
#pragma omp parallel num_threads(threads)
    {
        float acc[MOST_ROWS];
#pragma omp for schedule(static)
        for (int64_t q = 0; q < quads; q++) {
#ifdef LANES
            /* Ask for the codes PREFETCH_ROWS rows ahead: left to the hardware's prefetchers, a core's misses
             * in flight reached about half of the memory's rate (1.9 ms for the default model's head against
             * 1.0 ms with this, 2 threads of an AMD EPYC). Prefetching past the end reads nothing. */
            const char *ahead = (const char *)(codes + (4 * q + PREFETCH_ROWS) * k);
            for (int64_t b = 0; b < 4 * k; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
#endif
            pair_dots(xf, 0, codes + 4 * q * k, k, 4, k, acc);
            for (int i = 0; i < 4; i++) out[4 * q + i] = acc[i] * bf16_to_float(scales[4 * q + i]);
        }
#pragma omp for schedule(static)
        for (int64_t j = 4 * quads; j < n; j++) {
#ifdef LANES
            const char *ahead = (const char *)(codes + (j + PREFETCH_ROWS) * k);
            for (int64_t b = 0; b < k; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
#endif
            pair_dots(xf, k, codes + j * k, 0, rows, k, acc);
            float scale = bf16_to_float(scales[j]);
            for (int r = 0; r < rows; r++) out[r * n + j] = acc[r] * scale;
        }
    }
    free(xf);
    return 0;
}
