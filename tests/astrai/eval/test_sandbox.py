"""The HumanEval sandbox: exit status, timeouts, memory / process / network limits, and cleanup.

Every hostile program here is bounded by construction (a fork "bomb" forks at most 62 processes in all, each
sleeping, never exponentially), so a guard that fails cannot take the machine down: the test fails instead.
"""

import os
import sys
import time

import pytest

from astrai.eval.sandbox import Limits, run_program, run_programs
from astrai.eval.sandbox_child import seccomp_program

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's guards are Linux syscalls")

FAST = Limits(timeout_s=5.0)

# a bounded fork tree: every process forks 2 children down to depth 5 (at most 62 children, who sleep until the
# sandbox kills its process group); each line of stdout says whether a fork worked (the child's pid) or was refused
BOMB = """
import os, time
def spawn(depth):
    for _ in range(2 if depth else 0):
        try:
            pid = os.fork()
        except OSError as e:
            print("refused", type(e).__name__, flush=True)
            continue
        if pid == 0:
            print("child", os.getpid(), flush=True)
            spawn(depth - 1)
            time.sleep(30)
            os._exit(0)
spawn(5)
time.sleep(0.5)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, waiting to be reaped
    except OSError:
        return False


def _children(outcome) -> list[int]:
    return [int(line.split()[1]) for line in outcome.stdout.splitlines() if line.startswith("child")]


def _all_gone(pids: list[int], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(_alive, pids))


def test_exit_status_output_and_stdin_eof():
    ok = run_program("import sys\nassert sys.stdin.read() == ''\nprint('hello')", FAST)
    assert ok.passed and ok.returncode == 0 and ok.stdout == "hello\n" and ok.error == ""
    bad = run_program("assert 1 + 1 == 3, 'arithmetic'", FAST)
    assert bad.status == "failed" and bad.returncode == 1 and bad.error == "AssertionError: arithmetic"
    assert run_program("raise SystemExit(3)", FAST).returncode == 3
    assert run_program("import sys; sys.exit(0)", FAST).passed


def test_infinite_loop_and_sleep_time_out():
    for source in ("while True:\n    pass", "import time\ntime.sleep(60)"):
        start = time.monotonic()
        outcome = run_program(source, Limits(timeout_s=0.5))
        assert outcome.status == "timeout" and outcome.returncode is None and not outcome.passed
        assert 0.5 <= outcome.elapsed_s < 2.5 and time.monotonic() - start < 3.0


def test_cpu_limit_counts_as_timeout():
    # a busy loop exhausts RLIMIT_CPU (1 s) long before the 20 s wall clock: SIGXCPU
    outcome = run_program("while True:\n    pass", Limits(timeout_s=20.0, cpu_s=1))
    assert outcome.status == "timeout" and outcome.elapsed_s < 10.0


def test_memory_limit_refuses_a_10_gib_allocation():
    outcome = run_program("x = bytearray(10 * 2**30)\nprint('allocated')", FAST)
    assert outcome.status == "failed" and "MemoryError" in outcome.error and "allocated" not in outcome.stdout


def test_output_flood_is_cut_by_the_file_size_limit():
    outcome = run_program("while True:\n    print('x' * 1000)", Limits(timeout_s=10.0, file_size_mb=1))
    assert outcome.status == "failed" and outcome.elapsed_s < 5.0  # SIGXFSZ, not the timeout
    assert len(outcome.stdout) <= 2000


def test_no_network():
    high = run_program("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)", FAST)
    assert high.status == "failed" and "PermissionError" in high.error
    low = run_program("import _socket\n_socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)", FAST)
    if "seccomp" not in low.guards:
        pytest.skip(f"no seccomp filter here (guards: {low.guards}): only the Python-level socket guard holds")
    assert low.status == "failed" and "PermissionError" in low.error


def test_fork_bomb_is_refused_and_nothing_survives():
    outcome = run_program(BOMB, Limits(timeout_s=5.0))
    children = _children(outcome)
    assert _all_gone(children), "a process of the sandbox outlived it"
    if "seccomp" not in outcome.guards:
        pytest.skip(f"no seccomp filter here (guards: {outcome.guards})")
    assert children == [] and outcome.stdout.count("refused PermissionError") == 2


def test_process_limit_without_seccomp():
    outcome = run_program(BOMB, Limits(timeout_s=5.0, seccomp=False, max_processes=8))
    children = _children(outcome)
    assert _all_gone(children), "a process of the sandbox outlived it"
    if os.geteuid() == 0 and "nobody" not in outcome.guards:
        pytest.skip("root without the uid drop: Linux does not enforce RLIMIT_NPROC for uid 0")
    assert "refused" in outcome.stdout and len(children) < 8 + 16  # the live count moves a little meanwhile


def test_cannot_signal_other_processes():
    # signal 0 only checks that the target exists: harmless even if the guard failed
    outcome = run_program("import os\nos.kill(os.getppid(), 0)", FAST)
    if "seccomp" not in outcome.guards:
        pytest.skip(f"no seccomp filter here (guards: {outcome.guards})")
    assert outcome.status == "failed" and "PermissionError" in outcome.error


def test_threads_still_work():
    source = "import threading\nout = []\nt = threading.Thread(target=out.append, args=(1,))\nt.start()\nt.join()\n"
    source += "assert out == [1]"
    assert run_program(source, FAST).passed


def test_runs_in_a_fresh_directory_that_is_removed(tmp_path):
    outcome = run_program("import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())", FAST)
    assert outcome.passed
    workdir = outcome.stdout.strip()
    assert workdir != os.getcwd() and not os.path.exists(workdir)
    if "nobody" in outcome.guards:  # as root the program runs as nobody: other files are read-only to it
        target = tmp_path / "x.txt"
        denied = run_program(f"open({str(target)!r}, 'w').write('x')", FAST)
        assert denied.status == "failed" and "PermissionError" in denied.error and not target.exists()


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("ASTRAI_SECRET_TOKEN", "s3cret")
    outcome = run_program("import os\nprint(sorted(os.environ))", FAST)
    assert outcome.passed and "HTTPS_PROXY" not in outcome.stdout and "ASTRAI_SECRET_TOKEN" not in outcome.stdout


def test_run_programs_keeps_order_and_reports_each():
    sources = [f"import sys\nsys.exit({i % 2})" for i in range(6)]
    seen = []
    outcomes = run_programs(sources, FAST, workers=3, on_done=lambda i, o: seen.append(i))
    assert [o.passed for o in outcomes] == [True, False] * 3 and sorted(seen) == list(range(6))


def test_seccomp_filter_shape():
    assert seccomp_program("riscv64") is None
    prog = seccomp_program("x86_64")
    assert prog[0] == (0x20, 0, 0, 4) and prog[-1] == (0x06, 0, 0, 0x7FFF0000)  # load arch ... allow
    assert seccomp_program("aarch64") is not None
