/* Tier views through the node agent, from C (the `agent`,
 * `agent_socket` and `tier_views` config keys). Run by tests/capi.rs
 * against a real `kspeed agent --tier-bytes` process:
 *
 *   agent_views_test SPACE SOCKET
 *
 * Reads epochs 0 and 1 attached; epoch 0 fills the agent's node tier, so
 * epoch 1's samples come mostly as views of it: each such batch has no
 * span (`span` NULL), each sample's bytes match the catalog's CRC32C, and
 * a view's page cannot be made writable (mprotect fails with EACCES: the
 * agent passed its tier read-only). Prints one line per failed check and
 * exits non-zero if any failed. */
#define _GNU_SOURCE
#include <kspeed.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"

/* Reads epoch `e`, checking every sample's bytes; returns the samples
 * whose page refuses PROT_WRITE (views of the read-only tier) and counts
 * the batches without a span into `spanless`. */
static uint64_t read_epoch(ksp_loader *l, uint64_t e, uint64_t *samples, uint64_t *spanless) {
    uint64_t views = 0;
    long page = sysconf(_SC_PAGESIZE);
    CHECK(ksp_loader_set_epoch(l, e) == KSP_OK, "%s", last_error());
    for (;;) {
        ksp_batch b = KSP_BATCH_INIT;
        CHECK(ksp_loader_next_batch(l, &b) == KSP_OK, "%s", last_error());
        if (b.count == 0) break;
        if (b.span == NULL) (*spanless)++;
        for (size_t i = 0; i < b.count; i++) {
            const ksp_sample *s = &b.samples[i];
            ksp_catalog_sample c = KSP_CATALOG_SAMPLE_INIT;
            CHECK(ksp_loader_catalog_sample(l, s->id, &c) == KSP_OK, "%s", last_error());
            CHECK(s->len == c.len && crc32c(s->data, s->len) == c.crc32c, "sample %llu bytes",
                  (unsigned long long)s->id);
            (*samples)++;
            /* The ring is mapped read-write already (mprotect leaves it
             * so); the tier's read-only mapping refuses write access. */
            void *at = (void *)((uintptr_t)s->data & ~(uintptr_t)(page - 1));
            if (mprotect(at, (size_t)page, PROT_READ | PROT_WRITE) != 0) {
                CHECK(errno == EACCES, "mprotect: %s", strerror(errno));
                views++;
            }
        }
        CHECK(ksp_loader_release_batch(l, b.seq) == KSP_OK, "%s", last_error());
    }
    return views;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: agent_views_test SPACE SOCKET\n");
        return 2;
    }
    ksp_config *cfg = NULL;
    CHECK(ksp_config_new(&cfg) == KSP_OK, "%s", last_error());
    const char *kv[][2] = {
        {"space", argv[1]}, {"agent", "required"}, {"agent_socket", argv[2]},
        {"tier_views", "true"}, {"batch_size", "16"}, {"seed", "9"},
        {"ring_bytes", "1MiB"}, {"pin", "false"}, {"end_epoch", "2"},
    };
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        CHECK(ksp_config_set(cfg, kv[i][0], kv[i][1]) == KSP_OK, "%s: %s", kv[i][0], last_error());
    ksp_loader *l = NULL;
    /* No agent at a socket: the network's status, naming the socket. */
    char missing[4096];
    snprintf(missing, sizeof missing, "%s.missing", argv[2]);
    CHECK(ksp_config_set(cfg, "agent_socket", missing) == KSP_OK, "%s", last_error());
    CHECK(ksp_loader_new(cfg, &l) == KSP_ERR_NETWORK && l == NULL,
          "no agent: status not KSP_ERR_NETWORK: %s", last_error());
    CHECK(strstr(last_error(), ".missing") != NULL, "no agent: %s", last_error());
    CHECK(ksp_config_set(cfg, "agent_socket", argv[2]) == KSP_OK, "%s", last_error());
    CHECK(ksp_loader_new(cfg, &l) == KSP_OK, "%s", last_error());
    ksp_config_free(cfg);
    if (!l) return 1;
    uint64_t n0 = 0, s0 = 0, n1 = 0, s1 = 0;
    read_epoch(l, 0, &n0, &s0);
    uint64_t views = read_epoch(l, 1, &n1, &s1);
    uint64_t len = 0;
    CHECK(ksp_loader_catalog_len(l, &len) == KSP_OK, "%s", last_error());
    CHECK(n0 == len && n1 == len, "epochs of %llu and %llu samples, catalog %llu",
          (unsigned long long)n0, (unsigned long long)n1, (unsigned long long)len);
    /* Epoch 0 filled the tier; only samples read ahead before their
     * member was filled come in the ring in epoch 1. */
    CHECK(views * 2 >= n1, "%llu views of %llu samples", (unsigned long long)views,
          (unsigned long long)n1);
    CHECK(s1 > 0, "no batch of epoch 1 without a span");
    ksp_loader_free(l);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("agent views: %llu of %llu samples of epoch 1 were read-only views; all checks passed\n",
           (unsigned long long)views, (unsigned long long)n1);
    return 0;
}
