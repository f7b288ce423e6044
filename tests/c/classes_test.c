/* Class names and sample members through the C ABI, run by
 * tests/capi_classes.rs:
 *
 *   classes_test SPACE NAME0 NAME1 ...
 *   classes_test SPACE --members EXT0 EXT1 ...
 *
 * First form: SPACE is a preloaded ImageFolder space whose class folders, in
 * label order, are NAME0, NAME1, ... Second form: SPACE holds tar shards
 * preloaded with --members EXT0,EXT1,...; member EXTj of sample i holds the
 * text "EXTj of i" for every EXTj but the first. Exits non-zero if any check
 * failed. */
#include <kspeed.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (!(cond)) {                                                          \
            failures++;                                                         \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);     \
            fprintf(stderr, __VA_ARGS__);                                       \
            fprintf(stderr, "\n");                                              \
        }                                                                       \
    } while (0)

static char msg[4096];

static const char *last_error(void) {
    size_t n = 0;
    ksp_status st = ksp_last_error(msg, sizeof msg, &n);
    if (st != KSP_OK && st != KSP_ERR_BUFFER_TOO_SMALL) return "(no message)";
    return msg;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: classes_test SPACE NAME...\n");
        return 2;
    }
    ksp_config *cfg = NULL;
    CHECK(ksp_config_new(&cfg) == KSP_OK, "%s", last_error());
    const char *kv[][2] = {
        {"space", argv[1]}, {"batch_size", "2"}, {"ring_bytes", "4MiB"}, {"pollers", "1"},
        {"pin", "false"},   {"mlock", "false"},  {"huge_pages", "false"},
    };
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        CHECK(ksp_config_set(cfg, kv[i][0], kv[i][1]) == KSP_OK, "%s: %s", kv[i][0], last_error());
    ksp_loader *l = NULL;
    CHECK(ksp_loader_new(cfg, &l) == KSP_OK, "%s", last_error());
    ksp_config_free(cfg);
    if (!l) return 1;

    if (argc >= 3 && strcmp(argv[2], "--members") == 0) {
        uint64_t m = 99;
        CHECK(ksp_loader_member_count(l, &m) == KSP_OK, "%s", last_error());
        CHECK(m == (uint64_t)(argc - 3), "member count %llu", (unsigned long long)m);
        for (uint64_t j = 0; j < m; j++) {
            char buf[64];
            size_t n = 0;
            CHECK(ksp_loader_member_name(l, j, buf, sizeof buf, &n) == KSP_OK, "%s", last_error());
            CHECK(strcmp(buf, argv[3 + j]) == 0, "member %llu: %s", (unsigned long long)j, buf);
        }
        uint32_t off = 0, len = 0;
        CHECK(ksp_loader_sample_member(l, 0, m, &off, &len) == KSP_ERR_INVALID_ARG, "index past");
        uint64_t seen = 0;
        CHECK(ksp_loader_set_epoch(l, 0) == KSP_OK, "%s", last_error());
        for (;;) {
            ksp_batch b = KSP_BATCH_INIT;
            ksp_status st = ksp_loader_next_batch(l, &b);
            CHECK(st == KSP_OK, "%s", last_error());
            if (st != KSP_OK || b.count == 0) break; /* count 0: end of the epoch */
            for (size_t i = 0; i < b.count; i++) {
                const ksp_sample *s = &b.samples[i];
                for (uint64_t j = 0; j < m; j++) {
                    CHECK(ksp_loader_sample_member(l, s->id, j, &off, &len) == KSP_OK, "%s",
                          last_error());
                    CHECK((uint64_t)off + len <= s->len, "member inside the sample");
                    if (j == 0) continue;
                    char want[64];
                    int w = snprintf(want, sizeof want, "%s of %llu", argv[3 + j],
                                     (unsigned long long)s->id);
                    CHECK(len == (uint32_t)w && memcmp(s->data + off, want, len) == 0,
                          "sample %llu member %s: %.*s", (unsigned long long)s->id, argv[3 + j],
                          (int)len, (const char *)s->data + off);
                }
                seen++;
            }
            CHECK(ksp_loader_release_batch(l, b.seq) == KSP_OK, "%s", last_error());
        }
        CHECK(seen > 0, "no samples read");
        ksp_loader_free(l);
        if (failures) return 1;
        printf("all checks passed\n");
        return 0;
    }

    uint64_t count = 99;
    CHECK(ksp_loader_class_count(l, &count) == KSP_OK, "%s", last_error());
    CHECK(count == (uint64_t)(argc - 2), "count %llu, expected %d", (unsigned long long)count,
          argc - 2);
    CHECK(ksp_loader_class_count(l, NULL) == KSP_ERR_NULL_ARG, "NULL out");

    for (uint64_t i = 0; i < count && i < (uint64_t)(argc - 2); i++) {
        const char *want = argv[2 + i];
        char buf[256];
        size_t n = 0;
        CHECK(ksp_loader_class_name(l, i, buf, sizeof buf, &n) == KSP_OK, "%s", last_error());
        CHECK(n == strlen(want) && memcmp(buf, want, n) == 0 && buf[n] == 0,
              "class %llu: got %.*s, expected %s", (unsigned long long)i, (int)n, buf, want);
        /* Too small: nothing written, the length needed reported. */
        char small[2] = {'x', 'x'};
        size_t need = 0;
        CHECK(ksp_loader_class_name(l, i, small, sizeof small, &need) == KSP_ERR_BUFFER_TOO_SMALL,
              "small buffer");
        CHECK(need == strlen(want) && small[0] == 'x', "need %zu", need);
    }
    char buf[16];
    size_t n = 0;
    CHECK(ksp_loader_class_name(l, count, buf, sizeof buf, &n) == KSP_ERR_INVALID_ARG,
          "label past the classes");
    CHECK(strstr(last_error(), "not below") != NULL, "%s", last_error());
    CHECK(ksp_loader_class_name(l, 0, NULL, 4, &n) == KSP_ERR_NULL_ARG, "NULL buf");

    ksp_loader_free(l);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
