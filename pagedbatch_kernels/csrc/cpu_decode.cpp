// Paged decode attention for the CPU engine: one query token per row, its keys and values read where
// they lie in the pool (block by block through the row's block table), for float32 and bfloat16 pools.
// Built at first use by pagedbatch_kernels/cpu_native.py with -march=native; the vectors are GCC/Clang vector
// extensions, so the same code is AVX-512 here, AVX2 or NEON elsewhere.
//
// A task is one (row, KV head): its group of query heads at once, so each key and value is loaded
// once for the group. Three passes over the row's context: scores (a dot product per position and
// query head), softmax (the scores are kept, L2-sized, instead of rescaling a running sum), then the
// weighted values. The query heads go through in tiles that keep the accumulators in registers.

#include "cpu_vec.h"

constexpr int MAX_TILE = 8;

// scores[g * ld + p] = q_g . k_p for the tile's TILE query heads (q already scaled, float32).
template <typename T, int DV, int TILE>
static void tile_scores(const float* q, const T* keys, const Row& row, float* scores, int ld) {
    vfloat qv[TILE][DV];
    for (int g = 0; g < TILE; g++)
        for (int c = 0; c < DV; c++) qv[g][c] = load(q + (g * DV + c) * LANES);
    each_position(keys, row, [&](int p, const T* k) {
        vfloat kv[DV];
        for (int c = 0; c < DV; c++) kv[c] = load(k + c * LANES);
        for (int g = 0; g < TILE; g++) {
            vfloat acc = qv[g][0] * kv[0];
            for (int c = 1; c < DV; c++) acc += qv[g][c] * kv[c];
            scores[g * ld + p] = sum(acc);
        }
    });
}

// out_g = sum_p w[g * ld + p] v_p / totals[g] for the tile's query heads.
template <typename T, int DV, int TILE>
static void tile_values(const float* weights, int ld, const float* totals, const T* values, const Row& row,
                        float* out) {
    vfloat acc[TILE][DV] = {};
    each_position(values, row, [&](int p, const T* v) {
        vfloat vv[DV];
        for (int c = 0; c < DV; c++) vv[c] = load(v + c * LANES);
        for (int g = 0; g < TILE; g++) {
            vfloat w = splat(weights[g * ld + p]);
            for (int c = 0; c < DV; c++) acc[g][c] += w * vv[c];
        }
    });
    for (int g = 0; g < TILE; g++)
        for (int c = 0; c < DV; c++) store(out + (g * DV + c) * LANES, acc[g][c] / totals[g]);
}

// Softmax of each query head's scores in place over positions low.. (before them and padding to ld
// hold NO_WEIGHT), scores soft-capped first where softcap > 0; its sum and log-sum-exp.
static void softmax(float* scores, int heads, int low, int length, int ld, float softcap, float* totals, float* lse) {
    for (int g = 0; g < heads; g++) {
        float* s = scores + g * ld;
        if (softcap > 0.f)
            for (int p = low / LANES * LANES; p < length; p += LANES) store(s + p, soft_cap(load(s + p), softcap));
        for (int p = 0; p < low; p++) s[p] = NO_WEIGHT;
        for (int p = length; p < ld; p++) s[p] = NO_WEIGHT;
        vfloat top = splat(NO_WEIGHT);
        for (int p = 0; p < ld; p += LANES) {
            vfloat x = load(s + p);
            top = x > top ? x : top;
        }
        float m = max(top);
        vfloat total = {};
        for (int p = 0; p < ld; p += LANES) {
            vfloat e = exp_nonpositive(load(s + p) - m);
            store(s + p, e);
            total += e;
        }
        totals[g] = sum(total);
        lse[g] = m + std::log(totals[g]);
    }
}

template <typename T, int DV>
struct Kernels {
    using Scores = void (*)(const float*, const T*, const Row&, float*, int);
    using Values = void (*)(const float*, int, const float*, const T*, const Row&, float*);
    // at least 4 heads a tile where their queries no longer fit in registers (AVX2: a head of 64 is
    // 8 of its 16): each key is still loaded once for them, their queries read from L1 (bfloat16
    // decodes ran ~1.4x faster than one head a tile)
    static constexpr int tile = std::min(MAX_TILE, std::max(4, ACCUMULATORS / DV));

    template <int TILE>
    static void pick(int size, Scores* scores, Values* values) {
        if constexpr (TILE >= 1) {
            if (size == TILE) {
                *scores = tile_scores<T, DV, TILE>;
                *values = tile_values<T, DV, TILE>;
            } else {
                pick<TILE - 1>(size, scores, values);
            }
        }
    }

    // One (row, KV head): `group` query heads from q (float32, unscaled) into out, lse, over the row's
    // positions from `low` (a sliding window's first), scores soft-capped at `softcap` where > 0.
    static void task(const float* q, const T* keys, const T* values, const Row& row, int low, int group,
                     float scale, float softcap, float* out, float* lse) {
        constexpr int D = DV * LANES;
        if (row.length <= 0) {
            std::fill(out, out + group * D, 0.f);
            std::fill(lse, lse + group, -INFINITY);
            return;
        }
        thread_local std::vector<float> scratch;
        int ld = (row.length + LANES - 1) / LANES * LANES;
        scratch.resize(size_t(group) * (D + ld + 1));
        float* scaled = scratch.data();
        float* scores = scaled + group * D;
        float* totals = scores + size_t(group) * ld;
        for (int i = 0; i < group * D; i++) scaled[i] = q[i] * scale;
        for (int g = 0; g < group; g += tile) {
            Scores s = nullptr;
            Values v = nullptr;
            pick<tile>(std::min(tile, group - g), &s, &v);
            s(scaled + g * D, keys, row, scores + size_t(g) * ld, ld);
        }
        softmax(scores, group, low, row.length, ld, softcap, totals, lse);
        for (int g = 0; g < group; g += tile) {
            Scores s = nullptr;
            Values v = nullptr;
            pick<tile>(std::min(tile, group - g), &s, &v);
            v(scores + size_t(g) * ld, ld, totals + g, values, row, out + g * D);
        }
    }
};

template <typename T, int DV>
static void run(const float* q, const T* keys, const T* values, const int32_t* tables, int width,
                const int32_t* lengths, const int32_t* lows, int rows, int heads, int kv_heads, int block_size,
                float scale, float softcap, float* out, float* lse) {
    constexpr int D = DV * LANES;
    const int group = heads / kv_heads;
    const int tasks = rows * kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int t = 0; t < tasks; t++) {
        int r = t / kv_heads, h = t % kv_heads;
        Row row{tables + int64_t(r) * width, lengths[r], block_size, int64_t(kv_heads) * D, int64_t(h) * D};
        int64_t first = int64_t(r) * heads + int64_t(h) * group;  // the group's first query head
        int low = lows ? std::min(lows[r], row.length) : 0;
        Kernels<T, DV>::task(q + first * D, keys, values, row, low, group, scale, softcap, out + first * D,
                             lse + first);
    }
}

// Every row's context within its table and every block it reads within the pool.
static bool in_bounds(const int32_t* tables, int width, const int32_t* lengths, int rows, int block_size,
                      int num_blocks) {
    for (int r = 0; r < rows; r++)
        if (!context_in_bounds(tables + int64_t(r) * width, width, lengths[r], block_size, num_blocks)) return false;
    return true;
}

template <typename T>
static int dispatch(int head_dim, const float* q, const void* k, const void* v, const int32_t* tables, int width,
                    const int32_t* lengths, const int32_t* lows, int rows, int heads, int kv_heads, int block_size,
                    float scale, float softcap, float* out, float* lse) {
    const T* keys = static_cast<const T*>(k);
    const T* values = static_cast<const T*>(v);
    switch (head_dim) {
#define HEAD(D)                                                                                                 \
    case D:                                                                                                     \
        run<T, D / LANES>(q, keys, values, tables, width, lengths, lows, rows, heads, kv_heads, block_size, scale, \
                          softcap, out, lse);                                                                  \
        return 0;
        PB_HEAD_SIZES(HEAD)
#undef HEAD
        default:
            return -1;
    }
}

// Attention over two disjoint parts of a context from each part's output and log-sum-exp, as
// cpu_decode.merge_partial computes it with torch (logaddexp, then each part weighted by exp(its lse
// - the total's)): out_a and out_b [heads, head_dim], lse_a and lse_b [heads] float32, in place into a.
static void merge_partial(float* out_a, float* lse_a, const float* out_b, const float* lse_b, int64_t heads,
                          int head_dim) {
#pragma omp parallel for schedule(static) if (heads * head_dim >= 32 * 1024)
    for (int64_t h = 0; h < heads; h++) {
        const float a = lse_a[h], b = lse_b[h], top = std::max(a, b);
        const float lse = std::isinf(top) && top < 0 ? top : top + std::log1p(std::exp(-std::fabs(a - b)));
        const vfloat wa = splat(std::exp(a - lse)), wb = splat(std::exp(b - lse));
        float* o = out_a + h * head_dim;
        const float* x = out_b + h * head_dim;
        int d = 0;
        for (; d + LANES <= head_dim; d += LANES) store(o + d, load(o + d) * wa + load(x + d) * wb);
        for (; d < head_dim; d++) o[d] = o[d] * wa[0] + x[d] * wb[0];
        lse_a[h] = lse;
    }
}

extern "C" {

void pb_merge_partial(float* out_a, float* lse_a, const float* out_b, const float* lse_b, int64_t heads, int head_dim) {
    merge_partial(out_a, lse_a, out_b, lse_b, heads, head_dim);
}

// Head sizes the kernels take, for the caller to check before a call.
int pb_supports_head_dim(int head_dim) { return head_dim_supported(head_dim); }

// q [rows, heads, head_dim] float32; k, v [blocks, block_size, kv_heads, head_dim] float32 or bfloat16
// (bf16 = 1); tables [rows, width] and lengths [rows] int32; out [rows, heads, head_dim] and lse
// [rows, heads] float32; lows [rows] int32 or null: row r attends to its positions lows[r].. only (a
// sliding window); softcap > 0: scores s become softcap * tanh(s / softcap). Every tensor contiguous. Returns 0; -1 for a head size it does not take, -2 for
// a context longer than its table or a block outside the pool's num_blocks (nothing is read then).
int pb_decode_attention(const float* q, const void* k, const void* v, int bf16, int num_blocks,
                        const int32_t* tables, int width, const int32_t* lengths, const int32_t* lows, int rows,
                        int heads, int kv_heads, int head_dim, int block_size, float scale, float softcap, float* out,
                        float* lse) {
    if (!head_dim_supported(head_dim)) return -1;
    if (!in_bounds(tables, width, lengths, rows, block_size, num_blocks)) return -2;
    if (bf16)
        return dispatch<uint16_t>(head_dim, q, k, v, tables, width, lengths, lows, rows, heads, kv_heads,
                                  block_size, scale, softcap, out, lse);
    return dispatch<float>(head_dim, q, k, v, tables, width, lengths, lows, rows, heads, kv_heads, block_size, scale,
                           softcap, out, lse);
}
}
