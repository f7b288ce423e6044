/* Resume at another world size through the C ABI, and the exactly-once
 * audit. Run by tests/capi.rs:
 *
 *   elastic_test SPACE SOURCE WORKDIR
 *
 * SPACE is a preloaded space of 200 samples. Four ranks (rank/world set
 * on each loader, one after another: lock-step is each rank taking the
 * same batches) take 3 batches of 8; three ranks resume from the job
 * position and finish the epoch. Every sample is checked against the
 * catalog's CRC32C, the union of delivered ids is the epoch exactly once
 * (the padding duplicate aside), ksp_audit passes on the seven positions
 * and names a missing rank's. Prints one line per failed check. */
#include <kspeed.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define SAMPLES 200
static unsigned seen[SAMPLES];
static uint64_t delivered = 0;

static ksp_loader *open_rank(const char *space, unsigned rank, unsigned world) {
    ksp_config *cfg = NULL;
    CHECK(ksp_config_new(&cfg) == KSP_OK, "%s", last_error());
    char r[16], w[16];
    snprintf(r, sizeof r, "%u", rank);
    snprintf(w, sizeof w, "%u", world);
    const char *kv[][2] = {
        {"space", space}, {"batch_size", "8"}, {"seed", "11"}, {"ring_bytes", "1MiB"}, {"rank", r},
        {"world", w}, {"pollers", "1"}, {"pin", "false"}, {"mlock", "false"}, {"huge_pages", "false"},
    };
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        CHECK(ksp_config_set(cfg, kv[i][0], kv[i][1]) == KSP_OK, "%s=%s: %s", kv[i][0], kv[i][1],
              last_error());
    ksp_loader *l = NULL;
    CHECK(ksp_loader_new(cfg, &l) == KSP_OK, "rank %u of %u: %s", rank, world, last_error());
    ksp_config_free(cfg);
    return l;
}

/* Takes up to `batches` batches of epoch 0 (all: UINT64_MAX), checking
 * each sample's bytes; returns the samples taken. */
static uint64_t take(ksp_loader *l, uint64_t batches) {
    uint64_t n = 0;
    for (uint64_t k = 0; k < batches; k++) {
        ksp_batch b = KSP_BATCH_INIT;
        ksp_status st = ksp_loader_next_batch(l, &b);
        CHECK(st == KSP_OK, "next_batch: %s", last_error());
        if (st != KSP_OK || b.count == 0) break;
        CHECK(b.epoch == 0, "epoch %llu", (unsigned long long)b.epoch);
        for (size_t i = 0; i < b.count; i++) {
            const ksp_sample *s = &b.samples[i];
            ksp_catalog_sample c = KSP_CATALOG_SAMPLE_INIT;
            CHECK(ksp_loader_catalog_sample(l, s->id, &c) == KSP_OK, "%s", last_error());
            CHECK(s->len == c.len && crc32c(s->data, s->len) == c.crc32c, "sample %llu bytes",
                  (unsigned long long)s->id);
            if (s->id < SAMPLES) seen[s->id]++;
            n++;
        }
        CHECK(ksp_loader_release_batch(l, b.seq) == KSP_OK, "%s", last_error());
    }
    delivered += n;
    return n;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: elastic_test SPACE SOURCE WORKDIR\n");
        return 2;
    }
    const char *space = argv[1];
    uint8_t pos[7][KSP_POSITION_BYTES];
    const uint8_t *ptrs[7];
    size_t lens[7];
    uint8_t job[KSP_JOB_POSITION_BYTES];
    size_t n = 0;

    /* Four ranks take 3 batches of 8 each: 96 of the epoch's order. */
    for (unsigned r = 0; r < 4; r++) {
        ksp_loader *l = open_rank(space, r, 4);
        if (!l) return 1;
        CHECK(take(l, 3) == 24, "rank %u", r);
        ksp_stats st = KSP_STATS_INIT;
        CHECK(ksp_loader_stats(l, &st) == KSP_OK, "%s", last_error());
        CHECK(st.digest_epoch == 0 && st.digest_count == 24, "digest %llu/%llu",
              (unsigned long long)st.digest_epoch, (unsigned long long)st.digest_count);
        CHECK(ksp_loader_save_position(l, pos[r], sizeof pos[r], &n) == KSP_OK && n == KSP_POSITION_BYTES,
              "%s", last_error());
        uint64_t e = 9, consumed = 0;
        uint8_t small[8];
        CHECK(ksp_loader_job_position(l, small, sizeof small, &n, &e, &consumed) == KSP_ERR_BUFFER_TOO_SMALL &&
                  n == KSP_JOB_POSITION_BYTES,
              "a small buffer is refused with the size");
        CHECK(ksp_loader_job_position(l, job, sizeof job, &n, &e, &consumed) == KSP_OK, "%s", last_error());
        CHECK(e == 0 && consumed == 96, "job position %llu/%llu", (unsigned long long)e,
              (unsigned long long)consumed);
        /* The same job position encoded from (epoch, consumed). */
        uint8_t at[KSP_JOB_POSITION_BYTES];
        CHECK(ksp_loader_job_position_at(l, 0, 96, at, sizeof at, &n) == KSP_OK && n == sizeof at &&
                  memcmp(at, job, sizeof at) == 0,
              "ksp_loader_job_position_at: %s", last_error());
        ksp_loader_free(l);
    }

    /* Three ranks resume from the job position (rank 2's saved position
     * for rank 2: any rank's gives the job's) and finish the epoch. */
    for (unsigned r = 0; r < 3; r++) {
        ksp_loader *l = open_rank(space, r, 3);
        if (!l) return 1;
        const uint8_t *from = r == 2 ? pos[2] : job;
        size_t len = r == 2 ? KSP_POSITION_BYTES : KSP_JOB_POSITION_BYTES;
        CHECK(ksp_loader_restore_job_position(l, from, len) == KSP_OK, "%s", last_error());
        /* 104 left over 3 ranks: 35 steps each (one padding duplicate). */
        CHECK(take(l, UINT64_MAX) == 35, "rank %u of 3", r);
        CHECK(ksp_loader_save_position(l, pos[4 + r], sizeof pos[4 + r], &n) == KSP_OK, "%s",
              last_error());
        /* A rank's own position does not resume on another world. */
        CHECK(ksp_loader_restore_position(l, pos[0], KSP_POSITION_BYTES) == KSP_ERR_INVALID_ARG,
              "another world's rank position");
        CHECK(strstr(last_error(), "rank/world") != NULL, "%s", msg);
        ksp_loader_free(l);
    }

    /* The union: every sample at least once, exactly one twice (g(200) =
     * g(0), the padding), 201 in all. */
    unsigned twice = 0, missing = 0;
    for (unsigned i = 0; i < SAMPLES; i++) {
        missing += seen[i] == 0;
        twice += seen[i] == 2;
        CHECK(seen[i] <= 2, "sample %u %u times", i, seen[i]);
    }
    CHECK(delivered == 201 && missing == 0 && twice == 1, "delivered %llu, missing %u, twice %u",
          (unsigned long long)delivered, missing, twice);

    for (int i = 0; i < 7; i++) {
        ptrs[i] = pos[i];
        lens[i] = KSP_POSITION_BYTES;
    }
    char report[256];
    CHECK(ksp_audit(ptrs, lens, 7, report, sizeof report, &n) == KSP_OK, "%s", last_error());
    CHECK(strcmp(report, "epoch 0: 200 samples, each exactly once, and 1 padding duplicates\n") == 0,
          "report: %s", report);
    CHECK(n == strlen(report), "length %zu", n);
    /* A rank of the second world missing. */
    CHECK(ksp_audit(ptrs, lens, 6, report, sizeof report, &n) == KSP_ERR_DATA, "audit of 6");
    CHECK(strstr(last_error(), "2 rank positions for a world of 3") != NULL, "%s", msg);
    /* Not a position. */
    lens[3] = 10;
    CHECK(ksp_audit(ptrs, lens, 7, report, sizeof report, &n) == KSP_ERR_INVALID_ARG, "a short buffer");

    if (failures) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
