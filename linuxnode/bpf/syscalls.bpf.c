/* Syscall-level violations of each sandbox, seen at the syscall boundary of its processes.
 *
 * - sys_exit (raw tracepoint, every syscall on the node): a call the seccomp filter refuses
 *   (the loader marks their numbers in `watched`) that returned -EPERM, and a fork-family
 *   call that returned -EAGAIN (the pids limit refused it; one record per sandbox per
 *   second at most, as a fork bomb refuses thousands a second). seccomp skips the sys_enter
 *   tracepoint of a call it refuses but not sys_exit, so exit is the one place to see them;
 *   ret is tested before anything else because almost every call on the node fails there.
 * - sys_enter_open* (tracepoints): an open of a path in the `sensitive` trie (policy the
 *   loader fills; a trailing NUL in a stored key makes it an exact path, none a prefix).
 *
 * Only processes whose v2 cgroup id is in `sandboxes` are reported. Records go to the
 * `events` ring buffer, at most SF_BUDGET_PER_S refused/sensitive ones per sandbox per
 * second: an agent retrying a refused call in a loop must not flood the node or the bus;
 * the next record that goes out carries how many were held back. The only kernel struct read is pt_regs (the ptrace register ABI,
 * stable across kernels), for the syscall number and the arguments sys_exit does not carry.
 */
#include <uapi/linux/bpf.h>
#include <linux/ptrace.h>

#define SF_EPERM 1
#define SF_EAGAIN 11
#define SF_PATH_MAX 256
#define SF_FORK_REPORT_NS 1000000000ULL
#define SF_BUDGET_PER_S 100

#define SF_WATCH_REFUSED 1 /* seccomp answers EPERM to it (always or for some arguments) */
#define SF_WATCH_FORK 2    /* creates a task: -EAGAIN means the pids limit was hit */

#define SF_EVENT_REFUSED 1   /* a watched syscall returned -EPERM */
#define SF_EVENT_SENSITIVE 2 /* an open of a sensitive path */
#define SF_EVENT_FORK 3      /* a fork-family call returned -EAGAIN */

struct sf_sandbox {
    u32 flags;
};

struct sf_path_key {
    u32 prefixlen; /* bits of path to match: 8 * (length including the NUL) when looking up */
    char path[SF_PATH_MAX];
};

/* Mirrored by syscall_watch.py (_Record); keep the two in step. */
struct sf_syscall_event {
    u64 ts_ns; /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
    u64 cgroup_id;
    u32 pid;
    u32 tid;
    char comm[16];
    s64 ret;
    u64 arg0; /* first syscall argument (clone flags, ptrace request, ...) */
    u64 arg1; /* second (the ioctl command) */
    u32 nr;
    u8 kind;
    u8 pad[3];
    u32 suppressed; /* records of this sandbox held back by the budget since the last one */
    u32 pad2;
    char path[SF_PATH_MAX]; /* SF_EVENT_SENSITIVE only */
};
#define SF_SYSCALL_EVENT_SIZE 336
_Static_assert(sizeof(struct sf_syscall_event) == SF_SYSCALL_EVENT_SIZE, "sf_syscall_event layout");

BPF_HASH(sandboxes, u64, struct sf_sandbox, 65536);
BPF_ARRAY(watched, u8, 1024); /* syscall number -> SF_WATCH_* bits */
BPF_LPM_TRIE(sensitive, struct sf_path_key, u8, 1024);
struct sf_budget {
    u64 window_start;
    u32 used;
    u32 suppressed;
};

BPF_HASH(fork_refused_at, u64, u64, 65536); /* cgroup id -> when its last fork record went out */
BPF_HASH(budget, u64, struct sf_budget, 65536); /* cgroup id -> its records this second */
BPF_PERCPU_ARRAY(scratch, struct sf_path_key, 1);
BPF_PERCPU_ARRAY(lost, u64, 1);
BPF_RINGBUF_OUTPUT(events, 64); /* 256 KiB: ~790 records before the reader must run */

#if defined(__x86_64__)
#define SF_NR(r) ((r)->orig_ax)
#define SF_ARG0(r) ((r)->di)
#define SF_ARG1(r) ((r)->si)
#elif defined(__aarch64__)
#define SF_NR(r) ((r)->syscallno)
#define SF_ARG0(r) ((r)->orig_x0)
#define SF_ARG1(r) ((r)->regs[1])
#endif

/* 1 when the sandbox may send one more refused/sensitive record this second (and how
 * many it was refused since its last one), 0 when it is over budget. Approximate across
 * CPUs, which is all a flood guard needs. */
static __always_inline int take_budget(u64 cgroup_id, u32 *suppressed)
{
    u64 now = bpf_ktime_get_ns();
    struct sf_budget *b = budget.lookup(&cgroup_id);
    if (!b) {
        struct sf_budget fresh = {.window_start = now, .used = 1, .suppressed = 0};
        budget.update(&cgroup_id, &fresh);
        *suppressed = 0;
        return 1;
    }
    if (now - b->window_start >= 1000000000ULL) {
        b->window_start = now;
        b->used = 0;
    }
    if (b->used >= SF_BUDGET_PER_S) {
        __sync_fetch_and_add(&b->suppressed, 1);
        return 0;
    }
    b->used += 1;
    *suppressed = b->suppressed;
    b->suppressed = 0;
    return 1;
}

static __always_inline struct sf_syscall_event *reserve(u8 kind, u64 cgroup_id)
{
    struct sf_syscall_event *e = events.ringbuf_reserve(sizeof(struct sf_syscall_event));
    if (!e) {
        int zero = 0;
        u64 *n = lost.lookup(&zero);
        if (n)
            *n += 1;
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    e->ts_ns = bpf_ktime_get_ns();
    e->cgroup_id = cgroup_id;
    e->pid = id >> 32;
    e->tid = (u32)id;
    bpf_get_current_comm(e->comm, sizeof(e->comm));
    e->kind = kind;
    e->ret = 0;
    e->arg0 = 0;
    e->arg1 = 0;
    e->nr = 0;
    __builtin_memset(e->pad, 0, sizeof(e->pad));
    e->suppressed = 0;
    e->pad2 = 0;
    e->path[0] = 0;
    return e;
}

RAW_TRACEPOINT_PROBE(sys_exit)
{
    long ret = (long)ctx->args[1];
    if (ret != -SF_EPERM && ret != -SF_EAGAIN)
        return 0;
    u64 cgroup_id = bpf_get_current_cgroup_id();
    if (!sandboxes.lookup(&cgroup_id))
        return 0;
    struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
    u64 nr = 0;
    bpf_probe_read_kernel(&nr, sizeof(nr), &SF_NR(regs));
    int index = (int)nr;
    if (nr >= 1024)
        return 0;
    u8 *watch = watched.lookup(&index);
    if (!watch)
        return 0;
    u8 kind;
    u32 suppressed = 0;
    if (ret == -SF_EPERM && (*watch & SF_WATCH_REFUSED)) {
        if (!take_budget(cgroup_id, &suppressed))
            return 0;
        kind = SF_EVENT_REFUSED;
    } else if (ret == -SF_EAGAIN && (*watch & SF_WATCH_FORK)) {
        u64 now = bpf_ktime_get_ns();
        u64 *last = fork_refused_at.lookup(&cgroup_id);
        if (last && now - *last < SF_FORK_REPORT_NS)
            return 0;
        fork_refused_at.update(&cgroup_id, &now);
        kind = SF_EVENT_FORK;
    } else {
        return 0;
    }
    struct sf_syscall_event *e = reserve(kind, cgroup_id);
    if (!e)
        return 0;
    e->ret = ret;
    e->nr = (u32)nr;
    e->suppressed = suppressed;
    bpf_probe_read_kernel(&e->arg0, sizeof(e->arg0), &SF_ARG0(regs));
    bpf_probe_read_kernel(&e->arg1, sizeof(e->arg1), &SF_ARG1(regs));
    events.ringbuf_submit(e, 0);
    return 0;
}

static __always_inline int opened(const char *filename, u32 nr)
{
    u64 cgroup_id = bpf_get_current_cgroup_id();
    if (!sandboxes.lookup(&cgroup_id))
        return 0;
    int zero = 0;
    struct sf_path_key *key = scratch.lookup(&zero);
    if (!key)
        return 0;
    int n = bpf_probe_read_user_str(key->path, sizeof(key->path), filename);
    if (n <= 0)
        return 0;
    key->prefixlen = (u32)n * 8;
    if (!sensitive.lookup(key))
        return 0;
    u32 suppressed = 0;
    if (!take_budget(cgroup_id, &suppressed))
        return 0;
    struct sf_syscall_event *e = reserve(SF_EVENT_SENSITIVE, cgroup_id);
    if (!e)
        return 0;
    e->nr = nr;
    e->suppressed = suppressed;
    bpf_probe_read_kernel(e->path, sizeof(e->path), key->path);
    events.ringbuf_submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat) { return opened(args->filename, (u32)args->__syscall_nr); }
TRACEPOINT_PROBE(syscalls, sys_enter_openat2) { return opened(args->filename, (u32)args->__syscall_nr); }
#if defined(__x86_64__)
TRACEPOINT_PROBE(syscalls, sys_enter_open) { return opened(args->filename, (u32)args->__syscall_nr); }
#endif
