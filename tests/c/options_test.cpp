// The C++ wrapper's Config::set (ffi/cpp/kspeed.hpp) over the options
// table: tests/options.rs writes one case per line on stdin,
//
//   MODE \t KEY \t VALUE
//
// and this program sets KEY to VALUE on a fresh kspeed::Config through the
// overload MODE names, printing one line per case:
//
//   ok                      accepted
//   err \t STATUS \t MESSAGE  kspeed::Error (its status() and what())
//
// MODE: "string" (set(key, std::string)), "cstr" (set(key, const char*)),
// "u64" (set(key, uint64_t): VALUE is a decimal that fits), "i64"
// (set(key, int64_t)), "bool" (set(key, bool): VALUE is true or false).
// tests/options.rs compares each line with what Rust's LoaderOptions::set
// says for the same key and value. Anything else thrown ends the program
// with status 1.
#include <kspeed.hpp>

#include <cstdint>
#include <iostream>
#include <string>

namespace {

void set(kspeed::Config& cfg, const std::string& mode, const std::string& key,
         const std::string& value) {
    if (mode == "string") {
        cfg.set(key, value);
    } else if (mode == "cstr") {
        cfg.set(key, value.c_str());
    } else if (mode == "u64") {
        cfg.set(key, static_cast<uint64_t>(std::stoull(value)));
    } else if (mode == "i64") {
        cfg.set(key, static_cast<int64_t>(std::stoll(value)));
    } else if (mode == "bool") {
        cfg.set(key, value == "true");
    } else {
        throw std::invalid_argument("unknown mode " + mode);
    }
}

}  // namespace

int main() {
    std::string line;
    while (std::getline(std::cin, line)) {
        const size_t a = line.find('\t');
        const size_t b = line.find('\t', a + 1);
        if (a == std::string::npos || b == std::string::npos) {
            std::cerr << "bad case line: " << line << "\n";
            return 1;
        }
        const std::string mode = line.substr(0, a);
        const std::string key = line.substr(a + 1, b - a - 1);
        const std::string value = line.substr(b + 1);
        kspeed::Config cfg;
        try {
            set(cfg, mode, key, value);
            std::cout << "ok\n";
        } catch (const kspeed::Error& e) {
            std::cout << "err\t" << static_cast<int>(e.status()) << "\t" << e.what() << "\n";
        }
    }
    return 0;
}
