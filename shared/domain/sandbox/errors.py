"""SandboxUnavailable, and what to fix when the host cannot isolate (one table of hints)."""

from __future__ import annotations


class SandboxUnavailable(RuntimeError):
    """Isolation can't be set up here; code rewards must not run."""


# (what the failure says, what the operator should do): docs/sandbox.md has the long form.
_HINTS = [
    (
        "mount /proc",
        "a user namespace may mount a /proc of its own only where the caller's /proc is fully visible: "
        "Docker masks /proc paths (run with --security-opt systempaths=unconfined); Kubernetes: "
        "securityContext.procMount: Unmasked",
    ),
    (
        "unshare failed",
        "user namespaces are off or blocked: sysctl user.max_user_namespaces > 0 (and "
        "kernel.unprivileged_userns_clone=1 / kernel.apparmor_restrict_unprivileged_userns=0 where the "
        "kernel has them); in a container, a seccomp profile that allows unshare and clone with namespace "
        "flags (docs/sandbox.md)",
    ),
    ("uid_map", "the user namespace's uid map could not be written: the container runtime must allow it"),
    ("pivot_root", "pivot_root refused inside the mount namespace (an AppArmor profile may forbid it)"),
    ("seccomp", "the kernel refused the seccomp filter (CONFIG_SECCOMP_FILTER, or an outer profile)"),
]


def explain(message: str) -> str:
    """`message` with what to fix, where a hint applies."""
    for needle, hint in _HINTS:
        if needle in message:
            return f"{message} ({hint})"
    return message
