/* A forked child cannot use its parent's loader (run by tests/capi.rs):
 *
 *   fork_test SPACE
 *
 * The parent holds a batch and forks. In the child every call on the
 * loader returns KSP_ERR_FORKED, with a message naming both pids, and
 * writes nothing (the outputs keep a sentinel); ksp_loader_free there
 * returns without touching the parent's loader. The parent then reads the
 * batch it held and the rest of the epoch, every byte checked against the
 * catalog's CRC32C. Before the fix, the child's next_batch returned KSP_OK
 * with pointers into a ring the child does not have (MADV_DONTFORK).
 * Prints one line per failed check; exits non-zero if any failed. */
#define _POSIX_C_SOURCE 200809L
#include <kspeed.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <stddef.h>
#include <time.h>
#include <unistd.h>

static int failures = 0;

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            failures++;                                                     \
            printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);          \
            printf(__VA_ARGS__);                                            \
            printf("\n");                                                   \
        }                                                                   \
    } while (0)

static char msg[4096];

static const char *last_error(void) {
    size_t n = 0;
    ksp_status st = ksp_last_error(msg, sizeof msg, &n);
    if (st != KSP_OK && st != KSP_ERR_BUFFER_TOO_SMALL) return "(no message)";
    return msg;
}

static uint32_t crc32c(const uint8_t *p, size_t n) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
    }
    return ~c;
}

/* Samples of `b` whose length or CRC32C differs from the catalog. */
static int bad_samples(ksp_loader *l, const ksp_batch *b) {
    int bad = 0;
    for (size_t i = 0; i < b->count; i++) {
        const ksp_sample *s = &b->samples[i];
        ksp_catalog_sample c = KSP_CATALOG_SAMPLE_INIT;
        if (ksp_loader_catalog_sample(l, s->id, &c) != KSP_OK || c.len != s->len ||
            c.crc32c != crc32c(s->data, s->len))
            bad++;
    }
    return bad;
}

/* The child: every call on the parent's loader is refused, nothing is
 * written, and freeing it leaves the parent's loader alone. */
static int child(ksp_loader *l, uint64_t held_seq, pid_t parent) {
    char want_parent[64], want_child[64];
    snprintf(want_parent, sizeof want_parent, "created by pid %ld", (long)parent);
    snprintf(want_child, sizeof want_child, "forked child (pid %ld)", (long)getpid());

    ksp_batch b;
    memset(&b, 0xab, sizeof b);
    b.struct_size = sizeof(ksp_batch);
    b.sample_size = sizeof(ksp_sample);
    ksp_status st = ksp_loader_next_batch(l, &b);
    CHECK(st == KSP_ERR_FORKED, "child next_batch: status %d: %s", (int)st, last_error());
    CHECK(strstr(last_error(), want_parent) != NULL, "message names the parent: %s", msg);
    CHECK(strstr(msg, want_child) != NULL, "message names the child: %s", msg);
    CHECK(strstr(msg, "create a new loader after fork") != NULL, "message says what to do: %s",
          msg);
    const uint8_t *p = (const uint8_t *)&b.count;
    size_t tail = sizeof b - offsetof(ksp_batch, count);
    size_t written = 0;
    for (size_t i = 0; i < tail; i++) written += p[i] != 0xab;
    CHECK(written == 0, "child next_batch wrote %zu bytes of the batch", written);

    uint64_t v = 0x5eed;
    st = ksp_loader_epoch_len(l, &v);
    CHECK(st == KSP_ERR_FORKED && v == 0x5eed, "child epoch_len: status %d, out %llu", (int)st,
          (unsigned long long)v);
    st = ksp_loader_class_count(l, &v);
    CHECK(st == KSP_ERR_FORKED && v == 0x5eed, "child class_count: status %d", (int)st);
    ksp_stats s = KSP_STATS_INIT;
    s.samples = 0x5eed;
    st = ksp_loader_stats(l, &s);
    CHECK(st == KSP_ERR_FORKED && s.samples == 0x5eed, "child stats: status %d", (int)st);
    st = ksp_loader_set_epoch(l, 1);
    CHECK(st == KSP_ERR_FORKED, "child set_epoch: status %d", (int)st);
    st = ksp_loader_release_batch(l, held_seq);
    CHECK(st == KSP_ERR_FORKED, "child release_batch: status %d", (int)st);
    /* Leaks the child's copy; must neither hang (joining pollers the child
     * does not have) nor stop the parent's loader. */
    ksp_loader_free(l);
    if (failures == 0) printf("child: all checks passed\n");
    fflush(stdout);
    return failures == 0 ? 0 : 1;
}

/* Waits for child `pid` (SIGCHLD blocked in `chld`) at most `secs`, killing
 * it past that; true when it exited 0. */
static int child_passed(sigset_t *chld, pid_t pid, time_t secs, const char *what) {
    int wstatus = 0;
    struct timespec deadline = {secs, 0};
    siginfo_t info;
    if (sigtimedwait(chld, &info, &deadline) < 0) {
        kill(pid, SIGKILL);
        CHECK(0, "%s: the child did not finish within %ld s", what, (long)secs);
    }
    waitpid(pid, &wstatus, 0);
    int ok = WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0;
    CHECK(ok, "%s child: exited %d, signal %d", what,
          WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1,
          WIFSIGNALED(wstatus) ? WTERMSIG(wstatus) : 0);
    return ok;
}

/* The child of a process running a node service: every call on it is
 * refused and nothing written; stopping it there returns at once (before
 * the fix it joined threads the child does not have: a hang) and leaves
 * the parent's service alone. */
static int service_child(ksp_node_service *svc, pid_t parent) {
    char want_parent[64], want_child[64];
    snprintf(want_parent, sizeof want_parent, "created by pid %ld", (long)parent);
    snprintf(want_child, sizeof want_child, "forked child (pid %ld)", (long)getpid());
    uint16_t port = 0x5eed;
    ksp_status st = ksp_node_service_port(svc, &port);
    CHECK(st == KSP_ERR_FORKED && port == 0x5eed, "child service_port: status %d, out %u",
          (int)st, (unsigned)port);
    CHECK(strstr(last_error(), want_parent) != NULL, "message names the parent: %s", msg);
    CHECK(strstr(msg, want_child) != NULL, "message names the child: %s", msg);
    CHECK(strstr(msg, "create a new node service after fork") != NULL,
          "message says what to do: %s", msg);
    ksp_node_service_stop(svc);
    if (failures == 0) printf("service child: all checks passed\n");
    fflush(stdout);
    return failures == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        printf("usage: fork_test SPACE\n");
        return 2;
    }
    /* SIGCHLD is blocked before any kspeed thread starts (they inherit the
     * mask), so the child's exit stays pending for sigtimedwait below. */
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    ksp_config *cfg = NULL;
    CHECK(ksp_config_new(&cfg) == KSP_OK, "%s", last_error());
    const char *kv[][2] = {
        {"space", argv[1]}, {"batch_size", "16"},    {"seed", "3"},
        {"pin", "false"},   {"mlock", "false"},      {"huge_pages", "false"},
        {"pollers", "2"},   {"ring_bytes", "192KiB"},
    };
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        CHECK(ksp_config_set(cfg, kv[i][0], kv[i][1]) == KSP_OK, "%s: %s", kv[i][0], last_error());
    ksp_loader *l = NULL;
    ksp_status st = ksp_loader_new(cfg, &l);
    ksp_config_free(cfg);
    if (st != KSP_OK) {
        printf("FAIL ksp_loader_new: %s\n", last_error());
        return 1;
    }
    uint64_t per_epoch = 0;
    CHECK(ksp_loader_epoch_len(l, &per_epoch) == KSP_OK, "%s", last_error());

    ksp_batch held = KSP_BATCH_INIT;
    CHECK(ksp_loader_next_batch(l, &held) == KSP_OK && held.count > 0, "%s", last_error());
    fflush(stdout); /* the child must not print the parent's buffered lines */

    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) {
        /* A hang in the child ends it (the parent reports the signal). */
        sigprocmask(SIG_UNBLOCK, &chld, NULL);
        alarm(60);
        _exit(child(l, held.seq, parent));
    }

    /* Wait for the child with a deadline (SIGCHLD, blocked before the
     * fork, is taken with sigtimedwait); kill it past the deadline. */
    int wstatus = 0;
    struct timespec deadline = {90, 0};
    siginfo_t info;
    if (sigtimedwait(&chld, &info, &deadline) < 0) {
        kill(pid, SIGKILL);
        CHECK(0, "the child did not finish within 90 s");
    }
    waitpid(pid, &wstatus, 0);
    CHECK(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0, "child: exited %d, signal %d",
          WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1,
          WIFSIGNALED(wstatus) ? WTERMSIG(wstatus) : 0);

    /* A node service in a process that forks. */
    ksp_node_service *svc = NULL;
    CHECK(ksp_node_service_start(argv[1], "127.0.0.1:0", "fork-token", &svc) == KSP_OK, "%s",
          last_error());
    uint16_t port = 0;
    CHECK(ksp_node_service_port(svc, &port) == KSP_OK && port > 0, "%s", last_error());
    fflush(stdout);
    pid_t spid = fork();
    if (spid < 0) {
        perror("fork");
        return 1;
    }
    if (spid == 0) {
        sigprocmask(SIG_UNBLOCK, &chld, NULL);
        alarm(30);
        _exit(service_child(svc, parent));
    }
    child_passed(&chld, spid, 60, "service");
    uint16_t again = 0;
    CHECK(ksp_node_service_port(svc, &again) == KSP_OK && again == port,
          "parent service_port after the fork: %s", last_error());
    ksp_node_service_stop(svc);

    /* The parent's batch and loader are untouched. */
    uint64_t n = held.count;
    int bad = bad_samples(l, &held);
    for (;;) {
        ksp_batch b = KSP_BATCH_INIT;
        st = ksp_loader_next_batch(l, &b);
        CHECK(st == KSP_OK, "parent next_batch after the fork: %s", last_error());
        if (st != KSP_OK || b.count == 0) break;
        n += b.count;
        bad += bad_samples(l, &b);
    }
    CHECK(n == per_epoch, "parent read %llu of %llu samples", (unsigned long long)n,
          (unsigned long long)per_epoch);
    CHECK(bad == 0, "parent: %d samples with wrong bytes", bad);
    ksp_loader_free(l);
    if (failures == 0) printf("all checks passed\n");
    return failures == 0 ? 0 : 1;
}
