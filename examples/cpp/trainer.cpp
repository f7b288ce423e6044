// A trainer-shaped loop over kspeed's C++ wrapper: reads epochs from a
// preloaded space, checks every sample's CRC32C against the catalog, and
// prints throughput. Exit status 0 when every sample matched.
//
//   trainer SPACE [EPOCHS] [BATCH] [RANK WORLD]
//
// Build: see examples/cpp/CMakeLists.txt (find_package(kspeed)) or
//   g++ -std=c++17 trainer.cpp $(pkg-config --cflags --libs kspeed)
#include <kspeed.hpp>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

// CRC32C (Castagnoli), table-driven.
struct Crc32c {
    std::array<uint32_t, 256> table{};
    Crc32c() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
            table[i] = c;
        }
    }
    uint32_t operator()(const uint8_t* p, size_t n) const {
        uint32_t c = 0xffffffffu;
        for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
        return ~c;
    }
};

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: trainer SPACE [EPOCHS] [BATCH] [RANK WORLD]\n");
        return 2;
    }
    const std::string space = argv[1];
    const uint64_t epochs = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 2;
    const int batch = argc > 3 ? std::atoi(argv[3]) : 64;
    const int rank = argc > 5 ? std::atoi(argv[4]) : 0;
    const int world = argc > 5 ? std::atoi(argv[5]) : 1;
    try {
        kspeed::Config cfg;
        cfg.set("space", space)
            .set("batch_size", batch)
            .set("seed", 42)
            .set("rank", rank)
            .set("world", world)
            .set("ring_bytes", "64MiB")
            .set("mlock", false);
        kspeed::Loader loader(cfg);
        const Crc32c crc;
        uint64_t samples = 0, bytes = 0, bad = 0;
        const auto t0 = std::chrono::steady_clock::now();
        for (uint64_t epoch = 0; epoch < epochs; ++epoch) {
            loader.set_epoch(epoch);
            uint64_t in_epoch = 0;
            while (auto b = loader.next_batch()) {
                for (const ksp_sample& s : *b) {
                    const ksp_catalog_sample c = loader.catalog_sample(s.id);
                    if (s.len != c.len || crc(s.data, s.len) != c.crc32c || s.label != c.label) {
                        std::fprintf(stderr, "sample %llu differs from the catalog\n",
                                     static_cast<unsigned long long>(s.id));
                        ++bad;
                    }
                    bytes += s.len;
                    ++samples;
                    ++in_epoch;
                }
            }
            if (in_epoch != loader.epoch_len()) {
                std::fprintf(stderr, "epoch %llu: %llu samples, expected %llu\n",
                             static_cast<unsigned long long>(epoch),
                             static_cast<unsigned long long>(in_epoch),
                             static_cast<unsigned long long>(loader.epoch_len()));
                ++bad;
            }
        }
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const ksp_stats st = loader.stats();
        std::printf("kspeed %s: %llu samples, %.1f MB in %.2f s: %.0f samples/s, %.3f GB/s, "
                    "stall %.1f%%, %llu bad\n",
                    kspeed::version().c_str(), static_cast<unsigned long long>(samples),
                    bytes / 1e6, secs, samples / secs, bytes / secs / 1e9,
                    100.0 * st.stall_s / (secs > 0 ? secs : 1),
                    static_cast<unsigned long long>(bad));
        return bad == 0 ? 0 : 1;
    } catch (const kspeed::Error& e) {
        std::fprintf(stderr, "kspeed error (status %d): %s\n", static_cast<int>(e.status()),
                     e.what());
        return 1;
    }
}
