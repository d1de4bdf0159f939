/* Egress allowlist of each sandbox, enforced in its v2 cgroup.
 *
 * connect4/connect6/sendmsg4/sendmsg6 refuse (EPERM, at once) any destination that is not
 * in the `allow` trie for the caller's cgroup id; sock_create refuses every inet socket
 * but TCP and UDP (raw, ICMP, SCTP, ...). Policy lives in maps the loader updates at run
 * time; every refusal goes to the `denials` ring buffer. The programs never read kernel
 * structs (the build headers are older than the kernel), only the stable context ABI.
 *
 * A sandbox with egress has an entry in `dns_redirect`: its IPv4 DNS traffic (port 53, TCP
 * or UDP, to any address, loopback included) is rewritten to the node's DNS stub before any
 * other rule is looked at, and recvmsg4 rewrites the stub's replies back to the address the
 * sandbox asked, so resolvers that check the reply's source accept it.
 *
 * The loader defines SF_SOCKET_TRACEPOINTS when tracefs is usable: refused socket() calls
 * are then reported at syscall exit, which also sees those the kernel refuses before our
 * hook runs (AF_PACKET, or SOCK_RAW without CAP_NET_RAW). Without it, sock_create
 * reports its own refusals.
 */
#include <uapi/linux/bpf.h>
#include "allowlist.h"

#define SF_SOCK_STREAM 1
#define SF_SOCK_DGRAM 2
#define SF_IPPROTO_TCP 6
#define SF_IPPROTO_UDP 17
#define SF_EPERM 1
#define SF_EACCES 13
#define SF_DNS_PORT_BE 0x3500 /* htons(53) */
#define SF_ALLOW 1
#define SF_DENY 0

_Static_assert(sizeof(struct sf_rule_key) == SF_RULE_KEY_SIZE, "sf_rule_key layout");
_Static_assert(sizeof(struct sf_denial) == SF_DENIAL_SIZE, "sf_denial layout");

BPF_HASH(sandboxes, u64, struct sf_sandbox, 65536);
BPF_LPM_TRIE(allow, struct sf_rule_key, struct sf_rule_val, 262144);
BPF_LPM_TRIE(blocked, struct sf_rule_key, struct sf_rule_val, 4096);
BPF_ARRAY(config, struct sf_config, 1);
BPF_HASH(dns_redirect, u64, struct sf_dns_redirect, 65536);
BPF_TABLE("lru_hash", u64, struct sf_dns_origin, dns_origin, 65536);
BPF_PERCPU_ARRAY(lost, u64, 1);
BPF_RINGBUF_OUTPUT(denials, 64); /* 256 KiB: ~3,600 records before the reader must run */
#ifdef SF_SOCKET_TRACEPOINTS
BPF_HASH(socket_calls, u32, struct sf_socket_call, 16384);
#endif

static __always_inline void report(u8 kind, u64 cgroup_id, const u32 *addr, u16 port_be,
                                   u16 family, u16 type, u16 protocol)
{
    struct sf_denial *d = denials.ringbuf_reserve(sizeof(struct sf_denial));
    if (!d) {
        int zero = 0;
        u64 *n = lost.lookup(&zero);
        if (n)
            *n += 1;
        return;
    }
    u64 id = bpf_get_current_pid_tgid();
    d->ts_ns = bpf_ktime_get_ns();
    d->cgroup_id = cgroup_id;
    d->pid = id >> 32;
    d->tid = (u32)id;
    bpf_get_current_comm(d->comm, sizeof(d->comm));
    d->addr[0] = addr[0];
    d->addr[1] = addr[1];
    d->addr[2] = addr[2];
    d->addr[3] = addr[3];
    d->port = bpf_ntohs(port_be);
    d->family = family;
    d->type = type;
    d->protocol = protocol;
    d->kind = kind;
    __builtin_memset(d->pad, 0, sizeof(d->pad));
    denials.ringbuf_submit(d, 0);
}

/* 127.0.0.0/8, 0.0.0.0 (which connect() takes as loopback), ::1 and ::, mapped or not. */
static __always_inline int is_local(const u32 *a)
{
    if (a[0] || a[1])
        return 0;
    if (a[2] == bpf_htonl(0xffff))
        return (bpf_ntohl(a[3]) >> 24) == 127 || a[3] == 0;
    return a[2] == 0 && (a[3] == 0 || a[3] == bpf_htonl(1));
}

#define SF_TRIE_ALLOW 0
#define SF_TRIE_BLOCKED 1

static __always_inline int in_trie(int trie, struct sf_rule_key *key)
{
    if (trie == SF_TRIE_BLOCKED)
        return blocked.lookup(key) != 0;
    return allow.lookup(key) != 0;
}

/* Any hit allows, so the commonest rules go first: a bare name or address (any proto, any
 * port), then name:port, then the protocol-specific forms. */
static __always_inline int matches(int trie, struct sf_rule_key *key, u8 proto, u16 port_be)
{
    key->proto = SF_PROTO_ANY;
    key->port = 0;
    if (in_trie(trie, key))
        return 1;
    key->port = port_be;
    if (port_be && in_trie(trie, key))
        return 1;
    key->proto = proto;
    if (in_trie(trie, key))
        return 1;
    key->port = 0;
    return port_be && in_trie(trie, key);
}

static __always_inline int decide(struct bpf_sock_addr *ctx, u8 kind, const u32 *addr)
{
    u64 cgroup_id = bpf_get_current_cgroup_id();
    u16 port_be = (u16)ctx->user_port;
    u8 proto = (u8)ctx->protocol;
    int zero = 0;

    /* No `sandboxes` check here (it costs a hash lookup per call): a cgroup with no rules,
     * such as one a sandbox made below its own, matches nothing and is denied anyway. */
    struct sf_config *cfg = config.lookup(&zero);
    if (!cfg)
        goto deny;
    if (is_local(addr) && bpf_get_netns_cookie(ctx) != cfg->host_netns_cookie)
        return SF_ALLOW;

    struct sf_rule_key key = {};
    key.prefixlen = SF_RULE_FIXED_BITS + 128;
    key.addr[0] = addr[0];
    key.addr[1] = addr[1];
    key.addr[2] = addr[2];
    key.addr[3] = addr[3];
    if (cfg->blocked_rules) {
        key.cgroup_id = 0;
        if (matches(SF_TRIE_BLOCKED, &key, proto, port_be))
            goto deny;
    }
    key.cgroup_id = cgroup_id;
    if (matches(SF_TRIE_ALLOW, &key, proto, port_be))
        return SF_ALLOW;
deny:
    report(kind, cgroup_id, addr, port_be, (u16)ctx->user_family, (u16)ctx->type, proto);
    return SF_DENY;
}

static __always_inline int decide4(struct bpf_sock_addr *ctx, u8 kind)
{
    u32 ip4 = ctx->user_ip4;
    if ((u16)ctx->user_port == SF_DNS_PORT_BE &&
        (ctx->protocol == SF_IPPROTO_UDP || ctx->protocol == SF_IPPROTO_TCP)) {
        u64 cgroup_id = bpf_get_current_cgroup_id();
        struct sf_dns_redirect *to = dns_redirect.lookup(&cgroup_id);
        if (to) {
            struct sf_dns_origin origin = {};
            origin.addr = ip4;
            origin.port = SF_DNS_PORT_BE;
            u64 cookie = bpf_get_socket_cookie(ctx);
            dns_origin.update(&cookie, &origin);
            ctx->user_ip4 = to->addr;
            ctx->user_port = to->port;
            return SF_ALLOW;
        }
    }
    u32 addr[4] = {0, 0, bpf_htonl(0xffff), ip4};
    return decide(ctx, kind, addr);
}

static __always_inline int decide6(struct bpf_sock_addr *ctx, u8 kind)
{
    u32 addr[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};
    return decide(ctx, kind, addr);
}

int sf_connect4(struct bpf_sock_addr *ctx) { return decide4(ctx, SF_KIND_CONNECT); }
int sf_connect6(struct bpf_sock_addr *ctx) { return decide6(ctx, SF_KIND_CONNECT); }
int sf_sendmsg4(struct bpf_sock_addr *ctx) { return decide4(ctx, SF_KIND_SENDMSG); }
int sf_sendmsg6(struct bpf_sock_addr *ctx) { return decide6(ctx, SF_KIND_SENDMSG); }

/* A reply from the stub shows the source the sandbox sent to (never denies). */
int sf_recvmsg4(struct bpf_sock_addr *ctx)
{
    u64 cgroup_id = bpf_get_current_cgroup_id();
    struct sf_dns_redirect *to = dns_redirect.lookup(&cgroup_id);
    if (!to || ctx->user_ip4 != to->addr || (u16)ctx->user_port != to->port)
        return SF_ALLOW;
    u64 cookie = bpf_get_socket_cookie(ctx);
    struct sf_dns_origin *origin = dns_origin.lookup(&cookie);
    if (origin) {
        ctx->user_ip4 = origin->addr;
        ctx->user_port = origin->port;
    }
    return SF_ALLOW;
}

int sf_sock_create(struct bpf_sock *sk)
{
    u32 type = sk->type, protocol = sk->protocol;
    if ((type == SF_SOCK_STREAM && protocol == SF_IPPROTO_TCP) ||
        (type == SF_SOCK_DGRAM && protocol == SF_IPPROTO_UDP))
        return SF_ALLOW;
#ifndef SF_SOCKET_TRACEPOINTS
    u32 none[4] = {};
    report(SF_KIND_SOCKET, bpf_get_current_cgroup_id(), none, 0, (u16)sk->family, (u16)type,
           (u16)protocol);
#endif
    return SF_DENY;
}

#ifdef SF_SOCKET_TRACEPOINTS
TRACEPOINT_PROBE(syscalls, sys_enter_socket)
{
    u64 cgroup_id = bpf_get_current_cgroup_id();
    if (!sandboxes.lookup(&cgroup_id))
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct sf_socket_call call = {};
    call.family = args->family;
    call.type = args->type;
    call.protocol = args->protocol;
    socket_calls.update(&tid, &call);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_socket)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct sf_socket_call *found = socket_calls.lookup(&tid);
    if (!found)
        return 0;
    struct sf_socket_call call = *found;
    socket_calls.delete(&tid);
    if (args->ret != -SF_EPERM && args->ret != -SF_EACCES)
        return 0;
    u32 none[4] = {};
    report(SF_KIND_SOCKET, bpf_get_current_cgroup_id(), none, 0, (u16)call.family,
           (u16)(call.type & 0xf), (u16)call.protocol);
    return 0;
}
#endif
