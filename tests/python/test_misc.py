"""Package-level helpers: version, CPU target, memory accounting."""

import os
import platform
import subprocess
import sys
import textwrap

import libkda
import pytest
from conftest import BF16, BOUND, make_inputs


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


# The inputs x = [q, k, v, g, beta] (B = 1, T = 90, H = 2, K = V = 32) of the scripts the tests
# below run in a subprocess with an environment variable set (the CPU choices are made once).
_SUBPROCESS_INPUTS = textwrap.dedent("""
    import numpy as np, ml_dtypes, libkda
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 1, 90, 2, 32))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((1, 90, 2, 32))
    g = -np.exp(rng.normal(-2, 1, (1, 90, 2, 32)))
    beta = rng.uniform(0, 1, (1, 90, 2))
    x = [a.astype({dtype}) for a in (q, k, v, g, beta)]
""")


def _cpuinfo_field(*names):
    """The first /proc/cpuinfo line's value whose key starts with one of names ("" if none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(names):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags():
    return set(_cpuinfo_field("flags", "Features").split())


def _cpu_runs(target):
    flags = _cpu_flags()
    avx2 = {"avx2", "fma", "f16c", "bmi2"} <= flags
    if target == "avx2":
        return avx2
    if target == "avx512":
        return avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    return True


def _forward_in_subprocess(dtype, **env_vars):
    """The forward on _SUBPROCESS_INPUTS in a fresh process with env_vars set (the library makes
    its CPU choices once per process): 'ran: <cpu_target> <cpu_bf16_dot_products> <rel to the
    oracle>', or 'error: <message>' where the call raised."""
    code = _SUBPROCESS_INPUTS.format(dtype=dtype) + textwrap.dedent("""
        try:
            o, _ = libkda.chunk_kda(*x)
        except ValueError as e:
            print("error:", e)
            raise SystemExit(0)
        r, _ = libkda.naive_recurrent_kda(*x)
        o, r = o.astype(np.float64), r.astype(np.float64)
        print("ran:", libkda.cpu_target(), libkda.cpu_bf16_dot_products(),
              np.sqrt(np.mean((o - r) ** 2) / np.mean(r ** 2)))
    """)
    env = dict(os.environ, **env_vars)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.strip()


@pytest.mark.parametrize("target", ["generic", "avx2", "avx512"])
def test_forced_cpu_target_runs_or_says_the_cpu_lacks_it(target):
    # KDA_CPU_TARGET forces a target: where the CPU runs it, its kernels agree with the oracle; where
    # it does not (an x86 target on another CPU), every call raises naming the variable and the
    # target instead of falling back in silence.
    out = _forward_in_subprocess("np.float32", KDA_CPU_TARGET=target)
    if _cpu_runs(target) and platform.machine() in ("x86_64", "AMD64") or target == "generic":
        assert out.startswith("ran: " + target + " "), out
        assert float(out.split()[3]) <= 1e-5, out
    else:
        assert "KDA_CPU_TARGET" in out and "not supported by this CPU" in out, out


def test_unknown_cpu_target_is_an_error_of_every_call():
    # A KDA_CPU_TARGET naming no target is not silently ignored: each kernel call raises, naming it.
    code = textwrap.dedent("""
        import numpy as np, libkda
        x = [np.zeros((1, 4, 1, 8), np.float32) for _ in range(4)] + [np.zeros((1, 4, 1), np.float32)]
        try:
            libkda.chunk_kda(*x)
        except ValueError as e:
            print(e)
        else:
            raise SystemExit("no error")
    """)
    env = dict(os.environ, KDA_CPU_TARGET="avx9000")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "KDA_CPU_TARGET" in res.stdout and "avx9000" in res.stdout, res.stdout


def _run_with_bf16_dot_env(value):
    # bf16 inputs (K = V = 32, two 16-token blocks past the first) with the setting given.
    env = {"KDA_BF16_DOT_PRODUCTS": value, "KDA_CPU_TARGET": ""}
    out = _forward_in_subprocess("ml_dtypes.bfloat16", **env)
    return out if out.startswith("error:") else "ran: " + " ".join(out.split()[2:])


def test_bf16_dot_products_follow_the_vendor_rule():
    # Unset or auto: bf16 dot products on the avx512 target of an AVX512_BF16 CPU from AMD only
    # (Intel's Xeons issue vdpbf16ps at half their FMA rate); off: never.
    has = libkda.cpu_target() == "avx512" and "avx512_bf16" in _cpu_flags()
    want = has and _cpuinfo_field("vendor_id") == "AuthenticAMD"
    if os.environ.get("KDA_CPU_TARGET") or os.environ.get("KDA_BF16_DOT_PRODUCTS"):
        pytest.skip("the environment forces a CPU target or a product setting")
    assert libkda.cpu_bf16_dot_products() is want
    for value in ("", "auto"):
        out = _run_with_bf16_dot_env(value)
        assert out.startswith(f"ran: {want} "), out
        assert float(out.split()[2]) <= BOUND[BF16], out
    out = _run_with_bf16_dot_env("off")
    assert out.startswith("ran: False "), out
    assert float(out.split()[2]) <= BOUND[BF16], out


def test_forced_bf16_dot_products_run_or_say_the_cpu_lacks_them():
    # on: wherever the CPU has AVX512_BF16 on the avx512 target, within the bf16 bound of the oracle;
    # elsewhere every call raises naming the variable.
    out = _run_with_bf16_dot_env("on")
    if _cpu_runs("avx512") and "avx512_bf16" in _cpu_flags() and platform.machine() in ("x86_64", "AMD64"):
        assert out.startswith("ran: True "), out
        assert float(out.split()[2]) <= BOUND[BF16], out
    else:
        assert "KDA_BF16_DOT_PRODUCTS" in out and "AVX512_BF16" in out, out


def test_unknown_bf16_dot_products_setting_is_an_error_of_every_call():
    out = _run_with_bf16_dot_env("fast")
    assert out.startswith("error:") and "KDA_BF16_DOT_PRODUCTS" in out and "'fast'" in out, out


@pytest.mark.parametrize("value", ["", "auto", "on", "off"])
def test_decode_strips_settings_run(value):
    # KDA_DECODE_STRIPS only picks between two kernels that give the same bits (ctest runs the
    # decode tests under the setting the vendor rule does not pick); every setting is accepted.
    out = _forward_in_subprocess("np.float32", KDA_DECODE_STRIPS=value, KDA_CPU_TARGET="")
    assert out.startswith("ran: "), out
    assert float(out.split()[3]) <= 1e-5, out


def test_unknown_decode_strips_setting_is_an_error_of_every_call():
    out = _forward_in_subprocess("np.float32", KDA_DECODE_STRIPS="sometimes", KDA_CPU_TARGET="")
    assert out.startswith("error:") and "KDA_DECODE_STRIPS" in out and "'sometimes'" in out, out


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


FORK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import libkda
    rng = np.random.default_rng(0)
    shape = (1, 100, 4, 32)
    x = dict(q=rng.standard_normal(shape).astype(np.float32), k=rng.standard_normal(shape).astype(np.float32),
             v=rng.standard_normal(shape).astype(np.float32),
             g=(-0.1 * np.abs(rng.standard_normal(shape))).astype(np.float32),
             beta=rng.uniform(0, 1, shape[:3]).astype(np.float32))
    o, s = libkda.chunk_kda(**x, num_threads=2, use_qk_l2norm_in_kernel=True, output_final_state=True)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            oc, sc = libkda.chunk_kda(**x, num_threads=2, use_qk_l2norm_in_kernel=True, output_final_state=True)
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
            print("the forked child hung in libkda.chunk_kda")
            sys.exit(1)
        time.sleep(0.05)
    code = os.waitstatus_to_exitcode(status)
    print("ok" if code == 0 else f"the forked child failed: exit {code}")
""")


def test_forked_child_after_a_threaded_call():
    """GNU OpenMP's thread pool does not survive fork(): a child forked after a multi-threaded call
    (multiprocessing's default start method on Linux, DataLoader workers, prefork servers) runs its
    calls on one thread instead of waiting forever for the parent's workers, and gets the parent's
    results bitwise. In a fresh interpreter (numpy and libkda only: no other library's threads at
    the fork); the child is killed after 60 s, so a hang fails the test instead of hanging it."""
    r = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-2000:]
