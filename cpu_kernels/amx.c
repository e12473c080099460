/* Many-row bf16 products y = x @ w.T on CPUs with AMX (Intel Sapphire Rapids and later): batched decode's GEMMs.
 *
 * Why: a batched decode step (9-64 rows) multiplies every weight by a few dozen rows. oneDNN runs these at memory
 * speed too, but through torch's wrapper (~36 us a call) and a Python op (~45 us) around each of a step's ~120
 * products: ~10 ms of a 40 ms 16-row SmolLM2-135M step on the 2-core Xeon. This kernel is reached through the
 * C++ `astrai::cpu_matvec` op (~2 us) and reads the weight as it is, row-major, with no packed copy: the weight is
 * the A operand (16 weight rows x 32 k per tile, loaded with the row stride), x is repacked per call into B tiles
 * (k pairs x 16 x rows, AMX's VNNI layout; a 16 x 16 transpose of 32-bit pairs, cheap at decode's row counts), and
 * each C tile, [16 weight rows][16 x rows] in fp32, is transposed into y on the way out.
 *
 * `tdpbf16ps` multiplies bf16 pairs exactly and accumulates in fp32 (as `vdpbf16ps` in matvec.c and oneDNN's AMX
 * path do; subnormal inputs count as zero). Up to 64 rows of x share one read of each weight tile (four C tiles);
 * more rows are taken 64 at a time.
 *
 * Linux lends AMX's tile state to a process only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); `astrai_amx_ready`
 * asks once and says whether the CPU and the OS allow it. Threads: OpenMP, weight tiles split across them.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

#define TARGET_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#define MAX_ROWS 64 /* x rows per pass: four C tiles of 16 */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when this CPU has AMX-TILE and AMX-BF16, the OS enables the tile state (XCR0 bits 17-18) and grants it to this
 * process; asked once (a racing second caller asks again, harmlessly) */
int astrai_amx_ready(void) {
    static int ready = -1;
    if (ready >= 0) return ready;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    int cpu = (d >> 22 & 1) && (d >> 24 & 1); /* AMX-BF16, AMX-TILE */
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (cpu && (c >> 27 & 1)) { /* OSXSAVE: XGETBV may be read */
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        cpu = (lo >> 17 & 3) == 3;
    } else {
        cpu = 0;
    }
    ready = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* r[i][j] <- r[j][i]: 16 x 16 32-bit elements in 64 shuffles */
static inline TARGET_AMX void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

static inline __mmask16 first_lanes(long n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* the B tile of x rows [0, rows) (rows <= 16; x in 32-bit pairs, row stride `pairs` = K / 2) and k pairs 16s..: [16
 * pairs][16 rows], zero past the rows and pairs there are */
static inline TARGET_AMX void pack_b(const uint32_t *x, long rows, long pairs, long s, uint32_t *out) {
    __m512i r[16];
    __mmask16 valid = first_lanes(pairs - 16 * s);
    for (long i = 0; i < 16; i++)
        r[i] = i < rows ? _mm512_maskz_loadu_epi32(valid, x + i * pairs + 16 * s) : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; p++) _mm512_store_si512(out + 16 * p, r[p]);
}

/* the C tile in `c` ([16 weight rows][16 x rows], fp32) into out's rows [0, rows) and columns [0, cols) */
static inline TARGET_AMX void store_c(const float *c, long rows, long cols, float *out, long ld) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(c + 16 * i);
    transpose16(r);
    for (long m = 0; m < rows; m++) _mm512_mask_storeu_epi32(out + m * ld, first_lanes(cols), r[m]);
}

/* each weight row this many k steps ahead of its loads (`_mm_prefetch`, one line per row per step): over 120 weights
 * of 1536 x 576 at 16 rows on the 2-core Xeon, 18.0 -> 20.2 GB/s */
#define PREFETCH_STEPS 4

/* one k step: the weight tile (A, in tile TA) against each x block's B tile of step s (xb step-major: a step's B tiles
 * lie together), into C tiles 0-3; B tiles 6 and 7 in turn */
#define STEP(TA, a, lda, s)                                                                  \
    do {                                                                                     \
        const uint32_t *b_ = xb + (s) * blocks * 256;                                        \
        _tile_loadd(TA, a, lda);                                                             \
        _tile_loadd(6, b_, 64);                                                              \
        _tile_dpbf16ps(0, TA, 6);                                                            \
        if (blocks > 1) { _tile_loadd(7, b_ + 256, 64); _tile_dpbf16ps(1, TA, 7); }            \
        if (blocks > 2) { _tile_loadd(6, b_ + 512, 64); _tile_dpbf16ps(2, TA, 6); }            \
        if (blocks > 3) { _tile_loadd(7, b_ + 768, 64); _tile_dpbf16ps(3, TA, 7); }            \
    } while (0)

static TARGET_AMX void weight_block(const uint16_t *w, long n, long K, long S, const uint32_t *xb, long blocks,
                                   long rows, float *out, long ld, uint16_t *spare, float *c) {
    const uint16_t *a = w;
    long lda = K * 2;
    if (n < 16 || K % 32) {
        memset(spare, 0, 16 * S * 64);
        for (long i = 0; i < n; i++) memcpy(spare + i * S * 32, w + i * K, K * 2);
        a = spare, lda = S * 64;
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    long s = 0;
    for (; s + 2 <= S; s += 2) {
        for (int i = 0; i < 16; i++) {
            _mm_prefetch((const char *)a + i * lda + (s + PREFETCH_STEPS) * 64, _MM_HINT_T0);
            _mm_prefetch((const char *)a + i * lda + (s + 1 + PREFETCH_STEPS) * 64, _MM_HINT_T0);
        }
        STEP(4, a + s * 32, lda, s);
        STEP(5, a + (s + 1) * 32, lda, s + 1);
    }
    if (s < S) STEP(4, a + s * 32, lda, s);
    for (long j = 0; j < blocks; j++) {
        switch (j) {
        case 0: _tile_stored(0, c, 64); break;
        case 1: _tile_stored(1, c, 64); break;
        case 2: _tile_stored(2, c, 64); break;
        default: _tile_stored(3, c, 64); break;
        }
        store_c(c, rows - 16 * j < 16 ? rows - 16 * j : 16, n, out + 16 * j * ld, ld);
    }
}

/* output columns gathered per thread before they go to y: each flush writes 4 * STAGE_COLUMNS contiguous bytes per
 * row of y, where a tile's own 64 would touch as many pages as y has rows (the LM head's rows are 196 KB apart) */
#define STAGE_COLUMNS 256

static void flush(const float *stage, long rows, long width, float *y, long ldy) {
    for (long m = 0; m < rows; m++) memcpy(y + m * ldy, stage + m * STAGE_COLUMNS, width * sizeof(float));
}

/* y [M, sum ns] fp32 = x [M, K] bf16 @ cat(ws).T, ws[g] [ns[g], K] bf16 row-major; K even. Returns -1 (y not fully
 * written) when a buffer cannot be allocated or AMX is not ready, 0 on success. */
TARGET_AMX int astrai_amx_bf16(const uint16_t *x, long M, long K, const uint16_t *const *ws, const long *ns, long count,
                               float *y, int threads) {
    if (!astrai_amx_ready() || K % 2) return -1;
    long S = (K + 31) / 32, ldy = 0, tiles = 0;
    for (long g = 0; g < count; g++) ldy += ns[g], tiles += (ns[g] + 15) / 16;
    long (*tile)[3] = malloc((tiles ? tiles : 1) * sizeof *tile); /* weight, first row, first column of y */
    uint32_t *xb = aligned_alloc(64, (size_t)S * (MAX_ROWS / 16) * 1024);
    int failed = !tile || !xb;
    for (long g = 0, t = 0, column = 0; !failed && g < count; column += ns[g], g++)
        for (long r = 0; r < ns[g]; r += 16, t++) tile[t][0] = g, tile[t][1] = r, tile[t][2] = column + r;
    for (long m0 = 0; !failed && m0 < M; m0 += MAX_ROWS) {
        long rows = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS, blocks = (rows + 15) / 16;
        const uint32_t *xm = (const uint32_t *)(x + m0 * K);
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (long i = 0; i < S * blocks; i++) {
                long j = i % blocks, s = i / blocks;
                pack_b(xm + j * 16 * (K / 2), rows - 16 * j < 16 ? rows - 16 * j : 16, K / 2, s, xb + i * 256);
            }
            struct tile_config config = {.palette = 1};
            for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64, config.rows[t] = 16;
            _tile_loadconfig(&config);
            uint16_t *spare = aligned_alloc(64, 16 * S * 64);
            float *stage = aligned_alloc(64, MAX_ROWS * STAGE_COLUMNS * sizeof(float));
            float c[256] __attribute__((aligned(64)));
            long first = 0, width = 0; /* the stage holds y's columns [first, first + width) */
            float *out = y + m0 * ldy;
            /* each thread a contiguous run of tiles (the columns of y in order), as a static schedule gives */
            long part = omp_get_thread_num(), parts = omp_get_num_threads();
            for (long t = tiles * part / parts; t < tiles * (part + 1) / parts; t++) {
                long g = tile[t][0], r = tile[t][1], n = ns[g] - r < 16 ? ns[g] - r : 16;
                if (!spare || !stage) {
#pragma omp atomic write
                    failed = 1;
                    break;
                }
                if (width && (tile[t][2] != first + width || width + 16 > STAGE_COLUMNS))
                    flush(stage, rows, width, out + first, ldy), width = 0;
                if (!width) first = tile[t][2];
                weight_block(ws[g] + r * K, n, K, S, xb, blocks, rows, stage + width, STAGE_COLUMNS, spare, c);
                width += n;
            }
            if (width) flush(stage, rows, width, out + first, ldy);
            free(spare), free(stage);
            _tile_release();
        }
    }
    free(tile), free(xb);
    return failed ? -1 : 0;
}
