/* Exercises every function of the kspeed C ABI, its error paths included.
 * Run by tests/capi.rs (plainly, under AddressSanitizer, under valgrind):
 *
 *   capi_test SPACE SOURCE WORKDIR
 *
 * SPACE is a preloaded space, SOURCE its source directory, WORKDIR a
 * scratch directory. Prints one line per failed check and exits non-zero if
 * any failed. */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <kspeed.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

static ksp_config *config(const char *space, const char *ring) {
    ksp_config *cfg = NULL;
    CHECK(ksp_config_new(&cfg) == KSP_OK, "%s", last_error());
    const char *kv[][2] = {
        {"space", space}, {"batch_size", "16"}, {"seed", "5"}, {"ring_bytes", ring},
        {"pollers", "1"}, {"submit_batch", "4"}, {"pin", "false"}, {"mlock", "false"}, {"huge_pages", "false"},
    };
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        CHECK(ksp_config_set(cfg, kv[i][0], kv[i][1]) == KSP_OK, "%s=%s: %s", kv[i][0], kv[i][1],
              last_error());
    return cfg;
}

/* Reads one epoch; checks every sample against the catalog; returns the
 * samples read and stores their ids in ids (if not NULL). */
static uint64_t spanless_batches = 0; /* batches with tier views (span NULL) */
static uint64_t read_epoch(ksp_loader *l, uint64_t epoch, uint64_t *ids, uint64_t max_ids) {
    uint64_t n = 0;
    CHECK(ksp_loader_set_epoch(l, epoch) == KSP_OK, "%s", last_error());
    for (;;) {
        ksp_batch b = KSP_BATCH_INIT;
        ksp_status st = ksp_loader_next_batch(l, &b);
        CHECK(st == KSP_OK, "next_batch: %s", last_error());
        if (st != KSP_OK || b.count == 0) break;
        CHECK(b.count <= 16, "batch of %zu", b.count);
        CHECK(b.epoch == epoch, "batch epoch %llu", (unsigned long long)b.epoch);
        /* With tier_views, a batch holding memory-tier samples has no span. */
        const int spanless = b.span == NULL;
        if (spanless) {
            spanless_batches++;
            CHECK(b.span_len == 0 && b.wrap == NULL && b.wrap_len == 0, "no span, no wrap");
        } else {
            CHECK(b.span == b.samples[0].data, "span starts at the first sample");
        }
        for (size_t i = 0; i < b.count; i++) {
            const ksp_sample *s = &b.samples[i];
            ksp_catalog_sample c = KSP_CATALOG_SAMPLE_INIT;
            CHECK(ksp_loader_catalog_sample(l, s->id, &c) == KSP_OK, "%s", last_error());
            CHECK(s->len == c.len, "sample %llu length", (unsigned long long)s->id);
            CHECK(crc32c(s->data, s->len) == c.crc32c, "sample %llu bytes",
                  (unsigned long long)s->id);
            CHECK(s->label == c.label, "sample %llu label", (unsigned long long)s->id);
            int in_span = s->data >= b.span && s->data + s->len <= b.span + b.span_len;
            int in_wrap = b.wrap && s->data >= b.wrap && s->data + s->len <= b.wrap + b.wrap_len;
            CHECK(spanless || in_span || in_wrap, "sample %llu outside the batch's spans",
                  (unsigned long long)s->id);
            if (ids && n < max_ids) ids[n] = s->id;
            n++;
        }
        CHECK(b.seq > 0, "a batch has an identity");
        CHECK(ksp_loader_release_batch(l, b.seq) == KSP_OK, "%s", last_error());
        /* Releasing it again does nothing. */
        CHECK(ksp_loader_release_batch(l, b.seq) == KSP_OK, "%s", last_error());
    }
    return n;
}

static int log_calls = 0;
static void on_log(void *ud, int level, const char *target, const char *message) {
    (void)target;
    CHECK(ud == (void *)&log_calls, "userdata passed through");
    CHECK(level >= 1 && level <= 5, "level %d", level);
    CHECK(message && message[0], "empty message");
    log_calls++;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: capi_test SPACE SOURCE WORKDIR\n");
        return 2;
    }
    const char *space = argv[1], *source = argv[2], *work = argv[3];
    char path[4096];

    /* Version. */
    CHECK(ksp_abi_version() == KSP_ABI_VERSION, "abi %u", ksp_abi_version());
    CHECK(strlen(ksp_version()) > 0, "version string");

    /* ksp_last_error: NULL arguments, truncation. */
    size_t n = 0;
    CHECK(ksp_last_error(NULL, 10, &n) == KSP_ERR_NULL_ARG, "null buf");
    CHECK(ksp_last_error(msg, 10, NULL) == KSP_ERR_NULL_ARG, "null out_len");

    /* Log callback: bad level, then on at info. */
    CHECK(ksp_set_log_callback(on_log, &log_calls, 9) == KSP_ERR_INVALID_ARG, "level 9");
    CHECK(ksp_set_log_callback(on_log, &log_calls, 3) == KSP_OK, "%s", last_error());

    /* Config errors. */
    CHECK(ksp_config_new(NULL) == KSP_ERR_NULL_ARG, "config_new(NULL)");
    ksp_config *cfg = NULL;
    CHECK(ksp_config_new(&cfg) == KSP_OK, "%s", last_error());
    CHECK(ksp_config_set(cfg, "no_such_key", "1") == KSP_ERR_INVALID_ARG, "unknown key");
    CHECK(strstr(last_error(), "no_such_key") != NULL, "message names the key: %s", msg);
    char small[8];
    CHECK(ksp_last_error(small, sizeof small, &n) == KSP_ERR_BUFFER_TOO_SMALL, "truncated");
    CHECK(n > sizeof small && strlen(small) == sizeof small - 1, "length %zu", n);
    CHECK(ksp_config_set(cfg, "batch_size", "lots") == KSP_ERR_INVALID_ARG, "bad number");
    CHECK(ksp_config_set(cfg, "shuffle", "maybe") == KSP_ERR_INVALID_ARG, "bad bool");
    CHECK(ksp_config_set(cfg, "ring_bytes", "12 parsecs") == KSP_ERR_INVALID_ARG, "bad size");
    CHECK(ksp_config_set(cfg, "rdma_gid_index", "first") == KSP_ERR_INVALID_ARG, "bad GID index");
    CHECK(ksp_config_set(cfg, "rdma_port", "1") == KSP_OK, "%s", last_error());
    CHECK(ksp_config_set(cfg, "rdma_gid_index", "auto") == KSP_OK, "%s", last_error());
    CHECK(ksp_config_set(cfg, "rdma", "false") == KSP_OK, "%s", last_error());
    CHECK(ksp_config_set(NULL, "seed", "1") == KSP_ERR_NULL_ARG, "null cfg");
    CHECK(ksp_config_set(cfg, NULL, "1") == KSP_ERR_NULL_ARG, "null key");
    CHECK(ksp_config_set(cfg, "seed", NULL) == KSP_ERR_NULL_ARG, "null value");

    /* Loader errors: no input, missing space, NULLs. */
    ksp_loader *l = NULL;
    CHECK(ksp_loader_new(cfg, &l) == KSP_ERR_INVALID_ARG, "no space or source");
    CHECK(l == NULL, "out untouched on failure");
    CHECK(ksp_config_set(cfg, "space", "/nonexistent/kspeed/space") == KSP_OK, "%s", last_error());
    ksp_status st = ksp_loader_new(cfg, &l);
    CHECK(st != KSP_OK && l == NULL, "missing space: %d", (int)st);
    CHECK(strstr(last_error(), "/nonexistent/kspeed/space") != NULL, "names the path: %s", msg);
    CHECK(ksp_loader_new(NULL, &l) == KSP_ERR_NULL_ARG, "null cfg");
    CHECK(ksp_loader_new(cfg, NULL) == KSP_ERR_NULL_ARG, "null out");
    ksp_config_free(cfg);
    ksp_config_free(NULL);

    /* A sample larger than the ring is an error at open. */
    cfg = config(space, "4KiB");
    CHECK(ksp_loader_new(cfg, &l) == KSP_ERR_INVALID_ARG, "ring too small: %s", last_error());
    ksp_config_free(cfg);

    /* A ring in GPU memory needs cluster mode over RDMA: refused, named. */
    cfg = config(space, "4MiB");
    CHECK(ksp_config_set(cfg, "gpu_ring", "0") == KSP_OK, "%s", last_error());
    CHECK(ksp_config_set(cfg, "gpu_ring", "first") == KSP_ERR_INVALID_ARG, "bad ordinal");
    CHECK(ksp_loader_new(cfg, &l) == KSP_ERR_INVALID_ARG && l == NULL, "gpu ring without rdma");
    CHECK(strstr(last_error(), "GPU memory (device 0) needs cluster mode over RDMA") != NULL,
          "names why: %s", last_error());
    ksp_config_free(cfg);

    /* Local rank: half of the pair is refused at open, named; a bad
     * number at set. */
    cfg = config(space, "2MiB");
    CHECK(ksp_config_set(cfg, "local_rank", "first") == KSP_ERR_INVALID_ARG, "bad local rank");
    CHECK(ksp_config_set(cfg, "local_rank", "1") == KSP_OK, "%s", last_error());
    CHECK(ksp_loader_new(cfg, &l) == KSP_ERR_INVALID_ARG && l == NULL, "local rank alone");
    CHECK(strstr(last_error(), "local_rank given without local_world_size") != NULL, "names why: %s",
          last_error());
    CHECK(ksp_config_set(cfg, "local_world_size", "1") == KSP_OK, "%s", last_error());
    CHECK(ksp_loader_new(cfg, &l) == KSP_ERR_INVALID_ARG && l == NULL, "rank 1 of 1");
    CHECK(strstr(last_error(), "local rank 1 is not below local world size 1") != NULL, "names why: %s",
          last_error());
    CHECK(ksp_config_set(cfg, "local_world_size", "2") == KSP_OK, "%s", last_error());
    CHECK(ksp_config_set(cfg, "poller_numa_node", "0") == KSP_OK, "%s", last_error());
    CHECK(ksp_loader_new(cfg, &l) == KSP_OK, "rank 1 of 2: %s", last_error());
    ksp_loader_free(l);
    l = NULL;
    ksp_config_free(cfg);

    /* The real thing: two epochs, byte-exact. */
    cfg = config(space, "2MiB");
    int calls_before = log_calls;
    CHECK(ksp_loader_new(cfg, &l) == KSP_OK, "%s", last_error());
    ksp_config_free(cfg); /* the loader does not need it any more */
    CHECK(log_calls > calls_before, "kspeed logged through the callback");
    /* Reading starts at the first batch, or at ksp_loader_start_reading:
     * then the ring fills with nobody consuming (60 s deadline). */
    ksp_stats st0 = KSP_STATS_INIT;
    CHECK(ksp_loader_stats(l, &st0) == KSP_OK && st0.disk_reads == 0, "read before the first batch: %llu",
          (unsigned long long)st0.disk_reads);
    CHECK(ksp_loader_start_reading(NULL) == KSP_ERR_NULL_ARG, "null loader");
    CHECK(ksp_loader_start_reading(l) == KSP_OK, "%s", last_error());
    for (time_t until = time(NULL) + 60;;) {
        CHECK(ksp_loader_stats(l, &st0) == KSP_OK, "%s", last_error());
        if (st0.read_ahead > 0) break;
        if (time(NULL) >= until) {
            CHECK(0, "no read ahead within 60 s of ksp_loader_start_reading");
            break;
        }
        struct timespec pause = {0, 1000000};
        nanosleep(&pause, NULL);
    }
    CHECK(st0.samples == 0, "samples %llu", (unsigned long long)st0.samples);
    uint64_t per_epoch = 0, total = 0;
    CHECK(ksp_loader_epoch_len(l, &per_epoch) == KSP_OK && per_epoch > 0, "%s", last_error());
    CHECK(ksp_loader_catalog_len(l, &total) == KSP_OK && total == per_epoch, "%s", last_error());
    ksp_catalog_sample cs = KSP_CATALOG_SAMPLE_INIT;
    CHECK(ksp_loader_catalog_sample(l, total, &cs) == KSP_ERR_INVALID_ARG, "id past the catalog");
    for (uint64_t e = 0; e < 2; e++) {
        uint64_t got = read_epoch(l, e, NULL, 0);
        CHECK(got == per_epoch, "epoch %llu: %llu of %llu", (unsigned long long)e,
              (unsigned long long)got, (unsigned long long)per_epoch);
    }
    ksp_stats stats = KSP_STATS_INIT;
    CHECK(ksp_loader_stats(l, &stats) == KSP_OK, "%s", last_error());
    CHECK(stats.samples == 2 * per_epoch, "stats.samples %llu", (unsigned long long)stats.samples);

    /* Save mid-epoch, read on, restore, read the same again. */
    CHECK(ksp_loader_set_epoch(l, 2) == KSP_OK, "%s", last_error());
    ksp_batch b = KSP_BATCH_INIT;
    CHECK(ksp_loader_next_batch(l, &b) == KSP_OK && b.count > 0, "%s", last_error());
    CHECK(ksp_loader_release_batch(l, b.seq + 1) == KSP_ERR_INVALID_ARG,
          "a batch never handed out: %s", last_error());
    CHECK(ksp_loader_release_batch(l, b.seq) == KSP_OK, "%s", last_error());
    uint64_t bpe = 0;
    CHECK(ksp_loader_batches_per_epoch(l, &bpe) == KSP_OK && bpe == (per_epoch + 15) / 16,
          "batches per epoch %llu", (unsigned long long)bpe);
    uint64_t pe = 9, pi = 0;
    CHECK(ksp_loader_position(l, &pe, &pi) == KSP_OK && pe == 2 && pi == b.count, "position %llu/%llu",
          (unsigned long long)pe, (unsigned long long)pi);
    CHECK(ksp_loader_position(l, NULL, &pi) == KSP_ERR_NULL_ARG, "null epoch");
    uint8_t pos[KSP_POSITION_BYTES];
    uint8_t tiny[4];
    CHECK(ksp_loader_save_position(l, tiny, sizeof tiny, &n) == KSP_ERR_BUFFER_TOO_SMALL &&
              n == KSP_POSITION_BYTES, "small buffer, needed %zu", n);
    CHECK(ksp_loader_save_position(l, pos, sizeof pos, &n) == KSP_OK && n == KSP_POSITION_BYTES,
          "%s", last_error());
    uint64_t *first = calloc(per_epoch, sizeof *first), *again = calloc(per_epoch, sizeof *again);
    uint64_t rest = 0;
    for (;;) {
        CHECK(ksp_loader_next_batch(l, &b) == KSP_OK, "%s", last_error());
        if (b.count == 0) break;
        for (size_t i = 0; i < b.count && rest < per_epoch; i++) first[rest++] = b.samples[i].id;
    }
    CHECK(ksp_loader_restore_position(l, pos, sizeof pos) == KSP_OK, "%s", last_error());
    uint64_t k = 0;
    for (;;) {
        CHECK(ksp_loader_next_batch(l, &b) == KSP_OK, "%s", last_error());
        if (b.count == 0) break;
        for (size_t i = 0; i < b.count && k < per_epoch; i++) again[k++] = b.samples[i].id;
    }
    CHECK(k == rest && memcmp(first, again, rest * sizeof *first) == 0, "resumed %llu vs %llu",
          (unsigned long long)k, (unsigned long long)rest);
    free(first);
    free(again);
    uint8_t junk[KSP_POSITION_BYTES] = {1, 2, 3};
    CHECK(ksp_loader_restore_position(l, junk, sizeof junk) == KSP_ERR_INVALID_ARG, "junk position");
    CHECK(ksp_loader_restore_position(l, NULL, 0) == KSP_ERR_NULL_ARG, "null position");
    CHECK(ksp_loader_next_batch(l, NULL) == KSP_ERR_NULL_ARG, "null batch");
    CHECK(ksp_loader_next_batch(NULL, &b) == KSP_ERR_NULL_ARG, "null loader");
    CHECK(ksp_loader_release_batch(NULL, 1) == KSP_ERR_NULL_ARG, "null loader");
    CHECK(ksp_loader_stats(l, NULL) == KSP_ERR_NULL_ARG, "null stats");
    CHECK(ksp_loader_epoch_len(NULL, &per_epoch) == KSP_ERR_NULL_ARG, "null loader");
    ksp_loader_free(l);
    ksp_loader_free(NULL);

    /* Memory-tier views: epoch 0 fills a tier holding the whole set, later
     * epochs hand samples out of it in place: byte-exact, and those
     * batches have no span (tier_views). Without tier_views every batch
     * has one (checked in read_epoch above). */
    CHECK(spanless_batches == 0, "a span for every batch without tier_views");
    cfg = config(space, "2MiB");
    CHECK(ksp_config_set(cfg, "tier_bytes", "64MiB") == KSP_OK, "%s", last_error());
    CHECK(ksp_config_set(cfg, "tier_views", "sometimes") == KSP_ERR_INVALID_ARG, "bad bool");
    CHECK(strstr(last_error(), "tier_views") != NULL, "names the key: %s", msg);
    CHECK(ksp_config_set(cfg, "tier_views", "true") == KSP_OK, "%s", last_error());
    CHECK(ksp_loader_new(cfg, &l) == KSP_OK, "%s", last_error());
    ksp_config_free(cfg);
    for (uint64_t e = 0; e < 3; e++) {
        uint64_t got = read_epoch(l, e, NULL, 0);
        CHECK(got == per_epoch, "tier views, epoch %llu: %llu of %llu", (unsigned long long)e,
              (unsigned long long)got, (unsigned long long)per_epoch);
    }
    CHECK(spanless_batches > 0, "later epochs are served from the tier in place");
    ksp_loader_free(l);

    /* end_epoch: two epochs read, nothing read ahead past them, and the
     * epoch after the last is refused. */
    cfg = config(space, "2MiB");
    CHECK(ksp_config_set(cfg, "end_epoch", "two") == KSP_ERR_INVALID_ARG, "bad end_epoch");
    CHECK(strstr(last_error(), "end_epoch") != NULL, "names the key: %s", msg);
    CHECK(ksp_config_set(cfg, "end_epoch", "2") == KSP_OK, "%s", last_error());
    CHECK(ksp_loader_new(cfg, &l) == KSP_OK, "%s", last_error());
    ksp_config_free(cfg);
    for (uint64_t e = 0; e < 2; e++) {
        uint64_t got = read_epoch(l, e, NULL, 0);
        CHECK(got == per_epoch, "end_epoch, epoch %llu: %llu of %llu", (unsigned long long)e,
              (unsigned long long)got, (unsigned long long)per_epoch);
    }
    ksp_stats es = KSP_STATS_INIT;
    CHECK(ksp_loader_stats(l, &es) == KSP_OK, "%s", last_error());
    CHECK(es.disk_reads == 2 * per_epoch && es.read_ahead + es.read_ahead_discarded == 0,
          "end_epoch: %llu disk reads for %llu samples, %llu read ahead",
          (unsigned long long)es.disk_reads, (unsigned long long)(2 * per_epoch),
          (unsigned long long)(es.read_ahead + es.read_ahead_discarded));
    CHECK(ksp_loader_set_epoch(l, 2) == KSP_ERR_INVALID_ARG, "set_epoch past end_epoch");
    CHECK(strstr(last_error(), "last epoch 1") != NULL, "names the last epoch: %s", msg);
    ksp_loader_free(l);

    /* The panic boundary (ksp_test_panic exists in a library built with
     * the test-panic feature; tests/capi.rs defines KSP_TEST_PANIC then). */
#ifdef KSP_TEST_PANIC
    CHECK(ksp_test_panic() == KSP_ERR_PANIC, "panic status");
    CHECK(strstr(last_error(), "panicked") != NULL, "panic message: %s", msg);
    printf("capi_test: panic boundary checked\n");
#endif

    /* Preload and verify. */
    snprintf(path, sizeof path, "%s/c-space", work);
    CHECK(ksp_preload(source, path, NULL, 1, 0, 1) == KSP_OK, "preload: %s", last_error());
    CHECK(ksp_preload(source, path, NULL, 1, 0, 1) == KSP_OK, "preload again: %s", last_error());
    uint64_t checked = 0, bad = 1;
    CHECK(ksp_verify(path, &checked, &bad) == KSP_OK, "verify: %s", last_error());
    CHECK(checked == total && bad == 0, "checked %llu bad %llu", (unsigned long long)checked,
          (unsigned long long)bad);
    CHECK(ksp_preload(source, NULL, NULL, 1, 0, 1) == KSP_ERR_NULL_ARG, "null space");
    CHECK(ksp_preload(source, path, NULL, 2, 5, 1) == KSP_ERR_INVALID_ARG, "node 5 of 2: %s",
          last_error());
    CHECK(ksp_verify("/nonexistent/kspeed", &checked, &bad) != KSP_OK, "verify missing");

    /* A node service in this process, and a loader reading through it.
     * Skipped under valgrind (CAPI_TEST_NO_SERVICE=1): valgrind keeps its
     * global lock while a thread blocks in io_uring_enter, so the service's
     * and the consumer's threads take turns 50 ms at a time. */
    if (getenv("CAPI_TEST_NO_SERVICE")) goto done;
    ksp_node_service *svc = NULL;
    CHECK(ksp_node_service_start(space, "127.0.0.1:0", "c-token", &svc) == KSP_OK, "%s",
          last_error());
    uint16_t port = 0;
    CHECK(ksp_node_service_port(svc, &port) == KSP_OK && port > 0, "%s", last_error());
    CHECK(ksp_node_service_start(space, "not an address", "t", &svc) != KSP_OK, "bad listen");
    snprintf(path, sizeof path, "%s/cluster.txt", work);
    FILE *f = fopen(path, "w");
    fprintf(f, "0 127.0.0.1:%u\n", port);
    fclose(f);
    cfg = config(space, "2MiB");
    CHECK(ksp_config_set(cfg, "space", "") == KSP_OK, "clear space");
    char catalog[4096];
    snprintf(catalog, sizeof catalog, "%s/catalog.ksc", space);
    ksp_config_free(cfg);
    CHECK(ksp_config_new(&cfg) == KSP_OK, "%s", last_error());
    const char *kv[][2] = {{"source", source}, {"catalog", catalog}, {"cluster_file", path},
                           {"token", "c-token"}, {"batch_size", "16"}, {"ring_bytes", "2MiB"},
                           {"pollers", "1"}, {"pin", "false"}, {"mlock", "false"}};
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        CHECK(ksp_config_set(cfg, kv[i][0], kv[i][1]) == KSP_OK, "%s", last_error());
    CHECK(ksp_loader_new(cfg, &l) == KSP_OK, "cluster loader: %s", last_error());
    if (l) {
        CHECK(read_epoch(l, 0, NULL, 0) == per_epoch, "epoch through the service");
        CHECK(ksp_loader_stats(l, &stats) == KSP_OK && stats.remote_samples >= per_epoch,
              "remote %llu", (unsigned long long)stats.remote_samples);
        ksp_loader_free(l);
    }
    /* A wrong token is refused with a network error. */
    CHECK(ksp_config_set(cfg, "token", "wrong") == KSP_OK, "%s", last_error());
    l = NULL;
    CHECK(ksp_loader_new(cfg, &l) == KSP_ERR_NETWORK && l == NULL, "wrong token");
    CHECK(strstr(last_error(), "token") != NULL, "message: %s", msg);
    ksp_config_free(cfg);
    ksp_node_service_stop(svc);
    ksp_node_service_stop(NULL);
    CHECK(ksp_node_service_port(NULL, &port) == KSP_ERR_NULL_ARG, "null service");
done:

    CHECK(ksp_set_log_callback(NULL, NULL, 0) == KSP_OK, "%s", last_error());
    if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
    else printf("capi_test: all checks passed\n");
    return failures ? 1 : 0;
}
