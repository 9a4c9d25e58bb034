"""The few-row matmul kernel in front of OpenBLAS: right answers, row results that do not
depend on how many rows share a call, MLX bound to it, and a clean fallback."""

import ctypes
import os
import sys

import numpy as np
import pytest

from dflash_mlx.cpu import blas, small_gemm

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or small_gemm.compiler() is None,
    reason="the kernel is built on Linux with a C compiler (macOS uses Accelerate)",
)
P = ctypes.c_void_p
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    lib = ctypes.CDLL(str(small_gemm.build(tmp_path_factory.mktemp("kernel"))))
    lib.dflash_small_gemm.restype = None
    return lib


def _run(lib, a, b, lda=None, ldb=None):
    """C = a @ b.T through the bare kernel; a and b may be column slices (ld > K)."""
    m, k = a.shape
    n = b.shape[0]
    c = np.full((m, n), np.nan, np.float32)  # beta = 0 must not read C
    lib.dflash_small_gemm(
        m,
        n,
        k,
        a.ctypes.data_as(P),
        lda or k,
        b.ctypes.data_as(P),
        ldb or k,
        c.ctypes.data_as(P),
        n,
    )
    return c


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 7), (5, 17), (64, 576), (129, 100), (1000, 33)])
def test_kernel_equals_float64_product(kernel, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    got = _run(kernel, a, b)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()) * np.sqrt(k)


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", [(1, 1), (64, 208), (70, 5), (200, 33)])
def test_nn_kernel_equals_float64_product_and_rows_do_not_depend_on_batch(kernel, m, n, k):
    """A @ B with B [K, N] (attention's probabilities @ values)."""
    rng = np.random.default_rng(m * 7 + n + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)

    def run(x):
        c = np.full((x.shape[0], n), np.nan, np.float32)
        args = (x.ctypes.data_as(P), k, b.ctypes.data_as(P), n, c.ctypes.data_as(P), n)
        kernel.dflash_small_gemm_nn(x.shape[0], n, k, *args)
        return c

    got = run(a)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()) * np.sqrt(k)
    for i in range(m):
        assert np.array_equal(run(np.ascontiguousarray(a[i : i + 1]))[0], got[i])


def test_kernel_reads_strided_rows(kernel):
    rng = np.random.default_rng(0)
    big_a = rng.standard_normal((4, 50)).astype(np.float32)
    big_b = rng.standard_normal((37, 60)).astype(np.float32)
    a, b = big_a[:, :40], big_b[:, :40]
    m, k = a.shape
    c = np.zeros((m, 37), np.float32)
    kernel.dflash_small_gemm(
        m, 37, k, big_a.ctypes.data_as(P), 50, big_b.ctypes.data_as(P), 60, c.ctypes.data_as(P), 37
    )
    np.testing.assert_allclose(c, a @ b.T, rtol=1e-5, atol=1e-5)


def test_a_row_gets_the_same_bits_alone_or_with_others(kernel):
    rng = np.random.default_rng(1)
    b = rng.standard_normal((515, 576)).astype(np.float32)
    for m in (2, 7, 8, 13, 16):
        a = rng.standard_normal((m, 576)).astype(np.float32)
        together = _run(kernel, a, b)
        for i in range(m):
            alone = _run(kernel, np.ascontiguousarray(a[i : i + 1]), b)
            assert np.array_equal(alone[0], together[i]), (m, i)


def test_shim_applies_alpha_and_beta_in_both_kernels_and_forwards_other_layouts():
    if not small_gemm.status()["active"]:
        pytest.skip(f"kernel not active in this process: {small_gemm.status()['error']}")
    lib = small_gemm._state["lib"]
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 20)).astype(np.float32)
    b = rng.standard_normal((11, 20)).astype(np.float32)
    c0 = rng.standard_normal((3, 11)).astype(np.float32)
    want = 0.5 * a @ b.T + 2.0 * c0
    for ta, tb, amat, bmat in (
        (NO_TRANS, TRANS, a, b),  # the A @ B^T kernel
        (NO_TRANS, NO_TRANS, a, np.ascontiguousarray(b.T)),  # the A @ B kernel
        (TRANS, NO_TRANS, np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)),  # forwarded
    ):
        c = c0.copy()
        lda, ldb = amat.shape[1], bmat.shape[1]
        lib.cblas_sgemm(
            ROW_MAJOR,
            ta,
            tb,
            3,
            11,
            20,
            ctypes.c_float(0.5),
            amat.ctypes.data_as(P),
            lda,
            bmat.ctypes.data_as(P),
            ldb,
            ctypes.c_float(2.0),
            c.ctypes.data_as(P),
            11,
        )
        np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)


def test_mlx_few_row_matmuls_go_through_the_kernel_and_many_rows_do_not():
    import mlx.core as mx

    if not small_gemm.status()["active"]:
        pytest.skip(f"kernel not active in this process: {small_gemm.status()['error']}")
    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 64)).astype(np.float32)
    many = "small_calls" if small_gemm.status()["split"] else "forwarded_calls"
    for rows, counter in ((4, "small_calls"), (small_gemm.MAX_ROWS + 40, many)):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        before = small_gemm.status()[counter]
        with mx.stream(mx.cpu):
            y = mx.array(x) @ mx.array(w).T
            mx.eval(y)
        assert small_gemm.status()[counter] > before, counter
        np.testing.assert_allclose(np.array(y), x @ w.T, rtol=1e-4, atol=1e-4)
    # which BLAS is behind is known by address, not by the clock (a busy CI timed it wrong)
    loaded = blas._loaded["path"]
    behind = small_gemm.status()["behind"]
    assert behind == os.path.realpath(loaded or blas.bundled_blas()), (behind, loaded)
    assert blas.measure(repeats=1)["fast"] == (loaded is not None)


def test_no_compiler_is_a_one_line_error_and_no_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises((RuntimeError, OSError)) as e:
        small_gemm.build(tmp_path)
    assert "\n" not in str(e.value)


def test_turned_off_by_environment(monkeypatch):
    monkeypatch.setenv(small_gemm.ENV, "0")
    monkeypatch.setitem(small_gemm._state, "lib", None)
    monkeypatch.setitem(small_gemm._state, "error", None)
    assert small_gemm.load("/nonexistent/libopenblas.so.0") is None
    assert "turned off" in small_gemm._state["error"]


def test_build_is_cached_per_source_and_cpu(tmp_path):
    first = small_gemm.build(tmp_path)
    mtime = os.stat(first).st_mtime_ns
    assert small_gemm.build(tmp_path) == first and os.stat(first).st_mtime_ns == mtime


def test_without_openblas_the_kernel_fronts_the_wheels_blas(tmp_path):
    """DFLASH_SYSTEM_BLAS=0 DFLASH_SCIPY_OPENBLAS=0: few-row products are the kernel's, and so are larger A @ B^T
    ones, in 16-row pieces (the reference BLAS costs ~M one-row products); A @ B products
    go to the wheel's BLAS."""
    import subprocess

    code = (
        "import numpy as np, dflash_mlx\n"
        "from dflash_mlx.cpu import blas, small_gemm\n"
        "import mlx.core as mx\n"
        "w = np.random.default_rng(0).standard_normal((200, 48)).astype(np.float32)\n"
        "for rows in (3, 40):\n"
        "    x = np.random.default_rng(rows).standard_normal((rows, 48)).astype(np.float32)\n"
        "    before = small_gemm.status()['small_calls']\n"
        "    y = mx.array(x) @ mx.array(w).T\n"
        "    assert np.allclose(np.array(y), x @ w.T, atol=1e-4), rows\n"
        "    assert small_gemm.status()['small_calls'] - before == -(-rows // 16), rows\n"
        "    one = np.array(mx.array(x[-1:]) @ mx.array(w).T)\n"
        "    assert np.array_equal(one[0], np.array(y)[-1]), 'a row has the same bits alone'\n"
        "s = small_gemm.status()\n"
        "assert s['split'] and s['forwarded_calls'] == 0, s\n"
        "z = mx.array(x) @ mx.array(np.ascontiguousarray(w.T))\n"
        "mx.eval(z)\n"
        "s = small_gemm.status()\n"
        "assert blas._loaded['path'] is None, blas._loaded\n"
        "assert s['forwarded_calls'] >= 1, s\n"
        "print('ok', blas.measure(repeats=1)['name'])  # named by the BLAS behind, not timed\n"
    )
    env = dict(os.environ, DFLASH_SYSTEM_BLAS="0", DFLASH_CACHE_DIR=str(tmp_path))
    env["DFLASH_SCIPY_OPENBLAS"] = "0"
    cmd = [sys.executable, "-c", code]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "reference BLAS" in p.stdout and "few-row kernel" in p.stdout, p.stdout


def test_small_forwarded_products_run_on_one_openblas_thread():
    """A product too big for the kernel but too small to pay for threads runs on one
    OpenBLAS thread (threaded, OpenBLAS's spinning workers take the kernel's cores); a large
    one gets OpenBLAS's threads back; ``set_one_thread(0)`` keeps them for every product."""
    import subprocess

    if blas._loaded["path"] is None:
        pytest.skip("no system OpenBLAS here (the wheel's reference BLAS has no threads)")
    code = (
        "import ctypes, numpy as np, dflash_mlx\n"
        "from dflash_mlx.cpu import blas, small_gemm\n"
        "import mlx.core as mx\n"
        "assert blas._loaded['path'], blas._loaded\n"
        "ob = ctypes.CDLL(blas._loaded['path'])\n"
        "pre = 'scipy_' if blas._loaded['kind'] == 'scipy-openblas32' else ''\n"
        "assert small_gemm.set_one_thread(small_gemm.ONE_THREAD_MACS) == 2\n"
        "def mm(m, k, n):\n"
        "    x, w = mx.random.normal((m, k)), mx.random.normal((n, k))\n"
        "    mx.eval(x @ w.T)\n"
        "    return getattr(ob, pre + 'openblas_get_num_threads')()\n"
        "assert mm(40, 48, 200) == 1  # 384k multiply-adds, forwarded (40 rows)\n"
        "assert mm(256, 512, 512) == 2  # 67M\n"
        "assert mm(40, 48, 200) == 1\n"
        "small_gemm.set_one_thread(0)\n"
        "assert mm(256, 512, 512) == 2 and mm(40, 48, 200) == 2\n"
        "print('ok')\n"
    )
    env = dict(os.environ, OPENBLAS_NUM_THREADS="2")
    p = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_an_extra_source_that_does_not_build_leaves_the_kernel(monkeypatch, tmp_path):
    """The selector's C source is built into the kernel's library; when it fails to build,
    the kernel is built alone (the selector then runs as MLX ops)."""
    src = tmp_path / "src" / "small_gemm.c"
    src.parent.mkdir()
    src.write_bytes(small_gemm.source_path().read_bytes())
    (src.parent / "path_select.c").write_text("this is not C\n")
    monkeypatch.setattr(small_gemm, "source_path", lambda: src)
    lib = ctypes.CDLL(str(small_gemm.build(tmp_path / "out")))
    assert hasattr(lib, "cblas_sgemm") and not hasattr(lib, "dflash_select_path")
