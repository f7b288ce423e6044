// A kspeed::Batch that outlives its kspeed::Loader (tests/capi.rs runs it
// under AddressSanitizer on a preloaded space): the batch shares the C
// loader, which is freed after the last of them, so the batch's samples
// stay readable and byte-exact, and its release and destruction touch no
// freed memory. The old wrapper kept a raw ksp_loader* that the Loader's
// destructor freed: reading the batch's sample array afterwards was a
// heap-use-after-free, and its release a call on a freed loader.
#include <kspeed.hpp>

#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

static int failures = 0;
#define CHECK(cond, ...)                                                \
    do {                                                                \
        if (!(cond)) {                                                  \
            std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            std::printf(__VA_ARGS__);                                   \
            std::printf("\n");                                          \
            failures++;                                                 \
        }                                                               \
    } while (0)

static uint32_t crc32c(const uint8_t* p, size_t n) {
    uint32_t c = ~0u;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    }
    return ~c;
}

struct Expected {
    uint64_t id;
    uint64_t len;
    uint32_t crc32c;
};

// The catalog's record of every sample of `b`, read while the loader lives.
static std::vector<Expected> expected(const kspeed::Loader& l, const kspeed::Batch& b) {
    std::vector<Expected> e;
    for (const ksp_sample& s : b) {
        ksp_catalog_sample c = l.catalog_sample(s.id);
        e.push_back({s.id, c.len, c.crc32c});
    }
    return e;
}

// Samples of `b` that differ from `e` (id, length or bytes).
static int bad_samples(const kspeed::Batch& b, const std::vector<Expected>& e) {
    if (b.size() != e.size()) return static_cast<int>(e.size());
    int bad = 0;
    for (size_t i = 0; i < b.size(); i++) {
        const ksp_sample& s = b[i];
        if (s.id != e[i].id || s.len != e[i].len || crc32c(s.data, s.len) != e[i].crc32c) bad++;
    }
    return bad;
}

static kspeed::Config config(const char* space) {
    kspeed::Config cfg;
    cfg.set("space", space)
        .set("batch_size", 16)
        .set("seed", 11)
        .set("ring_bytes", "192KiB")
        .set("pin", false)
        .set("mlock", false)
        .set("huge_pages", false);
    return cfg;
}

int main(int argc, char** argv) {
    if (argc < 2) {
        std::printf("usage: batch_outlives_loader SPACE\n");
        return 2;
    }
    try {
        // 1. The Loader is destroyed while its current batch lives; the
        // batch is read afterwards, then destroyed.
        {
            std::optional<kspeed::Batch> kept;
            std::vector<Expected> want;
            {
                kspeed::Loader loader(config(argv[1]));
                kept = loader.next_batch();
                CHECK(kept.has_value(), "a first batch");
                if (kept) want = expected(loader, *kept);
            }  // ~Loader: the C loader lives on in `kept`
            if (kept) {
                CHECK(kept->size() == 16, "batch of %zu", kept->size());
                CHECK(bad_samples(*kept, want) == 0, "the kept batch's bytes after ~Loader");
            }
        }  // ~Batch: releases it, and frees the C loader (the last owner)

        // 2. An older batch (released by the next next_batch()) and the
        // current one both outlive the Loader; release() on one, the
        // destructor on the other, in either order.
        {
            std::optional<kspeed::Batch> old_batch, current;
            std::vector<Expected> want;
            {
                kspeed::Loader loader(config(argv[1]));
                old_batch = loader.next_batch();
                current = loader.next_batch();
                CHECK(old_batch && current, "two batches");
                if (current) want = expected(loader, *current);
            }
            if (old_batch) old_batch->release();  // released by next_batch(): no-op
            if (current) {
                CHECK(bad_samples(*current, want) == 0, "the current batch's bytes");
                current->release();  // the last owner: frees the C loader
                current->release();  // a second release does nothing
            }
        }

        // 3. A moved-from Loader and a moved Batch.
        {
            std::optional<kspeed::Batch> kept;
            std::vector<Expected> want;
            {
                kspeed::Loader a(config(argv[1]));
                kspeed::Loader b(std::move(a));
                std::optional<kspeed::Batch> first = b.next_batch();
                CHECK(first.has_value(), "a batch from the moved Loader");
                if (first) want = expected(b, *first);
                kept = std::move(first);
            }
            if (kept) CHECK(bad_samples(*kept, want) == 0, "the moved batch's bytes");
        }
    } catch (const kspeed::Error& e) {
        std::printf("FAIL kspeed::Error %d: %s\n", static_cast<int>(e.status()), e.what());
        failures++;
    }
    if (failures == 0) std::printf("all checks passed\n");
    return failures == 0 ? 0 : 1;
}
