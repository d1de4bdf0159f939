/* Structs shared by allowlist.bpf.c and loader.py (which mirrors them with ctypes).
 *
 * Change a layout here and in loader.py together; both sides pin the sizes below.
 */
#ifndef SANDFLEET_ALLOWLIST_H
#define SANDFLEET_ALLOWLIST_H

/* What a denial record says was refused. */
#define SF_KIND_CONNECT 1 /* connect() (TCP, or UDP connect) */
#define SF_KIND_SENDMSG 2 /* sendto()/sendmsg() with an address on a UDP socket */
#define SF_KIND_SOCKET 3  /* socket(): raw, packet, ICMP, anything but TCP/UDP */

#define SF_PROTO_ANY 0

/* Key of the `allow` and `blocked` LPM tries. The trie matches `prefixlen` bits of the
 * bytes after it, so proto, port and cgroup id (96 bits, always matched whole) come first
 * and the address prefix last. IPv4 is stored IPv4-mapped (::ffff:a.b.c.d), so one rule
 * covers connect4 and a connect6 to the mapped address alike. */
struct sf_rule_key {
    __u32 prefixlen;
    __u8 proto;      /* IPPROTO_TCP, IPPROTO_UDP or SF_PROTO_ANY */
    __u8 pad;        /* always 0 */
    __u16 port;      /* network byte order; 0 = any port */
    __u64 cgroup_id; /* v2 cgroup id of the sandbox; 0 in the node-wide `blocked` trie */
    __u32 addr[4];   /* network byte order */
};
#define SF_RULE_FIXED_BITS 96
#define SF_RULE_KEY_SIZE 32

struct sf_rule_val {
    __u32 flags; /* unused by the programs; a place for provenance later */
};

/* A policed sandbox: in `sandboxes` from attach to detach, so the socket() tracepoints
 * (which run for every process on the node) report only sandbox processes. */
struct sf_sandbox {
    __u32 flags;
};

struct sf_config {
    __u64 host_netns_cookie; /* loopback counts as the sandbox's own only outside this netns */
    __u32 blocked_rules;     /* skip the `blocked` trie while it is empty */
    __u32 pad;
};

/* Where a sandbox's DNS goes: every IPv4 connect()/sendmsg() to port 53 (whatever
 * resolv.conf names, loopback included) is rewritten to the node's DNS stub, and the
 * reply's source rewritten back, so resolvers that check it accept the answer. */
struct sf_dns_redirect {
    __u32 addr; /* network byte order */
    __u16 port; /* network byte order */
    __u16 pad;
};

/* The destination a redirected socket asked for, by socket cookie (for recvmsg4). */
struct sf_dns_origin {
    __u32 addr;
    __u16 port;
    __u16 pad;
};

/* One refused attempt, as the ring buffer carries it. */
struct sf_denial {
    __u64 ts_ns;     /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
    __u64 cgroup_id;
    __u32 pid;       /* thread group id */
    __u32 tid;
    char comm[16];
    __u32 addr[4];   /* as in sf_rule_key; zero for SF_KIND_SOCKET */
    __u16 port;      /* host byte order */
    __u16 family;    /* AF_INET, AF_INET6, AF_PACKET, ... as the caller passed it */
    __u16 type;      /* SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, ... */
    __u16 protocol;  /* IPPROTO_* (or the ethertype of a packet socket) */
    __u8 kind;       /* SF_KIND_* */
    __u8 pad[7];
};
#define SF_DENIAL_SIZE 72

/* socket() arguments kept from syscall entry to exit, by thread id. */
struct sf_socket_call {
    __u32 family;
    __u32 type;
    __u32 protocol;
};

#endif
