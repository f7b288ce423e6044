// fn.kspeed.reader: a DALI CPU reader operator over libkspeed's C ABI.
//
// Each iteration takes max_batch_size samples from a kspeed loader (whose
// pollers read ahead into its landing ring), copies them into DALI's output
// buffers (uint8 bytes, int32 label), and returns the ring space. With
// `members` (a space of tar samples preloaded with --members), each listed
// member of a sample is an output of its own, before the label. Epochs
// follow DALI's reader conventions: with pad_last_batch the last batch of an
// epoch is filled by repeating its last sample and the next epoch starts
// fresh; without it the batch is filled from the next epoch, which then goes
// on from there. The shard is kspeed's rank (DistributedSampler semantics:
// every shard has ceil(N / num_shards) samples, the short ones padded).
#include <kspeed.hpp>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dali/pipeline/operator/checkpointing/op_checkpoint.h"
#include "dali/pipeline/operator/operator.h"

#ifndef KSPEED_DALI_BUILT_AGAINST
#define KSPEED_DALI_BUILT_AGAINST "unknown"
#endif

// The DALI version this plugin was compiled against; the Python loader
// (kspeed_dali.load) compares it with the running DALI before loading.
extern "C" __attribute__((visibility("default"))) const char* kspeed_dali_built_against() {
    return KSPEED_DALI_BUILT_AGAINST;
}

namespace kspeed_dali {

using dali::CPUBackend;
using dali::OpSpec;
using dali::OutputDesc;
using dali::TensorListShape;
using dali::Workspace;

class KspeedReader : public dali::Operator<CPUBackend> {
public:
    explicit KspeedReader(const OpSpec& spec)
        : dali::Operator<CPUBackend>(spec),
          shard_id_(spec.GetArgument<int>("shard_id")),
          num_shards_(spec.GetArgument<int>("num_shards")),
          pad_last_batch_(spec.GetArgument<bool>("pad_last_batch")) {
        DALI_ENFORCE(num_shards_ >= 1, "kspeed.reader: num_shards must be at least 1");
        DALI_ENFORCE(shard_id_ >= 0 && shard_id_ < num_shards_,
                     dali::make_string("kspeed.reader: shard_id ", shard_id_,
                                       " is not below num_shards ", num_shards_));
        const std::string space = spec.GetArgument<std::string>("space");
        const std::string cluster = spec.GetArgument<std::string>("cluster_file");
        const std::string token = spec.GetArgument<std::string>("token");
        const bool rdma = spec.GetArgument<bool>("rdma");
        DALI_ENFORCE(!space.empty(), "kspeed.reader: `space` is required");
        try {
            kspeed::Config cfg;
            cfg.set("space", space)
                .set("batch_size", max_batch_size_)
                .set("rank", shard_id_)
                .set("world", num_shards_)
                .set("shuffle", spec.GetArgument<bool>("random_shuffle"))
                // DALI gives every operator a random seed unless one is passed;
                // shards must agree, so without an explicit seed use 0.
                .set("seed", spec.HasArgument("seed")
                                 ? static_cast<uint64_t>(spec.GetArgument<int64_t>("seed"))
                                 : uint64_t{0})
                .set("ring_bytes", spec.GetArgument<std::string>("ring_bytes"))
                .set("tier_bytes", spec.GetArgument<std::string>("tier_bytes"))
                // This operator copies every sample into DALI's output by
                // its own pointer (never a batch's span), so samples in the
                // memory tier can be handed over in place: one copy per
                // byte (tier -> output) instead of two (tier -> ring ->
                // output).
                .set("tier_views", spec.GetArgument<bool>("tier_views"))
                .set("mlock", spec.GetArgument<bool>("mlock"));
            const int pollers = spec.GetArgument<int>("pollers");
            if (pollers > 0) cfg.set("pollers", pollers);
            const int lookahead = spec.GetArgument<int>("prefetch_samples");
            if (lookahead > 0) cfg.set("lookahead", lookahead);
            if (!cluster.empty()) cfg.set("cluster_file", cluster).set("token", token);
            if (rdma) cfg.set("rdma", "true");
            // A space preloaded from a bucket: where and as whom a sample
            // every node lost is read from it.
            const std::string s3_endpoint = spec.GetArgument<std::string>("s3_endpoint_url");
            const std::string s3_profile = spec.GetArgument<std::string>("s3_profile");
            if (!s3_endpoint.empty()) cfg.set("s3_endpoint_url", s3_endpoint);
            if (!s3_profile.empty()) cfg.set("s3_profile", s3_profile);
            // A partial space's source samples kept on the NVMe for their
            // next read (docs/CACHE.md, "The cache area").
            const std::string cache_dir = spec.GetArgument<std::string>("cache_dir");
            if (!cache_dir.empty())
                cfg.set("cache_dir", cache_dir)
                    .set("cache_bytes", spec.GetArgument<std::string>("cache_bytes"))
                    .set("cache_policy", spec.GetArgument<std::string>("cache_policy"));
            // Set whether or not cache_dir is: without one the loader
            // refuses it by name rather than this dropping it unseen.
            const std::string cache_memory_bytes =
                spec.GetArgument<std::string>("cache_memory_bytes");
            if (cache_memory_bytes != "0") cfg.set("cache_memory_bytes", cache_memory_bytes);
            loader_ = std::make_unique<kspeed::Loader>(cfg);
            epoch_len_ = loader_->epoch_len();
            catalog_len_ = loader_->catalog_len();
            members_ = member_indices(spec.GetRepeatedArgument<std::string>("members"), space);
            loader_->set_epoch(0);
        } catch (const kspeed::Error& e) {
            DALI_FAIL(dali::make_string("kspeed.reader: ", e.what()));
        }
    }

    // The space's member index of each name in `names`, in that order;
    // every name must be one of the space's members.
    std::vector<uint64_t> member_indices(const std::vector<std::string>& names,
                                         const std::string& space) const {
        std::vector<uint64_t> out;
        if (names.empty()) return out;
        const uint64_t m = loader_->member_count();
        std::string have;
        for (uint64_t j = 0; j < m; ++j) have += (j ? "," : "") + loader_->member_name(j);
        DALI_ENFORCE(m > 0, dali::make_string("kspeed.reader: `members` given, but the samples of ",
                                              space, " are single files (preload tar shards with "
                                              "--members EXT,EXT,... to keep their members)"));
        for (const std::string& name : names) {
            uint64_t j = 0;
            while (j < m && loader_->member_name(j) != name) ++j;
            DALI_ENFORCE(j < m, dali::make_string("kspeed.reader: member \"", name,
                                                  "\" is not one of the space's members (", have,
                                                  ")"));
            out.push_back(j);
        }
        return out;
    }

    bool HasContiguousOutputs() const override { return true; }

    dali::ReaderMeta GetReaderMeta() const override {
        dali::ReaderMeta m;
        m.epoch_size = static_cast<dali::Index>(catalog_len_);
        m.epoch_size_padded = static_cast<dali::Index>(epoch_len_) * num_shards_;
        m.number_of_shards = num_shards_;
        m.shard_id = shard_id_;
        m.pad_last_batch = pad_last_batch_;
        m.stick_to_shard = 1;
        return m;
    }

    // A checkpoint is the loader position from which the held kspeed batch
    // was taken plus how many of its samples DALI has consumed: restoring
    // takes the same batch again (the order is deterministic) and skips them.
    // A pipeline of another shard (num_shards or shard_id) resumes the job
    // from its job position instead: the rest of the epoch dealt to its
    // shards, each sample not yet consumed exactly once (the Loader's
    // restore_job_position; every shard consumed the same number of samples
    // at a checkpoint, one batch per iteration, so the shards are in
    // lock-step).
    void SaveState(dali::OpCheckpoint& cpt, dali::AccessOrder) override {
        std::vector<uint8_t> state = held_ ? held_start_ : loader_->save_position();
        const uint64_t skip = held_ ? held_pos_ : 0;
        for (int i = 0; i < 8; ++i) state.push_back(static_cast<uint8_t>(skip >> (8 * i)));
        cpt.MutableCheckpointState() = std::move(state);
    }

    void RestoreState(const dali::OpCheckpoint& cpt) override {
        const auto& state = cpt.CheckpointState<std::vector<uint8_t>>();
        DALI_ENFORCE(state.size() == KSP_POSITION_BYTES + 8, "kspeed.reader: malformed checkpoint");
        const uint64_t skip = le(state, KSP_POSITION_BYTES, 8);
        try {
            held_.reset();
            held_start_.assign(state.begin(), state.begin() + KSP_POSITION_BYTES);
            // KSPDPOS3 (docs/FORMAT.md, "Saved positions"): rank u32 at 32,
            // world u32 at 36, then the next step's epoch, base and index
            // (u64 at 40, 48, 56), all little-endian.
            const uint64_t rank = le(held_start_, 32, 4), world = le(held_start_, 36, 4);
            if (rank != static_cast<uint64_t>(shard_id_) || world != static_cast<uint64_t>(num_shards_)) {
                // The position's own job position (checking the checkpoint
                // is of this dataset, seed and shuffle), then, inside the
                // held batch, the job's at its exact sample: `skip` more
                // steps of every one of the `world` shards.
                loader_->restore_job_position(held_start_);
                if (skip > 0) {
                    const uint64_t epoch = le(held_start_, 40, 8), base = le(held_start_, 48, 8),
                                   index = le(held_start_, 56, 8);
                    loader_->restore_job_position(loader_->job_position_at(epoch, base + (index + skip) * world));
                }
                held_start_.clear();
                epoch_ = loader_->position().first;
                return;
            }
            loader_->restore_position(held_start_);
            epoch_ = loader_->position().first;
            if (skip > 0) {
                held_ = loader_->next_batch();
                DALI_ENFORCE(held_ && skip <= held_->size(), "kspeed.reader: checkpoint does not fit the data");
                held_pos_ = skip;
            }
        } catch (const kspeed::Error& e) {
            DALI_FAIL(dali::make_string("kspeed.reader: restoring the checkpoint: ", e.what()));
        }
    }

    std::string SerializeCheckpoint(const dali::OpCheckpoint& cpt) const override {
        const auto& pos = cpt.CheckpointState<std::vector<uint8_t>>();
        return std::string(pos.begin(), pos.end());
    }

    void DeserializeCheckpoint(dali::OpCheckpoint& cpt, const std::string& data) const override {
        cpt.MutableCheckpointState() = std::vector<uint8_t>(data.begin(), data.end());
    }

protected:
    // The little-endian unsigned integer of `bytes` bytes at `at` of `b`.
    static uint64_t le(const std::vector<uint8_t>& b, size_t at, int bytes) {
        uint64_t v = 0;
        for (int i = 0; i < bytes; ++i) v |= uint64_t{b[at + i]} << (8 * i);
        return v;
    }

    // Whether the held kspeed batch has samples left, fetching the next one
    // (and returning the used one's ring space) when it has none; false at
    // the end of the epoch.
    bool have_samples() {
        if (held_ && held_pos_ < held_->size()) return true;
        held_.reset();
        loader_->save_position(held_start_);
        held_ = loader_->next_batch();
        held_pos_ = 0;
        return held_.has_value();
    }

    // Gathers the next max_batch_size samples and describes the outputs.
    // Usually that is one whole kspeed batch, held until the next iteration;
    // otherwise (an epoch's short last batch, and every batch after an epoch
    // boundary without padding) the samples go through a reused staging
    // buffer, since only one kspeed batch can be held at a time.
    bool SetupImpl(std::vector<OutputDesc>& out, const Workspace&) override {
        const int n = max_batch_size_;
        stage_.clear();
        off_.clear();
        len_.clear();
        ids_.clear();
        labels_.clear();
        direct_ = false;
        try {
            while (static_cast<int>(len_.size()) < n) {
                if (!have_samples()) {
                    // End of this epoch.
                    loader_->set_epoch(++epoch_);
                    if (pad_last_batch_ && !len_.empty()) {
                        while (static_cast<int>(len_.size()) < n) {
                            off_.push_back(off_.back());
                            len_.push_back(len_.back());
                            ids_.push_back(ids_.back());
                            labels_.push_back(labels_.back());
                        }
                        break;
                    }
                    continue;
                }
                if (len_.empty() && held_pos_ == 0 && static_cast<int>(held_->size()) == n) {
                    // The common case: the whole kspeed batch is the DALI
                    // batch; it stays held until the next iteration and
                    // RunImpl copies straight from the ring (one copy).
                    for (const ksp_sample& s : *held_) {
                        len_.push_back(s.len);
                        ids_.push_back(s.id);
                        labels_.push_back(static_cast<int32_t>(s.label));
                    }
                    held_pos_ = held_->size();
                    direct_ = true;
                    break;
                }
                // Take what fits; the rest of the kspeed batch stays held
                // for the next iteration (after an epoch boundary without
                // padding, DALI and kspeed batches are out of step).
                while (held_pos_ < held_->size() && static_cast<int>(len_.size()) < n) {
                    const ksp_sample& s = (*held_)[held_pos_++];
                    off_.push_back(stage_.size());
                    len_.push_back(s.len);
                    ids_.push_back(s.id);
                    labels_.push_back(static_cast<int32_t>(s.label));
                    stage_.insert(stage_.end(), s.data, s.data + s.len);
                }
            }
        } catch (const kspeed::Error& e) {
            DALI_FAIL(dali::make_string("kspeed.reader: ", e.what()));
        }
        // Each byte output's pieces: the whole sample, or each member.
        const size_t outs = members_.empty() ? 1 : members_.size();
        piece_off_.assign(outs * n, 0);
        piece_len_.assign(outs * n, 0);
        try {
            for (int i = 0; i < n; ++i) {
                if (members_.empty()) {
                    piece_len_[i] = len_[i];
                    continue;
                }
                const uint64_t id = ids_[i];
                for (size_t k = 0; k < outs; ++k) {
                    auto [off, len] = loader_->member_range(id, members_[k]);
                    piece_off_[k * n + i] = off;
                    piece_len_[k * n + i] = len;
                }
            }
        } catch (const kspeed::Error& e) {
            DALI_FAIL(dali::make_string("kspeed.reader: ", e.what()));
        }
        out.resize(outs + 1);
        for (size_t k = 0; k < outs; ++k) {
            TensorListShape<> shape(n, 1);
            for (int i = 0; i < n; ++i)
                shape.set_tensor_shape(i, {static_cast<int64_t>(piece_len_[k * n + i])});
            out[k] = {shape, DALI_UINT8};
        }
        TensorListShape<> label_shape(n, 1);
        for (int i = 0; i < n; ++i) label_shape.set_tensor_shape(i, {1});
        out[outs] = {label_shape, DALI_INT32};
        return true;
    }

    void RunImpl(Workspace& ws) override {
        const size_t n = len_.size();
        const size_t outs = piece_len_.size() / n;
        auto& labels = ws.Output<CPUBackend>(static_cast<int>(outs));
        // One copy per piece: output k's sample i is piece k * n + i.
        src_.resize(outs * n);
        dst_.resize(outs * n);
        size_t total = 0;
        for (size_t k = 0; k < outs; ++k) {
            auto& data = ws.Output<CPUBackend>(static_cast<int>(k));
            for (size_t i = 0; i < n; ++i) {
                const uint8_t* sample = direct_ ? (*held_)[i].data : stage_.data() + off_[i];
                src_[k * n + i] = sample + piece_off_[k * n + i];
                dst_[k * n + i] = data.mutable_tensor<uint8_t>(static_cast<int>(i));
                total += piece_len_[k * n + i];
            }
        }
        for (size_t i = 0; i < n; ++i) labels.mutable_tensor<int32_t>(static_cast<int>(i))[0] = labels_[i];
        // The copy is this operator's whole cost when the samples come from
        // the memory tier: spread it over the pipeline's threads, in runs of
        // consecutive pieces of about equal bytes (one run per thread).
        const size_t pieces = outs * n;
        const int threads = ws.HasThreadPool() ? ws.GetThreadPool().NumThreads() : 1;
        if (threads <= 1 || total < kParallelCopyBytes) {
            copy(0, pieces);
            return;
        }
        auto& pool = ws.GetThreadPool();
        const size_t share = total / threads + 1;
        size_t begin = 0, run = 0;
        for (size_t i = 0; i < pieces; ++i) {
            run += piece_len_[i];
            if (run >= share || i + 1 == pieces) {
                const size_t b = begin, e = i + 1;
                pool.AddWork([this, b, e](int) { copy(b, e); });
                begin = e;
                run = 0;
            }
        }
        pool.RunAll();
    }

    // Copies pieces [b, e) to their outputs.
    void copy(size_t b, size_t e) const {
        for (size_t i = b; i < e; ++i)
            if (piece_len_[i] > 0) std::memcpy(dst_[i], src_[i], piece_len_[i]);
    }

    // Below this many bytes a batch is copied on the calling thread (waking
    // the pool costs more than it saves).
    static constexpr size_t kParallelCopyBytes = size_t{1} << 20;

private:
    std::vector<const uint8_t*> src_;
    std::vector<uint8_t*> dst_;
    int shard_id_;
    int num_shards_;
    bool pad_last_batch_;
    uint64_t epoch_len_ = 0;
    uint64_t catalog_len_ = 0;
    uint64_t epoch_ = 0;
    std::unique_ptr<kspeed::Loader> loader_;
    // The kspeed batch being consumed, how far, and the position it came from.
    std::optional<kspeed::Batch> held_;
    size_t held_pos_ = 0;
    std::vector<uint8_t> held_start_;
    // This iteration's samples are the held batch itself (no staging copy).
    bool direct_ = false;
    // Reused across iterations: no allocation per sample once warm.
    std::vector<uint8_t> stage_;
    std::vector<size_t> off_, len_;
    std::vector<uint64_t> ids_;
    std::vector<int32_t> labels_;
    // The space's member index of each byte output (empty: one output, the
    // whole sample), and this iteration's pieces (output k, sample i at
    // k * n + i): where each lies in its sample, and its length.
    std::vector<uint64_t> members_;
    std::vector<size_t> piece_off_, piece_len_;
};

}  // namespace kspeed_dali

namespace dali {

DALI_REGISTER_OPERATOR(kspeed__Reader, ::kspeed_dali::KspeedReader, CPU);

DALI_SCHEMA(kspeed__Reader)
    .DocStr(R"(Reads samples from a kspeed space (preloaded with `kspeed preload`) through
libkspeed: io_uring pollers read ahead, in the shard's sampler order, into a landing ring;
in cluster mode the samples other nodes hold are pushed by their node services.

Outputs the sample bytes (uint8, 1-D) and the label (int32, shape [1]; -1 when unlabeled);
with `members`, one uint8 output per listed member of each sample, then the label.
Pass the same `seed` to every shard (without one, 0 is used, not a random seed).)")
    .NumInput(0)
    .NumOutput(2)
    .OutputFn([](const OpSpec& spec) {
        // The listed members, then the label; without members the sample, then the label.
        const auto members = spec.GetRepeatedArgument<std::string>("members");
        return members.empty() ? 2 : static_cast<int>(members.size()) + 1;
    })
    .MakeStateful()
    .AddRandomSeedArg()
    .AddArg("space", "The kspeed space directory (this node's, in cluster mode).",
            DALI_STRING)
    .AddOptionalArg("shard_id", "Index of the shard to read (kspeed's rank).", 0)
    .AddOptionalArg("num_shards", "Number of shards the dataset is split into (kspeed's world size).",
                    1)
    .AddOptionalArg("random_shuffle", "Shuffle every epoch (kspeed's seeded sampler).", false)
    .AddOptionalArg("pad_last_batch",
                    "Fill the last batch of an epoch by repeating its last sample; otherwise it is "
                    "filled from the next epoch.",
                    false)
    .AddOptionalArg("prefetch_samples",
                    "Most samples read ahead of the consumer (0: as many as the ring holds).", 0)
    .AddOptionalArg("ring_bytes", "Landing ring size, e.g. \"256MiB\", or \"auto\" (sized from the batch).", std::string("auto"))
    .AddOptionalArg("tier_bytes", "Memory tier budget, e.g. \"8GiB\" (0: none).", std::string("0"))
    .AddOptionalArg("tier_views",
                    "Copy samples held in the memory tier straight from it into the output, not "
                    "through the landing ring first.",
                    true)
    .AddOptionalArg("members",
                    "A space of tar samples preloaded with `--members` (e.g. jpg,json): output "
                    "these members of each sample, each as an output of its own in this order, "
                    "then the label (empty: the whole sample as one output).",
                    std::vector<std::string>())
    .AddOptionalArg("pollers", "kspeed poller threads (0: kspeed's default).", 0)
    .AddOptionalArg("mlock", "Lock the landing ring in memory.", true)
    .AddOptionalArg("cluster_file",
                    "Cluster mode: the node list (`<index> <host:port>` per line).", std::string(""))
    .AddOptionalArg("token", "Cluster mode: the job token.", std::string(""))
    .AddOptionalArg("rdma",
                    "Cluster mode: receive samples as RDMA writes (every node serves with --rdma).",
                    false)
    .AddOptionalArg("s3_endpoint_url",
                    "A space preloaded from an S3-compatible store: its endpoint, for samples read "
                    "from the bucket when every node lost them (empty: the AWS variables').",
                    std::string(""))
    .AddOptionalArg("cache_dir",
                    "A partial space (`kspeed preload --max-bytes`): keep the samples read from "
                    "its source in this NVMe folder for their next read (the shard's area is "
                    "CACHE_DIR/rank<shard_id>; \":memory:\": in the process's memory instead, "
                    "a space's samples too; empty: none).",
                    std::string(""))
    .AddOptionalArg("cache_bytes", "The cache area's budget, e.g. \"100GiB\" (with cache_dir).",
                    std::string("0"))
    .AddOptionalArg("cache_policy",
                    "What the cache area keeps: next-use (the default), min or lru.",
                    std::string("next-use"))
    .AddOptionalArg("cache_memory_bytes",
                    "A memory level above the cache area on disk (cache_dir a folder): an "
                    "area of this many bytes in the process's memory, read first, by the same "
                    "policy (docs/CACHE.md, \"Two levels\"); \"0\": none.",
                    std::string("0"))
    .AddOptionalArg("s3_profile",
                    "A space preloaded from an object store: the AWS profile to read it as "
                    "(empty: AWS_PROFILE, else default).",
                    std::string(""));

}  // namespace dali
