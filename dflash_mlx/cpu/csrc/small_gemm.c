/* cblas_sgemm for the few-row products of decoding, in front of OpenBLAS (or the wheel's BLAS).
 *
 * OpenBLAS packs the whole weight for C = A @ B^T even when A has 1-16 rows, so an
 * [8, 576] x [576, 49152] product reads and writes it twice (~4x a plain gemv here). This
 * kernel reads each weight row once for all rows of A. Every C[m][n] is one dot product
 * whose summation order depends only on K, never on M: a row's result is the same whether
 * it is multiplied alone (a decode step) or with others (a verify). Every other call goes
 * to the real cblas_sgemm, except small A @ B products (small_gemm_nn below); small ones
 * among those run on one OpenBLAS thread. Weights registered with exact 16-bit words are
 * read as those words: half the bytes, the same sums. Built at run time by
 * dflash_mlx/small_gemm.py.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>

#ifdef __AVX512F__
#define VL 16
#define MT 8
#else
#define VL 8
#define MT 4
#endif
#define NT 2
#define PREFETCH 64 /* floats ahead in the next tile's rows */

typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));
typedef unsigned short vh __attribute__((vector_size(VL * 2), aligned(2)));
typedef unsigned int vu __attribute__((vector_size(VL * 4)));
#ifdef __FLT16_MAX__ /* the compiler has _Float16 */
#define HAS_F16 1
typedef _Float16 vhf __attribute__((vector_size(VL * 2), aligned(2)));
#else
#define HAS_F16 0
#endif
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);

static sgemm_fn real_sgemm = 0;
static int max_rows = 16;
/* OpenBLAS's thread count is set per forwarded call: products of fewer than one_thread_macs
 * multiply-adds run on one thread. Threaded, OpenBLAS's workers spin on after each call and
 * take the cores this kernel's OpenMP team needs (a drafter step ran 2x slower, measured). */
typedef void (*set_threads_fn)(int);
static set_threads_fn set_threads = 0;
static int blas_threads = 1, cur_threads = 0;
static long one_thread_macs = 1L << 21;
static long calls_small = 0, calls_forwarded = 0;
static long ns_small = 0, ns_forwarded = 0;

static inline long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* The lanes of v summed as a fixed tree (halves added until one lane is left): the same
 * order for every output, whatever the tile, in a few vector adds instead of VL - 1 chained
 * scalar ones. */
static inline float hsum(vf v) {
#if VL == 16
    typedef float v8 __attribute__((vector_size(32)));
    v8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    typedef float v8 __attribute__((vector_size(32)));
    v8 h = v;
#endif
    typedef float v4 __attribute__((vector_size(16)));
    v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    typedef float v2 __attribute__((vector_size(8)));
    v2 d = __builtin_shufflevector(q, q, 0, 1) + __builtin_shufflevector(q, q, 2, 3);
    return d[0] + d[1];
}

static inline void store(float *c, float s, float alpha, float beta) {
    *c = beta == 0.0f ? alpha * s : alpha * s + beta * *c;
}

/* A weight's element type: float32, or 16-bit words that widen exactly to the float32
 * values MLX holds (registered below). kind is a constant at every call site. */
enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline __attribute__((always_inline)) vf wvec(const void *b, size_t k, const int kind) {
    if (kind == F32) return *(const vf *)((const float *)b + k);
#if VL == 16 && defined(__AVX512F__)
    if (kind == F16) return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const unsigned short *)b + k)));
#elif VL == 8 && defined(__F16C__)
    if (kind == F16) return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const unsigned short *)b + k)));
#elif HAS_F16
    if (kind == F16) return __builtin_convertvector(*(const vhf *)((const _Float16 *)b + k), vf);
#endif
    /* bfloat16: the top half of a float32 */
    vu u = __builtin_convertvector(*(const vh *)((const unsigned short *)b + k), vu) << 16;
    return (vf)u;
}

static inline __attribute__((always_inline)) float wone(const void *b, size_t k, const int kind) {
    if (kind == F32) return ((const float *)b)[k];
#if HAS_F16
    if (kind == F16) return (float)((const _Float16 *)b)[k];
#endif
    union { unsigned int u; float f; } v = {(unsigned int)((const unsigned short *)b)[k] << 16};
    return v.f;
}

static inline const void *wrow(const void *B, size_t n, int ldb, const int kind) {
    return kind ? (const void *)((const unsigned short *)B + n * ldb)
                : (const void *)((const float *)B + n * ldb);
}

/* C[m0 .. m0+mt) x [n, n+NT): mt is a constant at each call site, so the accumulators
 * stay in registers. */
static inline __attribute__((always_inline)) void tile(const int mt, int m0, int n, int K,
                                                       float alpha, const float *A, int lda,
                                                       const void *B, int ldb, float beta,
                                                       float *C, int ldc, const int kind) {
    const int kv = K - K % VL;
    const void *b[NT];
    for (int j = 0; j < NT; j++) b[j] = wrow(B, (size_t)(n + j), ldb, kind);
    const float *a[MT];
    for (int i = 0; i < mt; i++) a[i] = A + (size_t)(m0 + i) * lda;
    vf acc[MT][NT];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < NT; j++) acc[i][j] = (vf){0};
    for (int k = 0; k < kv; k += VL) {
        vf w[NT];
        for (int j = 0; j < NT; j++) {
            w[j] = wvec(b[j], k, kind);
            /* The next tile's rows, a little ahead: without it the loads of each new tile
             * stall the FMAs (8 rows: 24 -> 12 ms on one core for the 49k head). A prefetch
             * past the end of B never faults. */
            const char *ahead = (const char *)wrow(b[j], (size_t)NT, ldb, kind);
            __builtin_prefetch(ahead + (size_t)(k + PREFETCH) * (kind ? 2 : 4));
        }
        for (int i = 0; i < mt; i++) {
            const vf x = *(const vf *)(a[i] + k);
            for (int j = 0; j < NT; j++) acc[i][j] += x * w[j];
        }
    }
    /* The last K % VL terms as explicit FMAs (here and in column()): contraction left to
     * the compiler could differ between the specializations, and so would the bits. */
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < NT; j++) {
            float s = hsum(acc[i][j]);
            for (int k = kv; k < K; k++) s = __builtin_fmaf(a[i][k], wone(b[j], k, kind), s);
            store(C + (size_t)(m0 + i) * ldc + n + j, s, alpha, beta);
        }
}

/* One column of C, summed in the same order as in a tile (the last N % NT columns). */
static inline __attribute__((always_inline)) void column(int M, int n, int K, float alpha,
                                                         const float *A, int lda, const void *B,
                                                         int ldb, float beta, float *C, int ldc,
                                                         const int kind) {
    const int kv = K - K % VL;
    const void *b = wrow(B, (size_t)n, ldb, kind);
    for (int m = 0; m < M; m++) {
        const float *a = A + (size_t)m * lda;
        vf acc = {0};
        for (int k = 0; k < kv; k += VL) acc += *(const vf *)(a + k) * wvec(b, k, kind);
        float s = hsum(acc);
        for (int k = kv; k < K; k++) s = __builtin_fmaf(a[k], wone(b, k, kind), s);
        store(C + (size_t)m * ldc + n, s, alpha, beta);
    }
}

/* Columns [n0, n1) of C for all M rows; B row n is weight row n (length K). */
static inline __attribute__((always_inline)) void block(int M, int n0, int n1, int K,
                                                        float alpha, const float *A, int lda,
                                                        const void *B, int ldb, float beta,
                                                        float *C, int ldc, const int kind) {
    int n = n0;
    for (; n + NT <= n1; n += NT) {
        int m0 = 0;
        for (; m0 + MT <= M; m0 += MT)
            tile(MT, m0, n, K, alpha, A, lda, B, ldb, beta, C, ldc, kind);
        switch (M - m0) {
#if MT > 7
        case 7: tile(7, m0, n, K, alpha, A, lda, B, ldb, beta, C, ldc, kind); break;
        case 6: tile(6, m0, n, K, alpha, A, lda, B, ldb, beta, C, ldc, kind); break;
        case 5: tile(5, m0, n, K, alpha, A, lda, B, ldb, beta, C, ldc, kind); break;
        case 4: tile(4, m0, n, K, alpha, A, lda, B, ldb, beta, C, ldc, kind); break;
#endif
#if MT > 3
        case 3: tile(3, m0, n, K, alpha, A, lda, B, ldb, beta, C, ldc, kind); break;
#endif
#if MT > 2
        case 2: tile(2, m0, n, K, alpha, A, lda, B, ldb, beta, C, ldc, kind); break;
#endif
        case 1: tile(1, m0, n, K, alpha, A, lda, B, ldb, beta, C, ldc, kind); break;
        default: break;
        }
    }
    for (; n < n1; n++) column(M, n, K, alpha, A, lda, B, ldb, beta, C, ldc, kind);
}

/* C = A @ B with B [K, N] row-major (attention's probabilities @ values): rows of C are
 * built NW vectors wide, summing over k in order, so again a row's bits do not depend on M. */
#define NW 4
static void small_gemm_nn(int M, int N, int K, float alpha, const float *A, int lda,
                          const float *B, int ldb, float beta, float *C, int ldc) {
    int n0 = 0;
    for (; n0 + NW * VL <= N; n0 += NW * VL) {
        for (int m = 0; m < M; m++) {
            const float *a = A + (size_t)m * lda;
            vf acc[NW];
            for (int j = 0; j < NW; j++) acc[j] = (vf){0};
            for (int k = 0; k < K; k++) {
                const float *b = B + (size_t)k * ldb + n0;
                const vf x = (vf){0} + a[k];
                for (int j = 0; j < NW; j++) acc[j] += x * *(const vf *)(b + j * VL);
            }
            float *c = C + (size_t)m * ldc + n0;
            for (int j = 0; j < NW; j++)
                for (int l = 0; l < VL; l++) store(c + j * VL + l, acc[j][l], alpha, beta);
        }
    }
    for (int m = 0; m < M; m++) { /* the last N % (NW * VL) columns, same order over k */
        const float *a = A + (size_t)m * lda;
        for (int n = n0; n < N; n++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += a[k] * B[(size_t)k * ldb + n];
            store(C + (size_t)m * ldc + n, s, alpha, beta);
        }
    }
}

/* Threads only pay for products of at least ~256k weights (1 MB in float32). */
static void small_gemm(int M, int N, int K, float alpha, const float *A, int lda,
                       const void *B, int ldb, float beta, float *C, int ldc, const int kind) {
    const int tiles = (N + NT - 1) / NT;
    const int parallel = (long)N * K >= (1L << 18);
#pragma omp parallel for schedule(static) if (parallel)
    for (int t = 0; t < tiles; t += 32) {
        int n0 = t * NT, n1 = (t + 32) * NT;
        if (n1 > N) n1 = N;
        block(M, n0, n1, K, alpha, A, lda, B, ldb, beta, C, ldc, kind);
    }
}

/* Weights registered with 16-bit words that widen exactly to their float32 values (a
 * bfloat16 checkpoint loaded as float32; weights dequantized in float16): a product with
 * one of them reads the words, half the bytes, and gives the same bits. Keyed by the float32
 * buffer, which the caller keeps alive (and unchanged) for as long as it is registered. */
#define HALF_SLOTS 16384 /* an open-addressed table, at most half full: a miss is ~1 probe */
static struct {
    const float *w; /* 0: an empty slot; written last, so a reader never sees half an entry */
    const void *words;
    int n, k, kind;
} halves[HALF_SLOTS];
static int n_halves = 0, use_halves = 1;
static long calls_half = 0;

static inline size_t slot_of(const void *p) {
    unsigned long long x = (unsigned long long)(size_t)p;
    x ^= x >> 17;
    x *= 0x9E3779B97F4A7C15ull;
    return (size_t)(x >> 40) & (HALF_SLOTS - 1);
}

static const void *half_words(const float *B, int N, int K, int ldb, int *kind) {
    for (size_t i = slot_of(B);; i = (i + 1) & (HALF_SLOTS - 1)) {
        const float *w = __atomic_load_n(&halves[i].w, __ATOMIC_ACQUIRE);
        if (!w) return 0;
        if (w == B && halves[i].n == N && halves[i].k == K && ldb == K) {
            *kind = halves[i].kind;
            return halves[i].words;
        }
    }
}

/* One product of at most max_rows rows, from the weight's registered words if it has any. */
static void few_rows(int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                     int ldb, float beta, float *C, int ldc) {
    int kind = F32;
    const void *words = n_halves && use_halves ? half_words(B, N, K, ldb, &kind) : 0;
    if (words && kind == BF16) {
        small_gemm(M, N, K, alpha, A, lda, words, ldb, beta, C, ldc, BF16);
        calls_half++;
    } else if (words) {
        small_gemm(M, N, K, alpha, A, lda, words, ldb, beta, C, ldc, F16);
        calls_half++;
    } else {
        small_gemm(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, F32);
    }
    calls_small++;
}

/* Split products with more rows than max_rows into max_rows-row pieces for the kernel
 * instead of forwarding them (set when the BLAS behind is the wheel's reference one, which
 * costs ~M one-row products: 359 ms for the drafter's context projection of 200 rows,
 * against 11 ms in pieces). */
static int split_rows = 0;

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C,
                 int ldc) {
    /* One row handed over as a transposed [K, 1] matrix with unit stride (MLX does so for a
     * [..., 1, K] operand whose strides allow both readings, as in mlx-lm's SwitchGLU) is
     * the same contiguous row: the kernel takes it, so its bits are a row's like any other. */
    if (order == ROW_MAJOR && ta == TRANS && M == 1 && lda == 1) {
        ta = NO_TRANS;
        lda = K;
    }
    if (order == ROW_MAJOR && ta == NO_TRANS && tb == TRANS && M >= 1 &&
        (M <= max_rows || (split_rows && max_rows > 0)) && N >= 1 && K >= 1) {
        const long t0 = now_ns();
        for (int m0 = 0; m0 < M; m0 += max_rows) {
            const int m = M - m0 < max_rows ? M - m0 : max_rows;
            few_rows(m, N, K, alpha, A + (size_t)m0 * lda, lda, B, ldb, beta,
                     C + (size_t)m0 * ldc, ldc);
        }
        ns_small += now_ns() - t0;
        return;
    }
    /* Small A @ B only (these weights are never large): no threads, one pass. */
    if (order == ROW_MAJOR && ta == NO_TRANS && tb == NO_TRANS && M >= 1 && M <= max_rows &&
        N >= 1 && K >= 1 && (long)N * K <= (1L << 16)) {
        const long t0 = now_ns();
        small_gemm_nn(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        ns_small += now_ns() - t0;
        calls_small++;
        return;
    }
    if (!real_sgemm) real_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    if (set_threads) {
        const int want = (long)M * N * K < one_thread_macs ? 1 : blas_threads;
        if (want != cur_threads) set_threads(cur_threads = want);
    }
    const long t0 = now_ns();
    real_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    ns_forwarded += now_ns() - t0;
    calls_forwarded++;
}

/* dlsym of prefix + base: the scipy-openblas32 wheel's OpenBLAS names its symbols
 * scipy_cblas_sgemm etc. (no plain cblas_sgemm); a system OpenBLAS has prefix "". */
static void *sym(void *h, const char *prefix, const char *base) {
    char name[128];
    return strlen(prefix) + strlen(base) < sizeof name
               ? dlsym(h, strcat(strcpy(name, prefix), base)) : 0;
}

/* Bind the real BLAS; 0 on success. */
int dflash_small_gemm_init(const char *blas_path, const char *prefix, int rows) {
    void *h = dlopen(blas_path, RTLD_NOW | RTLD_GLOBAL);
    if (!h) return 1;
    real_sgemm = (sgemm_fn)sym(h, prefix, "cblas_sgemm");
    if (!real_sgemm) return 2;
    set_threads = (set_threads_fn)sym(h, prefix, "openblas_set_num_threads");
    int (*get_threads)(void) = (int (*)(void))sym(h, prefix, "openblas_get_num_threads");
    if (!get_threads) set_threads = 0;
    if (set_threads) blas_threads = cur_threads = get_threads();
    max_rows = rows;
    return 0;
}

void dflash_small_gemm_set_rows(int rows) { max_rows = rows; }

/* 1: split A @ B^T products of more than max_rows rows into pieces for the kernel. */
void dflash_small_gemm_set_split(int on) { split_rows = on; }

/* The file of the cblas_sgemm that calls not taken here go to (dladdr), or 0: which BLAS
 * is behind, known without timing it. */
const char *dflash_small_gemm_forward_library(void) {
    Dl_info info;
    if (!real_sgemm) real_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    if (!real_sgemm || !dladdr((void *)real_sgemm, &info)) return 0;
    return info.dli_fname;
}

/* Forwarded products of fewer multiply-adds than macs run on one OpenBLAS thread (0: never).
 * Returns OpenBLAS's own thread count, or 0 when the BLAS cannot set one. */
int dflash_small_gemm_set_one_thread(long macs) {
    one_thread_macs = macs;
    return set_threads ? blas_threads : 0;
}

/* Calls (what 0) or nanoseconds (what 1) spent in the kernel (forwarded 0) or OpenBLAS. */
long dflash_small_gemm_counter(int forwarded, int what) {
    if (what) return forwarded ? ns_forwarded : ns_small;
    return forwarded ? calls_forwarded : calls_small;
}

/* Register words [n, k] (kind 1: bfloat16, 2: float16) for the float32 weight w [n, k];
 * 0 on success, 1 when the table is half full (8,192 weights) or the compiler had no
 * float16. Registration happens on one thread, before any product uses w. */
int dflash_small_gemm_register(const float *w, int n, int k, const void *words, int kind) {
    if (!w || !(kind == BF16 || (kind == F16 && HAS_F16))) return 1;
    size_t i = slot_of(w);
    for (;; i = (i + 1) & (HALF_SLOTS - 1)) {
        if (!halves[i].w) break;
        if (halves[i].w == w && halves[i].n == n && halves[i].k == k) return 0;
    }
    if (2 * (n_halves + 1) > HALF_SLOTS) return 1;
    halves[i].words = words;
    halves[i].n = n;
    halves[i].k = k;
    halves[i].kind = kind;
    __atomic_store_n(&halves[i].w, w, __ATOMIC_RELEASE);
    n_halves++;
    return 0;
}

long dflash_small_gemm_half_calls(void) { return calls_half; }

/* 0: read registered weights as float32 again (A/B timing, tests); 1: as their words. */
void dflash_small_gemm_use_halves(int on) { use_halves = on; }

/* The A @ B kernel alone (B [K, N] row-major), for tests. */
void dflash_small_gemm_nn(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                          float *C, int ldc) {
    small_gemm_nn(M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
}

/* The A @ B^T kernel alone, for tests that compare it with the real BLAS on the same inputs. */
void dflash_small_gemm(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                       float *C, int ldc) {
    small_gemm(M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc, F32);
}
