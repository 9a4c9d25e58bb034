/* The DFlash 2 path selector on the CPU (docs/algorithm.md §3): top-K candidates of each
 * drafter row, the lattice row the walk visits, greedy or sampled walk, in one call.
 *
 * On MLX's CPU backend the selector's ~40 small ops cost more than their arithmetic (an
 * argpartition over an 8,192-id row alone takes ~0.1 ms); here a row's top-K is one pass
 * over its logits with a sorted buffer of K. selector.select_path_ops is the definition;
 * dflash_mlx/select_host.py calls this and is tested against it. Built with small_gemm.c.
 */
#include <math.h>
#include <stddef.h>

#define MAX_K 64

/* The K best of x[0 .. V) into vals / idx, best first; equal scores keep the lower id
 * first (a later one only enters past a strictly lower score). */
static void top_k(const float *x, int V, int K, float *vals, int *idx) {
    int n = 0;
    for (int v = 0; v < V; v++) {
        const float s = x[v];
        if (n == K && !(s > vals[K - 1])) continue;
        int pos = n < K ? n++ : K - 1;
        while (pos > 0 && vals[pos - 1] < s) {
            vals[pos] = vals[pos - 1];
            idx[pos] = idx[pos - 1];
            pos--;
        }
        vals[pos] = s;
        idx[pos] = v;
    }
}

/* One batch row. X: logits [L, V] (row stride ldx); ids: target ids of X's columns [V], or
 * 0 (the columns are target ids); anchor: the block's first token; g: gates [L, R]; A, Bc:
 * codebooks [vocab, R]; K <= MAX_K; T: temperature (0: greedy); u: uniforms [L] (T > 0).
 * Out: cand [L, K] target ids, best first; path [L] candidate indices; q [L, K] the
 * proposal rows (T > 0). Returns 0, or 1 when K is out of range. */
int dflash_select_path(int L, int V, const float *X, int ldx, const int *ids, int anchor, int R,
                       const float *g, const float *A, const float *Bc, int K, float T,
                       const float *u, int *cand, int *path, float *q) {
    if (K < 1 || K > MAX_K || K > V) return 1;
    float vals[MAX_K], ag[256], s[MAX_K];
    int idx[MAX_K];
    if (R > 256) return 1;
    int prev_token = anchor;
    for (int t = 0; t < L; t++) {
        top_k(X + (size_t)t * ldx, V, K, vals, idx);
        int *c = cand + (size_t)t * K;
        for (int k = 0; k < K; k++) c[k] = ids ? ids[idx[k]] : idx[k];
        /* S_t(prev, b) = U_t(b) + sum_r A[prev, r] g[t, r] Bc[b, r] */
        const float *a = A + (size_t)prev_token * R, *gt = g + (size_t)t * R;
        for (int r = 0; r < R; r++) ag[r] = a[r] * gt[r];
        for (int k = 0; k < K; k++) {
            const float *b = Bc + (size_t)c[k] * R;
            float acc = 0.0f;
            for (int r = 0; r < R; r++) acc += ag[r] * b[r];
            s[k] = vals[k] + acc;
        }
        int choice = 0;
        if (T > 0.0f) {
            float m = s[0] / T, total = 0.0f, cdf = 0.0f;
            for (int k = 1; k < K; k++) m = s[k] / T > m ? s[k] / T : m;
            float *qt = q + (size_t)t * K;
            for (int k = 0; k < K; k++) total += qt[k] = expf(s[k] / T - m);
            int below = 0;
            for (int k = 0; k < K; k++) {
                qt[k] /= total;
                cdf += qt[k];
                below += cdf <= u[t];
            }
            choice = below < K ? below : K - 1;
        } else {
            for (int k = 1; k < K; k++)
                if (s[k] > s[choice]) choice = k;
        }
        path[t] = choice;
        prev_token = c[choice];
    }
    return 0;
}
