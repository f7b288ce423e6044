/* The C ABI's extensible structs (ksp_stats, ksp_catalog_sample, ksp_batch
 * and its ksp_sample array): a caller compiled against an older, smaller layout still works
 * and nothing past its struct is written; a caller compiled against a
 * newer, larger layout gets the fields the library knows and zeroes for
 * the rest; a size below the first layout (or one that was never set) is
 * KSP_ERR_STRUCT_SIZE with nothing written and nothing consumed.
 * Run by tests/capi.rs:
 *
 *   sized_structs_test SPACE [MIN_LOOP_STALLS]
 *
 * SPACE is a preloaded space. MIN_LOOP_STALLS (default 0) is the least
 * ksp_stats.loop_stalls must show: tests/capi.rs passes 1 when the library
 * has the test hook that blocks each poller's first tick
 * (KSPEED_TEST_STALL_MS). Prints one line per failed check and exits
 * non-zero if any failed. */
#include <kspeed.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ksp_stats as a program compiled against its first layout sees it: it
 * ended at read_ahead_discarded. */
struct old_stats {
    size_t struct_size;
    uint64_t samples, bytes;
    double elapsed_s, stall_s;
    uint64_t disk_reads, tier_hits, retries, p50_us, p99_us, remote_samples, failovers,
        source_reads, read_ahead, read_ahead_discarded;
};

/* ksp_stats as a program compiled against its second layout sees it: it
 * ended at latency_reads (before loop_stalls was appended). */
struct second_stats {
    struct old_stats first;
    uint64_t p90_us, p999_us, max_us, latency_reads;
};

/* ksp_catalog_sample as a program compiled against its first layout (ABI
 * 4) sees it: it ended at label. */
struct old_catalog_sample {
    size_t struct_size;
    uint64_t len;
    uint32_t crc32c, reserved;
    int64_t label;
};

/* ksp_stats, ksp_sample, ksp_catalog_sample and ksp_batch as a program compiled against a
 * later header, with fields this library does not know, might see them. */
struct new_stats {
    ksp_stats s;
    uint64_t future[3];
};
struct new_sample {
    ksp_sample s;
    uint64_t future[2];
};
struct new_catalog_sample {
    ksp_catalog_sample c;
    uint64_t future[2];
};
struct new_batch {
    ksp_batch b;
    uint64_t future[3];
};

_Static_assert(sizeof(struct old_stats) == KSP_STATS_MIN_SIZE, "first ksp_stats layout");
_Static_assert(offsetof(ksp_stats, p90_us) == KSP_STATS_MIN_SIZE, "fields are appended");
_Static_assert(sizeof(ksp_stats) > KSP_STATS_MIN_SIZE, "ksp_stats grew past its first layout");
_Static_assert(offsetof(ksp_stats, loop_stalls) == sizeof(struct second_stats),
               "loop_stalls is appended after the second layout");
_Static_assert(sizeof(ksp_batch) >= KSP_BATCH_MIN_SIZE, "first ksp_batch layout");
_Static_assert(sizeof(ksp_sample) >= KSP_SAMPLE_MIN_SIZE, "first ksp_sample layout");
_Static_assert(sizeof(struct old_catalog_sample) == KSP_CATALOG_SAMPLE_MIN_SIZE,
               "first ksp_catalog_sample layout");
_Static_assert(sizeof(ksp_catalog_sample) >= KSP_CATALOG_SAMPLE_MIN_SIZE,
               "ksp_catalog_sample only grows");
_Static_assert(offsetof(ksp_stats, struct_size) == 0 && offsetof(ksp_batch, struct_size) == 0 &&
                   offsetof(ksp_catalog_sample, struct_size) == 0,
               "struct_size leads");

#define FILL 0xAB

static int all_bytes(const void *p, size_t n, unsigned char v) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != v) return 0;
    return 1;
}

static ksp_loader *open_loader(const char *space) {
    ksp_config *cfg = NULL;
    CHECK(ksp_config_new(&cfg) == KSP_OK, "%s", last_error());
    const char *kv[][2] = {
        {"space", space}, {"batch_size", "16"}, {"seed", "7"},    {"ring_bytes", "2MiB"},
        {"pollers", "1"}, {"pin", "false"},     {"mlock", "false"}, {"huge_pages", "false"},
    };
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        CHECK(ksp_config_set(cfg, kv[i][0], kv[i][1]) == KSP_OK, "%s", last_error());
    ksp_loader *l = NULL;
    CHECK(ksp_loader_new(cfg, &l) == KSP_OK, "%s", last_error());
    ksp_config_free(cfg);
    return l;
}

/* Checks sample s against the catalog. */
static void check_sample(ksp_loader *l, const ksp_sample *s) {
    ksp_catalog_sample c = KSP_CATALOG_SAMPLE_INIT;
    CHECK(ksp_loader_catalog_sample(l, s->id, &c) == KSP_OK, "%s", last_error());
    CHECK(s->len == c.len && crc32c(s->data, s->len) == c.crc32c && s->label == c.label,
          "sample %llu", (unsigned long long)s->id);
}

int main(int argc, char **argv) {
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: sized_structs_test SPACE [MIN_LOOP_STALLS]\n");
        return 2;
    }
    uint64_t min_loop_stalls = argc == 3 ? strtoull(argv[2], NULL, 10) : 0;
    ksp_loader *l = open_loader(argv[1]);
    if (!l) return 1;
    uint64_t per_epoch = 0;
    CHECK(ksp_loader_epoch_len(l, &per_epoch) == KSP_OK && per_epoch > 16, "%s", last_error());

    /* --- ksp_batch --- */
    /* Too small: refused, named, nothing written, nothing consumed. */
    ksp_batch b;
    memset(&b, FILL, sizeof b);
    b.struct_size = KSP_BATCH_MIN_SIZE - 8;
    b.sample_size = sizeof(ksp_sample);
    CHECK(ksp_loader_next_batch(l, &b) == KSP_ERR_STRUCT_SIZE, "batch struct_size below the minimum");
    CHECK(strstr(last_error(), "struct_size") != NULL, "message names the field: %s", msg);
    CHECK(b.struct_size == KSP_BATCH_MIN_SIZE - 8 && all_bytes(&b.count, sizeof b - 16, FILL),
          "a refused batch is not written");
    b.struct_size = sizeof b;
    b.sample_size = KSP_SAMPLE_MIN_SIZE - 8;
    CHECK(ksp_loader_next_batch(l, &b) == KSP_ERR_STRUCT_SIZE, "sample_size below the minimum");
    CHECK(strstr(last_error(), "sample_size") != NULL, "message names the field: %s", msg);
    /* Never set (what `ksp_batch b;` without KSP_BATCH_INIT may hold). */
    memset(&b, FILL, sizeof b);
    CHECK(ksp_loader_next_batch(l, &b) == KSP_ERR_STRUCT_SIZE, "uninitialised struct_size");
    b.struct_size = sizeof b;
    CHECK(ksp_loader_next_batch(l, &b) == KSP_ERR_STRUCT_SIZE, "uninitialised sample_size");
    b.sample_size = sizeof(ksp_sample) + 4;
    CHECK(ksp_loader_next_batch(l, &b) == KSP_ERR_STRUCT_SIZE, "sample_size not a multiple of 8");
    uint64_t pe = 9, pi = 9;
    CHECK(ksp_loader_position(l, &pe, &pi) == KSP_OK && pe == 0 && pi == 0,
          "refused calls consumed nothing: %llu/%llu", (unsigned long long)pe,
          (unsigned long long)pi);

    /* The first layout (KSP_BATCH_MIN_SIZE): epoch 0, ids recorded. */
    uint64_t *ids = calloc(per_epoch, sizeof *ids);
    uint64_t n0 = 0;
    for (;;) {
        ksp_batch ob = KSP_BATCH_INIT;
        ob.struct_size = KSP_BATCH_MIN_SIZE;
        ob.sample_size = KSP_SAMPLE_MIN_SIZE;
        CHECK(ksp_loader_next_batch(l, &ob) == KSP_OK, "%s", last_error());
        if (ob.count == 0) break;
        for (size_t i = 0; i < ob.count && n0 < per_epoch; i++) {
            /* The library lays samples out at the caller's stride: the
             * first layout's, shorter than this build's ksp_sample. */
            const ksp_sample *os =
                (const ksp_sample *)((const char *)ob.samples + i * ob.sample_size);
            check_sample(l, os);
            ids[n0++] = os->id;
        }
    }
    CHECK(n0 == per_epoch, "first layout: %llu of %llu", (unsigned long long)n0,
          (unsigned long long)per_epoch);

    /* A newer, larger layout with a wider ksp_sample: the same epoch again,
     * the same samples, every unknown field zero. */
    CHECK(ksp_loader_set_epoch(l, 0) == KSP_OK, "%s", last_error());
    uint64_t n1 = 0;
    for (;;) {
        struct new_batch nb;
        memset(&nb, FILL, sizeof nb);
        nb.b.struct_size = sizeof nb;
        nb.b.sample_size = sizeof(struct new_sample);
        CHECK(ksp_loader_next_batch(l, &nb.b) == KSP_OK, "%s", last_error());
        CHECK(nb.b.struct_size == sizeof nb, "struct_size is the caller's");
        CHECK(all_bytes(nb.future, sizeof nb.future, 0), "unknown batch fields zeroed");
        if (nb.b.count == 0) break;
        const struct new_sample *ns = (const struct new_sample *)nb.b.samples;
        for (size_t i = 0; i < nb.b.count; i++) {
            check_sample(l, &ns[i].s);
            CHECK(all_bytes(ns[i].future, sizeof ns[i].future, 0), "unknown sample fields zeroed");
            CHECK(n1 < per_epoch && ns[i].s.id == ids[n1], "sample %llu in order",
                  (unsigned long long)n1);
            n1++;
        }
        CHECK(ksp_loader_release_batch(l, nb.b.seq) == KSP_OK, "%s", last_error());
    }
    CHECK(n1 == per_epoch, "newer layout: %llu of %llu", (unsigned long long)n1,
          (unsigned long long)per_epoch);
    free(ids);

    /* --- ksp_stats --- */
    ksp_stats full = KSP_STATS_INIT;
    CHECK(ksp_loader_stats(l, &full) == KSP_OK, "%s", last_error());
    CHECK(full.struct_size == sizeof full, "struct_size is the caller's");
    CHECK(full.samples == 2 * per_epoch, "samples %llu", (unsigned long long)full.samples);
    CHECK(full.latency_reads > 0 && full.p50_us <= full.p90_us && full.p90_us <= full.p99_us &&
              full.p99_us <= full.p999_us && full.p999_us <= full.max_us && full.max_us > 0,
          "latency %llu reads: p50 %llu p90 %llu p99 %llu p999 %llu max %llu",
          (unsigned long long)full.latency_reads, (unsigned long long)full.p50_us,
          (unsigned long long)full.p90_us, (unsigned long long)full.p99_us,
          (unsigned long long)full.p999_us, (unsigned long long)full.max_us);

    /* The stall's causes (appended after source_bytes) add up to it. */
    double causes = full.stall_disk_s + full.stall_tier_s + full.stall_source_s + full.stall_peers_s +
                    full.stall_failover_s + full.stall_agent_s;
    CHECK(causes >= full.stall_s - 1e-6 && causes <= full.stall_s + 1e-6 && full.stall_peers_s == 0.0 &&
              full.slowest_peer_waits[0] == 0,
          "stall %.9f s, causes %.9f s (disk %.9f, peers %.9f)", full.stall_s, causes, full.stall_disk_s,
          full.stall_peers_s);
    /* The source's lead (appended after slowest_peer_waits): a space
     * read whole has no source samples. */
    CHECK(full.source_lead_count == 0 && full.source_lead_late == 0 && full.source_lead_p50_s == 0.0,
          "source lead of %llu samples", (unsigned long long)full.source_lead_count);
    /* loop_stalls is written (the struct was filled with FILL bytes
     * first) and counts the blocked ticks the hook made, if any. */
    ksp_stats filled;
    memset(&filled, FILL, sizeof filled);
    filled.struct_size = sizeof filled;
    CHECK(ksp_loader_stats(l, &filled) == KSP_OK, "%s", last_error());
    CHECK(filled.loop_stalls >= min_loop_stalls && filled.loop_stalls < (1ull << 32),
          "loop_stalls %llu (at least %llu)", (unsigned long long)filled.loop_stalls,
          (unsigned long long)min_loop_stalls);
    /* The peers' split (appended after stall_waits) is written too (the
     * struct held FILL bytes): no peers here, nothing split. */
    CHECK(filled.stall_peer_read_s == 0.0 && filled.stall_peer_send_s == 0.0 &&
              filled.stall_peer_link_s == 0.0 && filled.slowest_peer_read_s[0] == 0.0 &&
              filled.slowest_peer_link_s[3] == 0.0,
          "peer split %.9f %.9f %.9f", filled.stall_peer_read_s, filled.stall_peer_send_s,
          filled.stall_peer_link_s);
    /* The cache area's counters (appended after slowest_peer_link_s) are
     * written too: no cache_dir, all 0. */
    CHECK(filled.cache_hits == 0 && filled.cache_writes == 0 && filled.cache_corrupt == 0 &&
              filled.cache_held == 0 && filled.cache_slots == 0 && filled.cache_planned_hits == 0 &&
              filled.cache_write_bytes == 0 && filled.cache_write_errors == 0 &&
              filled.cache_area_bytes == 0,
          "cache hits %llu slots %llu", (unsigned long long)filled.cache_hits,
          (unsigned long long)filled.cache_slots);

    /* The second layout (up to latency_reads): filled, and loop_stalls,
     * which lies past it, not written. */
    struct {
        struct second_stats s;
        unsigned char after[64];
    } second;
    memset(&second, FILL, sizeof second);
    second.s.first.struct_size = sizeof second.s;
    CHECK(ksp_loader_stats(l, (ksp_stats *)&second.s) == KSP_OK, "second layout: %s",
          last_error());
    CHECK(second.s.first.samples == full.samples && second.s.latency_reads >= full.latency_reads &&
              second.s.max_us >= full.max_us,
          "second layout's fields");
    CHECK(all_bytes(second.after, sizeof second.after, FILL),
          "nothing written past the second layout");

    /* The first layout: filled, and not one byte past it written. */
    struct {
        struct old_stats s;
        unsigned char after[64];
    } old;
    memset(&old, FILL, sizeof old);
    old.s.struct_size = sizeof old.s;
    CHECK(ksp_loader_stats(l, (ksp_stats *)&old.s) == KSP_OK, "old layout: %s", last_error());
    CHECK(old.s.struct_size == sizeof old.s, "struct_size is the caller's");
    /* Delivered counts stand still between batches; the read counters may
     * move on (the pollers read ahead into the next epoch). */
    CHECK(old.s.samples == full.samples && old.s.bytes == full.bytes &&
              old.s.disk_reads >= full.disk_reads && old.s.elapsed_s >= full.elapsed_s,
          "old layout's fields");
    CHECK(all_bytes(old.after, sizeof old.after, FILL), "nothing written past the old layout");

    /* A newer layout: unknown fields zeroed. */
    struct new_stats ns;
    memset(&ns, FILL, sizeof ns);
    ns.s.struct_size = sizeof ns;
    CHECK(ksp_loader_stats(l, &ns.s) == KSP_OK, "%s", last_error());
    CHECK(ns.s.samples == full.samples && ns.s.max_us >= full.max_us && ns.s.max_us > 0,
          "newer layout's fields");
    CHECK(all_bytes(ns.future, sizeof ns.future, 0), "unknown stats fields zeroed");

    /* Too small, unaligned, absurd: refused with nothing written. */
    size_t bad_sizes[] = {0, 8, KSP_STATS_MIN_SIZE - 8, KSP_STATS_MIN_SIZE + 4,
                          KSP_MAX_STRUCT_SIZE + 8, (size_t)0xABABABABABABABABull};
    for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0]; i++) {
        memset(&ns, FILL, sizeof ns);
        ns.s.struct_size = bad_sizes[i];
        CHECK(ksp_loader_stats(l, &ns.s) == KSP_ERR_STRUCT_SIZE, "stats struct_size %zu",
              bad_sizes[i]);
        CHECK(strstr(last_error(), "struct_size") != NULL, "message names the field: %s", msg);
        CHECK(all_bytes((const char *)&ns + sizeof(size_t), sizeof ns - sizeof(size_t), FILL),
              "a refused struct_size %zu is not written", bad_sizes[i]);
    }

    /* --- ksp_catalog_sample --- */
    uint64_t cat_len = 0;
    CHECK(ksp_loader_catalog_len(l, &cat_len) == KSP_OK && cat_len > 2, "%s", last_error());
    uint64_t probe = cat_len - 1;
    ksp_catalog_sample cur = KSP_CATALOG_SAMPLE_INIT;
    CHECK(ksp_loader_catalog_sample(l, probe, &cur) == KSP_OK, "%s", last_error());
    CHECK(cur.struct_size == sizeof cur && cur.len > 0 && cur.reserved == 0, "current layout");

    /* The first layout: filled, and not one byte past it written. */
    struct {
        struct old_catalog_sample c;
        unsigned char after[64];
    } oc;
    memset(&oc, FILL, sizeof oc);
    oc.c.struct_size = sizeof oc.c;
    CHECK(ksp_loader_catalog_sample(l, probe, (ksp_catalog_sample *)&oc.c) == KSP_OK,
          "old catalog_sample layout: %s", last_error());
    CHECK(oc.c.struct_size == sizeof oc.c, "struct_size is the caller's");
    CHECK(oc.c.len == cur.len && oc.c.crc32c == cur.crc32c && oc.c.label == cur.label &&
              oc.c.reserved == 0,
          "old catalog_sample layout's fields");
    CHECK(all_bytes(oc.after, sizeof oc.after, FILL), "nothing written past the old layout");

    /* A newer layout: unknown fields zeroed. */
    struct new_catalog_sample nc;
    memset(&nc, FILL, sizeof nc);
    nc.c.struct_size = sizeof nc;
    CHECK(ksp_loader_catalog_sample(l, probe, &nc.c) == KSP_OK, "%s", last_error());
    CHECK(nc.c.len == cur.len && nc.c.crc32c == cur.crc32c && nc.c.label == cur.label,
          "newer catalog_sample layout's fields");
    CHECK(all_bytes(nc.future, sizeof nc.future, 0), "unknown catalog_sample fields zeroed");

    /* Too small, unaligned, never set: refused with nothing written. */
    size_t bad_cat[] = {0, 8, KSP_CATALOG_SAMPLE_MIN_SIZE - 8, KSP_CATALOG_SAMPLE_MIN_SIZE + 4,
                        KSP_MAX_STRUCT_SIZE + 8, (size_t)0xABABABABABABABABull};
    for (size_t i = 0; i < sizeof bad_cat / sizeof bad_cat[0]; i++) {
        memset(&nc, FILL, sizeof nc);
        nc.c.struct_size = bad_cat[i];
        CHECK(ksp_loader_catalog_sample(l, probe, &nc.c) == KSP_ERR_STRUCT_SIZE,
              "catalog_sample struct_size %zu", bad_cat[i]);
        CHECK(strstr(last_error(), "struct_size") != NULL, "message names the field: %s", msg);
        CHECK(all_bytes((const char *)&nc + sizeof(size_t), sizeof nc - sizeof(size_t), FILL),
              "a refused catalog_sample struct_size %zu is not written", bad_cat[i]);
    }

    ksp_loader_free(l);
    if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
    else printf("sized_structs_test: all checks passed\n");
    return failures ? 1 : 0;
}
