// The CPU engine's per-token kernels: RMSNorm (with the residual add), neox rotary embedding,
// SiLU-and-multiply and the KV-cache write. torch runs each as several ops of ~10 us of dispatch apiece,
// ~100-250 us a call where a decode step's arithmetic is ~1 us; compiled, dynamo's guards cost as
// much. These are the same arithmetic in one pass, float32 inside as the reference kernels
// (pagedbatch_kernels/reference.py) compute it, for float32 and bfloat16 tensors; rows are shared
// among torch's OpenMP threads where a call has enough of them to pay for waking the threads.

// Products and sums rounded one by one, as torch's element-wise ops round them: no fused multiply-adds.
#pragma GCC optimize("fp-contract=off")

#include "cpu_vec.h"

constexpr int64_t PARALLEL_ELEMENTS = 32 * 1024;  // below this, one thread: waking the others costs more

static inline float widen(float x) { return x; }
static inline float widen(uint16_t x) {
    uint32_t bits = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
static inline void narrow(float x, float* out) { *out = x; }
static inline void narrow(float x, uint16_t* out) {  // round to nearest even, as torch's float -> bfloat16
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffff) > 0x7f800000) {
        *out = uint16_t((bits >> 16) | 0x40);  // NaN stays NaN
        return;
    }
    bits += 0x7fff + ((bits >> 16) & 1);
    *out = uint16_t(bits >> 16);
}

static inline vfloat round_to(vfloat v, const float*) { return v; }
static inline vfloat round_to(vfloat v, const uint16_t*) { return round_bf16(v); }

// Vectors stored as T: bfloat16 rounded as round_bf16.
static inline void put(float* out, vfloat v) { store(out, v); }
static inline void put(uint16_t* out, vfloat v) {
    vfloat rounded = round_bf16(v);
    vuint bits;
    std::memcpy(&bits, &rounded, sizeof bits);
    bits >>= 16;
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i*)out, _mm512_cvtepi32_epi16((__m512i)bits));
#elif defined(__AVX2__)
    __m256i x = (__m256i)bits;  // each lane below 2^16: the unsigned saturating pack keeps it
    _mm_storeu_si128((__m128i*)out, _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
#else
    vhalf h = __builtin_convertvector(bits, vhalf);
    std::memcpy(out, &h, sizeof h);
#endif
}

// out = rms_norm(x (+ residual)) * weight; with a residual, sum_out = x + residual (rounded to T first,
// as torch adds in the tensors' dtype).
template <typename T>
static void rms_norm(const T* x, const T* residual, const T* weight, T* out, T* sum_out, int rows, int size,
                     float eps) {
#pragma omp parallel for schedule(static) if (int64_t(rows) * size >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        thread_local std::vector<float> row;
        row.resize(size);
        const int64_t at = int64_t(r) * size;
        int i = 0;
        vfloat lanes = {};
        for (; i + LANES <= size; i += LANES) {
            vfloat v = load(x + at + i);
            if (residual) {
                v = round_to(v + load(residual + at + i), x);
                put(sum_out + at + i, v);
            }
            store(row.data() + i, v);
            lanes += v * v;
        }
        float squares = sum(lanes);
        for (; i < size; i++) {
            float v = widen(x[at + i]);
            if (residual) {
                T rounded;
                narrow(v + widen(residual[at + i]), &rounded);
                sum_out[at + i] = rounded;
                v = widen(rounded);
            }
            row[i] = v;
            squares += v * v;
        }
        const float inverse = 1.f / std::sqrt(squares / size + eps);
        for (i = 0; i + LANES <= size; i += LANES) put(out + at + i, load(row.data() + i) * inverse * load(weight + i));
        for (; i < size; i++) narrow(row[i] * inverse * widen(weight[i]), out + at + i);
    }
}

// Rotates `heads` heads of head_dim at x (row stride x_stride, heads contiguous) into out (contiguous):
// halves x1, x2 -> (x1 cos - x2 sin, x2 cos + x1 sin), cos and sin of each token's position.
template <typename T>
static void rotary(const T* x, int64_t x_stride, const int64_t* positions, const float* cos_sin, int tokens,
                   int heads, int head_dim, T* out) {
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (int64_t(tokens) * heads * head_dim >= PARALLEL_ELEMENTS)
    for (int t = 0; t < tokens; t++) {
        const float* cos = cos_sin + positions[t] * head_dim;
        const float* sin = cos + half;
        for (int h = 0; h < heads; h++) {
            const T* in = x + t * x_stride + int64_t(h) * head_dim;
            T* o = out + (int64_t(t) * heads + h) * head_dim;
            int i = 0;
            for (; i + LANES <= half; i += LANES) {
                vfloat x1 = load(in + i), x2 = load(in + i + half), c = load(cos + i), s = load(sin + i);
                put(o + i, x1 * c - x2 * s);
                put(o + i + half, x2 * c + x1 * s);
            }
            for (; i < half; i++) {
                float x1 = widen(in[i]), x2 = widen(in[i + half]);
                narrow(x1 * cos[i] - x2 * sin[i], o + i);
                narrow(x2 * cos[i] + x1 * sin[i], o + i + half);
            }
        }
    }
}


// out[r] = silu(x[r][:size]) * x[r][size:] for rows of 2 * size, float32 (a bfloat16 one ran slower
// than torch's).
static void silu_and_mul(const float* x, int rows, int size, float* out) {
#pragma omp parallel for schedule(static) if (int64_t(rows) * size >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float* gate = x + int64_t(r) * 2 * size;
        const float* up = gate + size;
        float* o = out + int64_t(r) * size;
        int i = 0;
        for (; i + LANES <= size; i += LANES) {
            vfloat g = load(gate + i);
            store(o + i, g / (1.f + exp_any(-g)) * load(up + i));
        }
        for (; i < size; i++) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
}

// float8_e4m3fn weight codes [n, k] times their scales [n, groups] (`k / groups` inputs a group), as T:
// what quant_reference.dequantize computes (the code exactly, times the scale in float32, rounded once to
// T). The code's 7 magnitude bits go to the top of a float32's exponent and mantissa, which reads as the
// value times 2^-120 (a subnormal float32 for an FP8 subnormal); NaN codes stay NaN.
template <typename T>
static void dequant_fp8(const uint8_t* q, const T* scales, T* out, int64_t n, int64_t k, int64_t groups) {
    const int64_t per_group = k / groups;
#pragma omp parallel for schedule(static) if (n * k >= 4 * PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float scale = widen(scales[r * groups + g]);
            const int64_t at = r * k + g * per_group;
            for (int64_t c = 0; c < per_group; c++) {
                const uint32_t b = q[at + c], magnitude = b & 0x7f;
                const uint32_t bits = ((b & 0x80) << 24) | (magnitude << 20) | (magnitude == 0x7f ? 0x7fc00000u : 0u);
                float value;
                std::memcpy(&value, &bits, sizeof value);
                narrow(value * 0x1p120f * scale, out + at + c);
            }
        }
    }
}

extern "C" {

// dtype: 0 float32, 1 bfloat16; every tensor contiguous unless a stride says otherwise.
void pb_rms_norm(const void* x, const void* residual, const void* weight, void* out, void* sum_out, int rows,
                 int size, float eps, int bf16) {
    if (bf16)
        rms_norm((const uint16_t*)x, (const uint16_t*)residual, (const uint16_t*)weight, (uint16_t*)out,
                 (uint16_t*)sum_out, rows, size, eps);
    else
        rms_norm((const float*)x, (const float*)residual, (const float*)weight, (float*)out, (float*)sum_out, rows,
                 size, eps);
}

void pb_silu_and_mul(const float* x, int rows, int size, float* out) { silu_and_mul(x, rows, size, out); }

// Returns -2 (and writes nothing) where a position is past the cos_sin table's max_positions rows.
int pb_rotary(const void* x, int64_t x_stride, const int64_t* positions, const float* cos_sin, int64_t max_positions,
              int tokens, int heads, int head_dim, void* out, int bf16) {
    for (int t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return -2;
    if (bf16)
        rotary((const uint16_t*)x, x_stride, positions, cos_sin, tokens, heads, head_dim, (uint16_t*)out);
    else
        rotary((const float*)x, x_stride, positions, cos_sin, tokens, heads, head_dim, (float*)out);
    return 0;
}

// Row t of key and value (`width` elements each, row strides key_stride, value_stride) into slot
// slots[t] of the caches ([slots, width], the same dtype); a slot below 0 is skipped. Returns -2 (and
// writes nothing) where a slot is past the caches.
int pb_write_kv(const void* key, int64_t key_stride, const void* value, int64_t value_stride, void* k_cache,
                void* v_cache, const int64_t* slots, int tokens, int64_t num_slots, int width, int element_size) {
    for (int t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return -2;
    const char* k = static_cast<const char*>(key);
    const char* v = static_cast<const char*>(value);
    for (int t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        int64_t bytes = int64_t(width) * element_size;
        std::memcpy(static_cast<char*>(k_cache) + slots[t] * bytes, k + t * key_stride * element_size, bytes);
        std::memcpy(static_cast<char*>(v_cache) + slots[t] * bytes, v + t * value_stride * element_size, bytes);
    }
    return 0;
}

void pb_dequant_fp8(const uint8_t* q, const void* scales, void* out, int64_t n, int64_t k, int64_t groups, int bf16) {
    if (bf16)
        dequant_fp8(q, (const uint16_t*)scales, (uint16_t*)out, n, k, groups);
    else
        dequant_fp8(q, (const float*)scales, (float*)out, n, k, groups);
}
}
