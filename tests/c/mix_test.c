/* A mixture through the C ABI (the `mix` config key, ksp_sample.dataset).
 * Run by tests/capi.rs:
 *
 *   mix_test SPACE SOURCE WORKDIR
 *
 * SPACE is a preloaded space and SOURCE its source directory: the mixture
 * reads them side by side (the space's samples first in the id space),
 * 3:1, in an epoch of 400, with a memory tier over both. Checks each
 * dataset's count, that every sample's `dataset` matches its id's range,
 * and every sample's bytes; then the rank's position (KSPDPOS4) and
 * ksp_audit of it; then a second epoch, whose samples drawn in the first
 * come from the tier.
 * Prints one line per failed check and exits non-zero if any failed. */
#include <kspeed.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* Reads epoch `e` to its end, checking every sample; counts each
 * dataset's samples into `count`. */
static void read_epoch(ksp_loader *l, uint64_t e, uint64_t n0, uint64_t count[2]) {
    CHECK(ksp_loader_set_epoch(l, e) == KSP_OK, "%s", last_error());
    for (;;) {
        ksp_batch b = KSP_BATCH_INIT;
        CHECK(ksp_loader_next_batch(l, &b) == KSP_OK, "%s", last_error());
        if (b.count == 0) break;
        for (size_t i = 0; i < b.count; i++) {
            const ksp_sample *s = &b.samples[i];
            CHECK(s->dataset <= 1 && (s->id >= n0) == (s->dataset == 1), "sample %llu in dataset %u",
                  (unsigned long long)s->id, s->dataset);
            CHECK(s->reserved == 0, "reserved is zero");
            if (s->dataset > 1) continue;
            count[s->dataset]++;
            ksp_catalog_sample c = KSP_CATALOG_SAMPLE_INIT;
            uint64_t local = s->id - (s->dataset ? n0 : 0);
            CHECK(ksp_loader_catalog_sample(l, local, &c) == KSP_OK, "%s", last_error());
            CHECK(s->len == c.len && crc32c(s->data, s->len) == c.crc32c,
                  "dataset %u sample %llu bytes", s->dataset, (unsigned long long)local);
        }
        CHECK(ksp_loader_release_batch(l, b.seq) == KSP_OK, "%s", last_error());
    }
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: mix_test SPACE SOURCE WORKDIR\n");
        return 2;
    }
    char mix[8192];
    snprintf(mix, sizeof mix, "%s:0.75,%s:0.25", argv[1], argv[2]);
    ksp_config *cfg = NULL;
    CHECK(ksp_config_new(&cfg) == KSP_OK, "%s", last_error());
    const char *kv[][2] = {
        {"mix", mix}, {"mix_epoch_size", "400"}, {"batch_size", "16"}, {"seed", "9"},
        {"ring_bytes", "4MiB"}, {"pollers", "1"}, {"pin", "false"}, {"mlock", "false"},
        {"huge_pages", "false"}, {"tier_bytes", "16MiB"},
    };
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        CHECK(ksp_config_set(cfg, kv[i][0], kv[i][1]) == KSP_OK, "%s: %s", kv[i][0], last_error());
    /* A bad weight is refused by the options table, naming the key. */
    CHECK(ksp_config_set(cfg, "mix", "a:0.5,b:-2") == KSP_ERR_INVALID_ARG, "negative weight");
    CHECK(strstr(last_error(), "mix") != NULL, "message names the key: %s", msg);
    ksp_loader *l = NULL;
    CHECK(ksp_loader_new(cfg, &l) == KSP_OK, "%s", last_error());
    ksp_config_free(cfg);
    if (!l) return 1;
    /* The space's catalog is the first dataset's; the source holds the
     * same samples, so dataset 1's local id has the same catalog entry. */
    uint64_t n0 = 0;
    CHECK(ksp_loader_catalog_len(l, &n0) == KSP_OK, "%s", last_error());
    uint64_t count[2] = {0, 0};
    read_epoch(l, 0, n0, count);
    CHECK(count[0] == 300 && count[1] == 100, "counts %llu and %llu", (unsigned long long)count[0],
          (unsigned long long)count[1]);
    /* A mixture's rank position is a KSPDPOS4 of 120 + 24 bytes per
     * dataset (a KSP_POSITION_BYTES buffer is too small, naming the size),
     * and ksp_audit audits the epoch from it alone. */
    uint8_t pos[256];
    size_t n = 0;
    CHECK(ksp_loader_save_position(l, pos, KSP_POSITION_BYTES, &n) == KSP_ERR_BUFFER_TOO_SMALL &&
              n == 120 + 24 * 2,
          "a mixture's position needs %zu bytes", n);
    CHECK(ksp_loader_save_position(l, pos, sizeof pos, &n) == KSP_OK && n == 168 &&
              memcmp(pos, "KSPDPOS4", 8) == 0,
          "%s", last_error());
    const uint8_t *ptrs[1] = {pos};
    size_t lens[1] = {n};
    char report[256];
    size_t rn = 0;
    CHECK(ksp_audit(ptrs, lens, 1, report, sizeof report, &rn) == KSP_OK, "%s", last_error());
    CHECK(strcmp(report, "epoch 0: 400 samples, each exactly once\n") == 0, "report: %s", report);
    /* The digest's count (u64 at offset 88) one short, the CRC32C (after
     * the 164 bytes before it) redone: a sample skipped, KSP_ERR_DATA. */
    pos[88]--;
    uint32_t crc = crc32c(pos, 164);
    for (int k = 0; k < 4; k++) pos[164 + k] = (uint8_t)(crc >> (8 * k));
    CHECK(ksp_audit(ptrs, lens, 1, report, sizeof report, &rn) == KSP_ERR_DATA, "a sample skipped");
    CHECK(strstr(last_error(), "some skipped") != NULL, "names it: %s", msg);
    /* A byte flipped without its CRC: not a position. */
    pos[90] ^= 1;
    CHECK(ksp_audit(ptrs, lens, 1, report, sizeof report, &rn) == KSP_ERR_INVALID_ARG, "a corrupt position");
    /* The tier holds both datasets: epoch 1's draws of samples epoch 0
     * read are copies from memory. */
    ksp_stats before = KSP_STATS_INIT, after = KSP_STATS_INIT;
    CHECK(ksp_loader_stats(l, &before) == KSP_OK, "%s", last_error());
    uint64_t again[2] = {0, 0};
    read_epoch(l, 1, n0, again);
    CHECK(again[0] == 300 && again[1] == 100, "epoch 1 counts %llu and %llu",
          (unsigned long long)again[0], (unsigned long long)again[1]);
    CHECK(ksp_loader_stats(l, &after) == KSP_OK, "%s", last_error());
    CHECK(after.tier_hits > before.tier_hits + 100, "epoch 1: %llu tier hits",
          (unsigned long long)(after.tier_hits - before.tier_hits));
    ksp_loader_free(l);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("mix: all checks passed\n");
    return 0;
}
