"""Full speed from any thread: every parallel region of the CPU kernels runs on the library's one pool
(kernels/cpu/cpu_pool.h), whatever host thread calls in. With OpenMP each thread that opened a region got a pool of
its own; two of them on a 2-CPU machine throttled every spin-wait and a worker thread decoded at ~40% speed.

The tests count threads, not seconds: a host thread that opens a region of its own pool adds pool threads to the
process. Each runs in a child process, so no other test's threads are counted."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from swiftk.runtime.ops import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="CPU kernels not built here")


def _child(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_kernel_regions_from_many_threads_share_one_pool():
    """Three host threads alive at once, each running a matmul big enough to split over 2 threads: the process
    gains exactly those three threads and the pool no worker (OpenMP: three pools, three more threads)."""
    out = _child("""
        import json, os, threading, torch
        torch.set_num_threads(2)
        from swiftk.runtime.ops import cpu_linear, native
        x, w = torch.randn(4, 2048), torch.randn(2048, 2048)
        tasks = lambda: len(os.listdir("/proc/self/task"))
        want = cpu_linear.linear(x, w)            # the main thread starts the pool
        base, workers = tasks(), native.pool_workers()
        started, hold, same = threading.Barrier(4), threading.Event(), []
        def host():
            same.append(torch.equal(cpu_linear.linear(x, w), want))
            started.wait()
            hold.wait()                           # alive while counted: a pool of its own would still exist
        ths = [threading.Thread(target=host) for _ in range(3)]
        for t in ths:
            t.start()
        started.wait()
        out = {"new_threads": tasks() - base, "new_workers": native.pool_workers() - workers,
               "workers": workers, "same": all(same) and len(same) == 3}
        hold.set()
        for t in ths:
            t.join()
        print(json.dumps(out))
    """)
    assert out["workers"] == 1, out   # 2 threads: the caller and one pool worker
    assert out == {"new_threads": 3, "new_workers": 0, "workers": 1, "same": True}


def test_generate_on_a_worker_thread_opens_no_pool(smollm2_path):
    """generate from a threading.Thread (as the server, stream() and thread-pool hosts call it) leaves the process
    with no native thread it did not have, counted while that thread is still alive (a pool of its own, as libgomp
    gave each calling thread, lives as long as its thread); so every region of the decode (kernels and torch ops
    alike) ran on pools the main thread already had. Its tokens equal the main thread's. Python's own threads are
    excluded and waited for: one that is starting or ending shows as a task that threading does not list yet."""
    out = _child(f"""
        import json, os, threading, time, torch
        torch.set_num_threads(2)
        import swiftk
        eng = swiftk.load({str(smollm2_path)!r}, datastore=False)

        def native():   # threads no Python code started: thread pools (the kernels', libgomp's for torch and MKL)
            for t in threading.enumerate():
                if t not in (threading.main_thread(), host_thread):
                    t.join(timeout=60)
            return set(os.listdir("/proc/self/task")) - {{str(t.native_id) for t in threading.enumerate()}}

        p = "def fibonacci(n):"
        main = [eng.generate(p, max_new_tokens=24, method=m).token_ids for m in ("autoregressive", "swift")]
        host_thread = None
        base, got, done, hold = native(), [], threading.Event(), threading.Event()
        def host():
            for m in ("autoregressive", "swift"):
                got.append(eng.generate(p, max_new_tokens=24, method=m).token_ids)
            done.set()
            hold.wait()
        host_thread = threading.Thread(target=host)
        host_thread.start()
        done.wait()
        extra = native() - base
        for _ in range(50):    # a thread that has left Python may still be exiting: let it go
            if not extra:
                break
            time.sleep(0.02)
            extra = native() - base
        hold.set()
        host_thread.join()
        print(json.dumps({{"extra": len(extra), "same": got == main}}))
    """)
    assert out == {"extra": 0, "same": True}, out


EXIT_WITH_OPEN_STREAM = textwrap.dedent("""
    import sys, swiftk
    eng = swiftk.load(sys.argv[1], persist=False, datastore=False)
    it = eng.stream("Once upon a time", max_new_tokens=3000)
    print(next(it), flush=True)
""")


def test_a_script_that_exits_with_a_stream_open_exits_cleanly(smollm2_path):
    """The stream's worker is still decoding when the interpreter exits: it is cancelled and joined at exit, not
    torn down inside a kernel (that aborted with "terminate called without an active exception" in ~1 of 4 runs,
    so the script runs several times)."""
    for _ in range(4):
        r = subprocess.run([sys.executable, "-c", EXIT_WITH_OPEN_STREAM, str(smollm2_path)], capture_output=True,
                           text=True, timeout=300, env={**os.environ, "SWIFTK_PERSIST": "0"})
        assert r.returncode == 0 and "terminate called" not in r.stderr, (r.returncode, r.stderr[-2000:])
        assert r.stdout.strip()
