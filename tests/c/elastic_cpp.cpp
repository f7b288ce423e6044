// The C++ wrapper's job positions and audit (tests/capi.rs runs it on a
// preloaded space of 200 samples): 2 ranks take 3 batches of 8, 3 ranks
// resume from the job position (Loader::job_position, and a rank's saved
// position) and finish the epoch; kspeed::audit of the 5 positions says
// every sample once, and throws KSP_ERR_DATA naming a missing rank.
#include <kspeed.hpp>

#include <cstdio>
#include <string>
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

static kspeed::Loader open_rank(const char* space, unsigned rank, unsigned world) {
    kspeed::Config cfg;
    cfg.set("space", space).set("batch_size", 8).set("seed", 3).set("ring_bytes", "1MiB");
    cfg.set("rank", rank).set("world", world).set("pollers", 1).set("pin", "false");
    return kspeed::Loader(cfg);
}

int main(int argc, char** argv) {
    if (argc < 2) {
        std::printf("usage: elastic_cpp SPACE\n");
        return 2;
    }
    try {
        std::vector<std::vector<uint8_t>> positions;
        std::vector<uint8_t> job;
        std::vector<unsigned> seen(200, 0);
        for (unsigned r = 0; r < 2; r++) {
            kspeed::Loader l = open_rank(argv[1], r, 2);
            for (int k = 0; k < 3; k++) {
                auto b = l.next_batch();
                CHECK(b && b->size() == 8, "rank %u batch %d", r, k);
                for (const ksp_sample& s : *b) seen.at(s.id)++;
            }
            job = l.job_position();
            positions.push_back(l.save_position());
        }
        CHECK(job.size() == KSP_JOB_POSITION_BYTES, "job position of %zu bytes", job.size());
        uint64_t n = 0;
        for (unsigned r = 0; r < 3; r++) {
            kspeed::Loader l = open_rank(argv[1], r, 3);
            l.restore_job_position(r == 0 ? job : positions[1]);
            while (auto b = l.next_batch()) {
                for (const ksp_sample& s : *b) {
                    seen.at(s.id)++;
                    n++;
                }
            }
            positions.push_back(l.save_position());
        }
        // 152 left on 3 ranks: 51 each, one padding duplicate.
        CHECK(n == 153, "%llu delivered after the resume", (unsigned long long)n);
        unsigned missing = 0, twice = 0;
        for (unsigned c : seen) {
            missing += c == 0;
            twice += c == 2;
        }
        CHECK(missing == 0 && twice == 1, "missing %u, twice %u", missing, twice);
        std::string report = kspeed::audit(positions);
        CHECK(report == "epoch 0: 200 samples, each exactly once, and 1 padding duplicates\n", "%s",
              report.c_str());
        positions.pop_back();
        try {
            kspeed::audit(positions);
            CHECK(false, "an audit with a rank missing passed");
        } catch (const kspeed::Error& e) {
            CHECK(e.status() == KSP_ERR_DATA && std::string(e.what()).find("2 rank positions for a world of 3") !=
                                                    std::string::npos,
                  "%d: %s", static_cast<int>(e.status()), e.what());
        }
    } catch (const kspeed::Error& e) {
        std::printf("FAIL kspeed::Error %d: %s\n", static_cast<int>(e.status()), e.what());
        failures++;
    }
    if (failures == 0) std::printf("all checks passed\n");
    return failures == 0 ? 0 : 1;
}
