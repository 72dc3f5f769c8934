// The CPU engine's routed experts for a step of few tokens (decode): sum_j w[t, j] * expert_{ids[t, j]}(x[t])
// with each expert a SwiGLU MLP (gate/up rows [2I, H], gate first; down [H, I]), in one call. Each expert
// that has tokens reads its weights once, for all of its rows together (register tiles of TILE_OUTS outputs
// by up to TILE_ROWS token rows, over weights block-packed at load so that a tile streams contiguous
// memory: see pb_moe_tile_outs); experts that no token chose are not read at all. torch's way (a zero-padded batch of
// every expert through two bmm, or a loop of matmuls per expert) reads every expert's weights or pays a
// dozen dispatches per expert; at a decode step's size both cost more than the arithmetic.
//
// Arithmetic as the torch path: float32 products summed in float32 (bfloat16 weights widened exactly), SiLU's
// exp within ~1 ulp (`exp_any`, vectorised as the outputs' rounding and stores: scalar, they were ~40 % of a
// decode step's call);
// for bfloat16 the gate/up and down outputs and the SiLU product are rounded to bfloat16 where torch's
// bfloat16 matmuls and element-wise ops round them. The weighted sum over a token's k choices is float32,
// in choice order.

#include <memory>

#include "cpu_vec.h"

constexpr int TILE_VECTORS = 2;                          // output vectors of one register tile
constexpr int TILE_ROWS = ACCUMULATORS / TILE_VECTORS;   // token rows of one tile (12 AVX-512, 6 AVX2)
constexpr int TILE_OUTS = TILE_VECTORS * LANES;          // the packed layout's block of outputs
constexpr int BLOCK_OUTS = 64;                           // outputs of one work item (a multiple of TILE_OUTS)
static_assert(BLOCK_OUTS % TILE_OUTS == 0, "a work item starts a tile");
constexpr int64_t PARALLEL_MACS = 256 * 1024;      // below this many multiply-adds a call, one thread

static inline float round_scalar(float x, bool bf16) {
    if (!bf16) return x;
    uint32_t bits = uint32_t(::bf16(x)) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load_scalar(const float* p) { return *p; }
static inline float load_scalar(const uint16_t* p) {
    uint32_t bits = uint32_t(*p) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// the first `valid` lanes of v (all of them from LANES on) at out, rounded to bfloat16 where `round`
static inline void put(float* out, vfloat v, int valid, bool round) {
    if (round) v = round_bf16(v);
    if (valid >= LANES) return store(out, v);
    for (int i = 0; i < valid; i++) out[i] = v[i];
}

// y[r][n] = sum_k x[r][k] * w[k][n] for rows r < count and outputs n in [n0, n1), n0 a multiple of TILE_OUTS;
// w packed (`pb_moe_tile_outs`): [N / TILE_OUTS][K][TILE_OUTS], the outputs past N zero, so a tile of `count`
// rows by TILE_OUTS outputs streams one contiguous run of K * TILE_OUTS weights and its accumulators hold
// outputs side by side (no horizontal sum). Outputs past n1 are computed and not stored.
template <int count, typename W>
static void tile_rows(const float* const* x, const W* w, int K, int n0, int n1, float* const* y, bool round) {
    for (int n = n0; n < n1; n += TILE_OUTS) {
        const W* wt = w + int64_t(n / TILE_OUTS) * K * TILE_OUTS;
        vfloat acc[count][TILE_VECTORS] = {};
        for (int k = 0; k < K; k++) {
            vfloat wv[TILE_VECTORS];
            for (int v = 0; v < TILE_VECTORS; v++) wv[v] = load(wt + k * TILE_OUTS + v * LANES);
            for (int r = 0; r < count; r++) {
                vfloat xb = splat(x[r][k]);
                for (int v = 0; v < TILE_VECTORS; v++) acc[r][v] += xb * wv[v];
            }
        }
        const int valid = std::min(TILE_OUTS, n1 - n);
        for (int r = 0; r < count; r++)
            for (int v = 0; v < TILE_VECTORS; v++) put(y[r] + n + v * LANES, acc[r][v], valid - v * LANES, round);
    }
}

template <int count, typename W>
static void tile_tail(const float* const* in, const W* w, int K, int n0, int n1, float* const* out, int rest,
                      bool round) {
    if constexpr (count > 0) {
        if (rest == count) return tile_rows<count>(in, w, K, n0, n1, out, round);
        tile_tail<count - 1>(in, w, K, n0, n1, out, rest, round);
    }
}

// outputs [n0, n1) of one packed weight for its `count` rows (row i reads in[i], writes out[i])
template <typename W>
static void expert_block(const float* const* in, float* const* out, int count, const W* w, int K, int n0, int n1,
                         bool round) {
    int r = 0;
    for (; r + TILE_ROWS <= count; r += TILE_ROWS) tile_rows<TILE_ROWS>(in + r, w, K, n0, n1, out + r, round);
    if (r < count) tile_tail<TILE_ROWS - 1>(in + r, w, K, n0, n1, out + r, count - r, round);
}

static inline int64_t padded(int n) { return (int64_t(n) + TILE_OUTS - 1) / TILE_OUTS * TILE_OUTS; }

template <typename W>
static void moe(const float* x, int tokens, int hidden, const W* gate_up, const W* down, int inter, int experts,
                const int64_t* ids, const float* weights, int k, float* out, bool round) {
    const int slots = tokens * k;
    // the slots of each expert, in slot order (a counting sort)
    std::vector<int> start(experts + 1, 0), order(slots);
    for (int s = 0; s < slots; s++) start[ids[s] + 1]++;
    for (int e = 0; e < experts; e++) start[e + 1] += start[e];
    {
        std::vector<int> fill(start.begin(), start.end() - 1);
        for (int s = 0; s < slots; s++) order[fill[ids[s]]++] = s;
    }
    // scratch, left uninitialised (every element is written before it is read)
    std::unique_ptr<float[]> h(new float[int64_t(slots) * 2 * inter]), act(new float[int64_t(slots) * inter]),
        y(new float[int64_t(slots) * hidden]);
    std::vector<const float*> x_rows(slots), act_in(slots);
    std::vector<float*> gate_rows(slots), up_rows(slots), act_rows(slots), y_rows(slots);
    for (int i = 0; i < slots; i++) {
        int s = order[i];
        x_rows[i] = x + int64_t(s / k) * hidden;
        gate_rows[i] = h.get() + int64_t(s) * 2 * inter;
        up_rows[i] = gate_rows[i] + inter;
        act_rows[i] = act.get() + int64_t(s) * inter;
        act_in[i] = act_rows[i];
        y_rows[i] = y.get() + int64_t(s) * hidden;
    }
    // work items: (expert, block of outputs)
    std::vector<std::pair<int, int>> items1, items2;
    for (int e = 0; e < experts; e++) {
        if (start[e + 1] == start[e]) continue;
        for (int n = 0; n < inter; n += BLOCK_OUTS) items1.push_back({e, n});
        for (int n = 0; n < hidden; n += BLOCK_OUTS) items2.push_back({e, n});
    }
    const bool parallel = int64_t(slots) * 3 * inter * hidden >= PARALLEL_MACS;
    const int n1 = int(items1.size()), n2 = int(items2.size());
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int i = 0; i < n1; i++) {
            int e = items1[i].first, lo = items1[i].second, hi = std::min(inter, lo + BLOCK_OUTS);
            int first = start[e], count = start[e + 1] - first;
            // the expert's gate then its up matrix, each packed over padded(inter) outputs
            const W* w = gate_up + int64_t(e) * 2 * padded(inter) * hidden;
            expert_block(x_rows.data() + first, gate_rows.data() + first, count, w, hidden, lo, hi, round);
            expert_block(x_rows.data() + first, up_rows.data() + first, count, w + padded(inter) * hidden, hidden,
                         lo, hi, round);
            for (int r = 0; r < count; r++) {
                const float* g = gate_rows[first + r];
                const float* u = up_rows[first + r];
                float* a = act_rows[first + r];
                int j = lo;
                for (; j + LANES <= hi; j += LANES) {
                    vfloat gate = load(g + j), silu = gate / (1.f + exp_any(-gate));
                    put(a + j, (round ? round_bf16(silu) : silu) * load(u + j), LANES, round);
                }
                for (; j < hi; j++) {
                    float silu = round_scalar(g[j] / (1.f + std::exp(-g[j])), round);
                    a[j] = round_scalar(silu * u[j], round);
                }
            }
        }
#pragma omp for schedule(static)
        for (int i = 0; i < n2; i++) {
            int e = items2[i].first, lo = items2[i].second, hi = std::min(hidden, lo + BLOCK_OUTS);
            int first = start[e], count = start[e + 1] - first;
            expert_block(act_in.data() + first, y_rows.data() + first, count, down + int64_t(e) * padded(hidden) * inter,
                         inter, lo, hi, round);
        }
#pragma omp for schedule(static)
        for (int t = 0; t < tokens; t++) {
            float* o = out + int64_t(t) * hidden;
            for (int c = 0; c < hidden; c++) o[c] = 0.f;
            for (int j = 0; j < k; j++) {
                const float wt = weights[int64_t(t) * k + j];
                const float* src = y.get() + (int64_t(t) * k + j) * hidden;
                for (int c = 0; c < hidden; c++) o[c] += src[c] * wt;
            }
        }
    }
}

extern "C" {

// The outputs of one block of the packed layout: a matrix [N, K] (y = W x) is packed as
// [ceil(N / T)][K][T] with T this number (32 with AVX-512, 16 with AVX2), the rows past N zero.
int pb_moe_tile_outs() { return TILE_OUTS; }

// x [tokens, hidden] float32; gate_up [experts][2][padded(inter) / T][hidden][T] (each expert's gate matrix,
// then its up matrix, packed) and down [experts][padded(hidden) / T][inter][T], float32 (bf16 0) or bfloat16
// (bf16 1); ids [tokens, k] int64 in [0, experts); weights [tokens, k] float32; out [tokens, hidden]
// float32. Every tensor contiguous. Returns -1 (writing nothing) for an id out of range.
int pb_moe_experts(const float* x, int tokens, int hidden, const void* gate_up, const void* down, int inter,
                   int experts, const int64_t* ids, const float* weights, int k, float* out, int bf16) {
    for (int64_t s = 0; s < int64_t(tokens) * k; s++)
        if (ids[s] < 0 || ids[s] >= experts) return -1;
    if (bf16)
        moe(x, tokens, hidden, (const uint16_t*)gate_up, (const uint16_t*)down, inter, experts, ids, weights, k, out,
            true);
    else
        moe(x, tokens, hidden, (const float*)gate_up, (const float*)down, inter, experts, ids, weights, k, out,
            false);
    return 0;
}
}
