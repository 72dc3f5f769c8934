// Paged decode attention for the CPU engine: one query token per row, its keys and values read where
// they lie in the pool (block by block through the row's block table), for float32 and bfloat16 pools.
// Built at first use by kernels/cpu_native.py with -march=native; the vectors are GCC/Clang vector
// extensions, so the same code is AVX-512 here, AVX2 or NEON elsewhere.
//
// A task is one (row, KV head): its group of query heads at once, so each key and value is loaded
// once for the group. Three passes over the row's context: scores (a dot product per position and
// query head), softmax (the scores are kept, L2-sized, instead of rescaling a running sum), then the
// weighted values. The query heads go through in tiles that keep the accumulators in registers.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(64)));
typedef uint16_t vhalf __attribute__((vector_size(32)));

constexpr int LANES = 16;
constexpr int ACCUMULATORS = 24;  // vector registers for a tile's accumulators (of 32)
constexpr int MAX_TILE = 8;
constexpr float NO_WEIGHT = -1e30f;  // past the context: exp gives exactly 0

static inline vfloat splat(float x) { return vfloat{} + x; }
static inline vfloat load(const float* p) { vfloat v; std::memcpy(&v, p, sizeof v); return v; }
static inline vfloat load(const uint16_t* p) {  // bfloat16: the high half of a float32
    vhalf h;
    std::memcpy(&h, p, sizeof h);
    vuint bits = __builtin_convertvector(h, vuint) << 16;
    vfloat v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
}
static inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

static inline float sum(vfloat v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}

static inline float max(vfloat v) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)v);
#else
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = std::max(m, v[i]);
    return m;
#endif
}

// exp(x) for x <= 0: 2^round(x log2 e) times a degree-6 polynomial of the rest (under 2 ulp); 0 below -87.
static inline vfloat exp_nonpositive(vfloat x) {
    const vfloat big = splat(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
    vfloat t = (x < -87.f ? splat(-87.f) : x) * 1.44269504f;
    vfloat n = (t + big) - big;
    vfloat y = (t - n) * 0.693147181f;
    vfloat p = splat(1.f / 720);
    p = p * y + 1.f / 120;
    p = p * y + 1.f / 24;
    p = p * y + 1.f / 6;
    p = p * y + 0.5f;
    p = p * y + 1.f;
    p = p * y + 1.f;
    vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
    vfloat scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return x < -87.f ? vfloat{} : p * scale;
}

struct Row {
    const int32_t* table;
    int length;
    int block_size;
    int64_t position_stride;  // elements between consecutive positions of one KV head (KV heads x head size)
    int64_t head_offset;      // elements from a position's start to this KV head
};

// visit(p, the row's KV head at position p) for every position of the row's context, block by block.
template <typename T, typename Visit>
static inline void each_position(const T* cache, const Row& row, Visit visit) {
    for (int start = 0, b = 0; start < row.length; start += row.block_size, b++) {
        const T* at = cache + int64_t(row.table[b]) * row.block_size * row.position_stride + row.head_offset;
        int end = std::min(row.length, start + row.block_size);
        for (int p = start; p < end; p++, at += row.position_stride) visit(p, at);
    }
}

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

// Softmax of each query head's scores in place (padding to ld holds NO_WEIGHT); its sum and log-sum-exp.
static void softmax(float* scores, int heads, int length, int ld, float* totals, float* lse) {
    for (int g = 0; g < heads; g++) {
        float* s = scores + g * ld;
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
    static constexpr int tile = std::max(1, std::min(MAX_TILE, ACCUMULATORS / DV));

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

    // One (row, KV head): `group` query heads from q (float32, unscaled) into out, lse.
    static void task(const float* q, const T* keys, const T* values, const Row& row, int group, float scale,
                     float* out, float* lse) {
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
        softmax(scores, group, row.length, ld, totals, lse);
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
                const int32_t* lengths, int rows, int heads, int kv_heads, int block_size, float scale, float* out,
                float* lse) {
    constexpr int D = DV * LANES;
    const int group = heads / kv_heads;
    const int tasks = rows * kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int t = 0; t < tasks; t++) {
        int r = t / kv_heads, h = t % kv_heads;
        Row row{tables + int64_t(r) * width, lengths[r], block_size, int64_t(kv_heads) * D, int64_t(h) * D};
        int64_t first = int64_t(r) * heads + int64_t(h) * group;  // the group's first query head
        Kernels<T, DV>::task(q + first * D, keys, values, row, group, scale, out + first * D, lse + first);
    }
}

// Every row's context within its table and every block it reads within the pool.
static bool in_bounds(const int32_t* tables, int width, const int32_t* lengths, int rows, int block_size,
                      int num_blocks) {
    for (int r = 0; r < rows; r++) {
        int length = lengths[r];
        if (length > int64_t(width) * block_size) return false;
        for (int b = 0; b * block_size < length; b++) {
            int32_t block = tables[int64_t(r) * width + b];
            if (block < 0 || block >= num_blocks) return false;
        }
    }
    return true;
}

template <typename T>
static int dispatch(int head_dim, const float* q, const void* k, const void* v, const int32_t* tables, int width,
                    const int32_t* lengths, int rows, int heads, int kv_heads, int block_size, float scale,
                    float* out, float* lse) {
    const T* keys = static_cast<const T*>(k);
    const T* values = static_cast<const T*>(v);
    switch (head_dim) {
#define HEAD(DV)                                                                                                \
    case DV * LANES:                                                                                            \
        run<T, DV>(q, keys, values, tables, width, lengths, rows, heads, kv_heads, block_size, scale, out, lse); \
        return 0;
        HEAD(2) HEAD(3) HEAD(4) HEAD(5) HEAD(6) HEAD(7) HEAD(8) HEAD(10) HEAD(12) HEAD(16)
#undef HEAD
        default:
            return -1;
    }
}

extern "C" {

// Head sizes the kernel takes (multiples of 16), for the caller to check before a call.
int pb_supports_head_dim(int head_dim) {
    switch (head_dim / LANES * (head_dim % LANES == 0)) {
        case 2: case 3: case 4: case 5: case 6: case 7: case 8: case 10: case 12: case 16:
            return 1;
        default:
            return 0;
    }
}

// q [rows, heads, head_dim] float32; k, v [blocks, block_size, kv_heads, head_dim] float32 or bfloat16
// (bf16 = 1); tables [rows, width] and lengths [rows] int32; out [rows, heads, head_dim] and lse
// [rows, heads] float32. Every tensor contiguous. Returns 0; -1 for a head size it does not take, -2 for
// a context longer than its table or a block outside the pool's num_blocks (nothing is read then).
int pb_decode_attention(const float* q, const void* k, const void* v, int bf16, int num_blocks,
                        const int32_t* tables, int width, const int32_t* lengths, int rows, int heads, int kv_heads,
                        int head_dim, int block_size, float scale, float* out, float* lse) {
    if (!in_bounds(tables, width, lengths, rows, block_size, num_blocks)) return -2;
    if (bf16)
        return dispatch<uint16_t>(head_dim, q, k, v, tables, width, lengths, rows, heads, kv_heads, block_size,
                                  scale, out, lse);
    return dispatch<float>(head_dim, q, k, v, tables, width, lengths, rows, heads, kv_heads, block_size, scale,
                           out, lse);
}
}
