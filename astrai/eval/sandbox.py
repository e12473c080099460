"""Run untrusted Python programs (model-written code) in a resource-limited child process.

`run_program(source, limits)` writes the program into a fresh temporary directory and runs it as
`python -I sandbox_child.py SPEC` (`astrai.eval.sandbox_child`) with that directory as cwd, stdin from
/dev/null, a minimal environment (no proxies, HOME and TMPDIR inside the directory), stdout/stderr written to
files there (so a program printing forever cannot fill the evaluator's memory), in a new session. The child sets
up its guards on itself, then `exec`s the program; `run_programs` runs many in parallel threads. A program
*passes* when it exits with 0 within the wall-clock timeout.

The guards, in the order the child applies them (each one that took effect is listed in `Outcome.guards`):
1. rlimits: `RLIMIT_AS` (memory), `RLIMIT_CPU` (CPU seconds, SIGXCPU then SIGKILL), `RLIMIT_FSIZE` (file
   size), `RLIMIT_NOFILE`, `RLIMIT_CORE` 0, and `RLIMIT_NPROC` set to the sandbox user's live task count plus
   `Limits.max_processes` (Linux counts every task of the user, so an absolute value would be wrong).
2. `netns`: a new, empty network namespace (only a loopback that is down) through libc `unshare` via ctypes
   (`os.unshare` needs Python 3.12): `CLONE_NEWNET` as root, `CLONE_NEWUSER | CLONE_NEWNET` otherwise, where
   the kernel allows unprivileged user namespaces.
3. `nobody` (root only): the child drops to uid/gid 65534, keeping only `CAP_DAC_READ_SEARCH` so the interpreter
   can still import the standard library from a root-only prefix (e.g. pyenv under /root). As nobody it cannot
   write the evaluator's files, and RLIMIT_NPROC applies (Linux never enforces it for uid 0).
4. `seccomp` (Linux x86_64 / aarch64): a BPF filter that makes fork, vfork, clone of a new process (threads are
   allowed), execve, kill/tkill/tgkill, ptrace, process_vm_* and socket() fail with EPERM, and clone3 /
   io_uring_setup fail with ENOSYS (glibc then falls back to clone for threads); syscalls of another ABI kill
   the process. So a fork bomb gets `PermissionError` on its first fork, and no socket can be opened.
5. `socket`: `socket.socket` and `socket.create_connection` replaced by functions that raise (a Python-level
   guard the program could undo; the layers above are what holds).
The parent kills the whole process group (SIGKILL) when the wall clock runs out, and again after every run, so
nothing the program started outlives it; the directory is then removed.

Honest limits: this is defence in depth for benchmark code, not a security boundary. Without seccomp (other
architectures, or a kernel without it) processes are bounded only by RLIMIT_NPROC, which does not hold for root
when the uid drop fails; without a network namespace the network guard is the Python-level patch only; files
outside the temporary directory are protected only by the uid drop (as root) or not at all (as a normal user, the
program can write what that user can). Run untrusted code from unknown models in a container or VM as well.
Not here: Windows / macOS (needs `resource` and Linux syscalls; on macOS only the rlimits and timeout apply).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import attrs

from astrai.eval import sandbox_child
from astrai.eval.sandbox_child import GUARDS_FILE, NOBODY, PROGRAM

TAIL_CHARS = 2000  # the end of stdout/stderr kept per outcome


@attrs.frozen(kw_only=True)
class Limits:
    """What one sandboxed program may use."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the process group is killed (status "timeout")."""
    memory_mb: int = 2048
    """Address-space limit (RLIMIT_AS) in MiB: bigger allocations raise MemoryError."""
    cpu_s: int | None = None
    """CPU-seconds limit (RLIMIT_CPU); None: the timeout rounded up, plus 1."""
    file_size_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE), stdout and stderr included, in MiB."""
    open_files: int = 64
    """Most open file descriptors (RLIMIT_NOFILE)."""
    max_processes: int = 8
    """Tasks the sandbox user may add beyond its live count (RLIMIT_NPROC); the fallback when seccomp is off."""
    seccomp: bool = True
    """Install the seccomp filter (no new processes, signals, sockets); turn off only to test the other layers."""
    drop_root: bool = True
    """When the evaluator runs as root: run the program as nobody (uid 65534)."""

    @property
    def cpu_limit(self) -> int:
        """The RLIMIT_CPU soft limit in seconds."""
        return self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1


@attrs.frozen(kw_only=True)
class Outcome:
    """The result of running one program.

    Attributes:
        status: "passed" (exit code 0), "failed" (another exit code or a signal), or "timeout" (the wall clock
            or the CPU limit ran out).
        returncode: the exit code (negative: killed by that signal); None when it timed out.
        elapsed_s: wall-clock seconds.
        stdout: the last TAIL_CHARS characters the program wrote to stdout.
        stderr: the same for stderr (a traceback's last line says why it failed).
        guards: the guards that took effect (module docstring), e.g. ("rlimits", "netns", "seccomp", "socket").
    """

    status: str
    returncode: int | None
    elapsed_s: float
    stdout: str = ""
    stderr: str = ""
    guards: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """Whether the program exited with 0 in time."""
        return self.status == "passed"

    @property
    def error(self) -> str:
        """One line saying why it failed: the last stderr line, or the status ("" when it passed)."""
        if self.passed:
            return ""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        if self.status == "timeout":
            return "timeout"
        return lines[-1].strip() if lines else f"exit code {self.returncode}"


def run_program(source: str, limits: Limits | None = None) -> Outcome:
    """Run `source` in a fresh sandboxed interpreter and report how it ended (never raises for the program's
    own failures).

    Args:
        source: a whole Python program (run as `__main__`).
        limits: time, memory and process limits (default `Limits()`).
    """
    limits = limits or Limits()
    drop = limits.drop_root and os.geteuid() == 0
    workdir = tempfile.mkdtemp(prefix="astrai-sandbox-")
    try:
        with open(os.path.join(workdir, PROGRAM), "w", encoding="utf-8") as f:
            f.write(source)
        if drop:
            try:
                os.chown(workdir, NOBODY, NOBODY)  # nobody's cwd: the only place it may write
            except OSError:  # e.g. a container without CAP_CHOWN: run as root (the guards say so)
                drop = False
        spec = json.dumps({**attrs.asdict(limits), "cpu_limit": limits.cpu_limit, "drop": drop})
        with open(os.path.join(workdir, ".stdout"), "wb+") as out, open(os.path.join(workdir, ".stderr"), "wb+") as err:
            start = time.monotonic()
            proc = subprocess.Popen(  # no preexec_fn: it is unsafe in a threaded parent; the child guards itself
                [sys.executable, "-I", os.path.abspath(sandbox_child.__file__), spec],
                cwd=workdir, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=_environment(workdir),
                start_new_session=True, close_fds=True,
            )  # fmt: skip
            returncode = _wait_then_kill_group(proc, limits.timeout_s)
            elapsed = time.monotonic() - start
            stdout, stderr = _tail(out), _tail(err)
        guards = _read_guards(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    timed_out = returncode is None or returncode == -signal.SIGXCPU
    status = "timeout" if timed_out else "passed" if returncode == 0 else "failed"
    return Outcome(status=status, returncode=returncode, elapsed_s=elapsed,
                   stdout=stdout, stderr=stderr, guards=guards)  # fmt: skip


def run_programs(
    sources: Sequence[str],
    limits: Limits | None = None,
    *,
    workers: int | None = None,
    on_done: Callable[[int, Outcome], None] | None = None,
) -> list[Outcome]:
    """Run many programs, `workers` at a time (default min(4, CPU count)); outcomes in input order.

    Args:
        sources: the programs.
        limits: limits applied to each program.
        workers: parallel sandboxes.
        on_done: called (from a worker thread) with the index and outcome of each finished program.
    """
    workers = workers or min(4, os.cpu_count() or 1)

    def one(i: int) -> Outcome:
        outcome = run_program(sources[i], limits)
        if on_done is not None:
            on_done(i, outcome)
        return outcome

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, range(len(sources))))


def _environment(workdir: str) -> dict[str, str]:
    # nothing inherited: no proxies, tokens or PYTHON* variables (-I ignores those anyway)
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _wait_then_kill_group(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """Wait for the child up to `timeout_s` without reaping it, kill its whole process group, then reap it.

    Not reaping before `killpg` keeps the group id from being reused by an unrelated process. Returns the exit
    status (negative: a signal), or None when the timeout ran out.
    """
    deadline, pause, timed_out = time.monotonic() + timeout_s, 0.001, True
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            timed_out = False
            break
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, 0.02)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    returncode = proc.wait()
    return None if timed_out else returncode


def _tail(f) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - 4 * TAIL_CHARS))
    return f.read().decode("utf-8", "replace")[-TAIL_CHARS:]


def _read_guards(workdir: str) -> tuple[str, ...]:
    try:
        with open(os.path.join(workdir, GUARDS_FILE), encoding="utf-8") as f:
            return tuple(f.read(1000).split())
    except OSError:
        return ()
