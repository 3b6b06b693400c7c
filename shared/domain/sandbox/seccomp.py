"""The sandbox's seccomp filter, compiled here (libseccomp through `pyseccomp`) and loaded inside.

Why compiled outside: the harness runs on a bare interpreter with nothing but its stdlib
in sight, so it receives the finished BPF program (for this machine's architecture, with
libseccomp's check that refuses every other one) and only hands it to the kernel.

Allow by default, deny what a solution has no use for and what widens the kernel surface
it can reach: new namespaces (a nested user namespace would hand it every capability
again, CAP_NET_ADMIN and netfilter included), keyrings, bpf, ptrace, perf, mounts, module
and kexec calls, io_uring, userfaultfd, and netlink and packet sockets. Denied calls fail
with EPERM (clone3 with ENOSYS, so libc falls back to clone, whose flags can be checked).
"""

from __future__ import annotations

import errno
import os
import threading

from shared.domain.sandbox.errors import SandboxUnavailable

DENIED = (
    "unshare", "setns",
    "add_key", "keyctl", "request_key",
    "bpf", "ptrace", "perf_event_open", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount", "fspick",
    "mount_setattr",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd",
    "swapon", "swapoff", "acct", "syslog", "quotactl", "open_by_handle_at",
)  # fmt: skip
# clone(2) flags that make a namespace (CLONE_NEWTIME is 0x80 only for clone3/unshare: in
# clone's first argument that bit belongs to the exit signal).
CLONE_NEW = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
DENIED_SOCKET_FAMILIES = {"AF_NETLINK": 16, "AF_PACKET": 17}

_bpf: bytes | None = None
_lock = threading.Lock()


def _compile() -> bytes:
    try:
        import pyseccomp as sc  # type: ignore[import-untyped]
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: "Unable to find libseccomp"
        raise SandboxUnavailable(
            f"the seccomp filter needs libseccomp (apt-get install libseccomp2) and the pyseccomp package: {e}"
        ) from e
    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (OSError, ValueError, RuntimeError):
            pass  # a call this libseccomp does not know on this architecture: nothing to deny
    for flag in CLONE_NEW.values():
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags sit behind a pointer: make libc use clone
    for family in DENIED_SOCKET_FAMILIES.values():
        f.add_rule(sc.ERRNO(errno.EPERM), "socket", sc.Arg(0, sc.EQ, family))
    # In memory: a container with a read-only root filesystem has nowhere to put a file.
    with os.fdopen(os.memfd_create("burstrl-seccomp"), "w+b") as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def filter_bpf() -> bytes:
    """The filter as a BPF program (struct sock_filter[]), compiled once per process."""
    global _bpf
    with _lock:
        if _bpf is None:
            _bpf = _compile()
        return _bpf
