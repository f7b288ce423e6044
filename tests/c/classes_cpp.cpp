// Class names and sample members through the C++ wrapper (ffi/cpp/kspeed.hpp),
// run by tests/capi_classes.rs with the spaces classes_test.c reads:
//
//   classes_cpp SPACE NAME0 NAME1 ...
//   classes_cpp SPACE --members EXT0 EXT1 ...
//
// First form: SPACE is a preloaded ImageFolder space whose class folders, in
// label order, are NAME0, NAME1, ... Second form: SPACE holds tar shards
// preloaded with --members EXT0,EXT1,...; member EXTj of sample i holds the
// text "EXTj of i" for every EXTj but the first. Exits non-zero if any check
// failed.
#include <kspeed.hpp>

#include <cstdio>
#include <cstring>
#include <string>

#include "check.h"

namespace {

kspeed::Loader open(const char* space) {
    kspeed::Config cfg;
    cfg.set("space", space)
        .set("batch_size", 2)
        .set("ring_bytes", "4MiB")
        .set("pollers", 1)
        .set("pin", false)
        .set("mlock", false)
        .set("huge_pages", false);
    return kspeed::Loader(cfg);
}

// The status `f` throws with, KSP_OK if it returns.
template <class F>
ksp_status status_of(F f) {
    try {
        f();
    } catch (const kspeed::Error& e) {
        return e.status();
    }
    return KSP_OK;
}

void members(kspeed::Loader& l, int argc, char** argv) {
    const uint64_t m = l.member_count();
    CHECK(m == uint64_t(argc - 3), "member count %llu", (unsigned long long)m);
    for (uint64_t j = 0; j < m && j < uint64_t(argc - 3); j++)
        CHECK(l.member_name(j) == argv[3 + j], "member %llu: %s", (unsigned long long)j,
              l.member_name(j).c_str());
    CHECK(status_of([&] { l.member_name(m); }) == KSP_ERR_INVALID_ARG, "name past the members");
    uint64_t seen = 0;
    l.set_epoch(0);
    while (auto b = l.next_batch()) {
        for (const ksp_sample& s : *b) {
            CHECK(status_of([&] { l.member(s, m); }) == KSP_ERR_INVALID_ARG, "index past");
            for (uint64_t j = 0; j < m; j++) {
                auto [data, len] = l.member(s, j);
                CHECK(data >= s.data && data + len <= s.data + s.len, "member inside the sample");
                if (j == 0) continue;
                std::string want = std::string(argv[3 + j]) + " of " + std::to_string(s.id);
                CHECK(len == want.size() && std::memcmp(data, want.data(), len) == 0,
                      "sample %llu member %s: %.*s", (unsigned long long)s.id, argv[3 + j],
                      int(len), reinterpret_cast<const char*>(data));
            }
            seen++;
        }
    }
    CHECK(seen == l.epoch_len(), "read %llu of %llu samples", (unsigned long long)seen,
          (unsigned long long)l.epoch_len());
}

void classes(kspeed::Loader& l, int argc, char** argv) {
    const uint64_t n = l.class_count();
    CHECK(n == uint64_t(argc - 2), "class count %llu, expected %d", (unsigned long long)n,
          argc - 2);
    for (uint64_t i = 0; i < n && i < uint64_t(argc - 2); i++) {
        // A name longer than the wrapper's first guess is fetched whole.
        CHECK(l.class_name(i) == argv[2 + i], "class %llu: %s, expected %s",
              (unsigned long long)i, l.class_name(i).c_str(), argv[2 + i]);
    }
    CHECK(status_of([&] { l.class_name(n); }) == KSP_ERR_INVALID_ARG, "label past the classes");
    CHECK(l.member_count() == 0, "an ImageFolder sample is one file");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: classes_cpp SPACE NAME... | SPACE --members EXT...\n");
        return 2;
    }
    try {
        kspeed::Loader l = open(argv[1]);
        if (argc >= 3 && std::strcmp(argv[2], "--members") == 0)
            members(l, argc, argv);
        else
            classes(l, argc, argv);
    } catch (const kspeed::Error& e) {
        std::fprintf(stderr, "FAIL: kspeed::Error %d: %s\n", int(e.status()), e.what());
        failures++;
    }
    if (failures == 0) std::printf("all checks passed\n");
    return failures == 0 ? 0 : 1;
}
