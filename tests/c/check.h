/* What the C tests share: CHECK (count and print a failed check, go on),
 * the calling thread's last kspeed error message, and CRC32C (the
 * catalog's checksum) to check a sample's bytes. Each test defines
 * nothing of these itself; it reports `failures` at its end. C and C++
 * alike (the functions are inline: a test need not use them all). */
#ifndef KSPEED_TEST_CHECK_H
#define KSPEED_TEST_CHECK_H

#include <kspeed.h>

#include <stdint.h>
#include <stdio.h>

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

static inline const char *last_error(void) {
    size_t n = 0;
    ksp_status st = ksp_last_error(msg, sizeof msg, &n);
    if (st != KSP_OK && st != KSP_ERR_BUFFER_TOO_SMALL) return "(no message)";
    return msg;
}

static inline uint32_t crc32c(const uint8_t *p, size_t n) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
    }
    return ~c;
}

#endif
