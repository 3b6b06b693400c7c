"""Runs INSIDE the sandbox (namespace init, pid 1), with the system Python, stdlib only.

The parent passes this file's source with `python -I -S -c` and a JSON payload on stdin.
It never sees expected outputs: it only reports what the solution printed or returned,
and the parent (outside) compares. So a solution that patches anything in here can
only change what it reports about itself, never the verdict rule.

pid 1 is the supervisor: it finishes the jail (read-only mounts, a private tmpfs,
capabilities dropped) and forks the worker that runs the untrusted code. Killing pid 1
tears the whole pid namespace down, so nothing the solution forks can outlive the run.
"""

import ctypes
import io
import json
import os
import select
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
LOCKABLE = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _unescape(path):
    # mountinfo escapes space, tab, newline and backslash as octal.
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def jail(tmpfs_mb):
    """Make every mount read-only, give /tmp a private tmpfs, drop every capability."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    with open("/proc/self/mountinfo") as f:
        mounts = [(_unescape(ln.split()[4]), ln.split()[5]) for ln in f]
    for mountpoint, opts in mounts:
        # A remount must keep the flags the kernel locked when the namespace was made.
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for o in opts.split(","):
            flags |= LOCKABLE.get(o, 0)
        try:
            _mount(None, mountpoint, None, flags)
        except OSError:
            # Mounts hidden under others can't be reached; what can't be remounted must
            # at least not be writable by us: prove it rather than trust it.
            if os.path.isdir(mountpoint) and os.access(mountpoint, os.W_OK):
                raise
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(tmpfs_mb)}m,mode=0700")
    try:  # a /proc of our own pid namespace: the solution sees only its own processes
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    os.chdir("/tmp")
    os.environ.update({"HOME": "/tmp", "TMPDIR": "/tmp"})
    # Capabilities: we are root of our own user namespace; drop all of it so the
    # solution can neither remount rw nor touch the namespaces' settings.
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last cap is fine
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    data = (Data * 2)()
    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")
    with open("/proc/self/status") as f:
        eff = [ln for ln in f if ln.startswith("CapEff:")][0].split()[1]
    if int(eff, 16) != 0:
        raise OSError(f"capabilities still effective: {eff}")


class CappedWriter(io.TextIOBase):
    """sys.stdout for the solution: keeps at most `cap` characters, then stops it."""

    def __init__(self, cap):
        self.buf, self.n, self.cap = [], 0, cap

    def writable(self):
        return True

    def write(self, s):
        self.n += len(s)
        if self.n > self.cap:
            raise OverflowError("output limit exceeded")
        self.buf.append(s)
        return len(s)

    def getvalue(self):
        return "".join(self.buf)


def run_tests(payload, out_fd):
    """The worker: run the solution on each test and report what it produced."""

    def emit(obj):
        os.write(out_fd, (json.dumps(obj) + "\n").encode())

    code = payload["code"]
    cap = int(payload["max_output"])
    try:
        compiled = compile(code, "<solution>", "exec")
    except SyntaxError as e:
        emit({"fatal": f"SyntaxError: {e.msg} (line {e.lineno})"})
        return
    real_stdin, real_stdout = sys.stdin, sys.stdout
    for i, test in enumerate(payload["tests"]):
        out = CappedWriter(cap)
        sys.stdin, sys.stdout = io.StringIO(test.get("stdin", "")), out
        res = {"i": i}
        try:
            glb = {"__name__": "__main__", "__builtins__": __builtins__}
            try:
                exec(compiled, glb)
            except SystemExit as e:  # a program may end with sys.exit(); its output still counts
                res["exit"] = str(e.code)
            if "call" in test:
                fn = glb.get(test["call"])
                if not callable(fn):
                    raise NameError(f"the solution defines no function {test['call']!r}")
                res["ret"] = json.dumps(fn(*test.get("args", [])))
        except BaseException as e:  # noqa: BLE001  (report every failure as this test's result)
            res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            sys.stdin, sys.stdout = real_stdin, real_stdout
        res["stdout"] = out.getvalue()
        emit(res)
    emit({"done": True})


def main():
    payload = json.loads(sys.stdin.read())
    jail(payload["tmpfs_mb"])
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the solution may not ptrace us
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # if unshare dies, so do we (and the ns)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):  # raw writes to stdout/stderr go nowhere
            os.dup2(null, fd)
        code = 0
        try:
            run_tests(payload, w)
        except BaseException:  # noqa: BLE001
            code = 70
        os._exit(code)
    os.close(w)
    limit, got = int(payload["max_report"]), bytearray()
    overflow, status = False, None
    while True:
        # Stop when the worker exits even if something it forked still holds the pipe:
        # returning from pid 1 kills every process left in the namespace.
        ready, _, _ = select.select([r], [], [], 0.02)
        chunk = os.read(r, 65536) if ready else b""
        if len(got) + len(chunk) > limit:
            overflow = True
            os.kill(pid, signal.SIGKILL)
        else:
            got += chunk
        if status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
        if (ready and not chunk) or overflow or (status is not None and not ready):
            break
    if status is None:
        _, status = os.waitpid(pid, 0)
    report = {
        "report": got.decode(errors="replace"),
        "overflow": overflow,
        "exit": os.waitstatus_to_exitcode(status),
    }
    os.write(1, json.dumps(report).encode())


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # noqa: BLE001
        os.write(1, json.dumps({"setup_error": f"{type(e).__name__}: {e}"}).encode())
        os._exit(1)
