"""Runs INSIDE the sandbox (namespace init, pid 1), with the sandbox's Python, stdlib only.

The parent passes this file's source with `python -I -S -c` and a JSON payload on stdin.
It never sees expected outputs: it only reports what the solution printed or returned,
and the parent (outside) compares.

Three processes, each trusting less:
- pid 1, the supervisor, builds the jail (root.py's plan, applied by `build_root`: a
  read-only root holding only the interpreter, its stdlib and libraries; a private /proc
  and /tmp; limits; no capabilities; a seccomp filter) and collects the worker's report.
  Its death tears the whole pid namespace down.
- the worker runs no solution code at all: it forks one child per test and turns what
  each child sends back into one checked report line. The report pipe is its alone.
- each test's child closes the report pipe, then runs the solution as a judge would: fd 0
  a sealed in-memory file holding the test's input, fd 1 a pipe the worker reads (capped),
  fd 2 /dev/null. All else it can reach is its own result pipe (fd 3), which the worker
  reads with a size bound and parses strictly. So whatever a solution writes anywhere
  changes at most its own output and result, never the report's shape, and one test's
  tampering cannot leak into the next test.
"""

import base64
import ctypes
import fcntl
import json
import os
import re
import resource
import select
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_GET_SECCOMP, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 4, 21, 22, 24
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
# statvfs flags of a bind's source that a remount must keep (the kernel locks them).
KEEP_FLAGS = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}
RESULT_FD = 3  # a test child's result pipe; every other descriptor above 2 is closed

libc = ctypes.CDLL(None, use_errno=True)


# -- bounded JSON: one rule for both sides (the parent imports these two) ----------------
_ESCAPES = re.compile(r"\\.", re.DOTALL)
_STRINGS = re.compile(r'"[^"]*"')  # no escapes left: linear, nothing to backtrack
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def json_depth(text):
    """How deeply `text` nests, found in linear time and without recursion."""
    skeleton = _NOT_BRACKETS.sub("", _STRINGS.sub("", _ESCAPES.sub("", text)))
    depth = deepest = 0
    for ch in skeleton:
        depth += 1 if ch in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def loads_bounded(text, max_chars, max_depth):
    """json.loads for text nobody vouches for; ValueError when too long, too deep or not JSON."""
    if len(text) > max_chars:
        raise ValueError(f"longer than {max_chars} characters")
    if json_depth(text) > max_depth:
        raise ValueError(f"nested deeper than {max_depth}")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


# -- the jail ----------------------------------------------------------------------------
def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _bind_readonly(src, dst, extra=0):
    _mount(src, dst, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | extra
    st = os.statvfs(dst).f_flag
    for st_flag, ms_flag in KEEP_FLAGS.items():
        if st & st_flag:
            flags |= ms_flag
    _mount(None, dst, None, flags)


def build_root(spec):
    """A fresh tmpfs holding only `spec`'s paths, bound read-only; then make it the root."""
    stage = spec["stage"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for op in spec["ops"]:
        kind, path = op[0], op[1]
        dst = stage + path
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if kind == "symlink":
            os.symlink(op[2], dst)
        elif kind == "bind":
            if os.path.isdir(path):
                os.makedirs(dst, exist_ok=True)
            else:
                open(dst, "a").close()
            # Device nodes must stay devices; nothing else may be one or be setuid.
            _bind_readonly(path, dst, MS_NOSUID | (0 if path.startswith("/dev/") else MS_NODEV))
        elif kind == "mask":  # an empty read-only folder over one we don't want seen (site-packages)
            _mount("tmpfs", dst, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0755")
    os.makedirs(f"{stage}/tmp", exist_ok=True)
    if spec["proc"]:
        # A /proc of our own pid namespace, mounted while the host's is still in sight: the
        # kernel allows a new proc only where a fully visible one exists. Failing refuses the run.
        os.makedirs(f"{stage}/proc", exist_ok=True)
        try:
            _mount("proc", f"{stage}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError as e:
            raise OSError(e.errno, f"mount /proc: {os.strerror(e.errno)}") from None
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError(f"no pivot_root syscall number for {os.uname().machine}")
    os.chdir(stage)
    _check(libc.syscall(nr, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the host's root")  # nothing of the host is left
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _set_limits(lim):
    # Set inside the new user namespace: RLIMIT_NPROC then counts this namespace's processes
    # only (Linux 5.14+), not every task of the service's uid.
    for name, value in lim.items():
        res = getattr(resource, f"RLIMIT_{name.upper()}")
        soft, hard = value
        cur_hard = resource.getrlimit(res)[1]
        if cur_hard != resource.RLIM_INFINITY:  # never raise a hard limit (we could not)
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(res, (soft, hard))


def _drop_privileges(bpf):
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last cap is fine
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")
    left = (Data * 2)()
    _check(libc.capget(ctypes.byref(Header(0x20080522, 0)), left), "capget")
    if any(d.effective or d.permitted or d.inheritable for d in left):
        raise OSError("capabilities still held after capset")

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    n = len(bpf) // ctypes.sizeof(SockFilter)
    prog = SockFprog(n, (SockFilter * n).from_buffer_copy(bpf))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp filter")
    if libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0) != SECCOMP_MODE_FILTER:
        raise OSError("the seccomp filter is not in force")


def jail(payload):
    build_root({**payload["root"], "proc": payload["proc"]})
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={int(payload['tmpfs_mb'])}m,mode=0700")
    os.chdir("/tmp")
    os.environ.update({"HOME": "/tmp", "TMPDIR": "/tmp"})
    # The file size limit is set in each test's child, once it has written the test's input.
    _set_limits({k: v for k, v in payload["rlimits"].items() if k != "fsize"})
    _drop_privileges(base64.b64decode(payload["seccomp"]))


# -- running the tests -------------------------------------------------------------------
def collect(pid, limits):
    """Read each descriptor of `limits` ({fd: most bytes}) until `pid` exits; past a limit,
    kill it. Returns ({fd: data}, overflowed, exit code)."""
    got = {fd: bytearray() for fd in limits}
    live, overflow, status = set(limits), False, None
    while live and not overflow:
        ready, _, _ = select.select(sorted(live), [], [], 0.02)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                live.discard(fd)  # every writer closed it
            elif len(got[fd]) + len(chunk) > limits[fd]:
                overflow = True
                _kill(pid, reaped=status is not None)
                break
            else:
                got[fd] += chunk
        if status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
        # Stop when the process exits even if something it forked still holds a pipe.
        if status is not None and not ready:
            break
    if status is None:
        _, status = os.waitpid(pid, 0)
    return {fd: bytes(data) for fd, data in got.items()}, overflow, os.waitstatus_to_exitcode(status)


def _kill(pid, reaped):
    """SIGKILL the test's process group; before the child made one, the child itself (never a
    pid already reaped: it may be another process's now)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        if not reaped:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def input_fd(text):
    """The test's input as a sealed in-memory file, for fd 0: a real stdin that fstat sizes
    and os.read, open(0) and sys.stdin.buffer read, as on a judge, and that nobody can change."""
    fd = os.memfd_create("stdin", os.MFD_ALLOW_SEALING)
    view = memoryview(text.encode("utf-8", "surrogatepass"))
    while view:
        view = view[os.write(fd, view) :]
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def error_text(e):
    """ "Kind: message", both cut: the solution chooses its exception's class name and text."""
    try:
        message = str(e)[:200]
    except BaseException:  # noqa: BLE001  (a __str__ that raises)
        message = "(unprintable)"
    return f"{type(e).__name__[:100]}: {message}"


def run_one(compiled, test):
    """In a test's child: run the solution once as a program (its input on fd 0, its output on
    fd 1, read by the worker) and say how it ended, or what its function returned."""
    # Standard streams as the interpreter makes them for a UTF-8 locale: text over binary
    # buffers over the descriptors (.buffer, .fileno() and .mode work as on a judge).
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)
    out = sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)
    res = {}
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
        res["error"] = error_text(e)
    # What the interpreter does at exit: flush standard output, whatever the solution put
    # there (a FastIO-style wrapper writes to fd 1 only when flushed).
    for stream in (sys.stdout, out):
        try:
            stream.flush()
        except BaseException as e:  # noqa: BLE001
            res.setdefault("error", error_text(e))
    return res


def _child(compiled, test, fsize, report_fd, wr, out_wr):
    os.close(report_fd)
    stdin = input_fd(test.get("stdin", ""))
    # Order matters: a new descriptor may have taken number 3 until it is duplicated away.
    os.dup2(stdin, 0)
    os.dup2(out_wr, 1)  # fd 2 stays /dev/null
    if wr != RESULT_FD:
        os.dup2(wr, RESULT_FD)
    os.closerange(RESULT_FD + 1, 1 << 16)  # the report pipe and anything else: gone
    # Only now: the input written above is not the solution's to count against it.
    _set_limits({"fsize": fsize})
    os.setpgid(0, 0)  # one group per test: what it forks is killed with it
    me = os.getpid()
    res = run_one(compiled, test)
    if os.getpid() == me:  # a process the solution forked returns here too: it says nothing
        data = (json.dumps(res) + "\n").encode()
        while data:
            data = data[os.write(RESULT_FD, data) :]
    os._exit(0)


def _checked(raw, i, limit):
    """The child's result as a report line, or a corrupted mark: only known fields, right types."""
    try:
        got = loads_bounded(raw.decode(), limit, 1)
    except (ValueError, UnicodeDecodeError):
        got = None
    fields = {"ret", "error", "exit"}
    if not isinstance(got, dict) or not set(got) <= fields or not all(isinstance(v, str) for v in got.values()):
        return {"i": i, "corrupted": True}
    return {"i": i, **got}


def run_tests(payload, report_fd):
    """The worker: one child per test; it never runs the solution itself."""

    def emit(obj):
        os.write(report_fd, (json.dumps(obj) + "\n").encode())

    cap = int(payload["max_output"])
    try:
        compiled = compile(payload["code"], "<solution>", "exec")
    except SyntaxError as e:
        emit({"fatal": f"{type(e).__name__}: {e.msg} (line {e.lineno})"})
        return
    except (ValueError, MemoryError, RecursionError) as e:  # NUL bytes, absurd nesting
        emit({"fatal": f"{type(e).__name__}: {str(e)[:200]}"})
        return
    limit = 6 * cap + 4096  # a JSON-escaped return value plus the other fields
    fsize = payload["rlimits"]["fsize"]
    for i, test in enumerate(payload["tests"]):
        rd, wr = os.pipe()
        out_rd, out_wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(rd)
                os.close(out_rd)
                _child(compiled, test, fsize, report_fd, wr, out_wr)
            finally:
                os._exit(70)
        os.close(wr)
        os.close(out_wr)
        got, overflow, code = collect(pid, {rd: limit, out_rd: 4 * cap})  # UTF-8: at most 4 bytes a character
        os.close(rd)
        os.close(out_rd)
        _kill(pid, reaped=True)
        # Bytes that are not UTF-8 cross as lone surrogates; the parent shows them as U+FFFD.
        stdout = got[out_rd].decode("utf-8", "surrogateescape")
        if overflow or len(stdout) > cap:
            emit({"i": i, "output_limit": True})
        elif code != 0 or not got[rd]:  # a signal (CPU limit, ...), os._exit(): the run ends here
            emit({"i": i, "stop": code})
            return
        else:
            rec = _checked(got[rd], i, limit)
            emit(rec if rec.get("corrupted") else {**rec, "stdout": stdout})
    emit({"done": True})


def supervise(payload):
    """pid 1 after the jail: fork the worker, collect its report, print the envelope."""
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # nothing may ptrace us or open our descriptors
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):  # raw writes to stdout/stderr go nowhere
                os.dup2(null, fd)
            os.close(null)
            run_tests(payload, w)
        except BaseException:  # noqa: BLE001
            code = 70
        os._exit(code)
    os.close(w)
    got, overflow, code = collect(pid, {r: int(payload["max_report"])})
    return {"report": got[r].decode(errors="replace"), "overflow": overflow, "exit": code}


def main():
    payload = json.loads(sys.stdin.read())
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # if unshare dies, so do we (and the ns)
    try:
        jail(payload)
    except BaseException as e:  # noqa: BLE001  (the host can't isolate: the parent refuses)
        os.write(1, json.dumps({"setup_error": f"{type(e).__name__}: {e}"}).encode())
        os._exit(1)
    # From here on nothing is the host's fault: stderr goes quiet, so the parent can tell
    # a setup failure (something on stderr, no envelope) from this run's own.
    null = os.open("/dev/null", os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        envelope = supervise(payload)
    except BaseException as e:  # noqa: BLE001
        envelope = {"supervisor_error": f"{type(e).__name__}: {str(e)[:200]}"}
    os.write(1, json.dumps(envelope).encode())


if __name__ == "__main__":
    main()
