/* Paged attention of a packed batch on CPU: every selected sequence's few query rows over its context, read
 * from the paged cache by block table, in one call. See cpu_paged_attention.py for when and why.
 *
 * One work item is one (sequence, KV head): its group of query heads times the sequence's n rows, R rows in
 * all, attend together, so each key and value row is read from the cache and widened to fp32 once for all R
 * rows. Keys are taken one cache block at a time with an online softmax (a running max and sum per row), so
 * nothing of the context is gathered or copied. Items are shared by the threads of torch's OpenMP runtime
 * (the same libgomp, loaded by torch first), one at a time, as context lengths differ. Arithmetic in fp32. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_I8 = 2 };

/* Mirrored by cpu_paged_attention.Arguments (ctypes): keep the two in the same order. */
typedef struct {
    const void *query;          /* [T, H, D], contiguous */
    int query_dtype;            /* DTYPE_F32 or DTYPE_BF16; the output has the same */
    void *key_cache;            /* [KVH, slots, D]: heads apart by cache_head_stride, rows contiguous */
    void *value_cache;
    int cache_dtype;
    int64_t cache_head_stride;  /* elements */
    const float *key_scales;    /* DTYPE_I8 only: [KVH, slots], heads apart by scale_head_stride */
    const float *value_scales;
    int64_t scale_head_stride;
    const int32_t *block_tables; /* [num_seqs_in_step, max_blocks] */
    int max_blocks;
    int block_size;
    const int32_t *query_start; /* [num_seqs_in_step + 1]: sequence i owns query rows [start[i], start[i + 1]) */
    const int32_t *seq_lens;    /* context + new tokens per sequence */
    const int32_t *seqs;        /* the sequences to attend */
    int num_seqs;
    int heads, kv_heads, head_dim;
    float scale;
    int window;                 /* > 0: a query at p sees keys > p - window */
    int chunk;                  /* > 0: a query at p sees keys >= p - p % chunk */
    float softcap;              /* > 0: scores become softcap * tanh(score / softcap) */
    const float *sinks;         /* [H] or NULL: a logit per head that joins the softmax with no value */
    const float *alibi_slopes;  /* [H] or NULL: adds slope * (key position - query position) */
    void *out;                  /* [T, H, D], contiguous */
    int threads;
    /* The step's new keys and values, stored into the cache before anything is read (NULL: already stored):
     * [T, KVH, D] in the cache's dtype, rows contiguous, tokens and heads apart by their strides (elements),
     * each token at its slot in `slot_mapping` [T] (a negative slot is not stored). */
    const void *new_key;
    const void *new_value;
    int64_t key_token_stride, key_head_stride, value_token_stride, value_head_stride;
    const int64_t *slot_mapping;
    int num_tokens;
} Arguments;

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's cast does; a NaN stays a NaN. */
static uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* exp(x) for x <= 0 (every argument here is a score minus the running max), as a polynomial the compiler
 * vectorises where libm's expf is a scalar call. Cephes' expf: about 1 ulp; below -87 it returns 2^-126 ~ 0. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* Row `row` of a [.., D] tensor of `dtype` (times its scale for int8) into fp32 `dst`. */
static inline void load_row(const void *base, int dtype, int64_t row, int d, const float *scales, int64_t scale_row,
                            float *restrict dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)base + row * d;
#pragma omp simd
        for (int i = 0; i < d; i++) dst[i] = bf16_to_float(src[i]);
    } else if (dtype == DTYPE_I8) {
        const int8_t *src = (const int8_t *)base + row * d;
        float s = scales[scale_row];
#pragma omp simd
        for (int i = 0; i < d; i++) dst[i] = (float)src[i] * s;
    } else {
        memcpy(dst, (const float *)base + row * d, sizeof(float) * d);
    }
}

/* Keys are taken LANES at a time: a chunk of up to LANES consecutive positions of one cache block, widened
 * to fp32 once for all the item's rows, which are scored and summed in tiles of TILE rows (that many
 * independent sums in flight). GCC's vector extensions lower to AVX-512, AVX2 or SSE. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8 /* a vector of 16 floats would be two AVX2 registers, spilled as the tiles' sums grow */
#endif
#define TILE 4
#define AHEAD_CHUNKS 2
typedef float lanes_t __attribute__((vector_size(LANES * sizeof(float))));

static inline lanes_t load_lanes(const float *p) { lanes_t v; memcpy(&v, p, sizeof v); return v; }
static inline void store_lanes(float *p, lanes_t v) { memcpy(p, &v, sizeof v); }

/* Asks for rows [row, row + count) of a [.., D] cache ahead of use: a chunk's rows lie in one block, the next
 * chunk's often in another block anywhere in the pool, where the hardware's prefetcher would not look. */
static inline void prefetch_rows(const void *base, int64_t row, int count, int row_bytes) {
    const char *first = (const char *)base + row * row_bytes, *end = first + (int64_t)count * row_bytes;
    for (const char *line = first; line < end; line += 64) __builtin_prefetch(line, 0, 3);
}

/* Per-thread working memory of one item, sized for the largest item of the call; rows are padded to a whole
 * number of lanes (`width`), the padding zero. */
typedef struct {
    int width;     /* head_dim rounded up to LANES */
    float *q;      /* [R, width] the query rows, times the scale */
    float *acc;    /* [R, width] running weighted sums of values */
    float *max;    /* [R] running max score */
    float *sum;    /* [R] running sum of exp(score - max) */
    float *p;      /* [R, LANES] the chunk's scores, then their weights */
    float *keys;   /* [LANES, width] the chunk's keys */
    float *values; /* [LANES, width] */
    int *first, *last; /* [R] each row's keys in the context */
} Scratch;

static Scratch make_scratch(int rows, int d, void **owner) {
    Scratch s;
    s.width = (d + LANES - 1) / LANES * LANES;
    size_t floats = (size_t)rows * s.width * 2 + (size_t)rows * (2 + LANES) + (size_t)s.width * 2 * LANES;
    char *memory = calloc(floats * sizeof(float) + (size_t)rows * 2 * sizeof(int), 1);
    *owner = memory;
    s.q = (float *)memory;
    s.acc = s.q + (size_t)rows * s.width;
    s.max = s.acc + (size_t)rows * s.width;
    s.sum = s.max + rows;
    s.p = s.sum + rows;
    s.keys = s.p + (size_t)rows * LANES;
    s.values = s.keys + (size_t)s.width * LANES;
    s.first = (int *)(s.values + (size_t)LANES * s.width);
    s.last = s.first + rows;
    return s;
}

static inline float sum_lanes(lanes_t v) {
#if LANES == 16
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
#else
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
#endif
    return v[0] + v[1];
}

/* Scores of `tile` query rows (from row r) against the chunk's `count` keys, into s.p: per key, one vector of
 * partial sums per row, summed across its lanes once. */
static inline __attribute__((always_inline)) void score_tile(Scratch s, int r, int tile, int count) {
    for (int t = 0; t < count; t++) {
        lanes_t sums[TILE] = {0};
        for (int c = 0; c < s.width; c += LANES) {
            lanes_t k = load_lanes(s.keys + (size_t)t * s.width + c);
            for (int j = 0; j < tile; j++) sums[j] += load_lanes(s.q + (size_t)(r + j) * s.width + c) * k;
        }
        for (int j = 0; j < tile; j++) s.p[(size_t)(r + j) * LANES + t] = sum_lanes(sums[j]);
    }
}

/* acc[r..r+tile) += their weights in s.p times the chunk's `count` value rows. */
static inline __attribute__((always_inline)) void accumulate_tile(Scratch s, int r, int tile, int count) {
    for (int c = 0; c < s.width; c += LANES) {
        lanes_t acc[TILE];
        for (int j = 0; j < tile; j++) acc[j] = load_lanes(s.acc + (size_t)(r + j) * s.width + c);
        for (int t = 0; t < count; t++) {
            lanes_t v = load_lanes(s.values + (size_t)t * s.width + c);
            for (int j = 0; j < tile; j++) acc[j] += s.p[(size_t)(r + j) * LANES + t] * v;
        }
        for (int j = 0; j < tile; j++) store_lanes(s.acc + (size_t)(r + j) * s.width + c, acc[j]);
    }
}

/* The chunk's weights of row r: exp(score - new max) where the row sees the key, 0 elsewhere; folds the row's
 * running max and sum (and rescales its sums of values) over to the new max. */
static void weigh_row(const Arguments *a, Scratch s, int r, int head, int from, int count) {
    float *p = s.p + (size_t)r * LANES, top = s.max[r];
    const int query = s.last[r] - from; /* the query's position, as a lane */
    const int lo = s.first[r] > from ? s.first[r] - from : 0, hi = query < count - 1 ? query : count - 1;
    if (a->softcap > 0.0f)
        for (int t = 0; t < LANES; t++) p[t] = tanhf(p[t] / a->softcap) * a->softcap;
    if (a->alibi_slopes)
        for (int t = 0; t < LANES; t++) p[t] += a->alibi_slopes[head] * (float)(t - query);
#pragma omp simd reduction(max : top)
    for (int t = lo; t <= hi; t++) top = p[t] > top ? p[t] : top;
    if (top == -INFINITY) { /* the row has seen no key yet, nor does it in this chunk */
        memset(p, 0, sizeof(float) * LANES);
        return;
    }
    const float rescale = exp_nonpositive(s.max[r] - top); /* ~0 while the max is -inf */
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int t = 0; t < LANES; t++) {
        float w = (t >= lo && t <= hi) ? exp_nonpositive(p[t] - top) : 0.0f;
        p[t] = w;
        total += w;
    }
    if (rescale != 1.0f) {
        float *acc = s.acc + (size_t)r * s.width;
        for (int i = 0; i < s.width; i++) acc[i] *= rescale;
    }
    s.sum[r] = s.sum[r] * rescale + total;
    s.max[r] = top;
}


/* The chunk path for a bf16 query over a bf16 cache on a CPU with AVX512-BF16 (a bf16 model's decode rows):
 * each key row is multiplied by each query row in bf16 pairs (`vdpbf16ps`: products exact, sums in fp32),
 * straight from the cache, into 16 partial sums; the 16 keys' partial sums of a row are then folded together
 * into one vector holding the chunk's 16 scores (a tree of lane permutes), so the softmax takes a chunk's
 * scores in one vector and no score is summed across lanes on its own. Values are widened to fp32 in
 * registers and accumulated in fp32, as on the generic path. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAS_BF16_CHUNKS 1

enum { CHUNK_ROWS = 4 }; /* query rows scored together: each key vector loaded once for them */

static inline __m512 load_bf16x16(const uint16_t *values) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)values)), 16));
}

/* exp(x) for lanes x <= 0, the polynomial of exp_nonpositive(). */
static inline __m512 exp_nonpositive_lanes(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static const int32_t FOLD_FIRST[4][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
    {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
    {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};

/* Two vectors of partial sums folded: at `level` (0..3) each key holds `16 >> level` lanes (the keys of a,
 * then of b) and leaves with half as many, each the sum of a lane of its first and of its second half. */
static inline __m512 fold(__m512 a, __m512 b, int level) {
    __m512i first = _mm512_loadu_si512(FOLD_FIRST[level]);
    __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8 >> level));
    return _mm512_add_ps(_mm512_permutex2var_ps(a, first, b), _mm512_permutex2var_ps(a, second, b));
}

/* The 16 keys' vectors of partial sums folded in four levels into one: lane t holds key t's sum. */
static inline __m512 scores_of(__m512 partial[16]) {
    for (int level = 0, count = 16; level < 4; level++, count /= 2)
        for (int k = 0; k < count / 2; k++) partial[k] = fold(partial[2 * k], partial[2 * k + 1], level);
    return partial[0];
}

/* Scores of `tile` rows (from r) against the chunk's `count` keys at `keys` (bf16 rows of d), unscaled, into
 * scores[r..]. Lanes past `count` are 0. */
static inline __attribute__((always_inline)) void score_chunk_bf16(
        const uint16_t *const *queries, int r, int tile, const uint16_t *keys, int count, int d, __m512 *scores) {
    __m512 partial[CHUNK_ROWS][16];
    for (int t = 0; t < 16; t++) {
        for (int j = 0; j < tile; j++) partial[j][t] = _mm512_setzero_ps();
        if (t >= count) continue;
        const uint16_t *key = keys + (size_t)t * d;
        for (int c = 0; c < d; c += 32) {
            __m512bh k = (__m512bh)_mm512_loadu_si512(key + c);
            for (int j = 0; j < tile; j++)
                partial[j][t] = _mm512_dpbf16_ps(partial[j][t], k, (__m512bh)_mm512_loadu_si512(queries[r + j] + c));
        }
    }
    for (int j = 0; j < tile; j++) scores[r + j] = scores_of(partial[j]);
}

/* One chunk of `count` keys and values (bf16 rows of d from `keys` and `values`, positions from..) folded into
 * the online softmax of rows [begin, rows), as weigh_row() and accumulate_tile() do. */
static void attend_chunk_bf16(const Arguments *a, Scratch s, int begin, int rows, const uint16_t *const *queries,
                              const uint16_t *keys, const uint16_t *values, int from, int count) {
    const int d = a->head_dim;
    __m512 scores[rows];
    for (int r = begin; r < rows; r += CHUNK_ROWS) {
        switch (rows - r < CHUNK_ROWS ? rows - r : CHUNK_ROWS) {
        case 1: score_chunk_bf16(queries, r, 1, keys, count, d, scores); break;
        case 2: score_chunk_bf16(queries, r, 2, keys, count, d, scores); break;
        case 3: score_chunk_bf16(queries, r, 3, keys, count, d, scores); break;
        default: score_chunk_bf16(queries, r, CHUNK_ROWS, keys, count, d, scores); break;
        }
    }
    for (int r = begin; r < rows; r++) {
        const int query = s.last[r] - from, lo = s.first[r] > from ? s.first[r] - from : 0;
        const int hi = query < count - 1 ? query : count - 1;
        float *p = s.p + (size_t)r * LANES;
        if (hi < lo) { /* the row sees none of the chunk */
            _mm512_storeu_ps(p, _mm512_setzero_ps());
            continue;
        }
        const __mmask16 seen = (__mmask16)(((1u << (hi + 1)) - 1) & ~((1u << lo) - 1));
        const __m512 score = _mm512_mul_ps(scores[r], _mm512_set1_ps(a->scale));
        const float top = fmaxf(s.max[r], _mm512_mask_reduce_max_ps(seen, score));
        const __m512 weights = _mm512_maskz_mov_ps(seen, exp_nonpositive_lanes(_mm512_sub_ps(score, _mm512_set1_ps(top))));
        _mm512_storeu_ps(p, weights);
        const float rescale = exp_nonpositive(s.max[r] - top);
        if (rescale != 1.0f) {
            float *acc = s.acc + (size_t)r * s.width;
            for (int i = 0; i < s.width; i++) acc[i] *= rescale;
        }
        s.sum[r] = s.sum[r] * rescale + _mm512_reduce_add_ps(weights);
        s.max[r] = top;
    }
    for (int c = 0; c < d; c += 64) { /* 64 values of every row at a time: 4 vectors per row */
        const int vectors = d - c < 64 ? (d - c) / 16 : 4;
        for (int r = begin; r < rows; r += CHUNK_ROWS) {
            const int tile = rows - r < CHUNK_ROWS ? rows - r : CHUNK_ROWS;
            __m512 acc[CHUNK_ROWS][4];
            for (int j = 0; j < tile; j++)
                for (int v = 0; v < vectors; v++) acc[j][v] = _mm512_loadu_ps(s.acc + (size_t)(r + j) * s.width + c + 16 * v);
            for (int t = 0; t < count; t++) {
                __m512 value[4];
                for (int v = 0; v < vectors; v++) value[v] = load_bf16x16(values + (size_t)t * d + c + 16 * v);
                for (int j = 0; j < tile; j++) {
                    const __m512 w = _mm512_set1_ps(s.p[(size_t)(r + j) * LANES + t]);
                    for (int v = 0; v < vectors; v++) acc[j][v] = _mm512_fmadd_ps(w, value[v], acc[j][v]);
                }
            }
            for (int j = 0; j < tile; j++)
                for (int v = 0; v < vectors; v++) _mm512_storeu_ps(s.acc + (size_t)(r + j) * s.width + c + 16 * v, acc[j][v]);
        }
    }
}
#endif

#define FOR_TILES(begin, rows, CALL)                           \
    for (int r = (begin); r < (rows); r += TILE) {             \
        switch ((rows) - r < TILE ? (rows) - r : TILE) {       \
        case 1: CALL(r, 1); break;                             \
        case 2: CALL(r, 2); break;                             \
        case 3: CALL(r, 3); break;                             \
        default: CALL(r, TILE); break;                         \
        }                                                      \
    }

/* Bytes per element of the cache. */
static size_t cache_element_size(const Arguments *a) {
    return a->cache_dtype == DTYPE_F32 ? 4 : a->cache_dtype == DTYPE_BF16 ? 2 : 1;
}

/* The first key a query at `position` sees: 0, or later under a sliding window or attention chunks. */
static int first_key(const Arguments *a, int position) {
    int first = 0;
    if (a->window > 0 && position - a->window + 1 > first) first = position - a->window + 1;
    if (a->chunk > 0 && position - position % a->chunk > first) first = position - position % a->chunk;
    return first;
}

/* Asks for the key and value rows of the chunk that starts at `position` (up to `highest`), of one KV head
 * (its rows from `head_row`) of the sequence with block table `table`. */
static void prefetch_keys(const Arguments *a, const int32_t *table, int64_t head_row, int position, int highest) {
    if (position > highest) return;
    const int bs = a->block_size, end = (position / bs + 1) * bs, last = end - 1 < highest ? end - 1 : highest;
    const int count = last - position + 1 < LANES ? last - position + 1 : LANES;
    const int row_bytes = a->head_dim * (int)cache_element_size(a);
    const int64_t slot = (int64_t)table[position / bs] * bs + position % bs;
    prefetch_rows(a->key_cache, head_row + slot, count, row_bytes);
    prefetch_rows(a->value_cache, head_row + slot, count, row_bytes);
}

/* Asks for the first AHEAD_CHUNKS chunks of an item, as it starts. */
static void prefetch_item(const Arguments *a, int seq, int kv_head) {
    const int n = a->query_start[seq + 1] - a->query_start[seq], len = a->seq_lens[seq];
    const int32_t *table = a->block_tables + (int64_t)seq * a->max_blocks;
    const int64_t head_row = (int64_t)kv_head * a->cache_head_stride / a->head_dim;
    for (int chunk = 0, from = first_key(a, len - n); chunk < AHEAD_CHUNKS; chunk++) {
        prefetch_keys(a, table, head_row, from, len - 1);
        const int block_end = (from / a->block_size + 1) * a->block_size;
        from = from + LANES < block_end ? from + LANES : block_end; /* the next chunk, as attend_item takes them */
    }
}

/* Row r of an item is query head (kv_head * group + r % group) at the sequence's query row r / group: rows go
 * up by position, so the rows that see a chunk of keys (those at or past its first position) are the last
 * ones, and a prompt's rows attend only to the chunks up to their own position, not to the whole prompt. */
static void attend_item(const Arguments *a, int seq, int kv_head, Scratch s) {
    const int d = a->head_dim, bs = a->block_size, group = a->heads / a->kv_heads;
    const int start = a->query_start[seq], n = a->query_start[seq + 1] - start, len = a->seq_lens[seq];
    const int rows = group * n;
    int lowest = len, highest = 0;
    for (int r = 0; r < rows; r++) {
        int head = kv_head * group + r % group, position = len - n + r / group, first;
        float *q = s.q + (size_t)r * s.width;
        load_row(a->query, a->query_dtype, (int64_t)(start + r / group) * a->heads + head, d, NULL, 0, q);
        for (int i = 0; i < d; i++) q[i] *= a->scale;
        s.first[r] = first = first_key(a, position);
        s.last[r] = position;
        s.max[r] = -INFINITY;
        s.sum[r] = 0.0f;
        memset(s.acc + (size_t)r * s.width, 0, sizeof(float) * s.width);
        if (first < lowest) lowest = first;
        if (position > highest) highest = position;
    }
    const int32_t *table = a->block_tables + (int64_t)seq * a->max_blocks;
    const int64_t head_row = (int64_t)kv_head * a->cache_head_stride / d;
    prefetch_item(a, seq, kv_head);
    const int64_t scale_head = (int64_t)kv_head * a->scale_head_stride;
#ifdef HAS_BF16_CHUNKS
    const int bf16_chunks = a->query_dtype == DTYPE_BF16 && a->cache_dtype == DTYPE_BF16 && d % 32 == 0
                            && a->softcap <= 0.0f && a->alibi_slopes == NULL;
    const uint16_t *queries[rows];
    for (int r = 0; r < rows; r++)
        queries[r] = (const uint16_t *)a->query + ((int64_t)(start + r / group) * a->heads + kv_head * group + r % group) * d;
#endif
    for (int from = lowest; from <= highest;) {
        const int block_end = (from / bs + 1) * bs;
        const int to = from + LANES < block_end ? from + LANES : block_end; /* positions [from, to) */
        const int count = (to < highest + 1 ? to : highest + 1) - from;
        const int64_t slot = (int64_t)table[from / bs] * bs + from % bs;
        /* The rows before `begin` are at positions before the chunk: none of its keys is theirs. */
        const int begin = from > len - n ? (from - (len - n)) * group : 0;
        /* The chunk AHEAD_CHUNKS ahead, fetched while this one is worked on (the first ones were asked for as
         * the item started): memory, not arithmetic, is what a decode row mostly waits for. */
        prefetch_keys(a, table, head_row, from + AHEAD_CHUNKS * LANES, highest);
#ifdef HAS_BF16_CHUNKS
        if (bf16_chunks) {
            attend_chunk_bf16(a, s, begin, rows, queries, (const uint16_t *)a->key_cache + (head_row + slot) * d,
                              (const uint16_t *)a->value_cache + (head_row + slot) * d, from, count);
            from += count;
            continue;
        }
#endif
        for (int t = 0; t < count; t++)
            load_row(a->key_cache, a->cache_dtype, head_row + slot + t, d, a->key_scales, scale_head + slot + t,
                     s.keys + (size_t)t * s.width);
#define SCORE(r, tile) score_tile(s, r, tile, count)
        FOR_TILES(begin, rows, SCORE)
        for (int r = begin; r < rows; r++) weigh_row(a, s, r, kv_head * group + r % group, from, count);
        for (int t = 0; t < count; t++)
            load_row(a->value_cache, a->cache_dtype, head_row + slot + t, d, a->value_scales, scale_head + slot + t,
                     s.values + (size_t)t * s.width);
#define ACCUMULATE(r, tile) accumulate_tile(s, r, tile, count)
        FOR_TILES(begin, rows, ACCUMULATE)
        from += count;
    }
    for (int r = 0; r < rows; r++) {
        const int head = kv_head * group + r % group;
        float sum = s.sum[r], *acc = s.acc + (size_t)r * s.width;
        if (a->sinks) { /* the sink's weight joins the denominator and nothing else */
            float sink = a->sinks[head], top = s.max[r] > sink ? s.max[r] : sink;
            float rescale = exp_nonpositive(s.max[r] - top);
            sum = sum * rescale + exp_nonpositive(sink - top);
            for (int i = 0; i < d; i++) acc[i] *= rescale;
        }
        const float inverse = 1.0f / sum;
        const int64_t at = ((int64_t)(start + r / group) * a->heads + head) * d;
        if (a->query_dtype == DTYPE_BF16) {
            uint16_t *out = (uint16_t *)a->out + at;
            for (int i = 0; i < d; i++) out[i] = float_to_bf16(acc[i] * inverse);
        } else {
            float *out = (float *)a->out + at;
            for (int i = 0; i < d; i++) out[i] = acc[i] * inverse;
        }
    }
}

/* Token t's new key and value rows (every KV head) into the cache at its slot. */
static void store_token(const Arguments *a, int t) {
    const int64_t slot = a->slot_mapping[t];
    if (slot < 0) return;
    const size_t size = cache_element_size(a);
    const size_t row = (size_t)a->head_dim * size;
    for (int h = 0; h < a->kv_heads; h++) {
        const size_t to = ((size_t)h * a->cache_head_stride + (size_t)slot * a->head_dim) * size;
        const size_t key = ((size_t)t * a->key_token_stride + (size_t)h * a->key_head_stride) * size;
        const size_t value = ((size_t)t * a->value_token_stride + (size_t)h * a->value_head_stride) * size;
        memcpy((char *)a->key_cache + to, (const char *)a->new_key + key, row);
        memcpy((char *)a->value_cache + to, (const char *)a->new_value + value, row);
    }
}

void paged_attention(const Arguments *a) {
    int most_rows = 1;
    for (int i = 0; i < a->num_seqs; i++) {
        int seq = a->seqs[i], n = a->query_start[seq + 1] - a->query_start[seq];
        if (n > most_rows) most_rows = n;
    }
    const int rows = most_rows * (a->heads / a->kv_heads), kv = a->kv_heads, items = a->num_seqs * kv;
#pragma omp parallel num_threads(a->threads)
    {
        if (a->new_key != NULL) {
#pragma omp for schedule(static)
            for (int t = 0; t < a->num_tokens; t++) store_token(a, t);
        } /* the loop's end waits for every thread: all is stored before any item reads */
        void *owner;
        Scratch s = make_scratch(rows, a->head_dim, &owner);
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) attend_item(a, a->seqs[item / kv], item % kv, s);
        free(owner);
    }
}
