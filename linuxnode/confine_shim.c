/* sandfleet-confine: the exec shim that puts a `container` sandbox's processes under the
 * same Landlock policy as a `process` sandbox's (crun has no Landlock support of its own).
 * crun runs it, inside the container after pivot_root and seccomp, in front of the init; it
 * applies the rules it is given and execs the command. (Commands exec'd later come from the
 * spawner, which applies the same policy itself, as for a `process` sandbox.)
 * The policy is not here: linuxnode/landlock.py decides it and passes it as argv:
 *
 *   sandfleet-confine TAG HANDLED FLAGS ACCESS:PATH... -- COMMAND [ARG...]
 *
 * TAG is the audit login uid to take ("-": none), HANDLED the handled filesystem rights,
 * FLAGS the landlock_restrict_self flags, ACCESS the rights granted beneath PATH (all hex).
 * A PATH that does not exist is skipped. Exit 125 when confinement fails (nothing runs
 * unconfined), 127/126 when the command cannot be found or run, as a shell would.
 * Built statically by landlock.py with the host's C compiler. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef __NR_landlock_create_ruleset
#define __NR_landlock_create_ruleset 444
#define __NR_landlock_add_rule 445
#define __NR_landlock_restrict_self 446
#endif

struct ruleset_attr { uint64_t handled_access_fs, handled_access_net, scoped; };
struct path_beneath_attr { uint64_t allowed_access; int32_t parent_fd; } __attribute__((packed));

/* execute, write_file, read_file, truncate, ioctl_dev: the rights a rule on a file may carry */
#define FILE_RIGHTS ((1ULL << 0) | (1ULL << 1) | (1ULL << 2) | (1ULL << 14) | (1ULL << 15))

static int fail(const char *what) {
    fprintf(stderr, "sandfleet-confine: %s: %s\n", what, strerror(errno));
    return 125;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: sandfleet-confine TAG HANDLED FLAGS ACCESS:PATH... -- COMMAND...\n");
        return 125;
    }
    if (strcmp(argv[1], "-") != 0) {
        int fd = open("/proc/self/loginuid", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {  /* attribution only: the agent falls back to /proc/<pid>/cgroup */
            if (write(fd, argv[1], strlen(argv[1])) < 0) { /* ignored */ }
            close(fd);
        }
    }
    uint64_t handled = strtoull(argv[2], NULL, 16);
    unsigned int flags = (unsigned int)strtoul(argv[3], NULL, 16);
    long abi = syscall(__NR_landlock_create_ruleset, NULL, 0, 1U);
    struct ruleset_attr attr = {handled, 0, 0};
    int ruleset = (int)syscall(__NR_landlock_create_ruleset, &attr, abi >= 6 ? sizeof(attr) : 16, 0U);
    if (ruleset < 0) return fail("landlock_create_ruleset");
    int i = 4;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        char *colon = strchr(argv[i], ':');
        if (colon == NULL) { errno = EINVAL; return fail(argv[i]); }
        uint64_t access = strtoull(argv[i], NULL, 16) & handled;
        int fd = open(colon + 1, O_PATH | O_CLOEXEC);
        if (fd < 0) {
            if (errno == ENOENT) continue;
            return fail(colon + 1);
        }
        struct stat st;
        if (fstat(fd, &st) != 0) return fail(colon + 1);
        if (!S_ISDIR(st.st_mode)) access &= FILE_RIGHTS;
        struct path_beneath_attr rule = {access, fd};
        if (syscall(__NR_landlock_add_rule, ruleset, 1 /* LANDLOCK_RULE_PATH_BENEATH */, &rule, 0U) != 0)
            return fail(colon + 1);
        close(fd);
    }
    if (i + 1 >= argc) { errno = EINVAL; return fail("no command after --"); }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return fail("no_new_privs");
    if (syscall(__NR_landlock_restrict_self, ruleset, flags) != 0) return fail("landlock_restrict_self");
    close(ruleset);
    execvp(argv[i + 1], &argv[i + 1]);
    int err = errno;
    fprintf(stderr, "sandbox: %s: %s\n", argv[i + 1], strerror(err));
    return err == ENOENT || err == ENOTDIR ? 127 : 126;
}
