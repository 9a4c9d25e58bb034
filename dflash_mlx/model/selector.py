"""Path selector of DFlash 2 (docs/algorithm.md §3): choose one coherent path through the
top-K lattice. The pure-MLX twin, the fused Metal kernel's launch, the dispatch between them,
and the ``PathSelector`` module holding the learned tensors.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from .. import ops
from . import metal_kernel
from .metal_kernel import KernelSpec

KERNEL = KernelSpec(
    "path_select", ("U", "cand", "anchor", "g", "A", "Bc", "uniforms", "params"), ("path", "q")
)
MAX_THREADS = 256  # K * W threads per threadgroup (Metal's limit is 1024)


def top_candidates(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Top-k candidates per row, best first.

    Args:
        logits: drafter logits [B, L, V].
        k: candidates per row.

    Returns:
        (U [B, L, k] float32 scores, cand [B, L, k] uint32 token ids).
    """
    k = min(k, logits.shape[-1])
    part = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]  # [B, L, k] unordered
    vals = mx.take_along_axis(logits, part, axis=-1).astype(mx.float32)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(vals, order, axis=-1), mx.take_along_axis(part, order, axis=-1)


def lattice_scores(
    U: mx.array, cand: mx.array, anchor: mx.array, g: mx.array, A: mx.array, Bc: mx.array
) -> mx.array:
    """Pairwise scores S_t(a, b) = U_t(b) + sum_r A[a, r] g[t, r] B[b, r], in float32.

    Row 0's predecessor is the anchor (stored at predecessor index 0); row t > 0's
    predecessors are row t-1's candidates.

    Args:
        U: unary scores [B, L, K]; cand: candidate ids [B, L, K]; anchor: ids [B];
        g: gates [B, L, R]; A, Bc: predecessor / successor codebooks [V, R].

    Returns:
        S [B, L, K, K] indexed (row, predecessor, successor).
    """
    Bsz, _, K = cand.shape  # [B, L, K]
    first = mx.broadcast_to(anchor.reshape(Bsz, 1, 1), (Bsz, 1, K))
    pred = mx.concatenate([first, cand[:, :-1]], axis=1)  # [B, L, K]
    a_rows = A[pred].astype(mx.float32) * g.astype(mx.float32)[:, :, None, :]  # [B, L, K, R]
    b_rows = Bc[cand].astype(mx.float32)  # [B, L, K, R]
    pair = a_rows @ b_rows.swapaxes(-1, -2)  # [B, L, K, K]
    return U.astype(mx.float32)[:, :, None, :] + pair


def walk(
    S: mx.array, temperature: float = 0.0, uniforms: mx.array | None = None
) -> tuple[mx.array, mx.array | None]:
    """Walk the lattice row by row from the anchor.

    Greedy (temperature 0): argmax of the row the previous choice selects, ties to the
    lowest index. Sampled: draw from softmax(S_t(prev, .) / T) by inverse CDF with the given
    uniforms, and return those rows as the proposal q.

    Args:
        S: lattice [B, L, K, K]. temperature: T >= 0. uniforms: [B, L] in [0, 1) when T > 0.

    Returns:
        (path [B, L] int32 candidate indices, q [B, L, K] float32 or None when greedy).
    """
    Bsz, L, K, _ = S.shape
    prev = mx.zeros((Bsz,), dtype=mx.int32)
    path, qs = [], []
    for t in range(L):
        row = mx.take_along_axis(S[:, t], prev[:, None, None], axis=1)[:, 0]  # [B, K]
        if temperature == 0:
            prev = mx.argmax(row, axis=-1).astype(mx.int32)
        else:
            q = mx.softmax(row / temperature, axis=-1, precise=True)
            cdf = mx.cumsum(q, axis=-1)
            prev = mx.minimum((cdf <= uniforms[:, t : t + 1]).sum(-1), K - 1).astype(mx.int32)
            qs.append(q)
        path.append(prev)
    return mx.stack(path, axis=1), (mx.stack(qs, axis=1) if qs else None)


def select_path_ops(
    U: mx.array,
    cand: mx.array,
    anchor: mx.array,
    g: mx.array,
    A: mx.array,
    Bc: mx.array,
    temperature: float = 0.0,
    uniforms: mx.array | None = None,
) -> tuple[mx.array, mx.array | None]:
    """Pure-MLX selector: lattice scores then walk. The Metal kernel's semantic definition.

    Args:
        U, cand: [B, L, K] unary scores and candidate ids; anchor: [B];
        g: [B, L, R]; A, Bc: [V, R]; temperature: T; uniforms: [B, L] when T > 0.

    Returns:
        (path [B, L] int32 indices into the K candidates, q [B, L, K] or None).
    """
    return walk(lattice_scores(U, cand, anchor, g, A, Bc), temperature, uniforms)


def lanes_per_candidate(K: int, R: int) -> int:
    """Lanes W that split one candidate's rank-R dot product (a power of two, K * W <= 256)."""
    w = 1
    while w * 2 * K <= MAX_THREADS and w * 2 <= R:
        w *= 2
    return w


def select_path_kernel(
    kernel, U, cand, anchor, g, A, B, temperature=0.0, uniforms=None, lanes: int | None = None
):
    """Launch the fused kernel (``metal/path_select.metal``), one launch for the whole batch.

    Args:
        kernel: object returned by ``metal_kernel.build(KERNEL, ...)``.
        U, cand: [B, L, K]; anchor: [B]; g: [B, L, R]; A, B: [V, R];
        temperature: T; uniforms: [B, L] when T > 0; lanes: override W (tests).

    Returns:
        (path [B, L] int32, q [B, L, K] float32 or None when greedy).
    """
    Bsz, L, K = cand.shape
    R = g.shape[-1]
    sample = temperature > 0
    if sample and uniforms is None:
        raise ValueError("sampled selection needs uniforms [B, L]")
    if not mx.issubdtype(cand.dtype, mx.integer):
        raise ValueError(f"cand must hold integer token ids, got {cand.dtype}")
    W = lanes or lanes_per_candidate(K, R)
    if K * W > 1024:
        raise ValueError(f"top-k {K} x lanes {W} exceeds 1024 threads per threadgroup")
    # 64-bit ids are not passed to the kernel; 32-bit ids cover any vocabulary
    cand = cand if cand.dtype in (mx.uint32, mx.int32) else cand.astype(mx.uint32)
    anchor = anchor.reshape(Bsz)
    anchor = anchor if anchor.dtype in (mx.uint32, mx.int32) else anchor.astype(mx.uint32)
    u = uniforms.astype(mx.float32) if sample else mx.zeros((1,), mx.float32)
    params = mx.array([float(temperature) if sample else 1.0], dtype=mx.float32)
    path, q = kernel(
        inputs=[U, cand, anchor, g, A, B, u, params],
        template=[("K", K), ("W", W), ("SAMPLE", bool(sample))],
        grid=(K * W, Bsz, 1),
        threadgroup=(K * W, 1, 1),
        output_shapes=[(Bsz, L), (Bsz, L, K) if sample else (1,)],
        output_dtypes=[mx.int32, mx.float32],
    )
    return path, (q if sample else None)


def select_path(U, cand, anchor, g, A, Bc, temperature=0.0, uniforms=None):
    """Path selection: the fused kernel on a Metal GPU, else ``select_path_ops``.

    Args:
        U, cand: [B, L, K] scores and ids; anchor: [B]; g: [B, L, R]; A, Bc: [V, R];
        temperature: T; uniforms: [B, L] in [0, 1) when T > 0.

    Returns:
        (path [B, L] int32 candidate indices, q [B, L, K] float32 or None when greedy).
    """
    kernel = metal_kernel.cached(KERNEL, self_check) if metal_kernel.use_metal() else None
    if kernel is not None:
        return select_path_kernel(kernel, U, cand, anchor, g, A, Bc, temperature, uniforms)
    return select_path_ops(U, cand, anchor, g, A, Bc, temperature, uniforms)


def self_check(kernel) -> str | None:
    """Run ``kernel`` and the twin greedily and sampled on small random inputs.

    Args:
        kernel: a built kernel object.

    Returns:
        why they differ (paths must be equal, q within 1e-5), or None.
    """
    ks = mx.random.split(mx.random.key(11), 6)  # the process's random state is left alone
    B, L, K, R, V = 2, 5, 4, 8, 40
    U = 2.0 * mx.random.normal((B, L, K), key=ks[0])
    cand = mx.random.randint(0, V, (B, L, K), key=ks[1]).astype(mx.uint32)
    anchor = mx.random.randint(0, V, (B,), key=ks[2]).astype(mx.uint32)
    g = mx.random.normal((B, L, R), key=ks[3])
    A, Bc = (0.3 * mx.random.normal((V, R), key=k) for k in ks[4:6])
    inputs = (U, cand, anchor, g, A, Bc)
    u = mx.random.uniform(shape=(B, L), key=ks[0])
    path, _ = select_path_kernel(kernel, *inputs)
    problem = metal_kernel.compare([path], [select_path_ops(*inputs)[0]], atol=0)
    if problem is None:
        got, want = select_path_kernel(kernel, *inputs, 0.7, u), select_path_ops(*inputs, 0.7, u)
        problem = metal_kernel.compare(got, want, atol=1e-5)
    return problem


class PathSelector(nn.Module):
    """Learned parts of the selector: gate projection and the two codebooks.

    Args:
        hidden_size: H; rank: R; vocab_size: V.
    """

    def __init__(self, hidden_size: int, rank: int, vocab_size: int):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        # Zero codebooks make S = U: the DFlash 1 choice (argmax per row).
        self.predecessor_codebook = mx.zeros((vocab_size, rank))
        self.successor_codebook = mx.zeros((vocab_size, rank))

    def __call__(
        self,
        logits: mx.array,
        hidden: mx.array,
        anchor: mx.array,
        top_k: int,
        temperature: float = 0.0,
        uniforms: mx.array | None = None,
        to_target=None,
    ):
        """Choose draft tokens for rows 1..B-1.

        Args:
            logits: drafter logits [B, L, V] (V may be a draft vocabulary); hidden: final
                normed hidden [B, L, H]; anchor: [B]; top_k: K; temperature: T;
                uniforms: [B, L] when T > 0; to_target: the target ids [V'] of
                ``logits``' last axis (a draft vocabulary), since the codebooks are indexed
                by target ids.

        Returns:
            (tokens [B, L], cand [B, L, K], q [B, L, K] or None, path [B, L]).
        """
        g = self.hidden_projection(hidden)
        A, Bc = self.predecessor_codebook, self.successor_codebook
        host = ops.host_selector(top_k, A.shape[-1], A.dtype)  # the CPU's C twin
        if host is not None and not metal_kernel.use_metal():
            return host(logits, g, anchor, A, Bc, top_k, temperature, uniforms, to_target)
        U, cand = top_candidates(logits, top_k)
        if to_target is not None:
            cand = to_target[cand].astype(mx.uint32)
        path, q = select_path(U, cand, anchor, g, A, Bc, temperature, uniforms)
        tokens = mx.take_along_axis(cand, path[..., None].astype(mx.uint32), axis=-1)[..., 0]
        return tokens, cand, q, path
