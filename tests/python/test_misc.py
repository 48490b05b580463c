"""Package-level helpers: version, CPU target, memory accounting."""

import os
import subprocess
import sys
import textwrap

import libkda
from conftest import make_inputs


def test_version():
    assert libkda.__version__ == "0.1.0"


def test_cpu_target():
    assert libkda.cpu_target() in ("avx512", "avx2", "generic")


def test_memory_stats(rng):
    x = make_inputs(rng, B=1, T=200, H=2, K=32, V=32)
    cur0, _ = libkda.memory_stats()
    libkda.reset_peak_memory()
    assert libkda.memory_stats()[1] == cur0
    libkda.chunk_kda(**x, path="staged")
    cur1, peak1 = libkda.memory_stats()
    assert cur1 == cur0, "the library leaked accounted memory"
    assert peak1 > cur0, "the staged path materializes tensors through the allocator"


def test_generic_target_subprocess():
    # KDA_CPU_TARGET=generic forces the portable kernels; they agree with the oracle too.
    code = textwrap.dedent("""
        import numpy as np, libkda
        rng = np.random.default_rng(1)
        q, k = rng.standard_normal((2, 1, 90, 2, 32))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        v = rng.standard_normal((1, 90, 2, 32))
        g = -np.exp(rng.normal(-2, 1, (1, 90, 2, 32)))
        beta = rng.uniform(0, 1, (1, 90, 2))
        x = [a.astype(np.float32) for a in (q, k, v, g, beta)]
        o, _ = libkda.chunk_kda(*x)
        r, _ = libkda.naive_recurrent_kda(*x)
        rel = np.sqrt(np.mean((o - r) ** 2) / np.mean(r ** 2))
        print(libkda.cpu_target(), rel)
        assert libkda.cpu_target() == "generic" and rel <= 1e-5, rel
    """)
    env = dict(os.environ, KDA_CPU_TARGET="generic")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_concurrent_calls_release_the_gil(rng):
    # Calls from several Python threads run concurrently and give the serial results.
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from conftest import assert_bitwise

    xs = [make_inputs(np.random.default_rng(i), B=1, T=120, H=2, K=32, V=32) for i in range(4)]
    serial = [libkda.chunk_kda(**x, num_threads=1)[0] for x in xs]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda x: libkda.chunk_kda(**x, num_threads=1)[0], xs))
    for a, b in zip(serial, threaded):
        assert_bitwise(a, b)
