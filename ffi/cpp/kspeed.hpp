// kspeed.hpp: a small header-only C++17 RAII wrapper over the kspeed C ABI
// (kspeed.h). Errors are exceptions: every failed call throws kspeed::Error,
// which carries the ksp_status and kspeed's message. Handles are movable, not
// copyable; destructors never throw.
//
//   kspeed::Config cfg;
//   cfg.set("space", "/nvme/train").set("batch_size", 256).set("seed", 42);
//   kspeed::Loader loader(cfg);
//   for (uint64_t epoch = 0; epoch < 3; ++epoch) {
//       loader.set_epoch(epoch);
//       while (auto batch = loader.next_batch()) {
//           for (const ksp_sample& s : *batch) { /* s.data, s.len, s.id, s.label */ }
//       }   // the batch's ring space is returned when it goes out of scope
//   }
//
// Batches and lifetimes: a loader holds one batch at a time. A Batch's
// pointers (sample data, span, wrap) are valid until that batch is
// released: by its destructor or release(), or implicitly by the loader's
// next next_batch(), set_epoch() or restore_position(). A Batch releases
// only its own batch (it carries the batch's identity, ksp_batch.seq), so
// `while ((b = loader.next_batch()))` and holding an old Batch object past
// the next next_batch() are both safe: the old one's release does nothing.
// Do not read an old Batch's bytes after the next next_batch().
//
// A Batch may outlive its Loader: the Loader and its batches share the C
// loader (a std::shared_ptr), which is freed (ksp_loader_free: its threads
// stopped, its ring unmapped) when the last of them is destroyed. Until
// then a live Batch's bytes stay valid, and its release works as usual.
// A Batch that is kept keeps the loader's threads and ring alive with it.
//
// Fork: a Loader belongs to the process that created it. In a forked child
// every call throws kspeed::Error with status KSP_ERR_FORKED, and the
// destructors of the child's copies free nothing (see ksp_loader_new in
// kspeed.h); create a new Loader in the child.
//
// Lock-step: every batch but an epoch's last has exactly batch_size samples
// and every rank gets batches_per_epoch() batches; a ring that cannot hold
// a whole batch is refused when the Loader is built (the error names the
// ring_bytes needed).
//
// Thread safety: as for the C handles, one thread at a time per object.
#ifndef KSPEED_HPP
#define KSPEED_HPP

#include <kspeed.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kspeed {

/// The calling thread's last kspeed error message.
inline std::string last_error() {
    std::string msg(256, '\0');
    size_t n = 0;
    if (ksp_last_error(msg.data(), msg.size(), &n) == KSP_ERR_BUFFER_TOO_SMALL) {
        msg.assign(n + 1, '\0');
        ksp_last_error(msg.data(), msg.size(), &n);
    }
    msg.resize(n);
    return msg;
}

/// A failed kspeed call: the status and kspeed's message.
class Error : public std::runtime_error {
public:
    Error(ksp_status status, const std::string& message)
        : std::runtime_error(message), status_(status) {}
    ksp_status status() const noexcept { return status_; }

private:
    ksp_status status_;
};

/// Throws kspeed::Error unless `s` is KSP_OK.
inline void check(ksp_status s) {
    if (s != KSP_OK) throw Error(s, last_error());
}

/// The library's version string.
inline std::string version() { return ksp_version(); }

/// Loader settings (keys as for ksp_config_set).
class Config {
public:
    Config() { check(ksp_config_new(&p_)); }
    ~Config() { ksp_config_free(p_); }
    Config(Config&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
    Config& operator=(Config&& o) noexcept {
        std::swap(p_, o.p_);
        return *this;
    }
    Config(const Config&) = delete;
    Config& operator=(const Config&) = delete;

    Config& set(const std::string& key, const std::string& value) {
        check(ksp_config_set(p_, key.c_str(), value.c_str()));
        return *this;
    }
    Config& set(const std::string& key, const char* value) { return set(key, std::string(value)); }
    Config& set(const std::string& key, bool value) { return set(key, value ? "true" : "false"); }
    template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
    Config& set(const std::string& key, T value) {
        return set(key, std::to_string(value));
    }

    const ksp_config* get() const noexcept { return p_; }

private:
    ksp_config* p_ = nullptr;
};

class Loader;

/// A batch of samples, zero-copy in the loader's ring. Releasing (its
/// destructor, or release()) returns the space; the loader hands out one
/// batch at a time, so a new next_batch() releases the previous one and
/// invalidates its pointers. Releasing a batch the loader already released
/// does nothing: a Batch never frees another batch. A Batch shares the C
/// loader with its Loader, so it may outlive the Loader object: the C
/// loader is freed after the last of them.
class Batch {
public:
    Batch(Batch&& o) noexcept : l_(std::move(o.l_)), b_(o.b_) {}
    Batch& operator=(Batch&& o) noexcept {
        release();
        l_ = std::move(o.l_);
        b_ = o.b_;
        return *this;
    }
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;
    ~Batch() { release(); }

    size_t size() const noexcept { return b_.count; }
    const ksp_sample& operator[](size_t i) const noexcept { return b_.samples[i]; }
    const ksp_sample* begin() const noexcept { return b_.samples; }
    const ksp_sample* end() const noexcept { return b_.samples + b_.count; }
    uint64_t epoch() const noexcept { return b_.epoch; }
    /// The batch's identity (1, 2, ... in the loader's order).
    uint64_t seq() const noexcept { return b_.seq; }
    /// The batch's bytes: one contiguous span, plus a second when it wraps.
    /// {nullptr, 0} when the loader has `tier_views` on and some samples
    /// are handed out in place in the memory tier: use each sample's data.
    std::pair<const uint8_t*, size_t> span() const noexcept { return {b_.span, b_.span_len}; }
    std::pair<const uint8_t*, size_t> wrap() const noexcept { return {b_.wrap, b_.wrap_len}; }

    /// Returns the batch's space now (the destructor does it otherwise).
    /// Drops this batch's share of the C loader: if the Loader is gone and
    /// this was the last batch, the C loader is freed here.
    void release() noexcept {
        // Releases this batch only; a no-op when the loader already did.
        if (l_) ksp_loader_release_batch(l_.get(), b_.seq);
        l_.reset();
    }

private:
    friend class Loader;
    Batch(std::shared_ptr<ksp_loader> l, const ksp_batch& b) : l_(std::move(l)), b_(b) {}
    std::shared_ptr<ksp_loader> l_;
    ksp_batch b_;
};

/// Reads a rank's samples in sampler order (see the Rust Loader).
class Loader {
public:
    explicit Loader(const Config& cfg) {
        ksp_loader* p = nullptr;
        check(ksp_loader_new(cfg.get(), &p));
        // Shared with the batches handed out: the last owner frees it.
        // (A throwing allocation of the control block frees p too.)
        p_ = std::shared_ptr<ksp_loader>(p, ksp_loader_free);
    }
    // The C loader is freed here unless a Batch still holds it.
    ~Loader() = default;
    Loader(Loader&& o) noexcept : p_(std::move(o.p_)) {}
    Loader& operator=(Loader&& o) noexcept {
        std::swap(p_, o.p_);
        return *this;
    }
    Loader(const Loader&) = delete;
    Loader& operator=(const Loader&) = delete;

    /// The next batch, or std::nullopt at the end of the epoch.
    std::optional<Batch> next_batch() {
        // struct_size and sample_size: the layouts this program was
        // compiled with (the library fills what both know).
        ksp_batch b = KSP_BATCH_INIT;
        check(ksp_loader_next_batch(p_.get(), &b));
        if (b.count == 0) return std::nullopt;
        return Batch(p_, b);
    }
    void set_epoch(uint64_t epoch) { check(ksp_loader_set_epoch(p_.get(), epoch)); }
    // Reading starts at the first next_batch(); this starts it now (after
    // restore_position(), if the program restores).
    void start_reading() { check(ksp_loader_start_reading(p_.get())); }
    uint64_t epoch_len() const {
        uint64_t n = 0;
        check(ksp_loader_epoch_len(p_.get(), &n));
        return n;
    }
    /// Batches per epoch, the same on every rank (DDP lock-step).
    uint64_t batches_per_epoch() const {
        uint64_t n = 0;
        check(ksp_loader_batches_per_epoch(p_.get(), &n));
        return n;
    }
    /// {epoch, step} of the next sample next_batch() delivers.
    std::pair<uint64_t, uint64_t> position() const {
        uint64_t e = 0, i = 0;
        check(ksp_loader_position(p_.get(), &e, &i));
        return {e, i};
    }
    /// The position to resume from (KSP_POSITION_BYTES bytes; a mixture's
    /// KSPDPOS4 is longer).
    std::vector<uint8_t> save_position() const {
        std::vector<uint8_t> pos;
        save_position(pos);
        return pos;
    }
    /// The same into `pos`, reusing its storage (no allocation once sized).
    void save_position(std::vector<uint8_t>& pos) const {
        pos.resize(pos.capacity() > KSP_POSITION_BYTES ? pos.capacity() : KSP_POSITION_BYTES);
        size_t n = 0;
        ksp_status st = ksp_loader_save_position(p_.get(), pos.data(), pos.size(), &n);
        if (st == KSP_ERR_BUFFER_TOO_SMALL) {
            pos.resize(n);
            st = ksp_loader_save_position(p_.get(), pos.data(), pos.size(), &n);
        }
        check(st);
        pos.resize(n);
    }
    void restore_position(const std::vector<uint8_t>& pos) {
        check(ksp_loader_restore_position(p_.get(), pos.data(), pos.size()));
    }
    /// The job's position (KSP_JOB_POSITION_BYTES bytes, KSPDJOB1; a
    /// mixture's KSPDMIX1 is longer), valid for any world size when the job
    /// is in lock-step (DDP between steps).
    std::vector<uint8_t> job_position() const {
        return sized([&](uint8_t* b, size_t len, size_t* n) {
            return ksp_loader_job_position(p_.get(), b, len, n, nullptr, nullptr);
        });
    }
    /// The job position (epoch, consumed) of this loader's job, encoded as
    /// job_position() encodes its own.
    std::vector<uint8_t> job_position_at(uint64_t epoch, uint64_t consumed) const {
        return sized([&](uint8_t* b, size_t len, size_t* n) {
            return ksp_loader_job_position_at(p_.get(), epoch, consumed, b, len, n);
        });
    }
    /// Continues the job at this loader's rank and world from a job
    /// position or any rank's saved position: the rest of the epoch, each
    /// sample not yet consumed exactly once across the ranks.
    void restore_job_position(const std::vector<uint8_t>& pos) {
        check(ksp_loader_restore_job_position(p_.get(), pos.data(), pos.size()));
    }
    ksp_stats stats() const {
        ksp_stats s = KSP_STATS_INIT;
        check(ksp_loader_stats(p_.get(), &s));
        return s;
    }
    uint64_t catalog_len() const {
        uint64_t n = 0;
        check(ksp_loader_catalog_len(p_.get(), &n));
        return n;
    }
    ksp_catalog_sample catalog_sample(uint64_t id) const {
        ksp_catalog_sample c = KSP_CATALOG_SAMPLE_INIT;
        check(ksp_loader_catalog_sample(p_.get(), id, &c));
        return c;
    }
    /// Classes of an ImageFolder dataset (labels are 0 .. class_count()-1;
    /// 0 for a dataset without classes).
    uint64_t class_count() const {
        uint64_t n = 0;
        check(ksp_loader_class_count(p_.get(), &n));
        return n;
    }
    /// The class folder's name of `label`, as its bytes (a folder name
    /// need not be UTF-8). Throws KSP_ERR_INVALID_ARG past class_count().
    std::string class_name(uint64_t label) const {
        return text([&](char* b, size_t len, size_t* n) {
            return ksp_loader_class_name(p_.get(), label, b, len, n);
        });
    }
    /// How many tar members make each sample (`--members jpg,json,txt`);
    /// 0 when a sample is a single member or file.
    uint64_t member_count() const {
        uint64_t n = 0;
        check(ksp_loader_member_count(p_.get(), &n));
        return n;
    }
    /// The extension of member `index` (e.g. "json"). Throws
    /// KSP_ERR_INVALID_ARG when `index` is not below member_count().
    std::string member_name(uint64_t index) const {
        return text([&](char* b, size_t len, size_t* n) {
            return ksp_loader_member_name(p_.get(), index, b, len, n);
        });
    }
    /// Member `index` of sample `s` (a sample of a batch this loader
    /// handed out): a view into the sample's bytes, valid while they are
    /// (until the batch is released). Throws KSP_ERR_INVALID_ARG when
    /// `index` is not below member_count().
    std::pair<const uint8_t*, size_t> member(const ksp_sample& s, uint64_t index) const {
        auto [off, len] = member_range(s.id, index);
        return {s.data + off, len};
    }
    /// Where member `index` of sample `id` lies inside the sample's bytes:
    /// {offset, length}. Throws KSP_ERR_INVALID_ARG when `id` is past the
    /// catalog or `index` not below member_count().
    std::pair<uint32_t, uint32_t> member_range(uint64_t id, uint64_t index) const {
        uint32_t off = 0, len = 0;
        check(ksp_loader_sample_member(p_.get(), id, index, &off, &len));
        return {off, len};
    }

private:
    // A NUL-terminated string from `write(buf, len, &n)` (fetch).
    template <class Write>
    static std::string text(Write write) {
        return fetch<std::string>(write, 64, 1);
    }
    // Job position bytes from `write(buf, len, &n)` (fetch; a mixture's
    // is longer than KSPDJOB1's).
    template <class Write>
    static std::vector<uint8_t> sized(Write write) {
        return fetch<std::vector<uint8_t>>(write, KSP_JOB_POSITION_BYTES, 0);
    }
    // Calls `write(buf, len, &n)` with `first` bytes, and again with
    // n + `nul` when that was too small; the first n bytes.
    template <class Buf, class Write>
    static Buf fetch(Write write, size_t first, size_t nul) {
        Buf out(first, typename Buf::value_type{});
        size_t n = 0;
        ksp_status st = write(out.data(), out.size(), &n);
        if (st == KSP_ERR_BUFFER_TOO_SMALL) {
            out.assign(n + nul, typename Buf::value_type{});
            st = write(out.data(), out.size(), &n);
        }
        check(st);
        out.resize(n);
        return out;
    }
    std::shared_ptr<ksp_loader> p_;
};

/// Audits a job from its ranks' saved positions (save_position() of every
/// rank of every world that dealt the epochs): one line per epoch ("epoch
/// 3: 1,281,167 samples, each exactly once"); throws kspeed::Error
/// (KSP_ERR_DATA) naming the first sample skipped or delivered twice.
inline std::string audit(const std::vector<std::vector<uint8_t>>& positions) {
    std::vector<const uint8_t*> ptrs;
    std::vector<size_t> lens;
    for (const auto& p : positions) {
        ptrs.push_back(p.data());
        lens.push_back(p.size());
    }
    std::string report(256, '\0');
    size_t n = 0;
    ksp_status st = ksp_audit(ptrs.data(), lens.data(), ptrs.size(), report.data(), report.size(), &n);
    if (st == KSP_ERR_BUFFER_TOO_SMALL) {
        report.assign(n + 1, '\0');
        st = ksp_audit(ptrs.data(), lens.data(), ptrs.size(), report.data(), report.size(), &n);
    }
    check(st);
    report.resize(n);
    return report;
}

/// Preloads node `node_index` of `nodes` (with `replicas` copies) from
/// `source` into `space`; an empty `catalog` builds one.
inline void preload(const std::string& source, const std::string& space,
                    const std::string& catalog = "", uint32_t nodes = 1,
                    uint32_t node_index = 0, uint32_t replicas = 1) {
    check(ksp_preload(source.empty() ? nullptr : source.c_str(), space.c_str(),
                      catalog.empty() ? nullptr : catalog.c_str(), nodes, node_index, replicas));
}

/// Re-reads a space: {samples checked, bad samples}.
inline std::pair<uint64_t, uint64_t> verify(const std::string& space) {
    uint64_t checked = 0, bad = 0;
    check(ksp_verify(space.c_str(), &checked, &bad));
    return {checked, bad};
}

/// A node service serving a space to remote loaders; stopped by the destructor.
class NodeService {
public:
    NodeService(const std::string& space, const std::string& listen, const std::string& token) {
        check(ksp_node_service_start(space.c_str(), listen.c_str(), token.c_str(), &p_));
    }
    ~NodeService() { ksp_node_service_stop(p_); }
    NodeService(NodeService&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
    NodeService(const NodeService&) = delete;
    NodeService& operator=(const NodeService&) = delete;
    uint16_t port() const {
        uint16_t p = 0;
        check(ksp_node_service_port(p_, &p));
        return p;
    }

private:
    ksp_node_service* p_ = nullptr;
};

}  // namespace kspeed

#endif  // KSPEED_HPP
