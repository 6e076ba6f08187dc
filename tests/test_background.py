"""swiftk's background threads end before the interpreter does (swiftk/background.py): a daemon thread still in
native code at finalization aborted the process ("terminate called without an active exception")."""
import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_exit_waits_for_a_running_job():
    """The script ends while a job runs: the job finishes (joined at exit), it is not cut off."""
    p = _run("""
        import time
        from swiftk.background import Background
        Background(lambda: (time.sleep(0.5), print("JOB-DONE", flush=True)), name="t")
        print("MAIN-DONE", flush=True)
    """)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["MAIN-DONE", "JOB-DONE"], p.stdout


def test_exit_stops_a_long_job_at_its_next_check():
    """A job that calls check() between pieces stops at the next one (Stopped) instead of running to its end."""
    p = _run("""
        import time
        from swiftk.background import Background, Stopped, check
        def job():
            try:
                for _ in range(1000):
                    check()
                    time.sleep(0.01)
                print("RAN-TO-END", flush=True)
            except Stopped:
                print("STOPPED", flush=True)
        Background(job, name="t")
        time.sleep(0.1)
    """)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["STOPPED"], p.stdout


def test_exit_during_gp_fits_does_not_abort():
    """What aborted CI once: the process exits while the skip-set search's GP fit runs in its thread (before the
    join, 4 of 16 such runs aborted here)."""
    code = """
        import time, numpy as np
        from swiftk.background import Background
        from swiftk.proposers.layerskip.search import bo_suggest
        rng = np.random.default_rng({seed})
        X, y = (rng.random((200, 20)) > 0.5).astype(float), rng.random(200)
        for _ in range(2):
            Background(lambda: [bo_suggest(X, y, 2.5, 1e-2, i) for i in range(3)], name="swiftk-bo")
        time.sleep(0.5 + rng.random())
    """
    for seed in range(4):
        p = _run(code.format(seed=seed))
        assert p.returncode == 0, (seed, p.stderr[-2000:])


def test_a_job_started_during_exit_only_stops():
    """A thread still decoding when the exit handler has run may start a job: it stops at once (no native code
    left running), and a failed start leaves nothing for the exit handler to join."""
    p = _run("""
        import swiftk.background as bg
        bg._finish()
        t = bg.Background(lambda: print("RAN", flush=True), name="late")
        t.join(5)
        print("STOPPED" if isinstance(t.error, bg.Stopped) and not t.is_alive() else "NOT-STOPPED", flush=True)
        class Broken(bg.Background):
            def start(self):
                raise RuntimeError("no threads left")
        try:
            Broken(lambda: None, name="broken")
        except RuntimeError:
            print("LIVE", len(bg._live), flush=True)
    """)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["STOPPED", "LIVE", "0"], p.stdout


def test_a_wait_at_exit_is_announced_and_ctrl_c_ends_it_with_one_line_and_130():
    """A job still in a long piece of work when the script ends: the exit says it waits for it (one line), and
    Ctrl-C during that wait ends the process at once with "swiftk: interrupted" and status 130 -- no traceback of
    the atexit handler, no status 0."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from swiftk.background import Background, check
        def job():
            while True:
                check()
                time.sleep(30)   # a long piece of work between two checks
        Background(job, name="swiftk-corpus")
        print("ANSWER", flush=True)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ANSWER"
    line = p.stderr.readline()   # blocks until the exit announces its wait
    assert "stopping background work before exit (swiftk-corpus)" in line, line
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    rest = p.stderr.read()
    assert p.wait(30) == 130 and time.monotonic() - t < 10
    assert rest.strip() == "swiftk: interrupted", rest


def test_an_error_exit_ends_with_its_error_line_after_stopping_the_jobs():
    """The CLI failing while a job runs (the corpus build a load started): the wait is announced first, so the
    error is the last line the user sees, and the status is 2; jobs started after it run (in-process callers of
    cli.main, the tests among them, go on)."""
    p = _run("""
        import sys, threading, time
        from swiftk.background import Background, check
        from swiftk.cli import main
        import swiftk.api   # imported before the job starts: the failing call must come within its first piece
        started = threading.Event()
        def job():
            while True:
                check()
                started.set()
                time.sleep(3.0)   # a piece of work between two checks: longer than the 0.25 s unannounced wait
        Background(job, name="swiftk-corpus")
        started.wait()
        rc = main(["generate", "x", "-m", "/nonexistent/model.gguf"])
        b = Background(lambda: 7, name="after")   # a caller that goes on can still start jobs
        b.join()
        print("AFTER", b.result, flush=True)
        sys.exit(rc)
    """)
    assert p.stdout.split() == ["AFTER", "7"], p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-2000:]
    assert lines[-1].startswith("swiftk: error: "), lines
    assert any("stopping background work before exit (swiftk-corpus)" in ln for ln in lines[:-1]), lines
