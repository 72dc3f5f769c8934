// Vector helpers shared by the native CPU attention kernels: 16-float vectors as GCC/Clang vector
// extensions (one AVX-512 register, two AVX2 or four NEON ones), loads of float32 and bfloat16, sums,
// an exp for non-positive arguments, and the walk over a row's positions through its block table.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

// One vector register of floats: 16 with AVX-512, 8 with AVX/AVX2, else 4 (SSE, NEON). GCC lowers
// wider vector types than the target has through the stack, so the width follows the target. A tile
// keeps up to ACCUMULATORS vectors in registers: three quarters of the REGISTERS.
#if defined(__AVX512F__)
constexpr int LANES = 16, REGISTERS = 32;
#elif defined(__AVX__)
constexpr int LANES = 8, REGISTERS = 16;
#elif defined(__aarch64__)
constexpr int LANES = 4, REGISTERS = 32;
#else
constexpr int LANES = 4, REGISTERS = 16;
#endif
constexpr int ACCUMULATORS = REGISTERS * 3 / 4;

typedef float vfloat __attribute__((vector_size(4 * LANES)));
typedef int32_t vint __attribute__((vector_size(4 * LANES)));
typedef uint32_t vuint __attribute__((vector_size(4 * LANES)));
typedef uint16_t vhalf __attribute__((vector_size(2 * LANES)));

constexpr float NO_WEIGHT = -1e30f;  // past the context: exp gives exactly 0

// x in every lane, one broadcast (vfloat{} + x adds a zero first, as -0.f + 0.f is not -0.f; a loop of
// lane stores GCC sometimes builds of inserts)
static inline vfloat splat(float x) {
#if defined(__AVX512F__)
    return (vfloat)_mm512_set1_ps(x);
#elif defined(__AVX__)
    return (vfloat)_mm256_set1_ps(x);
#else
    vfloat v;
    for (int i = 0; i < LANES; i++) v[i] = x;
    return v;
#endif
}
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
// x as bfloat16, rounded to nearest even (NaN stays NaN)
static inline uint16_t bf16(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t(bits >> 16 | 0x40);
    return uint16_t((bits + 0x7fffu + (bits >> 16 & 1u)) >> 16);
}

static inline float sum(vfloat v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX__)
    __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#else
    float s = 0.f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}

static inline float max(vfloat v) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)v);
#elif defined(__AVX__)
    __m128 x = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
#else
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = std::max(m, v[i]);
    return m;
#endif
}

// p(y) 2^n: e^y for |y| <= ln 2 / 2 by a degree-6 polynomial, times 2^n (n integer-valued, -126..127).
static inline vfloat exp_parts(vfloat n, vfloat y) {
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
    return p * scale;
}

constexpr float ROUNDS = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds a float to an integer

// exp(x) for x <= 0: 2^round(x log2 e) times a degree-6 polynomial of the rest (under 2 ulp); 0 below -87.
static inline vfloat exp_nonpositive(vfloat x) {
    vfloat t = (x < -87.f ? splat(-87.f) : x) * 1.44269504f;
    vfloat n = (t + ROUNDS) - ROUNDS;
    return x < -87.f ? vfloat{} : exp_parts(n, (t - n) * 0.693147181f);
}

// exp(x) for any float x within ~1 ulp: x = n ln 2 + y with n an integer (ln 2 in two parts, so that
// n ln 2 is exact) and |y| <= ln 2 / 2, e^y by a degree-6 polynomial, times 2^n; 0 below -87, inf above
// 88.7.
static inline vfloat exp_any(vfloat x) {
    vfloat c = x < -87.f ? splat(-87.f) : (x > 88.f ? splat(88.f) : x);
    vfloat n = (c * 1.44269504f + ROUNDS) - ROUNDS;
    vfloat e = exp_parts(n, (c - n * 0.693359375f) - n * -2.12194440e-4f);
    e = x < -87.f ? vfloat{} : e;
    return x > 88.7f ? splat(INFINITY) : e;
}

// v rounded to bfloat16 (to nearest even, a NaN kept a NaN) as torch's float -> bfloat16, still float32.
static inline vfloat round_bf16(vfloat v) {
    vuint bits;
    std::memcpy(&bits, &v, sizeof bits);
    vuint rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    rounded = (bits & 0x7fffffffu) > 0x7f800000u ? (bits | 0x400000u) & 0xffff0000u : rounded;
    vfloat out;
    std::memcpy(&out, &rounded, sizeof out);
    return out;
}

// cap * tanh(x / cap) (attention logit soft-capping): tanh(a) as (1 - e) / (1 + e) with e = exp(-2a),
// a = |x / cap|; below 1/8, where that loses digits, by its Taylor series.
static inline vfloat soft_cap(vfloat x, float cap) {
    vfloat y = x / cap;
    vfloat a = y < 0.f ? -y : y;
    vfloat e = exp_nonpositive(-2.f * a);
    vfloat a2 = a * a;
    vfloat series = a * (1.f + a2 * (-1.f / 3 + a2 * (2.f / 15 + a2 * (-17.f / 315))));
    vfloat t = (a < 0.125f ? series : (1.f - e) / (1.f + e)) * cap;
    return y < 0.f ? -t : t;
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


// The head sizes the kernels are built for: X(head size) for each.
#define PB_HEAD_SIZES(X) X(16) X(32) X(48) X(64) X(80) X(96) X(112) X(128) X(160) X(192) X(256)

static inline bool head_dim_supported(int head_dim) {
    switch (head_dim) {
#define PB_CASE(D) case D:
        PB_HEAD_SIZES(PB_CASE)
#undef PB_CASE
        return true;
        default:
            return false;
    }
}

// A context of `length` positions within its table of `width` blocks, every block it reads within the pool.
static inline bool context_in_bounds(const int32_t* table, int width, int length, int block_size, int num_blocks) {
    if (length > int64_t(width) * block_size) return false;
    for (int b = 0; int64_t(b) * block_size < length; b++)
        if (table[b] < 0 || table[b] >= num_blocks) return false;
    return true;
}
