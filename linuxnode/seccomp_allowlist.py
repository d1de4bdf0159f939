"""The syscalls a sandbox may make, by name: what a normal Linux userland needs (shells,
coreutils, python3 with threads, asyncio and multiprocessing, pip, gcc/g++, go, node, the
JVM, git, curl, tar, sqlite, pytest), for both isolation levels. Every other syscall the
kernel has is refused (linuxnode/seccomp.py builds the filter from these lists).

The list started from what container runtimes allow an unprivileged container and was
checked by running those workloads under it (tests/security/test_syscall_allowlist.py
runs a broad one). A sandbox has no capabilities, so a call that needs one (setuid to
another user, mknod of a device, chown to another owner) is allowed here and still fails
in the kernel, as in any unprivileged container: refusing it here would only change who
says no, and make ordinary tools' probes look like attacks.

Left out on purpose (refused with EPERM and reported as `syscall.<name>` violations):
- namespaces, mounts and roots: unshare, setns, mount, umount2, pivot_root, chroot, the new
  mount API (open_tree, move_mount, fsopen, fsconfig, fsmount, fspick, mount_setattr);
- other processes' memory and files: ptrace, process_vm_readv/writev, kcmp, pidfd_getfd,
  process_madvise, process_mrelease, move_pages, migrate_pages;
- kernel attack surface no ordinary program needs, each with a history of escapes:
  io_uring_setup/enter/register, bpf, perf_event_open, userfaultfd, keyctl, add_key,
  request_key, modify_ldt, iopl, ioperm, memfd_secret;
- the host's state: reboot, kexec_*, *_module, swapon/off, acct, quotactl(_fd),
  clock_settime, clock_adjtime, settimeofday, adjtimex, syslog, sethostname, setdomainname,
  vhangup, fanotify_init, name_to_handle_at, open_by_handle_at, lookup_dcookie;
- numbers the kernel keeps but no longer implements (create_module, nfsservctl, uselib,
  ustat, sysfs, _sysctl, tuxcall, ...).
"""

from __future__ import annotations

FILES = (
    "read", "write", "open", "openat", "openat2", "creat", "close", "close_range", "lseek",
    "pread64", "pwrite64", "readv", "writev", "preadv", "pwritev", "preadv2", "pwritev2",
    "stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs",
    "access", "faccessat", "faccessat2", "getdents", "getdents64", "getcwd", "chdir", "fchdir",
    "rename", "renameat", "renameat2", "mkdir", "mkdirat", "rmdir", "link", "linkat", "unlink", "unlinkat",
    "symlink", "symlinkat", "readlink", "readlinkat", "chmod", "fchmod", "fchmodat", "fchmodat2",
    "chown", "fchown", "lchown", "fchownat", "umask", "utime", "utimes", "utimensat", "futimesat",
    "mknod", "mknodat",  # mkfifo; device nodes need CAP_MKNOD, which no sandbox has
    "truncate", "ftruncate", "fallocate", "fadvise64", "readahead", "flock", "fcntl",
    "fsync", "fdatasync", "sync", "syncfs", "sync_file_range",
    "sendfile", "splice", "tee", "vmsplice", "copy_file_range", "cachestat",
    "dup", "dup2", "dup3", "pipe", "pipe2", "memfd_create",
    "setxattr", "lsetxattr", "fsetxattr", "getxattr", "lgetxattr", "fgetxattr",
    "listxattr", "llistxattr", "flistxattr", "removexattr", "lremovexattr", "fremovexattr",
    "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch",
    "fanotify_mark",  # harmless without fanotify_init, which is refused
    "io_setup", "io_destroy", "io_getevents", "io_pgetevents", "io_submit", "io_cancel",  # libaio (databases)
)
MEMORY = (
    "brk", "mmap", "munmap", "mremap", "mprotect", "msync", "mincore", "madvise", "remap_file_pages",
    "mlock", "mlock2", "munlock", "mlockall", "munlockall", "pkey_mprotect", "pkey_alloc", "pkey_free",
    "mbind", "get_mempolicy", "set_mempolicy", "set_mempolicy_home_node",  # the caller's own pages (JVM NUMA, OpenBLAS)
    "membarrier", "map_shadow_stack",
)
PROCESSES = (
    "fork", "vfork", "execve", "execveat", "exit", "exit_group", "wait4", "waitid",
    "kill", "tkill", "tgkill", "pidfd_open", "pidfd_send_signal",
    "getpid", "getppid", "gettid", "getpgid", "setpgid", "getpgrp", "getsid", "setsid",
    "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setfsuid", "setfsgid", "setgroups",
    "capget", "capset", "prctl", "arch_prctl", "seccomp",  # a filter can only take away
    "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
    "set_tid_address", "set_robust_list", "get_robust_list", "rseq", "set_thread_area", "get_thread_area",
    "futex", "futex_waitv", "futex_wake", "futex_wait", "futex_requeue",
    "getrlimit", "setrlimit", "prlimit64", "getrusage", "getpriority", "setpriority", "ioprio_get", "ioprio_set",
    "sched_yield", "sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_setparam",
    "sched_getscheduler", "sched_setscheduler", "sched_get_priority_max", "sched_get_priority_min",
    "sched_rr_get_interval", "sched_getattr", "sched_setattr", "getcpu",
    "uname", "sysinfo", "times", "getrandom",
)
SIGNALS_AND_TIME = (
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait", "rt_sigqueueinfo",
    "rt_sigsuspend", "rt_tgsigqueueinfo", "sigaltstack", "signalfd", "signalfd4", "restart_syscall",
    "pause", "alarm", "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday", "time",
    "getitimer", "setitimer", "timer_create", "timer_settime", "timer_gettime", "timer_getoverrun", "timer_delete",
    "timerfd_create", "timerfd_settime", "timerfd_gettime",
)
EVENTS_AND_IPC = (
    "poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
    "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2",
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
)
NETWORK = (
    "socketpair", "bind", "listen", "accept", "accept4", "connect", "shutdown",
    "getsockname", "getpeername", "setsockopt", "getsockopt",
    "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg",
)
# Allowed only with some arguments (seccomp.py has the rules): clone without namespace flags,
# socket of a few address families, ioctl but a few commands, personality of a few values.
ARGUMENT_CHECKED = ("clone", "socket", "ioctl", "personality")

ALLOWED = FILES + MEMORY + PROCESSES + SIGNALS_AND_TIME + EVENTS_AND_IPC + NETWORK
