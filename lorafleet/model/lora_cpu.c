/* LoRA shrink/expand for CPU forwards that need no autograd (sampling, scoring).
 *
 * Why a kernel of our own: at decode a slot owns a handful of tokens, so each adapter's A and
 * B are read from memory to be multiplied by a few rows only. MKL's small batched GEMMs read
 * them well below memory speed on such shapes; these loops, prefetching the next slot's
 * weights into L2, come close to a plain read of the same bytes (figures, and the command
 * that measures them: docs/performance.md), and fold the gather of routed tokens, the
 * bf16->fp32 conversion, the LoRA scale and the scatter-add of the deltas into the same pass
 * (four to six torch ops per layer otherwise). `lf_lora_add` runs both halves for one layer in one call: at decode the
 * Python around each call costs as much as its arithmetic.
 *
 * Numerics (relied on by tests/model/test_native_kernels.py):
 * - every output element is computed by the same sequence of fp32 operations whatever the
 *   other rows of the batch are: a token's delta never depends on who shares its forward;
 * - shrink: 16 lane-wise partial sums over k (k mod 16), added in a fixed tree, then the
 *   k tail in order, times the token's scale;
 * - expand: the rank sum runs r = 0..R-1 in order; the delta is rounded to the output dtype
 *   and added as torch's `out.add_(delta.to(out.dtype))` does (bf16: round to nearest even);
 * - every multiply-add is an explicit fused one (fma16, fmaf) and the library is built with
 *   -ffp-contract=off, so no other operation is fused: left to the compiler, contraction
 *   differed between two expansions of the same loop (GCC 13 on a Sapphire Rapids host fused
 *   the one-token shrink differently from the others), and a token's bits then depended on
 *   how many tokens shared its slot. How tokens, rank rows and columns are blocked changes no
 *   operation;
 * - the builds for AVX-512, AVX2 + FMA and generic x86-64 (native.py picks one at run time)
 *   give the same bits: each lane of a 16-lane v16, whether one 64-byte vector or two 8-lane
 *   halves, takes the same operations in the same order.
 *
 * Layouts (see banks.py): A[slot] is [R, in] row-major at A + slot * a_slot_stride; B is
 * stored rank-major, B[slot][r, j] at B + slot * b_slot_stride + r * b_rank_stride + j.
 * Routed tokens are listed slot by slot: rows[t] is token t's row in x / y, and segment s
 * covers tokens segs[3s+1] .. segs[3s+2]-1, which use slot segs[3s].
 *
 * Threads: built with -fopenmp (native.py does so when torch runs on the same libgomp), a call
 * splits its tiles, and when there are fewer tiles than threads also each tile's rank rows
 * (shrink) or output columns (expand), over `nthreads` threads of torch's own OpenMP pool.
 * Every output element is still computed by one thread with the same chain of operations, so
 * results do not depend on the thread count. At decode the weights of different slots then
 * stream in on several cores at once; with one thread nothing changes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define LF_ABI_VERSION 4
#define TILE_ROWS 8  /* shrink: tokens sharing one pass over A */
#define EXPAND_ROWS 8  /* expand: tokens sharing one pass over B */
/* Tokens whose accumulators share the vector registers at once. A v16 accumulator takes one
 * zmm register on AVX-512 (32 of them) but two ymm on AVX2 (16 of them): there a tile runs
 * as sub-tiles of 4 tokens, one rank row (shrink) or 16 columns (expand) at a time, so the
 * accumulators never spill. Every element still takes the same chain of operations, so the
 * sub-tiling changes no result bit. */
#if defined(__AVX512F__)
#define SUB_TOKENS 8
#else
#define SUB_TOKENS 4
#endif

enum { LF_F32 = 0, LF_BF16 = 1 };
/* Software prefetch of the next slot's weights into L2 while this slot's stream in: slots sit
 * a whole bank row apart, so the hardware prefetcher cannot guess the jump (what it saves at
 * decode: docs/performance.md). */
#define PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

/* v16: 16 fp32 lanes, the unit every loop below works in. On AVX-512 (and the generic build)
 * it is one 64-byte vector. On AVX2 it is two native 8-lane halves: the compiler lowers a
 * 64-byte vector there lane by lane through the stack, which made the AVX2 build several times
 * slower than its FMA throughput allows. Every operation acts lane by lane in the same order
 * on either layout, so the layouts give the same bits. */
#if defined(__FMA__) && !defined(__AVX512F__)
typedef struct { v8 lo, hi; } v16;

static inline v16 zero16(void) { return (v16){{0}, {0}}; }
static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v.lo, p, sizeof v.lo);
    memcpy(&v.hi, p + 8, sizeof v.hi);
    return v;
}
static inline void store16(float *p, v16 v) {
    memcpy(p, &v.lo, sizeof v.lo);
    memcpy(p + 8, &v.hi, sizeof v.hi);
}
static inline v16 splat16(float f) {
    const v8 h = (v8)_mm256_set1_ps(f);
    return (v16){h, h};
}
static inline v16 add16(v16 a, v16 b) { return (v16){a.lo + b.lo, a.hi + b.hi}; }
/* a * b + c rounded once, lane by lane. */
static inline v16 fma16(v16 a, v16 b, v16 c) {
    return (v16){(v8)_mm256_fmadd_ps((__m256)a.lo, (__m256)b.lo, (__m256)c.lo),
                 (v8)_mm256_fmadd_ps((__m256)a.hi, (__m256)b.hi, (__m256)c.hi)};
}
static inline v8 low8(v16 v) { return v.lo; }
static inline v8 high8(v16 v) { return v.hi; }
#else
typedef float v16 __attribute__((vector_size(64)));

static inline v16 zero16(void) { return (v16){0}; }
static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat16(float f) {
#if defined(__AVX512F__)
    return (v16)_mm512_set1_ps(f);
#else
    return (v16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f};
#endif
}
static inline v16 add16(v16 a, v16 b) { return a + b; }
/* a * b + c rounded once, lane by lane: one instruction on AVX-512, the same bits from
 * libm's fmaf on a CPU without FMA. */
static inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    v16 r;
    for (int l = 0; l < 16; l++) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return r;
#endif
}
static inline v8 low8(v16 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline v8 high8(v16 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
#endif

/* Lanes i and i + 8, then i and i + 4, then (0 + 2) + (1 + 3): a fixed order, in vector
 * halves so it stays in registers. */
static inline float hsum16(v16 v) {
    const v8 s8 = low8(v) + high8(v);
    const v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) +
                  __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, as c10::BFloat16 */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 8 bf16 values (raw bits) widened to fp32, exactly. */
static inline v8 widen8(const uint16_t *p) {
    u16x8 h;
    memcpy(&h, p, sizeof h);
    const u32x8 bits = __builtin_convertvector(h, u32x8) << 16;
    v8 f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 8 floats rounded to nearest-even bf16 (NaN -> 0x7fc0), as c10::BFloat16 does; the bf16 bits
 * are in the low 16 bits of each lane. */
static inline u32x8 bf16_bits8(v8 f) {
    u32x8 u;
    memcpy(&u, &f, sizeof u);
    const u32x8 nan = (u & 0x7fffffffu) > 0x7f800000u;
    const u32x8 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (nan & 0x7fc0u) | (~nan & rounded);
}

static inline void narrow8(uint16_t *p, v8 f) {
    const u16x8 h = __builtin_convertvector(bf16_bits8(f), u16x8);
    memcpy(p, &h, sizeof h);
}

/* f rounded to bf16, back in fp32 (exact). */
static inline v8 round8(v8 f) {
    const u32x8 bits = bf16_bits8(f) << 16;
    v8 r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

#if defined(__FMA__) && !defined(__AVX512F__)
/* 16 bf16 values widened to fp32. */
static inline v16 load_bf16x16(const uint16_t *p) { return (v16){widen8(p), widen8(p + 8)}; }

/* dst[0 .. 16) (bf16) += delta, rounded as torch rounds dst.add_(delta.to(bfloat16)): the
 * delta to bf16, the sum in fp32, the sum to bf16. */
static inline void add_bf16x16(uint16_t *dst, v16 delta) {
    narrow8(dst, widen8(dst) + round8(delta.lo));
    narrow8(dst + 8, widen8(dst + 8) + round8(delta.hi));
}
#else
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

/* The same rounding as bf16_bits8, 16 lanes at once. */
static inline u32x16 bf16_bits16(v16 f) {
    u32x16 u;
    memcpy(&u, &f, sizeof u);
    const u32x16 nan = (u & 0x7fffffffu) > 0x7f800000u;
    const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (nan & 0x7fc0u) | (~nan & rounded);
}

static inline v16 widen_bits16(u32x16 h) {
    const u32x16 bits = h << 16;
    v16 f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline v16 load_bf16x16(const uint16_t *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    return widen_bits16(__builtin_convertvector(h, u32x16));
}

static inline void add_bf16x16(uint16_t *dst, v16 delta) {
    const v16 sum = load_bf16x16(dst) + widen_bits16(bf16_bits16(delta));
    const u16x16 h = __builtin_convertvector(bf16_bits16(sum), u16x16);
    memcpy(dst, &h, sizeof h);
}
#endif

/* Where the tile starting at token t0 of segment s points its L2 prefetch, relative to its own
 * weights: the next slot's, from the segment's first tile only. 0 (re-touching its own lines)
 * for later tiles and for the last segment. */
static inline int64_t prefetch_offset(const int64_t *segs, int64_t s, int64_t nseg, int64_t t0,
                                      int64_t slot_stride) {
    if (s + 1 >= nseg || t0 != segs[3 * s + 1]) return 0;
    return (segs[3 * s + 3] - segs[3 * s]) * slot_stride;
}

int lf_abi_version(void) { return LF_ABI_VERSION; }

/* 1 when built with OpenMP (calls may use several threads), 0 when serial. */
int lf_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Tiles of `tile` tokens over all segments. */
static int64_t count_tiles(const int64_t *segs, int64_t nseg, int64_t tile) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseg; s++) n += (segs[3 * s + 2] - segs[3 * s + 1] + tile - 1) / tile;
    return n;
}

/* The segment and first token of tile `index` (segments are few: a linear walk). */
static void tile_at(const int64_t *segs, int64_t nseg, int64_t tile, int64_t index, int64_t *s_out,
                    int64_t *t0_out) {
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t n = (segs[3 * s + 2] - segs[3 * s + 1] + tile - 1) / tile;
        if (index < n) {
            *s_out = s;
            *t0_out = segs[3 * s + 1] + index * tile;
            return;
        }
        index -= n;
    }
    *s_out = nseg; /* not reached for index < count_tiles */
    *t0_out = 0;
}

/* Into how many parts each tile is split so that `nthreads` threads have about two work items
 * each; parts never go below `min_part` of `extent` (rank rows or output columns). */
static int64_t parts_per_tile(int64_t ntiles, int nthreads, int64_t extent, int64_t min_part) {
    if (nthreads <= 1 || ntiles >= 2 * (int64_t)nthreads) return 1;
    int64_t parts = (2 * (int64_t)nthreads + ntiles - 1) / ntiles;
    const int64_t most = extent / min_part;
    if (parts > most) parts = most;
    return parts < 1 ? 1 : parts;
}

/* Per-thread scratch: 0 holds one shrink tile's tokens in fp32, 1 the calling thread's [M, R]
 * hidden of a whole lf_lora_add. */
static float *scratch(int which, size_t floats) {
    static __thread float *buf[2] = {NULL, NULL};
    static __thread size_t cap[2] = {0, 0};
    if (floats > cap[which]) {
        float *grown = NULL;
        if (posix_memalign((void **)&grown, 64, floats * sizeof(float)) != 0) return NULL;
        free(buf[which]);
        buf[which] = grown;
        cap[which] = floats;
    }
    return buf[which];
}

static void load_row(float *dst, const void *x, int32_t x_dtype, int64_t row, int64_t x_stride,
                     int64_t in) {
    if (x_dtype == LF_BF16) {
        const uint16_t *src = (const uint16_t *)x + row * x_stride;
        int64_t k = 0;
        for (; k + 16 <= in; k += 16) store16(dst + k, load_bf16x16(src + k));
        for (; k < in; k++) dst[k] = bf16_to_f32(src[k]);
    } else {
        memcpy(dst, (const float *)x + row * x_stride, (size_t)in * sizeof(float));
    }
}

/* RB rank rows of A against NT tokens per pass over k, the RB * NT accumulators in registers
 * (NT and RB are constants in each expansion). Each (token, rank row) accumulator takes the
 * chunks k = 0, 16, ... in order whatever RB is, so the blocking changes no result bit. At
 * decode (a few tokens per slot) one row at a time streams A fastest; with a full tile, two
 * rows per pass halve the reloads of the tokens (it pays on SmolLM2's down_proj, whose
 * 8 x 1536 tokens do not fit L1). */
#define SHRINK_BLOCK(NT, RB)                                                                \
    for (; r + RB <= r1; r += RB) {                                                         \
        const float *a = As + r * in;                                                       \
        v16 acc[RB][NT];                                                                    \
        for (int q = 0; q < RB; q++)                                                        \
            for (int i = 0; i < NT; i++) acc[q][i] = zero16();                              \
        for (int64_t k = 0; k < vec_end; k += 16) {                                         \
            v16 av[RB];                                                                     \
            for (int q = 0; q < RB; q++) {                                                  \
                const float *next = a + q * in + ahead + k;                                 \
                if (next < ahead_end) PREFETCH_L2(next);                                    \
                av[q] = load16(a + q * in + k);                                             \
            }                                                                               \
            for (int i = 0; i < NT; i++) {                                                  \
                const v16 xv = load16(xs + i * in_pad + k);                                 \
                for (int q = 0; q < RB; q++) acc[q][i] = fma16(av[q], xv, acc[q][i]);       \
            }                                                                               \
        }                                                                                   \
        for (int q = 0; q < RB; q++)                                                        \
            for (int i = 0; i < NT; i++) {                                                  \
                float sum = hsum16(acc[q][i]);                                              \
                for (int64_t k = vec_end; k < in; k++)                                      \
                    sum = __builtin_fmaf(a[q * in + k], xs[i * in_pad + k], sum);           \
                hidden[(t0 + i) * R + r + q] = sum * scale[t0 + i];                         \
            }                                                                               \
    }

/* Rows in blocks of RB, then any left one at a time. */
#define SHRINK_TILE(NT, RB) SHRINK_BLOCK(NT, RB) SHRINK_BLOCK(NT, 1)

/* Rank rows [r0, r1) of one tile of nt tokens starting at t0, whose slot's A is As; the L2
 * prefetch runs `ahead` floats ahead of the rows read, up to `ahead_end`. */
static int shrink_tile(const void *x, int32_t x_dtype, int64_t x_stride, int64_t in,
                       const int64_t *rows, int64_t t0, int nt, const float *As, int64_t ahead,
                       const float *ahead_end, int64_t R, int64_t r0, int64_t r1,
                       const float *scale, float *hidden) {
    const int64_t in_pad = (in + 15) & ~(int64_t)15;
    const int64_t vec_end = in & ~(int64_t)15;
    float *xs = scratch(0, (size_t)(TILE_ROWS * in_pad));
    if (xs == NULL) return -1;
    for (int i = 0; i < nt; i++) load_row(xs + i * in_pad, x, x_dtype, rows[t0 + i], x_stride, in);
    float *const tile_xs = xs;
    const int64_t tile_t0 = t0;
    for (int sub = 0; sub < nt; sub += SUB_TOKENS) {
        const float *xs = tile_xs + sub * in_pad;
        const int64_t t0 = tile_t0 + sub;
        const int n = nt - sub < SUB_TOKENS ? nt - sub : SUB_TOKENS;
        int64_t r = r0;
        switch (n) {
        case 1: SHRINK_TILE(1, 1) break;
        case 2: SHRINK_TILE(2, 1) break;
        case 3: SHRINK_TILE(3, 1) break;
        case 4: SHRINK_TILE(4, 1) break;
#if SUB_TOKENS > 4
        case 5: SHRINK_TILE(5, 2) break;
        case 6: SHRINK_TILE(6, 2) break;
        case 7: SHRINK_TILE(7, 2) break;
        default: SHRINK_TILE(8, 2) break;
#endif
        }
    }
    return 0;
}

/* hidden[t, r] = scale[t] * sum_k x[rows[t], k] * A[slot(t)][r, k]; hidden is [M, R].
 * `then` (then_len floats, or NULL) is what the caller reads next: while the last slot's A
 * streams in, it is prefetched as the next slot's A is for the others, so what follows does
 * not start cold (lf_lora_add passes its expand's first B and the rest of that bank row). */
int lf_shrink(const void *x, int32_t x_dtype, int64_t x_stride, int64_t in,
              const int64_t *rows, const int64_t *segs, int64_t nseg,
              const float *A, int64_t a_slot_stride, int64_t R,
              const float *scale, float *hidden, const float *then, int64_t then_len,
              int32_t nthreads) {
    const int64_t ntiles = count_tiles(segs, nseg, TILE_ROWS);
    const int64_t parts = parts_per_tile(ntiles, nthreads, R, 4);
    const int64_t items = ntiles * parts;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && items > 1) reduction(| : failed)
#endif
    for (int64_t w = 0; w < items; w++) {
        int64_t s, t0;
        tile_at(segs, nseg, TILE_ROWS, w / parts, &s, &t0);
        const int64_t part = w % parts;
        const int64_t end = segs[3 * s + 2];
        const int nt = (int)(end - t0 < TILE_ROWS ? end - t0 : TILE_ROWS);
        const float *As = A + segs[3 * s] * a_slot_stride;
        int64_t ahead = prefetch_offset(segs, s, nseg, t0, a_slot_stride);
        const float *ahead_end = (const float *)UINTPTR_MAX;
        if (then != NULL && s + 1 == nseg && t0 == segs[3 * s + 1]) {
            ahead = then - As;
            ahead_end = then + then_len;
        }
        failed |= shrink_tile(x, x_dtype, x_stride, in, rows, t0, nt, As, ahead, ahead_end, R,
                              part * R / parts, (part + 1) * R / parts, scale, hidden) != 0;
    }
    return failed ? -1 : 0;
}

/* y[row, j0 .. j0 + n) += delta[0 .. n), rounded as torch rounds out.add_(delta.to(dtype)). */
static inline void add_out(void *y, int32_t y_dtype, int64_t row, int64_t y_stride, int64_t j0,
                           const float *delta, int64_t n) {
    if (y_dtype == LF_BF16) {
        uint16_t *dst = (uint16_t *)y + row * y_stride + j0;
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) add_bf16x16(dst + j, load16(delta + j));
        for (; j < n; j++)
            dst[j] = f32_to_bf16(bf16_to_f32(dst[j]) + bf16_to_f32(f32_to_bf16(delta[j])));
    } else {
        float *dst = (float *)y + row * y_stride + j0;
        for (int64_t j = 0; j < n; j++) dst[j] += delta[j];
    }
}

/* y[row, j .. j + 16) += delta, rounded as add_out rounds. */
static inline void add_out16(void *y, int32_t y_dtype, int64_t row, int64_t y_stride, int64_t j,
                             v16 delta) {
    if (y_dtype == LF_BF16) {
        add_bf16x16((uint16_t *)y + row * y_stride + j, delta);
    } else {
        float *dst = (float *)y + row * y_stride + j;
        store16(dst, add16(load16(dst), delta));
    }
}

/* NT tokens x 16 * NV output columns, the accumulators in registers through all R ranks: per
 * rank, NV loads of B and NT broadcasts of hidden feed NT * NV multiply-adds, taken in rank
 * order for every element. `ahead` points the L2 prefetch at the next slot's B. */
#define EXPAND_BLOCK(NT, NV)                                                                \
    for (; j + 16 * NV <= j1; j += 16 * NV) {                                               \
        v16 acc[NT][NV];                                                                    \
        for (int i = 0; i < NT; i++)                                                        \
            for (int u = 0; u < NV; u++) acc[i][u] = zero16();                              \
        for (int64_t r = 0; r < R; r++) {                                                   \
            const float *b = Bs + r * b_rank_stride + j;                                    \
            v16 v[NV];                                                                      \
            for (int u = 0; u < NV; u++) {                                                  \
                PREFETCH_L2(b + ahead + 16 * u);                                            \
                v[u] = load16(b + 16 * u);                                                  \
            }                                                                               \
            for (int i = 0; i < NT; i++) {                                                  \
                const v16 hv16 = splat16(hidden[(t0 + i) * h_stride + r]);                 \
                for (int u = 0; u < NV; u++) acc[i][u] = fma16(hv16, v[u], acc[i][u]);      \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < NT; i++)                                                        \
            for (int u = 0; u < NV; u++)                                                    \
                add_out16(y, y_dtype, rows[t0 + i], y_stride, j + 16 * u, acc[i][u]);       \
    }

/* 32 columns at a time, then 16 (AVX2: 16 only; see SUB_TOKENS). */
#if SUB_TOKENS > 4
#define EXPAND_TILE(NT) EXPAND_BLOCK(NT, 2) EXPAND_BLOCK(NT, 1)
#else
#define EXPAND_TILE(NT) EXPAND_BLOCK(NT, 1)
#endif

/* y[rows[t], j] += sum_r hidden[t, r] * B[slot(t)][r, j], for t in [t0, t0 + nt) and
 * j in [j0, j1) (j0 a multiple of 16, so each column takes the same vector or scalar path as
 * in an unsplit call). */
static void expand_tile(const float *hidden, int64_t h_stride, int64_t R, const int64_t *rows,
                        int64_t t0, int nt, const float *Bs, int64_t ahead, int64_t b_rank_stride,
                        int64_t j0, int64_t j1, void *y, int32_t y_dtype, int64_t y_stride) {
    const int64_t tile_t0 = t0;
    for (int sub = 0; sub < nt; sub += SUB_TOKENS) {
        const int64_t t0 = tile_t0 + sub;
        const int n = nt - sub < SUB_TOKENS ? nt - sub : SUB_TOKENS;
        int64_t j = j0;
        switch (n) {
        case 1: EXPAND_TILE(1) break;
        case 2: EXPAND_TILE(2) break;
        case 3: EXPAND_TILE(3) break;
        case 4: EXPAND_TILE(4) break;
#if SUB_TOKENS > 4
        case 5: EXPAND_TILE(5) break;
        case 6: EXPAND_TILE(6) break;
        case 7: EXPAND_TILE(7) break;
        default: EXPAND_TILE(8) break;
#endif
        }
        /* The last < 16 columns: the same chain per element, in scalars. */
        float delta[16];
        for (int i = 0; i < n && j < j1; i++) {
            for (int64_t c = 0; c < j1 - j; c++) {
                float a = 0.0f;
                for (int64_t r = 0; r < R; r++)
                    a = __builtin_fmaf(hidden[(t0 + i) * h_stride + r], Bs[r * b_rank_stride + j + c], a);
                delta[c] = a;
            }
            add_out(y, y_dtype, rows[t0 + i], y_stride, j, delta, j1 - j);
        }
    }
}

int lf_expand_add(const float *hidden, int64_t h_stride, int64_t R,
                  const int64_t *rows, const int64_t *segs, int64_t nseg,
                  const float *B, int64_t b_slot_stride, int64_t b_rank_stride, int64_t out,
                  void *y, int32_t y_dtype, int64_t y_stride, int32_t nthreads) {
    const int64_t ntiles = count_tiles(segs, nseg, EXPAND_ROWS);
    const int64_t blocks = (out + 15) / 16; /* column parts are whole 16-column blocks */
    const int64_t parts = parts_per_tile(ntiles, nthreads, blocks, 4);
    const int64_t items = ntiles * parts;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && items > 1)
#endif
    for (int64_t w = 0; w < items; w++) {
        int64_t s, t0;
        tile_at(segs, nseg, EXPAND_ROWS, w / parts, &s, &t0);
        const int64_t part = w % parts;
        const int64_t j0 = 16 * (part * blocks / parts);
        const int64_t j1 = part + 1 == parts ? out : 16 * ((part + 1) * blocks / parts);
        const int64_t end = segs[3 * s + 2];
        const int nt = (int)(end - t0 < EXPAND_ROWS ? end - t0 : EXPAND_ROWS);
        const int64_t ahead = prefetch_offset(segs, s, nseg, t0, b_slot_stride);
        expand_tile(hidden, h_stride, R, rows, t0, nt, B + segs[3 * s] * b_slot_stride, ahead,
                    b_rank_stride, j0, j1, y, y_dtype, y_stride);
    }
    return 0;
}

/* One adapted layer's whole LoRA: y[rows[t]] += B[slot(t)] @ (scale[t] * A[slot(t)] @ x[rows[t]]).
 * A call from Python costs more than the arithmetic of a decode-sized layer, so the layer's
 * constants and the forward's routing come as two small structs built once (native.py), and
 * the hidden stays in this thread's scratch instead of a tensor. The results are those of
 * lf_shrink followed by lf_expand_add, bit for bit. */
typedef struct {
    const float *A;        /* [slots][R][in] */
    int64_t a_slot_stride;
    int64_t R;
    int64_t in;
    const float *B;        /* rank-major: B[slot][r, j] at B + slot * b_slot_stride + r * b_rank_stride + j */
    int64_t b_slot_stride;
    int64_t b_rank_stride;
    int64_t out;
    int64_t b_row_rest;    /* floats from a slot's B to the end of its bank row (>= R * b_rank_stride) */
} lf_layer;

typedef struct {
    const int64_t *rows;   /* routed token rows, slot by slot */
    const int64_t *segs;   /* [nseg][3]: slot, first, end */
    int64_t nseg;
    const float *scale;    /* per routed token */
    int64_t count;         /* routed tokens */
} lf_routing;

int lf_lora_add(const lf_layer *layer, const lf_routing *routing, const void *x, int32_t x_dtype,
                int64_t x_stride, void *y, int32_t y_dtype, int64_t y_stride, int32_t nthreads) {
    if (routing->count == 0) return 0;
    float *hidden = scratch(1, (size_t)(routing->count * layer->R));
    if (hidden == NULL) return -1;
    /* The expand starts on the first slot's B; past it, the bank row holds the next layers in
     * model order, which the next calls start on. */
    const float *first_B = layer->B + routing->segs[0] * layer->b_slot_stride;
    if (lf_shrink(x, x_dtype, x_stride, layer->in, routing->rows, routing->segs, routing->nseg,
                  layer->A, layer->a_slot_stride, layer->R, routing->scale, hidden, first_B,
                  layer->b_row_rest, nthreads) != 0)
        return -1;
    return lf_expand_add(hidden, layer->R, layer->R, routing->rows, routing->segs, routing->nseg,
                         layer->B, layer->b_slot_stride, layer->b_rank_stride, layer->out, y,
                         y_dtype, y_stride, nthreads);
}
