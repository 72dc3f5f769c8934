// Paged attention of many query rows that read one block table: a span is a range of rows of q over
// the same table (the tokens of a prompt chunk; decodes that share a prefix), row r seeing the first
// lengths[r] positions of it (a causal chunk: each token its own). For float32 and bfloat16 pools.
//
// The decode kernel's dot product per score ends in a horizontal sum, which costs more than the
// products once many queries read the same keys. Here a task is a tile of a span's rows for one KV
// head: all their query heads, as a matrix of queries, against the context CHUNK positions at a time,
// as small matrix products with the accumulators in registers: each chunk's keys are packed and
// transposed once into a [head size, CHUNK] scratch, so that scores come out as vectors of positions,
// and its values packed into a [CHUNK, head size] one (both float32), which the weighted sums read
// position by position into the queries' output rows. The softmax is the online one: a
// running maximum and sum per query, the outputs rescaled where the maximum grows.

#include <type_traits>

#include "cpu_vec.h"

constexpr int CHUNK = 64;  // key positions per step: four vectors of scores per query
constexpr int CV = CHUNK / LANES;
constexpr int TASK_QUERIES = 96;  // queries (rows x query heads per KV head) per task, about
constexpr int SCORE_TILE = std::max(1, ACCUMULATORS / CV);  // queries per score tile

// The value tiles: MR queries by a slice of SLICE vectors of the head, accumulated in registers beside
// the slice of a value and a weight. Per position a tile loads SLICE vectors and MR weights for
// MR x SLICE products: the slice with the most products per load.
constexpr int tile_for(int slice) { return std::max(1, (REGISTERS - 2 - slice) / slice); }
constexpr double products_per_load(int slice) { return double(tile_for(slice) * slice) / (tile_for(slice) + slice); }
constexpr int value_slice(int dv) {
    int best = 1;
    for (int s = 2; s <= dv; s++)
        if (dv % s == 0 && tile_for(s) >= 1 && products_per_load(s) > products_per_load(best)) best = s;
    return best;
}
constexpr int value_tile(int dv) { return tile_for(value_slice(dv)); }
constexpr int lcm(int a, int b) {
    int m = a;
    while (m % b) m += a;
    return m;
}

struct Task {
    int span, first, rows, kv_head;
};

// s[i][0:CHUNK] = q_i . kt[:, 0:CHUNK] for the tile's MR queries (q scaled, [MR, D]; kt [D, CHUNK]).
template <int D, int MR>
static inline void score_tile(const float* q, const float* kt, float* s) {
    vfloat acc[MR][CV] = {};
    for (int d = 0; d < D; d++) {
        vfloat k[CV];
        for (int c = 0; c < CV; c++) k[c] = load(kt + d * CHUNK + c * LANES);
        for (int i = 0; i < MR; i++) {
            vfloat x = splat(q[i * D + d]);
            for (int c = 0; c < CV; c++) acc[i][c] += x * k[c];
        }
    }
    for (int i = 0; i < MR; i++)
        for (int c = 0; c < CV; c++) store(s + i * CHUNK + c * LANES, acc[i][c]);
}

// o[i][column slice] += sum_p w[i][p] v[p][column slice] for the tile's MR queries, over `count`
// positions of the chunk's values (v [CHUNK, D]).
template <int D, int MR, int SLICE>
static inline void value_tile(const float* w, const float* v, int count, int column, float* o) {
    vfloat acc[MR][SLICE];
    for (int i = 0; i < MR; i++)
        for (int c = 0; c < SLICE; c++) acc[i][c] = load(o + i * D + column + c * LANES);
    for (int p = 0; p < count; p++) {
        vfloat x[SLICE];
        for (int c = 0; c < SLICE; c++) x[c] = load(v + p * D + column + c * LANES);
        for (int i = 0; i < MR; i++) {
            vfloat weight = splat(w[i * CHUNK + p]);
            for (int c = 0; c < SLICE; c++) acc[i][c] += weight * x[c];
        }
    }
    for (int i = 0; i < MR; i++)
        for (int c = 0; c < SLICE; c++) store(o + i * D + column + c * LANES, acc[i][c]);
}

// kt[d][p] = kc[p][d] for a chunk: CHUNK rows of D floats into D rows of CHUNK.
template <int D>
static inline void transpose_chunk(const float* kc, float* kt) {
#if defined(__AVX__)
    for (int p0 = 0; p0 < CHUNK; p0 += 8)
        for (int d0 = 0; d0 < D; d0 += 8) {  // 8 x 8 blocks: unpack pairs, shuffle quads, swap halves
            __m256 r[8], t[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(kc + (p0 + i) * D + d0);
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
                r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
            }
            for (int i = 0; i < 4; i++) {
                _mm256_storeu_ps(kt + (d0 + i) * CHUNK + p0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
                _mm256_storeu_ps(kt + (d0 + i + 4) * CHUNK + p0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
            }
        }
#else
    for (int p = 0; p < CHUNK; p++)
        for (int d = 0; d < D; d++) kt[d * CHUNK + p] = kc[p * D + d];
#endif
}

// bfloat16 pools on CPUs with AVX-512 BF16: the products go through VDPBF16PS, which multiplies pairs
// of bfloat16 and adds both products to a float32 lane, twice the products of a float32 FMA. Keys and
// queries are bfloat16 already (products exact, sums float32), so scores are as exact as the float32
// path's; the softmax weights are rounded to bfloat16 for the weighted sum of values, as `transformers`
// does for a bfloat16 model (its sum of weights stays float32). Pairs are 32-bit words: scores take
// pairs of head dimensions (keys transposed to [D/2, CHUNK] words), values pairs of positions
// ([CHUNK/2, D] words: two positions' values interleaved).
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool BF16_DOT = true;
typedef uint32_t bf16_pair;

static inline vfloat dot_pairs(vfloat acc, bf16_pair a, const bf16_pair* b) {
    __m512i x = _mm512_set1_epi32(int(a)), y = _mm512_loadu_si512(b);
    return (vfloat)_mm512_dpbf16_ps((__m512)acc, (__m512bh)x, (__m512bh)y);
}

// LANES floats into LANES bfloat16 (rounded to nearest even), in order.
static inline void store_bf16(uint16_t* p, vfloat v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh((__m512)v)); }

// Two rows of D bfloat16 values (positions 2k and 2k+1) into D words of (row a, row b) pairs.
template <int D>
static inline void interleave_rows(const uint16_t* a, const uint16_t* b, bf16_pair* out) {
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    int d = 0;
    for (; d + 32 <= D; d += 32) {
        __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
        _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(x, low, y));
        _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(x, high, y));
    }
    for (; d < D; d++) out[d] = uint32_t(a[d]) | uint32_t(b[d]) << 16;
}

// s[i][0:CHUNK] = scale * q_i . k for the tile's MR queries (qp [MR, D/2] pairs; kt [D/2, CHUNK] pairs).
template <int D, int MR>
static inline void score_tile_bf16(const bf16_pair* qp, const bf16_pair* kt, float scale, float* s) {
    vfloat acc[MR][CV] = {};
    for (int d = 0; d < D / 2; d++)
        for (int i = 0; i < MR; i++)
            for (int c = 0; c < CV; c++) acc[i][c] = dot_pairs(acc[i][c], qp[i * (D / 2) + d], kt + d * CHUNK + c * LANES);
    for (int i = 0; i < MR; i++)
        for (int c = 0; c < CV; c++) store(s + i * CHUNK + c * LANES, acc[i][c] * scale);
}

// o[i][column slice] += sum_p w[i][p] v[p][column slice] over `pairs` pairs of positions (wp [MR, CHUNK/2]
// pairs of weights, vp [CHUNK/2, D] pairs of values).
template <int D, int MR, int SLICE>
static inline void value_tile_bf16(const bf16_pair* wp, const bf16_pair* vp, int pairs, int column, float* o) {
    vfloat acc[MR][SLICE];
    for (int i = 0; i < MR; i++)
        for (int c = 0; c < SLICE; c++) acc[i][c] = load(o + i * D + column + c * LANES);
    for (int p = 0; p < pairs; p++)
        for (int i = 0; i < MR; i++)
            for (int c = 0; c < SLICE; c++)
                acc[i][c] = dot_pairs(acc[i][c], wp[i * (CHUNK / 2) + p], vp + p * D + column + c * LANES);
    for (int i = 0; i < MR; i++)
        for (int c = 0; c < SLICE; c++) store(o + i * D + column + c * LANES, acc[i][c]);
}
#else
constexpr bool BF16_DOT = false;
#endif

template <typename T, int DV>
struct SpanKernel {
    static constexpr int D = DV * LANES;
    static constexpr int SLICE = value_slice(DV);
    static constexpr int VALUE_TILE = value_tile(DV);
    static constexpr int PAD = lcm(SCORE_TILE, VALUE_TILE);  // queries are computed in multiples of this

    // bfloat16 pools take the VDPBF16PS path where the CPU has it
    static constexpr bool PAIRS = BF16_DOT && std::is_same_v<T, uint16_t>;

    struct Scratch {
        std::vector<float> q, o, s, kc, kt, vc, top, total;
        std::vector<uint32_t> qp, wp;  // the queries and a chunk's weights as bfloat16 pairs
        std::vector<int> visible, from;  // each query's positions from..visible (a sliding window's first)
        float softcap = 0.f;               // > 0: scores s become softcap * tanh(s / softcap)
    };

    // Turns the chunk's scores s[i] (positions c0.. of query i) into weights in place, updating the
    // running maximum and sum, and rescaling the output rows where the maximum grew.
    static void softmax_step(Scratch& w, int queries, int c0) {
        static const vint iota = [] {
            vint v;
            for (int i = 0; i < LANES; i++) v[i] = i;
            return v;
        }();
        float *scores = w.s.data(), *outs = w.o.data(), *tops = w.top.data(), *totals = w.total.data();
        const int *visible = w.visible.data(), *from = w.from.data();
        for (int i = 0; i < queries; i++) {
            float* s = scores + i * CHUNK;
            int seen = visible[i] - c0, skip = from[i] - c0;  // this chunk's positions the query sees: skip..seen
            if (seen <= 0 || skip >= CHUNK) {
                std::fill(s, s + CHUNK, 0.f);
                continue;
            }
            vfloat x[CV];
            vfloat top = splat(NO_WEIGHT);
            for (int c = 0; c < CV; c++) {
                x[c] = load(s + c * LANES);
                if (w.softcap > 0.f) x[c] = soft_cap(x[c], w.softcap);
                x[c] = (iota + c * LANES) < seen && (iota + c * LANES) >= skip ? x[c] : splat(NO_WEIGHT);
                top = x[c] > top ? x[c] : top;
            }
            float old = tops[i], now = std::max(old, max(top));
            if (now > old) {
                float shrink = std::exp(old - now);  // 0 at the first chunk: old is NO_WEIGHT
                totals[i] *= shrink;
                float* o = outs + size_t(i) * D;
                for (int c = 0; c < DV; c++) store(o + c * LANES, load(o + c * LANES) * shrink);
                tops[i] = now;
            }
            vfloat total = {};
            for (int c = 0; c < CV; c++) {
                vfloat e = (iota + c * LANES) < seen && (iota + c * LANES) >= skip ? exp_nonpositive(x[c] - now)
                                                                                   : vfloat{};
                store(s + c * LANES, e);
                total += e;
            }
            totals[i] += sum(total);
        }
    }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    // One chunk of `count` positions from c0 through VDPBF16PS: keys as [D/2, CHUNK] pairs of dimensions,
    // values as [CHUNK/2, D] pairs of positions, weights rounded to bfloat16 pairs.
    static void pair_chunk(Scratch& w, const T* keys, const T* values, const int32_t* table, int block_size,
                           int64_t stride, int kv_head, int c0, int count, float scale, int padded) {
        uint16_t* kc = reinterpret_cast<uint16_t*>(w.kc.data());  // [CHUNK, D] raw keys
        static const uint16_t zeros[D] = {};
        const uint16_t* rows[CHUNK];  // each position's values; zeros past the chunk's end
        for (int p = 0; p < CHUNK; p++) {
            if (p >= count) {
                rows[p] = zeros;
                continue;
            }
            int position = c0 + p;
            int64_t at = (int64_t(table[position / block_size]) * block_size + position % block_size) * stride +
                         int64_t(kv_head) * D;
            std::memcpy(kc + p * D, keys + at, sizeof(uint16_t) * D);
            rows[p] = values + at;
        }
        std::fill(kc + count * D, kc + CHUNK * D, uint16_t(0));
        transpose_chunk<D / 2>(w.kc.data(), w.kt.data());  // 32-bit words: pairs move together
        bf16_pair* vp = reinterpret_cast<bf16_pair*>(w.vc.data());
        const int pairs = (count + 1) / 2;
        for (int p = 0; p < pairs; p++) interleave_rows<D>(rows[2 * p], rows[2 * p + 1], vp + p * D);
        const bf16_pair* kt = reinterpret_cast<const bf16_pair*>(w.kt.data());
        for (int i = 0; i < padded; i += SCORE_TILE)
            score_tile_bf16<D, SCORE_TILE>(w.qp.data() + size_t(i) * D / 2, kt, scale, w.s.data() + i * CHUNK);
        softmax_step(w, padded, c0);
        uint16_t* weights = reinterpret_cast<uint16_t*>(w.wp.data());
        for (int i = 0; i < padded; i++)
            for (int c = 0; c < CV; c++) store_bf16(weights + i * CHUNK + c * LANES, load(w.s.data() + i * CHUNK + c * LANES));
        for (int column = 0; column < D; column += SLICE * LANES)
            for (int i = 0; i < padded; i += VALUE_TILE)
                value_tile_bf16<D, VALUE_TILE, SLICE>(w.wp.data() + size_t(i) * CHUNK / 2, vp, pairs, column,
                                                      w.o.data() + size_t(i) * D);
    }
#else
    static void pair_chunk(Scratch&, const T*, const T*, const int32_t*, int, int64_t, int, int, int, float, int) {}
#endif

    static void task(const Task& t, const float* q, const T* keys, const T* values, const int32_t* table,
                     const int32_t* lengths, const int32_t* lows, int heads, int kv_heads, int block_size,
                     float scale, float softcap, float* out, float* lse) {
        const int group = heads / kv_heads;
        const int queries = t.rows * group;
        const int padded = (queries + PAD - 1) / PAD * PAD;
        thread_local Scratch w;
        w.o.assign(size_t(padded) * D, 0.f);
        w.s.resize(size_t(padded) * CHUNK);
        w.kt.resize(size_t(D) * CHUNK);
        w.kc.resize(size_t(CHUNK) * D);
        w.vc.resize(size_t(CHUNK) * D);
        w.top.assign(padded, NO_WEIGHT);
        w.total.assign(padded, 0.f);
        w.visible.assign(padded, 0);
        w.from.assign(padded, 0);
        w.softcap = softcap;
        if constexpr (PAIRS) {
            w.qp.assign(size_t(padded) * D / 2, 0u);
            w.wp.resize(size_t(padded) * CHUNK / 2);
        } else {
            w.q.assign(size_t(padded) * D, 0.f);
        }
        int longest = 0, earliest = INT32_MAX;
        for (int r = 0; r < t.rows; r++) {
            int row = t.first + r, length = lengths[row], low = lows ? std::min(lows[row], length) : 0;
            longest = std::max(longest, length);
            earliest = std::min(earliest, low);
            for (int g = 0; g < group; g++) {
                int i = r * group + g;
                const float* src = q + (int64_t(row) * heads + t.kv_head * group + g) * D;
                if constexpr (PAIRS)  // unscaled: the scale multiplies the scores
                    for (int d = 0; d < D; d++) reinterpret_cast<uint16_t*>(w.qp.data())[size_t(i) * D + d] = bf16(src[d]);
                else
                    for (int d = 0; d < D; d++) w.q[size_t(i) * D + d] = src[d] * scale;
                w.visible[i] = length;
                w.from[i] = low;
            }
        }
        const int64_t stride = int64_t(kv_heads) * D;
        for (int c0 = earliest / CHUNK * CHUNK; c0 < longest; c0 += CHUNK) {
            int count = std::min(CHUNK, longest - c0);
            if constexpr (PAIRS) {
                pair_chunk(w, keys, values, table, block_size, stride, t.kv_head, c0, count, scale, padded);
                continue;
            }
            // the chunk's keys transposed and its values packed, both float32, once for all the queries
            float *kc = w.kc.data(), *vc = w.vc.data();
            for (int p = 0; p < count; p++) {
                int position = c0 + p;
                int64_t at = (int64_t(table[position / block_size]) * block_size + position % block_size) * stride +
                             int64_t(t.kv_head) * D;
                for (int d = 0; d < D; d += LANES) {
                    store(kc + p * D + d, load(keys + at + d));
                    store(vc + p * D + d, load(values + at + d));
                }
            }
            std::fill(kc + count * D, kc + CHUNK * D, 0.f);
            transpose_chunk<D>(kc, w.kt.data());
            for (int i = 0; i < padded; i += SCORE_TILE)
                score_tile<D, SCORE_TILE>(w.q.data() + size_t(i) * D, w.kt.data(), w.s.data() + i * CHUNK);
            softmax_step(w, padded, c0);
            for (int column = 0; column < D; column += SLICE * LANES)
                for (int i = 0; i < padded; i += VALUE_TILE)
                    value_tile<D, VALUE_TILE, SLICE>(w.s.data() + i * CHUNK, w.vc.data(), count, column,
                                                     w.o.data() + size_t(i) * D);
        }
        for (int r = 0; r < t.rows; r++) {
            for (int g = 0; g < group; g++) {
                int i = r * group + g;
                int64_t head = int64_t(t.first + r) * heads + t.kv_head * group + g;
                float* dst = out + head * D;
                float total = w.total[i];
                for (int d = 0; d < D; d++) dst[d] = total > 0.f ? w.o[size_t(i) * D + d] / total : 0.f;
                lse[head] = total > 0.f ? w.top[i] + std::log(total) : -INFINITY;
            }
        }
    }

    static void run(const float* q, const T* keys, const T* values, const int32_t* tables, int width,
                    const int32_t* bounds, int spans, const int32_t* lengths, const int32_t* lows, int heads,
                    int kv_heads, int block_size, float scale, float softcap, float* out, float* lse) {
        const int rows_per_task = std::max(1, TASK_QUERIES / (heads / kv_heads));
        std::vector<Task> tasks;
        for (int s = 0; s < spans; s++) {
            const int end = bounds[2 * s + 1];
            for (int first = bounds[2 * s]; first < end; first += rows_per_task)
                for (int h = 0; h < kv_heads; h++) tasks.push_back({s, first, std::min(rows_per_task, end - first), h});
        }
        const int count = int(tasks.size());
#pragma omp parallel for schedule(dynamic, 1)
        for (int i = 0; i < count; i++) {
            const Task& t = tasks[i];
            task(t, q, keys, values, tables + int64_t(t.span) * width, lengths, lows, heads, kv_heads, block_size,
                 scale, softcap, out, lse);
        }
    }
};

template <typename T>
static void dispatch(int head_dim, const float* q, const void* k, const void* v, const int32_t* tables, int width,
                     const int32_t* bounds, int spans, const int32_t* lengths, const int32_t* lows, int heads,
                     int kv_heads, int block_size, float scale, float softcap, float* out, float* lse) {
    switch (head_dim) {
#define SPANS(D)                                                                                           \
    case D:                                                                                                \
        SpanKernel<T, D / LANES>::run(q, static_cast<const T*>(k), static_cast<const T*>(v), tables, width, bounds, \
                               spans, lengths, lows, heads, kv_heads, block_size, scale, softcap, out, lse); \
        return;
        PB_HEAD_SIZES(SPANS)
#undef SPANS
    }
}

extern "C" {

// 1 where bfloat16 pools go through VDPBF16PS, their softmax weights rounded to bfloat16; else 0.
int pb_span_bf16_weights() { return BF16_DOT; }

// q [rows, heads, head_dim] float32; k, v [blocks, block_size, kv_heads, head_dim] float32 or bfloat16
// (bf16 = 1); tables [spans, width], bounds [spans, 2] (span s is rows bounds[s][0] to bounds[s][1], the
// spans apart) and lengths [rows] int32; lows [rows] int32 or null: row r attends to its positions
// lows[r].. only (a sliding window); softcap > 0: scores s become softcap * tanh(s / softcap);
// out [rows, heads, head_dim] and lse [rows, heads] float32,
// written for the spans' rows only. Every tensor contiguous. Returns 0; -1 for a head size it does not
// take, -2 for a span past the rows, a context longer than its table or a block outside the pool
// (nothing is read then).
int pb_span_attention(const float* q, const void* k, const void* v, int bf16, int num_blocks, const int32_t* tables,
                      int width, const int32_t* bounds, int spans, const int32_t* lengths, const int32_t* lows,
                      int rows, int heads, int kv_heads, int head_dim, int block_size, float scale, float softcap,
                      float* out, float* lse) {
    if (!head_dim_supported(head_dim) || heads % kv_heads) return -1;
    for (int s = 0; s < spans; s++) {
        const int begin = bounds[2 * s], end = bounds[2 * s + 1];
        if (begin < 0 || begin > end || end > rows) return -2;
        int longest = 0;  // the table's blocks that the longest row reads cover every other row's
        for (int r = begin; r < end; r++) longest = std::max(longest, lengths[r]);
        if (!context_in_bounds(tables + int64_t(s) * width, width, longest, block_size, num_blocks)) return -2;
    }
    if (bf16)
        dispatch<uint16_t>(head_dim, q, k, v, tables, width, bounds, spans, lengths, lows, heads, kv_heads,
                           block_size, scale, softcap, out, lse);
    else
        dispatch<float>(head_dim, q, k, v, tables, width, bounds, spans, lengths, lows, heads, kv_heads, block_size,
                        scale, softcap, out, lse);
    return 0;
}
}
