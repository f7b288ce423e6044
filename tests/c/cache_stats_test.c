/* The NVMe cache area's counters through ksp_stats (appended after
 * cache_slots: cache_planned_hits, cache_write_bytes, cache_write_errors,
 * cache_area_bytes) with a real area: two loaders, one after the other,
 * reading a source through the same `cache_dir`, every sample of every
 * epoch checked against the catalog. The first fills the area (its writes
 * may still be landing when its reads end: the writer syncs each), the
 * second finds what the first kept and hits. Run by tests/capi.rs:
 *
 *   cache_stats_test SOURCE CATALOG CACHE_DIR CACHE_BYTES EPOCHS
 *
 * Prints one line per failed check and each run's counters, then "all
 * checks passed", and exits non-zero if any check failed. */
#include <kspeed.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

_Static_assert(offsetof(ksp_stats, cache_planned_hits) > offsetof(ksp_stats, cache_slots),
               "the area's later counters are appended after cache_slots");

/* Reads `epochs` epochs through the area and returns the loader's stats
 * (taken before it is freed), or exits on a loader error. */
static ksp_stats run(char **argv, uint64_t epochs, const char *name) {
    ksp_config *cfg = NULL;
    CHECK(ksp_config_new(&cfg) == KSP_OK, "%s", last_error());
    const char *kv[][2] = {
        {"source", argv[1]},      {"catalog", argv[2]},    {"cache_dir", argv[3]},
        {"cache_bytes", argv[4]}, {"batch_size", "8"},     {"seed", "11"},
        {"ring_bytes", "8MiB"},   {"pollers", "2"},        {"pin", "false"},
        {"mlock", "false"},       {"huge_pages", "false"}, {"end_epoch", argv[5]},
    };
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        CHECK(ksp_config_set(cfg, kv[i][0], kv[i][1]) == KSP_OK, "%s=%s: %s", kv[i][0], kv[i][1],
              last_error());
    ksp_loader *l = NULL;
    if (ksp_loader_new(cfg, &l) != KSP_OK) {
        fprintf(stderr, "FAIL: %s: ksp_loader_new: %s\n", name, last_error());
        exit(1);
    }
    ksp_config_free(cfg);
    uint64_t per_epoch = 0;
    CHECK(ksp_loader_epoch_len(l, &per_epoch) == KSP_OK, "%s", last_error());
    uint64_t read = 0;
    for (uint64_t e = 0; e < epochs; e++) {
        CHECK(ksp_loader_set_epoch(l, e) == KSP_OK, "%s: epoch %llu: %s", name,
              (unsigned long long)e, last_error());
        for (;;) {
            ksp_batch b = KSP_BATCH_INIT;
            if (ksp_loader_next_batch(l, &b) != KSP_OK) {
                fprintf(stderr, "FAIL: %s: epoch %llu: %s\n", name, (unsigned long long)e,
                        last_error());
                exit(1);
            }
            if (b.count == 0) break;
            for (size_t i = 0; i < b.count; i++) {
                const ksp_sample *s = &b.samples[i];
                ksp_catalog_sample c = KSP_CATALOG_SAMPLE_INIT;
                CHECK(ksp_loader_catalog_sample(l, s->id, &c) == KSP_OK, "%s", last_error());
                CHECK(c.len == s->len && crc32c(s->data, s->len) == c.crc32c,
                      "%s: sample %llu: its bytes are not the catalog's", name,
                      (unsigned long long)s->id);
                read++;
            }
        }
    }
    CHECK(read == epochs * per_epoch, "%s: read %llu samples, want %llu", name,
          (unsigned long long)read, (unsigned long long)(epochs * per_epoch));
    ksp_stats st = KSP_STATS_INIT;
    CHECK(ksp_loader_stats(l, &st) == KSP_OK, "%s", last_error());
    ksp_loader_free(l);
    printf("%s: samples %llu, cache hits %llu (%llu B) planned %llu writes %llu (%llu B) "
           "errors %llu skipped %llu held %llu slots %llu area %llu B\n",
           name, (unsigned long long)st.samples, (unsigned long long)st.cache_hits,
           (unsigned long long)st.cache_hit_bytes, (unsigned long long)st.cache_planned_hits,
           (unsigned long long)st.cache_writes, (unsigned long long)st.cache_write_bytes,
           (unsigned long long)st.cache_write_errors, (unsigned long long)st.cache_skipped,
           (unsigned long long)st.cache_held, (unsigned long long)st.cache_slots,
           (unsigned long long)st.cache_area_bytes);
    return st;
}

/* What holds for any run through the area. */
static void check_run(const ksp_stats *st, unsigned long long cache_bytes, const char *name) {
    CHECK(st->cache_slots > 0 && st->cache_held <= st->cache_slots, "%s: held %llu of %llu slots",
          name, (unsigned long long)st->cache_held, (unsigned long long)st->cache_slots);
    CHECK(st->cache_area_bytes > 0 && st->cache_area_bytes <= cache_bytes,
          "%s: area %llu B, budget %llu B", name, (unsigned long long)st->cache_area_bytes,
          cache_bytes);
    /* A source three times the area read for several epochs: the plan
     * has hits whoever reads first. */
    CHECK(st->cache_planned_hits > 0 && st->cache_planned_hits >= st->cache_hits,
          "%s: hits %llu, planned %llu", name, (unsigned long long)st->cache_hits,
          (unsigned long long)st->cache_planned_hits);
    CHECK(st->cache_write_errors == 0, "%s: write errors %llu", name,
          (unsigned long long)st->cache_write_errors);
    CHECK(st->cache_write_bytes >= st->cache_writes && st->cache_write_bytes <= st->bytes,
          "%s: write bytes %llu for %llu writes", name, (unsigned long long)st->cache_write_bytes,
          (unsigned long long)st->cache_writes);
    CHECK(st->cache_hit_bytes >= st->cache_hits && st->cache_hit_bytes <= st->bytes,
          "%s: hit bytes %llu for %llu hits", name, (unsigned long long)st->cache_hit_bytes,
          (unsigned long long)st->cache_hits);
    /* A source read directly: its reads are disk reads; hits are in
     * neither count. */
    CHECK(st->disk_reads + st->source_reads + st->cache_hits == st->samples,
          "%s: disk reads %llu + source reads %llu + hits %llu, samples %llu", name,
          (unsigned long long)st->disk_reads, (unsigned long long)st->source_reads,
          (unsigned long long)st->cache_hits, (unsigned long long)st->samples);
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s SOURCE CATALOG CACHE_DIR CACHE_BYTES EPOCHS\n", argv[0]);
        return 2;
    }
    const unsigned long long cache_bytes = strtoull(argv[4], NULL, 10);
    const uint64_t epochs = strtoull(argv[5], NULL, 10);
    ksp_stats first = run(argv, epochs, "first run");
    check_run(&first, cache_bytes, "first run");
    /* An empty area at the start: what it holds at the end this run's
     * writes took (landed or still landing). */
    CHECK(first.cache_held > 0, "first run: held %llu after %llu writes",
          (unsigned long long)first.cache_held, (unsigned long long)first.cache_writes);
    ksp_stats second = run(argv, epochs, "second run");
    check_run(&second, cache_bytes, "second run");
    /* The first run's loader was freed, its writes landed: the second
     * finds them and hits. */
    CHECK(second.cache_hits > 0, "second run: no hit in an area the first run filled");
    CHECK(second.cache_area_bytes == first.cache_area_bytes, "one area: %llu B then %llu B",
          (unsigned long long)first.cache_area_bytes, (unsigned long long)second.cache_area_bytes);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
