"""The child side of `astrai.eval.sandbox`: run as `python -I sandbox_child.py SPEC` inside the sandbox directory.

It reads `program.py`, applies the guards to itself (rlimits, network namespace, uid drop, seccomp filter, socket
patch: the order and meaning are in `astrai.eval.sandbox`'s docstring), writes the names of those that took
effect to `.sandbox_guards`, then `exec`s the program as `__main__`. Guarding itself instead of a `preexec_fn`
keeps the parent safe to call from threads (preexec_fn can deadlock a threaded parent), and the child runs
single-threaded, as `unshare(CLONE_NEWUSER)` requires.

Standard library only: it starts once per program, so its imports are kept to what it needs (no attrs, no astrai
package: it is run by path, and `python -I` leaves its folder off sys.path). The parent imports it only for its
constants and path.
"""

import ctypes
import json
import os
import platform
import resource
import struct
import sys

NOBODY = 65534
PROGRAM = "program.py"
GUARDS_FILE = ".sandbox_guards"

_libc = None


def _libc_call(name: str, *args) -> bool:
    """Call a libc function through ctypes; True when it returned 0."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, name, None)
    return fn is not None and fn(*args) == 0


def user_tasks(uid: int) -> int:
    """Live tasks (threads included: Linux counts those for RLIMIT_NPROC) whose real uid is `uid`."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return total


def set_rlimits(spec: dict, uid: int) -> None:
    """Memory, CPU, file size, open files, core dumps, and tasks of `uid` (its live count plus a margin)."""
    mib = 1 << 20
    limits = {
        resource.RLIMIT_AS: spec["memory_mb"] * mib,
        resource.RLIMIT_CPU: spec["cpu_limit"],
        resource.RLIMIT_FSIZE: spec["file_size_mb"] * mib,
        resource.RLIMIT_NOFILE: spec["open_files"],
        resource.RLIMIT_CORE: 0,
    }
    if hasattr(resource, "RLIMIT_NPROC") and os.path.isdir("/proc"):
        limits[resource.RLIMIT_NPROC] = user_tasks(uid) + spec["max_processes"]
    for kind, value in limits.items():
        hard = value + 1 if kind == resource.RLIMIT_CPU else value  # CPU: SIGXCPU at soft, SIGKILL at hard
        resource.setrlimit(kind, (value, hard))


def unshare_network(as_root: bool) -> bool:
    """A new network namespace (root), or a user + network namespace (others); False when refused."""
    clone_newnet, clone_newuser = 0x40000000, 0x10000000
    return _libc_call("unshare", clone_newnet if as_root else clone_newuser | clone_newnet)


def drop_to_nobody() -> bool:
    """setuid/setgid to nobody, keeping only CAP_DAC_READ_SEARCH (read any file, search any directory)."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    pr_set_keepcaps, linux_capability_version_3, cap_dac_read_search = 8, 0x20080522, 2
    try:
        _libc_call("prctl", pr_set_keepcaps, 1, 0, 0, 0)
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    except OSError:
        return False
    data = (Data * 2)()
    data[0].effective = data[0].permitted = 1 << cap_dac_read_search
    _libc_call("capset", ctypes.byref(Header(linux_capability_version_3, 0)), data)  # failing leaves no caps
    return True


# syscall numbers: (AUDIT_ARCH, {name: nr}); aarch64 has no fork/vfork
SYSCALLS = {
    "x86_64": (0xC000003E, {"socket": 41, "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "kill": 62,
                            "ptrace": 101, "rt_sigqueueinfo": 129, "tkill": 200, "tgkill": 234,
                            "rt_tgsigqueueinfo": 297, "process_vm_readv": 310, "process_vm_writev": 311,
                            "execveat": 322, "pidfd_send_signal": 424, "io_uring_setup": 425, "clone3": 435}),
    "aarch64": (0xC00000B7, {"ptrace": 117, "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138,
                             "socket": 198, "clone": 220, "execve": 221, "rt_tgsigqueueinfo": 240,
                             "process_vm_readv": 270, "process_vm_writev": 271, "execveat": 281,
                             "pidfd_send_signal": 424, "io_uring_setup": 425, "clone3": 435}),
}  # fmt: skip
DENIED = ("fork", "vfork", "execve", "execveat", "kill", "tkill", "tgkill", "ptrace", "socket", "rt_sigqueueinfo",
          "rt_tgsigqueueinfo", "process_vm_readv", "process_vm_writev", "pidfd_send_signal")  # fmt: skip


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]] | None:
    """The BPF filter as (code, jt, jf, k) instructions over `struct seccomp_data`; None for another arch.

    The syscalls in DENIED fail with EPERM, clone3 and io_uring_setup with ENOSYS (glibc falls back to clone for
    threads), clone is allowed only with CLONE_THREAD in its flags (a thread, not a process); a syscall of another
    ABI (i386 via int 0x80, x32) kills the process, so the filter cannot be bypassed through a second table.
    """
    if machine not in SYSCALLS:
        return None
    arch, nr = SYSCALLS[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JGE|K, JMP|JSET|K, RET|K
    allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_ERRNO | errno
    clone_thread = 0x00010000
    # seccomp_data: int nr at offset 0, u32 arch at 4, u64 args[6] from 16 (little endian: low word first)
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if machine == "x86_64":  # the x32 ABI shares the arch value: refuse its syscall numbers
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, enosys)]
    for name in DENIED:
        if name in nr:
            prog += [(jeq, 0, 1, nr[name]), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, nr["clone3"]), (ret, 0, 0, enosys), (jeq, 0, 1, nr["io_uring_setup"]), (ret, 0, 0, enosys)]
    prog += [(jeq, 0, 3, nr["clone"]), (ld, 0, 0, 16), (jset, 1, 0, clone_thread), (ret, 0, 0, eperm)]
    prog += [(ret, 0, 0, allow)]
    return prog


def install_seccomp() -> bool:
    """Install the filter (after PR_SET_NO_NEW_PRIVS, which unprivileged processes need); False if refused."""
    prog = seccomp_program(platform.machine())
    if prog is None or sys.byteorder != "little":
        return False
    raw = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if not _libc_call("prctl", pr_set_no_new_privs, 1, 0, 0, 0):
        return False
    return _libc_call("prctl", pr_set_seccomp, seccomp_mode_filter, ctypes.byref(fprog), 0, 0)


def block_socket_module() -> None:
    """Make `socket.socket` and `socket.create_connection` raise (a Python-level guard the program can undo)."""
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    socket.socket = socket.create_connection = refuse


def main(spec: dict) -> None:
    """Guard this process as `spec` says (the parent's `Limits` plus `drop`), then run the program."""
    with open(PROGRAM, encoding="utf-8") as f:
        source = f.read()
    linux = sys.platform == "linux"
    guards = []
    set_rlimits(spec, NOBODY if spec["drop"] else os.getuid())
    guards.append("rlimits")
    if linux and unshare_network(os.geteuid() == 0):
        guards.append("netns")
    if spec["drop"] and drop_to_nobody():
        guards.append("nobody")
    if linux and spec["seccomp"] and install_seccomp():
        guards.append("seccomp")
    block_socket_module()
    guards.append("socket")
    try:
        with open(GUARDS_FILE, "w", encoding="utf-8") as f:
            f.write(" ".join(guards))
    except OSError:  # informational only: never keep the program from running
        pass
    sys.argv = [PROGRAM]
    exec(compile(source, PROGRAM, "exec"), {"__name__": "__main__", "__file__": PROGRAM, "__builtins__": __builtins__})


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
