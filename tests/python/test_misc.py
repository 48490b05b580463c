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


def test_forked_child_after_a_threaded_call(rng):
    """GNU OpenMP's thread pool does not survive fork(): a child forked after a multi-threaded call
    (multiprocessing's default start method on Linux, DataLoader workers, prefork servers) runs its
    calls on one thread instead of waiting forever for the parent's workers, and gets the parent's
    results bitwise. The child is killed after 60 s, so a hang fails the test instead of hanging it."""
    import numpy as np
    import time
    x = make_inputs(rng, T=100, H=4, K=32, V=32)
    o, s = libkda.chunk_kda(**x, num_threads=2, output_final_state=True)
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, just an exit code
        code = 3
        try:
            oc, sc = libkda.chunk_kda(**x, num_threads=2, output_final_state=True)
            code = 0 if np.array_equal(oc, o) and np.array_equal(sc, s) else 4
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung in libkda.chunk_kda")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0, f"the forked child failed: exit {os.waitstatus_to_exitcode(status)}"
