// The C++ wrapper's batch lifetimes (tests/capi.rs runs it on a preloaded
// space): a Batch releases only its own batch, so the two patterns below
// deliver every sample byte-exact. Both used to corrupt data: the first
// released the batch just assigned, the second freed the newer batch.
#include <kspeed.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>

static int failures = 0;
#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond)) {                                                \
            std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            std::printf(__VA_ARGS__);                                 \
            std::printf("\n");                                        \
            failures++;                                               \
        }                                                             \
    } while (0)

static uint32_t crc32c(const uint8_t* p, size_t n) {
    uint32_t c = ~0u;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    }
    return ~c;
}

// Bad samples in `b` (length or CRC32C differs from the catalog).
static int bad_samples(const kspeed::Loader& l, const kspeed::Batch& b) {
    int bad = 0;
    for (const ksp_sample& s : b) {
        ksp_catalog_sample c = l.catalog_sample(s.id);
        if (s.len != c.len || crc32c(s.data, s.len) != c.crc32c) bad++;
    }
    return bad;
}

int main(int argc, char** argv) {
    if (argc < 2) {
        std::printf("usage: batch_lifetime SPACE\n");
        return 2;
    }
    try {
        kspeed::Config cfg;
        // The smallest ring that holds a batch: the pollers refill every
        // released byte at once, so a wrong release shows as wrong bytes.
        cfg.set("space", argv[1]).set("batch_size", 16).set("seed", 7).set("ring_bytes", "192KiB");
        kspeed::Loader loader(cfg);
        const uint64_t per_epoch = loader.epoch_len();

        // Pattern 1: a loop assigning into one optional.
        for (uint64_t epoch = 0; epoch < 2; epoch++) {
            loader.set_epoch(epoch);
            std::optional<kspeed::Batch> b;
            uint64_t n = 0, bad = 0, batches = 0, last_seq = 0;
            while ((b = loader.next_batch())) {
                CHECK(b->seq() > last_seq, "batch identities grow");
                last_seq = b->seq();
                bad += bad_samples(loader, *b);
                n += b->size();
                batches++;
            }
            CHECK(n == per_epoch, "epoch %llu: %llu of %llu samples", (unsigned long long)epoch,
                  (unsigned long long)n, (unsigned long long)per_epoch);
            CHECK(batches == loader.batches_per_epoch(), "batches %llu", (unsigned long long)batches);
            CHECK(bad == 0, "epoch %llu: %llu samples with wrong bytes", (unsigned long long)epoch,
                  (unsigned long long)bad);
        }

        // Pattern 2: an old Batch object outlives the next next_batch();
        // dropping it must not free the newer batch.
        loader.set_epoch(2);
        uint64_t n = 0, bad = 0;
        for (;;) {
            std::optional<kspeed::Batch> a = loader.next_batch();
            if (!a) break;
            n += a->size();
            std::optional<kspeed::Batch> b = loader.next_batch();
            a.reset();  // a was released by next_batch(): this does nothing
            if (!b) break;
            // Give the pollers every chance to overwrite b if a.reset()
            // had released it: look at its bytes for a while.
            auto t0 = std::chrono::steady_clock::now();
            int b_bad = 0;
            do {
                b_bad = bad_samples(loader, *b);
            } while (b_bad == 0 &&
                     std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(20));
            bad += b_bad;
            n += b->size();
        }
        CHECK(n == per_epoch, "pattern 2: %llu of %llu samples", (unsigned long long)n,
              (unsigned long long)per_epoch);
        CHECK(bad == 0, "pattern 2: %llu samples with wrong bytes", (unsigned long long)bad);
    } catch (const kspeed::Error& e) {
        std::printf("FAIL kspeed::Error %d: %s\n", static_cast<int>(e.status()), e.what());
        failures++;
    }
    if (failures == 0) std::printf("all checks passed\n");
    return failures == 0 ? 0 : 1;
}
