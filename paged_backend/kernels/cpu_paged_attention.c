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
    const void *key_cache;      /* [KVH, slots, D]: heads apart by cache_head_stride, rows contiguous */
    const void *value_cache;
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
#define LANES 16
#define TILE 4
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
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
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

#define FOR_TILES(rows, CALL)                                  \
    for (int r = 0; r < (rows); r += TILE) {                   \
        switch ((rows) - r < TILE ? (rows) - r : TILE) {       \
        case 1: CALL(r, 1); break;                             \
        case 2: CALL(r, 2); break;                             \
        case 3: CALL(r, 3); break;                             \
        default: CALL(r, TILE); break;                         \
        }                                                      \
    }

/* Row r of an item is query head (kv_head * group + r / n) at the sequence's query row r % n. */
static void attend_item(const Arguments *a, int seq, int kv_head, Scratch s) {
    const int d = a->head_dim, bs = a->block_size, group = a->heads / a->kv_heads;
    const int start = a->query_start[seq], n = a->query_start[seq + 1] - start, len = a->seq_lens[seq];
    const int rows = group * n;
    int lowest = len, highest = 0;
    for (int r = 0; r < rows; r++) {
        int head = kv_head * group + r / n, position = len - n + r % n, first = 0;
        float *q = s.q + (size_t)r * s.width;
        load_row(a->query, a->query_dtype, (int64_t)(start + r % n) * a->heads + head, d, NULL, 0, q);
        for (int i = 0; i < d; i++) q[i] *= a->scale;
        if (a->window > 0 && position - a->window + 1 > first) first = position - a->window + 1;
        if (a->chunk > 0 && position - position % a->chunk > first) first = position - position % a->chunk;
        s.first[r] = first;
        s.last[r] = position;
        s.max[r] = -INFINITY;
        s.sum[r] = 0.0f;
        memset(s.acc + (size_t)r * s.width, 0, sizeof(float) * s.width);
        if (first < lowest) lowest = first;
        if (position > highest) highest = position;
    }
    const int32_t *table = a->block_tables + (int64_t)seq * a->max_blocks;
    const int64_t head_row = (int64_t)kv_head * a->cache_head_stride / d;
    const int64_t scale_head = (int64_t)kv_head * a->scale_head_stride;
    const int row_bytes = d * (a->cache_dtype == DTYPE_F32 ? 4 : a->cache_dtype == DTYPE_BF16 ? 2 : 1);
    for (int from = lowest; from <= highest;) {
        const int block_end = (from / bs + 1) * bs;
        const int to = from + LANES < block_end ? from + LANES : block_end; /* positions [from, to) */
        const int count = (to < highest + 1 ? to : highest + 1) - from;
        const int64_t slot = (int64_t)table[from / bs] * bs + from % bs;
        if (from + count <= highest) { /* the next chunk's rows, fetched while this one is worked on */
            const int next = from + count;
            const int64_t next_slot = (int64_t)table[next / bs] * bs + next % bs;
            prefetch_rows(a->key_cache, head_row + next_slot, LANES, row_bytes);
            prefetch_rows(a->value_cache, head_row + next_slot, LANES, row_bytes);
        }
        for (int t = 0; t < count; t++)
            load_row(a->key_cache, a->cache_dtype, head_row + slot + t, d, a->key_scales, scale_head + slot + t,
                     s.keys + (size_t)t * s.width);
#define SCORE(r, tile) score_tile(s, r, tile, count)
        FOR_TILES(rows, SCORE)
        for (int r = 0; r < rows; r++) weigh_row(a, s, r, kv_head * group + r / n, from, count);
        for (int t = 0; t < count; t++)
            load_row(a->value_cache, a->cache_dtype, head_row + slot + t, d, a->value_scales, scale_head + slot + t,
                     s.values + (size_t)t * s.width);
#define ACCUMULATE(r, tile) accumulate_tile(s, r, tile, count)
        FOR_TILES(rows, ACCUMULATE)
        from += count;
    }
    for (int r = 0; r < rows; r++) {
        const int head = kv_head * group + r / n;
        float sum = s.sum[r], *acc = s.acc + (size_t)r * s.width;
        if (a->sinks) { /* the sink's weight joins the denominator and nothing else */
            float sink = a->sinks[head], top = s.max[r] > sink ? s.max[r] : sink;
            float rescale = exp_nonpositive(s.max[r] - top);
            sum = sum * rescale + exp_nonpositive(sink - top);
            for (int i = 0; i < d; i++) acc[i] *= rescale;
        }
        const float inverse = 1.0f / sum;
        const int64_t at = ((int64_t)(start + r % n) * a->heads + head) * d;
        if (a->query_dtype == DTYPE_BF16) {
            uint16_t *out = (uint16_t *)a->out + at;
            for (int i = 0; i < d; i++) out[i] = float_to_bf16(acc[i] * inverse);
        } else {
            float *out = (float *)a->out + at;
            for (int i = 0; i < d; i++) out[i] = acc[i] * inverse;
        }
    }
}

void paged_attention(const Arguments *a) {
    int most_rows = 1;
    for (int i = 0; i < a->num_seqs; i++) {
        int seq = a->seqs[i], n = a->query_start[seq + 1] - a->query_start[seq];
        if (n > most_rows) most_rows = n;
    }
    const int rows = most_rows * (a->heads / a->kv_heads), items = a->num_seqs * a->kv_heads;
#pragma omp parallel num_threads(a->threads)
    {
        void *owner;
        Scratch s = make_scratch(rows, a->head_dim, &owner);
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) attend_item(a, a->seqs[item / a->kv_heads], item % a->kv_heads, s);
        free(owner);
    }
}
