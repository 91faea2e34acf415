/* DropIT's CPU packs as single loops (dropit_core/backends/native.py builds and loads this file).
 *
 * Each function computes what the eager torch path of dropit_core computes, value for value:
 * the same fp32 operations in the same order, built with -ffp-contract=off so that no multiply
 * and add are fused into one rounding. Eager torch makes a pass over memory per operation (ten
 * or so for a 4-bit pack, each with its own temporaries); here a value is read once and its code
 * written once, and the per-call cost is one C call, not an operator dispatch per operation.
 */
#include <stdint.h>
#include <string.h>

/* The draw's constants are seeds.py's, defined by the build (native.py's SPEC). */
#if !defined(MIX_MUL1) || !defined(MIX_MUL2) || !defined(TABLE_BITS) || !defined(UNIFORM_BITS)
#error "build with native.py: it defines the constants of seeds.py"
#endif
#define TABLE (1 << TABLE_BITS)
#define UNIFORM_SHIFT (32 - UNIFORM_BITS)

static inline uint32_t mix32(uint32_t x) { /* seeds.mix32 */
    x ^= x >> 16;
    x *= MIX_MUL1;
    x ^= x >> 15;
    x *= MIX_MUL2;
    x ^= x >> 15;
    return x;
}

/* GCC/Clang vector extensions: four fp32 lanes, and the same lanes as integers (selects). */
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

static inline f32x4 select4(i32x4 take, f32x4 a, f32x4 b) { /* take ? a : b, lane by lane */
    i32x4 r = ((i32x4)a & take) | ((i32x4)b & ~take);
    return (f32x4)r;
}

/* The minimum and maximum of x[0..n), n >= 1: two sets of four lanes (no serial chain of
 * compares), then the lanes in a fixed order. Either is an element of x. */
static void range_of(const float *x, int64_t n, float *lo_out, float *hi_out) {
    f32x4 lo_a = {x[0], x[0], x[0], x[0]}, hi_a = lo_a, lo_b = lo_a, hi_b = lo_a;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        f32x4 a, b;
        memcpy(&a, x + i, sizeof a);
        memcpy(&b, x + i + 4, sizeof b);
        lo_a = select4(a < lo_a, a, lo_a);
        hi_a = select4(a > hi_a, a, hi_a);
        lo_b = select4(b < lo_b, b, lo_b);
        hi_b = select4(b > hi_b, b, hi_b);
    }
    float lo = x[0], hi = x[0];
    for (int k = 0; k < 4; k++) {
        lo = lo_a[k] < lo ? lo_a[k] : lo;
        lo = lo_b[k] < lo ? lo_b[k] : lo;
        hi = hi_a[k] > hi ? hi_a[k] : hi;
        hi = hi_b[k] > hi ? hi_b[k] : hi;
    }
    for (; i < n; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    *lo_out = lo;
    *hi_out = hi;
}

/* Codes of xs[0..len) into code[0..len): floor(min((x - lo) / step + u, levels)), u the draw
 * of the element (lows[j] ^ high, 24 bits) times 2^-24, exact in fp32. */
static void codes_of(const float *xs, const uint32_t *lows, uint32_t high, int64_t len, float lo,
                     float step, float levels, uint8_t *code) {
    for (int64_t j = 0; j < len; j++) {
        float y = (xs[j] - lo) / step;
        y = y + (float)(int32_t)(lows[j] ^ high) * (1.0f / (float)(1 << UNIFORM_BITS));
        y = y > levels ? levels : y;
        code[j] = (uint8_t)(int32_t)y;
    }
}

/* len codes (len a multiple of 8 / BITS, else the last byte is padded with zero codes) into
 * bytes, the first code in the low bits. */
#define PACK_CODES(BITS)                                                                         \
    static void pack_##BITS(const uint8_t *code, int64_t len, uint8_t *out) {                    \
        enum { PER = 8 / BITS };                                                                  \
        const int64_t whole = len / PER;                                                          \
        for (int64_t b = 0; b < whole; b++) {                                                     \
            uint8_t v = 0;                                                                        \
            for (int k = 0; k < PER; k++) v |= (uint8_t)(code[b * PER + k] << (k * BITS));      \
            out[b] = v;                                                                           \
        }                                                                                         \
        if (whole * PER < len) {                                                                  \
            uint8_t v = 0;                                                                        \
            for (int k = 0; whole * PER + k < len; k++)                                           \
                v |= (uint8_t)(code[whole * PER + k] << (k * BITS));                              \
            out[whole] = v;                                                                       \
        }                                                                                         \
    }
PACK_CODES(2)
PACK_CODES(4)

/* The inverse: the codes of ceil(len / PER) bytes (a last byte's padding codes included). */
#define UNPACK_CODES(BITS)                                                                       \
    static void unpack_##BITS(const uint8_t *in, int64_t len, uint8_t *code) {                   \
        enum { PER = 8 / BITS, MASK = (1 << BITS) - 1 };                                          \
        const int64_t bytes = (len + PER - 1) / PER;                                              \
        for (int64_t b = 0; b < bytes; b++)                                                       \
            for (int k = 0; k < PER; k++) code[b * PER + k] = (uint8_t)((in[b] >> (k * BITS)) & MASK); \
    }
UNPACK_CODES(2)
UNPACK_CODES(4)

/* fp32 -> bf16 -> fp32, rounding to nearest even as torch's .to(torch.bfloat16) does (NaN left
 * a NaN). */
static inline float round_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return v;
    u += 0x7FFFu + ((u >> 16) & 1u);
    u &= 0xFFFF0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* fp32 -> fp16 -> fp32, rounding to nearest even as torch's .to(torch.float16) does: 13 bits
 * dropped from a normal value, a multiple of 2^-24 below fp16's smallest normal (2^-14), inf
 * from 65520 up (fp16's largest is 65504). */
static inline float round_fp16(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    const uint32_t sign = u & 0x80000000u, a = u & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return v;                         /* inf, NaN */
    if (a >= 0x477FF000u) u = sign | 0x7F800000u;           /* >= 65520: inf */
    else if (a >= 0x38800000u) u = sign | ((a + 0xFFFu + ((a >> 13) & 1u)) & 0xFFFFE000u);
    else {                                                  /* fp16 subnormal or zero */
        float q;
        memcpy(&q, &a, sizeof q);
        q = q * 0x1p24f;                                    /* exact: a power of two */
        q = (q + 0x1p23f) - 0x1p23f;                        /* q < 1024: nearest even integer */
        q = q * 0x1p-24f;
        memcpy(&u, &q, sizeof u);
        u |= sign;
    }
    memcpy(&v, &u, sizeof v);
    return v;
}

/* xs[0..len) rounded as `cast` says (1: bf16, 2: fp16) into out[0..len). */
static void round_into(const float *xs, int64_t len, int64_t cast, float *out) {
    if (cast == 1)
        for (int64_t j = 0; j < len; j++) out[j] = round_bf16(xs[j]);
    else
        for (int64_t j = 0; j < len; j++) out[j] = round_fp16(xs[j]);
}

/* Quant's pack of n fp32 values: groups of `group` values (the last may be shorter), each as
 * its minimum, its step ((max - min) * inv_levels, at least the smallest normal) and `bits`-bit
 * codes floor(min((x - min) / step + u, levels)), u = 24-bit draw * 2^-24 of element i:
 * (mix32(i mod TABLE + k0) ^ mix32(i / TABLE + k1)) >> UNIFORM_SHIFT (seeds.hash_bits), i = start + the
 * element's place in x (a range of a larger pack starts where its first group lies). Codes are
 * packed 8 / bits per byte, the first in the low bits; a group's codes start on a byte (the
 * caller checks group % (8 / bits) == 0) and the last byte is padded with zero codes. cast 1 or
 * 2: every value is read as its bf16 or fp16 rounding (the pack of x.to(dtype), bit for bit),
 * a chunk at a time, so no rounded copy of x is made. */
void dropit_quant_pack(const float *x, int64_t n, int64_t start, int64_t group, int64_t bits,
                       uint32_t k0, uint32_t k1, float inv_levels, int64_t cast, uint8_t *codes,
                       float *mins, float *scales) {
    uint32_t low[TABLE];
    for (uint32_t j = 0; j < TABLE; j++) low[j] = mix32(j + k0) >> UNIFORM_SHIFT;
    const float levels = (float)((1 << bits) - 1);
    const float tiny = 1.17549435082228750797e-38f; /* torch.finfo(float32).tiny */
    const int64_t per_byte = 8 / bits;
    uint8_t code[TABLE];
    float rounded[TABLE];
    for (int64_t g = 0, first = 0; first < n; g++, first += group) {
        const int64_t end = first + group < n ? first + group : n;
        float lo, hi;
        if (cast == 0) {
            range_of(x + first, end - first, &lo, &hi);
        } else { /* the chunks' ranges: a minimum and a maximum are exact in any order */
            for (int64_t at = first; at < end; at += TABLE) {
                const int64_t len = end - at < TABLE ? end - at : TABLE;
                float clo, chi;
                round_into(x + at, len, cast, rounded);
                range_of(rounded, len, &clo, &chi);
                lo = at == first || clo < lo ? clo : lo;
                hi = at == first || chi > hi ? chi : hi;
            }
        }
        float step = (hi - lo) * inv_levels;
        step = step < tiny ? tiny : step;
        mins[g] = lo;
        scales[g] = step;
        uint8_t *out = codes + first / per_byte;
        /* a chunk at a time within one TABLE-row of the draw table: one `high` per chunk, and
         * every chunk but a group's last starts and ends on a byte of codes */
        for (int64_t at = first; at < end;) {
            const int64_t index = start + at;
            const int64_t row_end = at + (TABLE - index % TABLE);
            const int64_t stop = end < row_end ? end : row_end;
            const int64_t len = stop - at;
            const uint32_t high = mix32((uint32_t)(index / TABLE) + k1) >> UNIFORM_SHIFT;
            uint8_t *dst = bits == 8 ? out : code;
            const float *xs = x + at;
            if (cast != 0) {
                round_into(xs, len, cast, rounded);
                xs = rounded;
            }
            codes_of(xs, low + index % TABLE, high, len, lo, step, levels, dst);
            if (bits == 4) pack_4(code, len, out);
            if (bits == 2) pack_2(code, len, out);
            out += (len + per_byte - 1) / per_byte;
            at = stop;
        }
    }
}

/* Quant's rebuild: value i = (float)code_i * step + min of its group, as fp32. */
void dropit_quant_rebuild(const uint8_t *codes, const float *mins, const float *scales,
                          int64_t n, int64_t group, int64_t bits, float *out) {
    const int64_t per_byte = 8 / bits;
    uint8_t code[TABLE];
    for (int64_t g = 0, first = 0; first < n; g++, first += group) {
        const int64_t end = first + group < n ? first + group : n;
        const float lo = mins[g], step = scales[g];
        const uint8_t *in = codes + first / per_byte;
        for (int64_t start = first; start < end; start += TABLE) {
            const int64_t len = end - start < TABLE ? end - start : TABLE;
            const uint8_t *src = code;
            if (bits == 8) src = in;
            if (bits == 4) unpack_4(in, len, code);
            if (bits == 2) unpack_2(in, len, code);
            float *o = out + start;
            for (int64_t j = 0; j < len; j++) {
                const float v = (float)src[j] * step;
                o[j] = v + lo;
            }
            in += (len + per_byte - 1) / per_byte;
        }
    }
}

/* The ReLU's mask: bit i set where out[i] <= 0 (packing.pack_bits(out <= 0)). */
void dropit_relu_mask(const float *out, int64_t n, uint8_t *bits) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint8_t b = 0;
        for (int k = 0; k < 8; k++) b |= (uint8_t)((out[i + k] <= 0.0f) << k);
        bits[i / 8] = b;
    }
    if (i < n) {
        uint8_t b = 0;
        for (int k = 0; i + k < n; k++) b |= (uint8_t)((out[i + k] <= 0.0f) << k);
        bits[i / 8] = b;
    }
}

/* The ReLU's input gradient: grad[i] where bit i is clear, +0.0 where it is set; the bit
 * patterns ANDed, so NaN and inf pass as they are (packing.zero_flagged). */
void dropit_relu_apply(const uint32_t *grad, const uint8_t *bits, int64_t n, uint32_t *result) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint32_t b = bits[i >> 3];
        for (int k = 0; k < 8; k++) result[i + k] = grad[i + k] & (((b >> k) & 1u) - 1u);
    }
    for (; i < n; i++) result[i] = grad[i] & (((uint32_t)(bits[i >> 3] >> (i & 7)) & 1u) - 1u);
}
