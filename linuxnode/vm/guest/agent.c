/* The guest agent of a sandfleet microVM: PID 1 of the guest once /init has mounted the
 * sandbox's root (the layers' overlay at /newroot), and the only program of the platform
 * inside a VM sandbox. It serves the node over one virtio-serial port and nothing else (the
 * guest has no network).
 *
 * Frames both ways: a 4-byte big-endian length, then the payload. The node's requests are
 * fixed binary layouts (u8 op, u32 id, then the op's fields; strings as u32 length + bytes),
 * because the node is trusted and C parses them in a few lines. Our answers are msgpack arrays
 * whose first element names the kind (["out", id, stream, bytes]...), which the node decodes
 * as a typed, size-checked tagged union and treats as hostile: nothing here is trusted by it.
 *
 * A command runs chrooted into /newroot in its own session, stdin/stdout/stderr on pipes; its
 * output goes out as it comes (64 KiB a frame), its wait status once it is reaped and its pipes
 * are drained. Being PID 1, the agent also reaps every orphan of the guest.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <ftw.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#define ROOT "/newroot"
#define UPPER "/mnt/upper"
#define PORT_NAME "org.sandfleet.agent"
#define MAX_FRAME (1u << 20)
#define CHUNK (64u << 10)
#define MAX_PROCS 64

enum { OP_EXEC = 1, OP_STDIN = 2, OP_CLOSE_STDIN = 3, OP_SIGNAL = 4, OP_WRITE_FILE = 5,
       OP_READ_FILE = 6, OP_PING = 7, OP_SETUP = 8, OP_RESET = 9, OP_PORT_OPEN = 10, OP_PORT_DATA = 11,
       OP_PORT_EOF = 12, OP_PORT_CLOSE = 13, OP_PORT_ACK = 14, OP_PORT_LISTENS = 15, OP_RESIZE = 16,
       OP_FS = 17, OP_QUIESCE = 18, OP_RESUME = 19, OP_DETACH = 20 };
enum { FS_STAT = 1, FS_LIST = 2, FS_MKDIR = 3, FS_REMOVE = 4, FS_RENAME = 5 };

#define MAX_PENDING (16u << 20) /* stdin a command has not read yet, held here for it */

struct proc {
    uint32_t id;
    pid_t pid;
    int in, out, err; /* -1 once closed */
    int reaped, status;
    unsigned char *pending; /* stdin waiting for room in the pipe */
    uint32_t pending_len;
    int close_in; /* close stdin once pending is written */
    int tty; /* out is a terminal's master (in its dup), err unused */
    int detached; /* a node before a machine-state restore ran it: its output and exit go nowhere */
};
/* Between QUIESCE and RESUME/DETACH the agent sends nothing (a machine state is being saved: the
 * port's stream must stand at a frame's end) and reads no command's output. */
static int quiet;

static struct proc procs[MAX_PROCS];

/* A port forward: a TCP connection this agent opened to the guest's loopback for the node. Each
 * way at most PORT_WINDOW bytes are in flight: we send no more than the node has acknowledged,
 * and acknowledge the node's as our socket takes them. */
#define MAX_CONNS 64
#define PORT_WINDOW (4u * CHUNK)
struct conn {
    uint32_t id;
    int fd; /* 0: a free slot (fd 0 is /dev/console's or closed, never a socket of ours) */
    unsigned char *pending; /* the node's bytes the socket has not taken yet */
    uint32_t pending_len;
    uint32_t unacked; /* ours the node has not acknowledged */
    int shut_pending; /* the node's side ended: shut our write side once pending is written */
    int read_done; /* "peof" sent */
};
static struct conn conns[MAX_CONNS];
static int port = -1;
static unsigned char *rx;
static uint32_t rx_len;

/* -- writing frames ------------------------------------------------------------------------ */

static unsigned char tx[MAX_FRAME + 64];
static uint32_t tx_len;

static void put(const void *p, uint32_t n) { memcpy(tx + 4 + tx_len, p, n); tx_len += n; }
static void put_u8(uint8_t v) { put(&v, 1); }
static void put_be32(uint32_t v) { uint8_t b[4] = {v >> 24, v >> 16, v >> 8, v}; put(b, 4); }
static void mp_array(uint8_t n) { put_u8(0x90 | n); }
static void mp_uint(uint32_t v) { put_u8(0xce); put_be32(v); }
static void mp_int(int32_t v) { put_u8(0xd2); put_be32((uint32_t)v); }
static void mp_bool(int v) { put_u8(v ? 0xc3 : 0xc2); }
static void mp_str(const char *s) {
    uint32_t n = strlen(s);
    put_u8(0xdb); put_be32(n); put(s, n);
}
static void mp_bin(const void *p, uint32_t n) { put_u8(0xc6); put_be32(n); put(p, n); }
static void mp_u64(uint64_t v) { put_u8(0xcf); put_be32(v >> 32); put_be32((uint32_t)v); }
static void mp_f64(double d) { uint64_t v; memcpy(&v, &d, 8); put_u8(0xcb); put_be32(v >> 32); put_be32((uint32_t)v); }

static void begin(const char *kind, uint8_t fields) { tx_len = 0; mp_array(fields + 1); mp_str(kind); }

static void send_frame(void) {
    tx[0] = tx_len >> 24; tx[1] = tx_len >> 16; tx[2] = tx_len >> 8; tx[3] = tx_len;
    uint32_t left = tx_len + 4, at = 0;
    while (left) {
        ssize_t n = write(port, tx + at, left);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == ENOTCONN)) { usleep(10000); continue; }
        if (n <= 0) return; /* the node went away: it reconnects or kills us */
        at += n; left -= n;
    }
}

static void send_failed(uint32_t id, int err, const char *what) {
    begin("failed", 3); mp_uint(id); mp_int(err); mp_str(what); send_frame();
}
static void send_done(uint32_t id, uint32_t n) { begin("done", 2); mp_uint(id); mp_uint(n); send_frame(); }

/* -- reading requests ---------------------------------------------------------------------- */

struct cursor { const unsigned char *p; uint32_t left; int bad; };

static uint32_t get_u32(struct cursor *c) {
    if (c->left < 4) { c->bad = 1; return 0; }
    uint32_t v = (uint32_t)c->p[0] << 24 | (uint32_t)c->p[1] << 16 | (uint32_t)c->p[2] << 8 | c->p[3];
    c->p += 4; c->left -= 4;
    return v;
}
/* A string as a fresh NUL-terminated copy (freed by the caller's exit or exec). */
static char *get_str(struct cursor *c) {
    uint32_t n = get_u32(c);
    if (c->bad || n > c->left) { c->bad = 1; return NULL; }
    char *s = malloc(n + 1);
    memcpy(s, c->p, n); s[n] = 0;
    c->p += n; c->left -= n;
    return s;
}

static struct proc *find(uint32_t id) {
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i].pid > 0 && procs[i].id == id) return &procs[i];
    return NULL;
}

static void close_fd(int *fd) { if (*fd >= 0) { close(*fd); *fd = -1; } }

static void do_exec(uint32_t id, struct cursor *c) {
    uint32_t argc = get_u32(c), envc = get_u32(c);
    if (c->bad || argc == 0 || argc > 4096 || envc > 4096) { send_failed(id, EINVAL, "bad exec request"); return; }
    char **argv = calloc(argc + 1, sizeof *argv), **envp = calloc(envc + 2, sizeof *envp);
    for (uint32_t i = 0; i < argc; i++) argv[i] = get_str(c);
    int has_path = 0;
    for (uint32_t i = 0; i < envc; i++) {
        envp[i] = get_str(c);
        if (envp[i] && strncmp(envp[i], "PATH=", 5) == 0) has_path = 1;
    }
    if (!has_path) envp[envc] = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    char *cwd = get_str(c);
    /* optional: a terminal of cols x rows instead of pipes */
    uint32_t tty = c->left >= 12 ? get_u32(c) : 0, cols = tty ? get_u32(c) : 0, rows = tty ? get_u32(c) : 0;
    struct proc *slot = NULL;
    for (int i = 0; i < MAX_PROCS && !slot; i++) if (procs[i].pid == 0) slot = &procs[i];
    if (c->bad || !slot) { send_failed(id, c->bad ? EINVAL : EAGAIN, c->bad ? "bad exec request" : "too many commands"); goto out; }
    int in[2], out[2], err[2], report[2];
    if (tty) {
        /* The sandbox root's own devpts instance (mounted by /init): its ptys are the guest's. */
        int master = open(ROOT "/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC), unlock = 0;
        int slave = master < 0 || ioctl(master, TIOCSPTLCK, &unlock) ? -1 : ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
        struct winsize ws = {.ws_row = rows, .ws_col = cols};
        if (slave < 0 || ioctl(master, TIOCSWINSZ, &ws) || (in[1] = fcntl(master, F_DUPFD_CLOEXEC, 3)) < 0) {
            int e = errno;
            if (master >= 0) close(master);
            if (slave >= 0) close(slave);
            send_failed(id, e, "terminal"); goto out;
        }
        in[0] = out[1] = slave; out[0] = master; err[0] = err[1] = -1;
    } else if (pipe2(in, O_CLOEXEC) || pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC)) {
        send_failed(id, errno, "pipe"); goto out;
    }
    if (pipe2(report, O_CLOEXEC)) { send_failed(id, errno, "pipe"); goto out; }
    pid_t pid = fork();
    if (pid == 0) {
        sigset_t none; sigemptyset(&none); sigprocmask(SIG_SETMASK, &none, NULL);
        setsid();
        if (tty) { ioctl(in[0], TIOCSCTTY, 0); dup2(in[0], 0); dup2(in[0], 1); dup2(in[0], 2); }
        else { dup2(in[0], 0); dup2(out[1], 1); dup2(err[1], 2); }
        int e = 0;
        if (chroot(ROOT) || chdir("/")) e = errno;
        else if (chdir(cwd)) e = -errno; /* negative: the cwd, not the command, is at fault */
        if (!e) execvpe(argv[0], argv, envp);
        e = e ? e : errno;
        (void)!write(report[1], &e, sizeof e);
        _exit(127);
    }
    close(in[0]); if (!tty) { close(out[1]); close(err[1]); } close(report[1]);
    int e = 0;
    ssize_t got = pid < 0 ? -1 : read(report[0], &e, sizeof e); /* EOF: the exec happened */
    close(report[0]);
    if (pid < 0 || got == sizeof e) {
        if (pid > 0) waitpid(pid, NULL, 0);
        close(in[1]); close(out[0]); if (err[0] >= 0) close(err[0]);
        if (pid > 0 && e < 0) send_failed(id, -e, "chdir");
        else send_failed(id, pid < 0 ? errno : e, argv[0] ? argv[0] : "");
        goto out;
    }
    fcntl(in[1], F_SETFL, O_NONBLOCK);
    *slot = (struct proc){.id = id, .pid = pid, .in = in[1], .out = out[0], .err = err[0], .tty = !!tty};
    begin("started", 2); mp_uint(id); mp_uint(pid); send_frame();
out:
    for (uint32_t i = 0; i < argc; i++) free(argv[i]);
    for (uint32_t i = 0; i < envc; i++) free(envp[i]);
    free(argv); free(envp); free(cwd);
}

/* Paths are resolved in the sandbox's root, as a process of it would: a child chroots there. */
static int in_root(const char *path, int flags, int mode) {
    int fds[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds)) return -errno;
    pid_t pid = fork();
    if (pid == 0) {
        int fd = -1, e = 0;
        if (chroot(ROOT) || chdir("/")) e = errno;
        else if ((fd = open(path, flags | O_CLOEXEC, mode)) < 0) e = errno;
        char cbuf[CMSG_SPACE(sizeof(int))] = {0};
        struct iovec iov = {&e, sizeof e};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
        if (fd >= 0) {
            m.msg_control = cbuf; m.msg_controllen = sizeof cbuf;
            struct cmsghdr *h = CMSG_FIRSTHDR(&m);
            h->cmsg_level = SOL_SOCKET; h->cmsg_type = SCM_RIGHTS; h->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(h), &fd, sizeof fd);
        }
        sendmsg(fds[1], &m, 0);
        _exit(0);
    }
    close(fds[1]);
    int e = EIO, fd = -1;
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&e, sizeof e};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    if (pid > 0 && recvmsg(fds[0], &m, 0) > 0) {
        struct cmsghdr *h = CMSG_FIRSTHDR(&m);
        if (h && h->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(h), sizeof fd);
    }
    close(fds[0]);
    if (pid > 0) waitpid(pid, NULL, 0);
    return fd >= 0 ? fd : -(e ? e : EIO);
}

static void do_write_file(uint32_t id, struct cursor *c) {
    uint32_t flags = get_u32(c), mode = get_u32(c);
    char *path = get_str(c);
    if (c->bad) { send_failed(id, EINVAL, "bad write request"); free(path); return; }
    int fd = in_root(path, O_WRONLY | O_CREAT | (flags & 1 ? O_APPEND : O_TRUNC), mode & 07777);
    free(path);
    if (fd < 0) { send_failed(id, -fd, "open"); return; }
    uint32_t at = 0;
    while (at < c->left) {
        ssize_t n = write(fd, c->p + at, c->left - at);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { int e = errno; close(fd); send_failed(id, e, "write"); return; }
        at += n;
    }
    if (!(flags & 1)) fchmod(fd, mode & 07777);
    close(fd);
    send_done(id, at);
}

static void do_read_file(uint32_t id, struct cursor *c) {
    uint32_t hi = get_u32(c), lo = get_u32(c), max = get_u32(c);
    char *path = get_str(c);
    if (c->bad) { send_failed(id, EINVAL, "bad read request"); free(path); return; }
    int fd = in_root(path, O_RDONLY, 0);
    free(path);
    if (fd < 0) { send_failed(id, -fd, "open"); return; }
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) { close(fd); send_failed(id, EISDIR, "read"); return; }
    if (max > CHUNK * 8) max = CHUNK * 8;
    static unsigned char buf[CHUNK * 8];
    ssize_t n;
    do n = pread(fd, buf, max, (off_t)hi << 32 | lo); while (n < 0 && errno == EINTR);
    int e = errno;
    close(fd);
    if (n < 0) { send_failed(id, e, "read"); return; }
    begin("data", 3); mp_uint(id); mp_bin(buf, n); mp_bool((uint32_t)n < max); send_frame();
}

/* After a restore from a snapshot: this sandbox's own size for the writable layer. */
static void do_setup(uint32_t id, struct cursor *c) {
    uint32_t disk_mb = get_u32(c);
    if (c->bad || disk_mb == 0) { send_failed(id, EINVAL, "bad setup request"); return; }
    char opts[64];
    snprintf(opts, sizeof opts, "size=%um", disk_mb);
    if (mount("upper", UPPER, "tmpfs", MS_REMOUNT | MS_NOSUID | MS_NODEV, opts)) { send_failed(id, errno, "remount"); return; }
    send_done(id, disk_mb);
}

/* Write what the pipe takes now; keep the rest for when it has room (poll says POLLOUT), so a
 * command that reads slowly gets all of its stdin and the agent never blocks on it. */
static void flush_stdin(struct proc *pr) {
    while (pr->pending_len && pr->in >= 0) {
        ssize_t w = write(pr->in, pr->pending, pr->pending_len);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno == EAGAIN) return;
        if (w <= 0) { pr->pending_len = 0; break; } /* EPIPE: it closed its stdin */
        memmove(pr->pending, pr->pending + w, pr->pending_len - w);
        pr->pending_len -= w;
    }
    if (!pr->pending_len && pr->close_in) { close_fd(&pr->in); pr->close_in = 0; }
}

static void queue_stdin(struct proc *pr, const unsigned char *p, uint32_t n) {
    if (n > MAX_PENDING - pr->pending_len) n = MAX_PENDING - pr->pending_len; /* beyond: cut */
    unsigned char *grown = realloc(pr->pending, pr->pending_len + n);
    if (!grown) return;
    pr->pending = grown;
    memcpy(pr->pending + pr->pending_len, p, n);
    pr->pending_len += n;
    flush_stdin(pr);
}


/* -- port forwards ------------------------------------------------------------------------- */

static struct conn *find_conn(uint32_t id) {
    for (int i = 0; i < MAX_CONNS; i++)
        if (conns[i].fd > 0 && conns[i].id == id) return &conns[i];
    return NULL;
}

static void send_id(const char *kind, uint32_t id) { begin(kind, 1); mp_uint(id); send_frame(); }

static void conn_read_done(struct conn *cn) {
    if (!cn->read_done) { cn->read_done = 1; send_id("peof", cn->id); }
}

static void do_port_open(uint32_t id, struct cursor *c) {
    uint32_t family = get_u32(c), port = get_u32(c);
    if (c->bad || (family != 4 && family != 6) || port == 0 || port > 65535) {
        send_failed(id, EINVAL, "bad port request"); return;
    }
    struct conn *slot = NULL;
    for (int i = 0; i < MAX_CONNS && !slot; i++) if (conns[i].fd <= 0) slot = &conns[i];
    if (!slot || find_conn(id)) { send_failed(id, slot ? EEXIST : EAGAIN, "too many connections"); return; }
    int fd = socket(family == 6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) { send_failed(id, errno, "socket"); return; }
    if (fd == 0) { int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3); close(fd); fd = moved; }
    /* A listener with a full accept queue would hold a blocking connect for minutes. */
    struct timeval limit = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
    int r;
    if (family == 6) {
        struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons(port), .sin6_addr = IN6ADDR_LOOPBACK_INIT};
        do r = connect(fd, (struct sockaddr *)&a, sizeof a); while (r < 0 && errno == EINTR);
    } else {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        do r = connect(fd, (struct sockaddr *)&a, sizeof a); while (r < 0 && errno == EINTR);
    }
    if (r < 0) { int e = errno; close(fd); send_failed(id, e == EINPROGRESS ? ETIMEDOUT : e, "connect"); return; }
    fcntl(fd, F_SETFL, O_NONBLOCK);
    *slot = (struct conn){.id = id, .fd = fd};
    send_id("opened", id);
}

/* What the socket takes now; the rest when poll says POLLOUT. Each write is acknowledged, so
 * the node may send more; bytes a broken socket cannot take are acknowledged too (dropped),
 * so the node never waits for room that will not come. */
static void flush_conn(struct conn *cn) {
    while (cn->pending_len) {
        ssize_t w = send(cn->fd, cn->pending, cn->pending_len, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno == EAGAIN) return;
        if (w <= 0) { w = cn->pending_len; conn_read_done(cn); }
        memmove(cn->pending, cn->pending + w, cn->pending_len - w);
        cn->pending_len -= w;
        begin("packed", 2); mp_uint(cn->id); mp_uint(w); send_frame();
    }
    if (cn->shut_pending) { shutdown(cn->fd, SHUT_WR); cn->shut_pending = 0; }
}

static void port_data(struct conn *cn, const unsigned char *p, uint32_t n) {
    if (!n || cn->shut_pending) return;
    if (n > PORT_WINDOW - cn->pending_len) n = PORT_WINDOW - cn->pending_len; /* the node keeps to it */
    unsigned char *grown = realloc(cn->pending, cn->pending_len + n);
    if (!grown) return;
    cn->pending = grown;
    memcpy(cn->pending + cn->pending_len, p, n);
    cn->pending_len += n;
    flush_conn(cn);
}

static void pump_conn(struct conn *cn) {
    static unsigned char buf[CHUNK];
    uint32_t room = PORT_WINDOW - cn->unacked;
    ssize_t n;
    do n = recv(cn->fd, buf, room < CHUNK ? room : CHUNK, 0); while (n < 0 && errno == EINTR);
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) { conn_read_done(cn); return; }
    cn->unacked += n;
    begin("pdata", 2); mp_uint(cn->id); mp_bin(buf, n); send_frame();
}

static void free_conn(struct conn *cn) {
    close(cn->fd);
    free(cn->pending);
    memset(cn, 0, sizeof *cn);
}

/* Whether a TCP socket listens on the loopback (or any) address at `port`: /proc/net/tcp{,6}
 * rows "sl local_address rem_address st ...", st 0A being LISTEN. */
static void do_port_listens(uint32_t id, struct cursor *c) {
    uint32_t family = get_u32(c), port = get_u32(c);
    if (c->bad || (family != 4 && family != 6)) { send_failed(id, EINVAL, "bad port request"); return; }
    FILE *f = fopen(family == 6 ? "/proc/net/tcp6" : "/proc/net/tcp", "re");
    if (!f) { send_failed(id, errno, "/proc/net/tcp"); return; }
    char line[512], local[64], state[8];
    unsigned found = 0, at;
    const char *loop = family == 6 ? "00000000000000000000000001000000" : "0100007F";
    const char *any = family == 6 ? "00000000000000000000000000000000" : "00000000";
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, " %*d: %63[0-9A-Fa-f]:%x %*s %7s", local, &at, state) != 3) continue;
        if (at == port && strcmp(state, "0A") == 0 && (!strcmp(local, loop) || !strcmp(local, any))) found = 1;
    }
    fclose(f);
    send_done(id, found);
}


/* -- the file tree: one operation in a child chrooted into the sandbox's root ------------------ */

#define ENTRY_ROOM 8300 /* the most one entry takes in a frame (two 4 KiB paths and its fields) */

static uint32_t listed, list_limit;
static int list_cut;

static const char *kind_of(mode_t m) {
    return S_ISREG(m) ? "file" : S_ISDIR(m) ? "dir" : S_ISLNK(m) ? "symlink" : "other";
}

static void put_entry(const char *path, const struct stat *st) {
    char target[4097] = "";
    if (S_ISLNK(st->st_mode)) {
        ssize_t n = readlink(path, target, sizeof target - 1);
        target[n > 0 ? n : 0] = 0;
    }
    mp_array(6); mp_str(path); mp_str(kind_of(st->st_mode)); mp_u64(st->st_size); mp_uint(st->st_mode & 07777);
    mp_f64(st->st_mtim.tv_sec + st->st_mtim.tv_nsec / 1e9); mp_str(target);
    listed++;
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Entries under `dir` (sorted, `depth` levels, never through a symlink), until the limit or the
 * frame is full (then the listing says it was cut). */
static void walk(const char *dir, uint32_t depth) {
    DIR *d = opendir(dir);
    if (!d) return;
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (n == cap) { cap = cap ? cap * 2 : 64; names = realloc(names, cap * sizeof *names); }
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, n, sizeof *names, cmp_names);
    for (size_t i = 0; i < n; i++) {
        char path[4097];
        struct stat st;
        if (list_cut || listed >= list_limit || tx_len + ENTRY_ROOM > MAX_FRAME) { list_cut = 1; break; }
        if (snprintf(path, sizeof path, "%s/%s", strcmp(dir, "/") ? dir : "", names[i]) >= (int)sizeof path) continue;
        if (lstat(path, &st)) continue;
        put_entry(path, &st);
        if (depth > 1 && S_ISDIR(st.st_mode)) walk(path, depth - 1);
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
}

static int remove_one(const char *path, const struct stat *st, int flag, struct FTW *f) {
    (void)st; (void)f;
    return flag == FTW_DP ? rmdir(path) : unlink(path);
}

static int make_dirs(char *path, uint32_t mode, int parents) {
    if (!parents) return mkdir(path, mode) ? errno : 0;
    for (char *p = path + 1; ; p++) {
        if (*p != '/' && *p) continue;
        char was = *p;
        *p = 0;
        struct stat st;
        if (mkdir(path, mode) && (errno != EEXIST || stat(path, &st) || !S_ISDIR(st.st_mode))) {
            int e = errno == EEXIST ? ENOTDIR : errno;
            *p = was;
            return e;
        }
        *p = was;
        if (!was) return 0;
    }
}

/* The child's work; its answer (a whole frame) goes to `out`. */
static void fs_child(uint32_t id, uint32_t op, struct cursor *c, int out) {
    int e = 0;
    if (chroot(ROOT) || chdir("/")) e = errno;
    if (op == FS_STAT || op == FS_LIST) {
        uint32_t depth = op == FS_LIST ? get_u32(c) : 0, limit = op == FS_LIST ? get_u32(c) : 1;
        char *path = get_str(c);
        struct stat st;
        if (!e && (c->bad || !path || path[0] != '/')) e = EINVAL;
        if (!e && lstat(path, &st)) e = errno;
        if (!e && op == FS_LIST && !S_ISDIR(st.st_mode)) e = ENOTDIR;
        if (e) { send_failed(id, e, op == FS_STAT ? "stat" : "list"); goto sent; }
        begin("entries", 3); mp_uint(id);
        uint32_t header = tx_len; /* an array32 whose count is set at the end */
        put_u8(0xdd); put_be32(0);
        list_limit = limit;
        if (op == FS_STAT) put_entry(path, &st);
        else walk(path, depth);
        uint8_t count[4] = {listed >> 24, listed >> 16, listed >> 8, listed};
        memcpy(tx + 4 + header + 1, count, 4);
        mp_bool(list_cut);
        send_frame();
        goto sent;
    }
    uint32_t flag = op == FS_RENAME ? 0 : get_u32(c), mode = op == FS_MKDIR ? get_u32(c) : 0;
    char *path = get_str(c), *dst = op == FS_RENAME ? get_str(c) : NULL;
    if (!e && (c->bad || !path || (op == FS_RENAME && !dst))) e = EINVAL;
    struct stat st;
    if (e) {}
    else if (op == FS_MKDIR) e = make_dirs(path, mode & 07777, flag);
    else if (op == FS_RENAME) e = rename(path, dst) ? errno : 0;
    else if (lstat(path, &st)) e = errno;
    else if (!S_ISDIR(st.st_mode)) e = unlink(path) ? errno : 0;
    else if (flag) e = nftw(path, remove_one, 32, FTW_DEPTH | FTW_PHYS) ? errno : 0;
    else e = rmdir(path) ? errno : 0;
    if (e) send_failed(id, e, op == FS_MKDIR ? "mkdir" : op == FS_RENAME ? "rename" : "remove");
    else send_done(id, 0);
sent:
    (void)out;
}

static void do_fs(uint32_t id, struct cursor *c) {
    uint32_t op = get_u32(c);
    if (c->bad || op < FS_STAT || op > FS_RENAME) { send_failed(id, EINVAL, "bad file request"); return; }
    int fds[2];
    if (pipe2(fds, O_CLOEXEC)) { send_failed(id, errno, "pipe"); return; }
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        port = fds[1]; /* the child's frame goes to the pipe, whole, and the agent sends it on */
        fs_child(id, op, c, fds[1]);
        _exit(0);
    }
    close(fds[1]);
    if (pid < 0) { close(fds[0]); send_failed(id, errno, "fork"); return; }
    uint32_t got = 0;
    ssize_t n;
    while (got < sizeof tx && (n = read(fds[0], tx + got, sizeof tx - got)) != 0) {
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) break;
        got += n;
    }
    close(fds[0]);
    waitpid(pid, NULL, 0);
    if (got < 4) { send_failed(id, EIO, "file request"); return; }
    tx_len = got - 4;
    send_frame();
}

/* A new node end (the launcher restarted): what ran for the old one is killed and forgotten,
 * since nobody waits for its output or exit any more. */
static void do_reset(uint32_t id) {
    uint32_t killed = 0;
    for (int i = 0; i < MAX_PROCS; i++) {
        struct proc *pr = &procs[i];
        if (pr->pid <= 0) continue;
        if (!pr->reaped) { kill(-pr->pid, SIGKILL); kill(pr->pid, SIGKILL); waitpid(pr->pid, NULL, 0); killed++; }
        close_fd(&pr->in); close_fd(&pr->out); close_fd(&pr->err);
        free(pr->pending);
        memset(pr, 0, sizeof *pr);
    }
    for (int i = 0; i < MAX_CONNS; i++) if (conns[i].fd > 0) free_conn(&conns[i]);
    quiet = 0;
    send_done(id, killed);
}

static void speak_again(void);
static void do_detach(uint32_t id);

static void handle(const unsigned char *p, uint32_t n) {
    struct cursor c = {p, n, 0};
    if (n < 5) return;
    uint8_t op = p[0];
    c.p++; c.left--;
    uint32_t id = get_u32(&c);
    struct proc *pr;
    struct conn *cn;
    switch (op) {
    case OP_EXEC: do_exec(id, &c); break;
    case OP_STDIN:
        if ((pr = find(id)) && pr->in >= 0 && !pr->close_in) queue_stdin(pr, c.p, c.left);
        break;
    case OP_CLOSE_STDIN:
        if ((pr = find(id))) {
            if (pr->pending_len) pr->close_in = 1;
            else close_fd(&pr->in);
        }
        break;
    case OP_SIGNAL: {
        uint32_t sig = get_u32(&c);
        if ((pr = find(id)) && !pr->reaped && !c.bad) kill(-pr->pid, (int)sig);
        break;
    }
    case OP_WRITE_FILE: do_write_file(id, &c); break;
    case OP_READ_FILE: do_read_file(id, &c); break;
    case OP_SETUP: do_setup(id, &c); break;
    case OP_RESET: do_reset(id); break;
    case OP_RESIZE: {
        uint32_t cols = get_u32(&c), rows = get_u32(&c);
        struct winsize ws = {.ws_row = rows, .ws_col = cols};
        if ((pr = find(id)) && pr->tty && pr->out >= 0 && !c.bad) ioctl(pr->out, TIOCSWINSZ, &ws);
        break;
    }
    case OP_FS: do_fs(id, &c); break;
    case OP_QUIESCE: send_done(id, 0); quiet = 1; break; /* the last frame until RESUME or DETACH */
    case OP_RESUME: speak_again(); send_done(id, 0); break;
    case OP_DETACH: do_detach(id); break;
    case OP_PORT_OPEN: do_port_open(id, &c); break;
    case OP_PORT_LISTENS: do_port_listens(id, &c); break;
    case OP_PORT_DATA:
        if ((cn = find_conn(id))) port_data(cn, c.p, c.left);
        break;
    case OP_PORT_EOF:
        if ((cn = find_conn(id))) { cn->shut_pending = 1; flush_conn(cn); }
        break;
    case OP_PORT_ACK: {
        uint32_t n = get_u32(&c);
        if ((cn = find_conn(id)) && !c.bad) cn->unacked -= n < cn->unacked ? n : cn->unacked;
        break;
    }
    case OP_PORT_CLOSE: /* answered once; a port we do not hold was closed already */
        if ((cn = find_conn(id))) { free_conn(cn); send_id("pclosed", id); }
        break;
    case OP_PING: {
        struct utsname u; uname(&u);
        begin("pong", 2); mp_uint(id); mp_str(u.release); send_frame();
        break;
    }
    }
}

/* -- the loop ------------------------------------------------------------------------------ */

static int open_port(void) {
    DIR *d = opendir("/sys/class/virtio-ports");
    struct dirent *e;
    char path[320], name[128];
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", e->d_name);
        int fd = open(path, O_RDONLY);
        if (fd < 0) continue;
        ssize_t n = read(fd, name, sizeof name - 1);
        close(fd);
        if (n <= 0) continue;
        name[n] = 0;
        if (name[n - 1] == '\n') name[n - 1] = 0;
        if (strcmp(name, PORT_NAME) == 0) {
            snprintf(path, sizeof path, "/dev/%s", e->d_name);
            closedir(d);
            return open(path, O_RDWR | O_CLOEXEC);
        }
    }
    if (d) closedir(d);
    return -1;
}

static void pump(struct proc *pr, int *fd, int stream) {
    static unsigned char buf[CHUNK];
    ssize_t n;
    do n = read(*fd, buf, sizeof buf); while (n < 0 && errno == EINTR);
    if (n <= 0) { close_fd(fd); return; }
    if (!pr->detached) { begin("out", 3); mp_uint(pr->id); mp_uint(stream); mp_bin(buf, n); send_frame(); }
}

static void finish_ended(void) {
    if (quiet) return;
    for (int i = 0; i < MAX_PROCS; i++) {
        struct proc *pr = &procs[i];
        if (pr->pid <= 0 || !pr->reaped || pr->out >= 0 || pr->err >= 0) continue;
        close_fd(&pr->in);
        if (!pr->detached) { begin("exited", 2); mp_uint(pr->id); mp_int(pr->status); send_frame(); }
        free(pr->pending);
        memset(pr, 0, sizeof *pr);
    }
}

/* What an ended command wrote is in its pipes; a daemon it left holding them must not hold us. */
static void drain(struct proc *pr) {
    fcntl(pr->out, F_SETFL, O_NONBLOCK); fcntl(pr->err, F_SETFL, O_NONBLOCK);
    while (pr->out >= 0) pump(pr, &pr->out, 1);
    while (pr->err >= 0) pump(pr, &pr->err, 2);
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_PROCS; i++) {
            struct proc *pr = &procs[i];
            if (pr->pid != pid) continue;
            pr->reaped = 1; pr->status = status;
            if (!quiet) drain(pr);
        }
    }
}

static void speak_again(void) {
    quiet = 0;
    for (int i = 0; i < MAX_PROCS; i++) if (procs[i].pid > 0 && procs[i].reaped) drain(&procs[i]);
}

/* A restored machine state's agent: the commands of the node that saved it keep running for
 * nobody (their output and exits dropped), its connections are closed; how many commands. */
static void do_detach(uint32_t id) {
    uint32_t kept = 0;
    for (int i = 0; i < MAX_PROCS; i++) {
        struct proc *pr = &procs[i];
        if (pr->pid <= 0) continue;
        pr->detached = 1;
        close_fd(&pr->in);
        kept += !pr->reaped;
    }
    for (int i = 0; i < MAX_CONNS; i++) if (conns[i].fd > 0) free_conn(&conns[i]);
    speak_again();
    send_done(id, kept);
}

int main(void) {
    sigset_t chld; sigemptyset(&chld); sigaddset(&chld, SIGCHLD); sigaddset(&chld, SIGPIPE);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    for (int tries = 0; (port = open_port()) < 0; tries++) {
        if (tries > 500) { fprintf(stderr, "agent: no port %s\n", PORT_NAME); return 1; }
        usleep(10000);
    }
    rx = malloc(MAX_FRAME + 8);
    struct utsname u; uname(&u);
    begin("hello", 1); mp_str(u.release); send_frame();
    for (;;) {
        struct pollfd fds[2 + 3 * MAX_PROCS + MAX_CONNS];
        struct proc *owner[2 + 3 * MAX_PROCS + MAX_CONNS];
        struct conn *owner_conn[2 + 3 * MAX_PROCS + MAX_CONNS];
        int nfds = 0;
        fds[nfds++] = (struct pollfd){.fd = port, .events = POLLIN};
        fds[nfds++] = (struct pollfd){.fd = sfd, .events = POLLIN};
        for (int i = 0; i < MAX_PROCS && !quiet; i++) {
            struct proc *pr = &procs[i];
            if (pr->pid <= 0) continue;
            if (pr->out >= 0) { owner[nfds] = pr; fds[nfds++] = (struct pollfd){.fd = pr->out, .events = POLLIN}; }
            if (pr->err >= 0) { owner[nfds] = pr; fds[nfds++] = (struct pollfd){.fd = pr->err, .events = POLLIN}; }
            if (pr->in >= 0 && pr->pending_len) { owner[nfds] = pr; fds[nfds++] = (struct pollfd){.fd = pr->in, .events = POLLOUT}; }
        }
        int first_conn = nfds;
        for (int i = 0; i < MAX_CONNS && !quiet; i++) {
            struct conn *cn = &conns[i];
            short events = (cn->read_done || cn->unacked >= PORT_WINDOW ? 0 : POLLIN) | (cn->pending_len ? POLLOUT : 0);
            if (cn->fd <= 0 || !events) continue;
            owner_conn[nfds] = cn;
            fds[nfds++] = (struct pollfd){.fd = cn->fd, .events = events};
        }
        if (poll(fds, nfds, -1) < 0) continue;
        if (fds[1].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {}
            reap();
        }
        for (int i = first_conn; i < nfds; i++) {
            struct conn *cn = owner_conn[i];
            if (fds[i].revents & POLLOUT || (cn->pending_len && fds[i].revents & (POLLERR | POLLHUP))) flush_conn(cn);
            if (cn->fd > 0 && fds[i].revents & (POLLIN | POLLERR | POLLHUP) && !cn->read_done && cn->unacked < PORT_WINDOW)
                pump_conn(cn);
        }
        for (int i = 2; i < first_conn; i++) {
            if (!fds[i].revents) continue;
            struct proc *pr = owner[i];
            if (fds[i].fd == pr->out) pump(pr, &pr->out, 1);
            else if (fds[i].fd == pr->err) pump(pr, &pr->err, 2);
            else if (fds[i].fd == pr->in) flush_stdin(pr);
        }
        finish_ended();
        if (fds[0].revents & POLLIN) {
            ssize_t n = read(port, rx + rx_len, MAX_FRAME + 8 - rx_len);
            if (n > 0) rx_len += n;
            for (;;) {
                if (rx_len < 4) break;
                uint32_t len = (uint32_t)rx[0] << 24 | (uint32_t)rx[1] << 16 | (uint32_t)rx[2] << 8 | rx[3];
                if (len > MAX_FRAME) { rx_len = 0; break; } /* not from our node: resynchronising is not possible */
                if (rx_len < len + 4) break;
                handle(rx + 4, len);
                memmove(rx, rx + 4 + len, rx_len - 4 - len);
                rx_len -= 4 + len;
            }
        } else if (fds[0].revents & POLLHUP) {
            usleep(20000); /* no node on the other end (between a snapshot and its restore) */
        }
    }
}
