"""fn.kspeed.reader on the CPU (device_id=None): sharded epochs, reader
metadata, real JPEGs through fn.decoders.image, checkpoints (also resumed
at another shard count), errors.

Environment: KSPEED_BIN (the kspeed binary), KSPEED_DALI_PLUGIN (the built
plugin). Run by ffi/dali/build_and_test.sh.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kspeed_dali  # noqa: E402

kspeed_dali.load()

from nvidia.dali import fn, pipeline_def  # noqa: E402

K = os.environ.get("KSPEED_BIN", "kspeed")


def sh(*args):
    # Every kspeed command here takes seconds; a hang fails the test.
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=300).stdout


def digest(b):
    return hashlib.sha1(bytes(b)).hexdigest()


class Dataset:
    """A generated ImageFolder tree, preloaded; maps content digest -> class."""

    def __init__(self, tmp, profile="imagenet", count=300, src=None):
        self.src = src or os.path.join(tmp, "src")
        if src is None:
            sh(K, "gen", "--profile", profile, "--count", str(count), "--out", self.src, "--seed", "1")
        self.space = os.path.join(tmp, "space")
        sh(K, "--progress", "none", "preload", "--source", self.src, "--space", self.space)
        self.by_digest = {}
        for cls in sorted(os.listdir(self.src)):
            d = os.path.join(self.src, cls)
            for f in os.listdir(d):
                with open(os.path.join(d, f), "rb") as fh:
                    self.by_digest[digest(fh.read())] = cls


def reader_pipeline(space, batch, shard=0, shards=1, pad=True, reader_kw=None, **kw):
    @pipeline_def(batch_size=batch, num_threads=2, device_id=None, **kw)
    def p():
        data, label = fn.kspeed.reader(space=space, shard_id=shard, num_shards=shards, random_shuffle=True,
                                       seed=7, pad_last_batch=pad, name="Reader", mlock=False,
                                       ring_bytes="32MiB", **(reader_kw or {}))
        return data, label
    pipe = p()
    pipe.build()
    return pipe


class ReaderTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="kspeed-dali-")
        cls.ds = Dataset(cls.tmp)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def read(self, pipe, iterations):
        out = []
        for _ in range(iterations):
            data, label = pipe.run()
            for i in range(len(data)):
                out.append((digest(data.at(i)), int(label.at(i)[0])))
        return out

    def test_two_shards_cover_every_epoch_with_right_bytes_and_labels(self):
        batch, n = 16, 300
        per_shard = n // 2
        iters = -(-per_shard // batch)
        seen = {}
        class_of_label = {}
        for shard in (0, 1):
            pipe = reader_pipeline(self.ds.space, batch, shard, 2)
            meta = pipe.reader_meta("Reader")
            self.assertEqual(meta["epoch_size"], n)
            self.assertEqual(meta["number_of_shards"], 2)
            self.assertEqual(meta["shard_id"], shard)
            self.assertEqual(pipe.epoch_size("Reader"), n)
            for epoch in range(3):
                got = self.read(pipe, iters)
                self.assertEqual(len(got), iters * batch)
                epoch_part = got[:per_shard]
                # Padding repeats the epoch's last sample.
                for d, l in got[per_shard:]:
                    self.assertEqual((d, l), got[per_shard - 1])
                for d, l in epoch_part:
                    self.assertIn(d, self.ds.by_digest, "bytes of a sample match no source file")
                    cls = self.ds.by_digest[d]
                    self.assertEqual(class_of_label.setdefault(l, cls), cls, "label/class mismatch")
                seen.setdefault(epoch, []).extend(d for d, _ in epoch_part)
        for epoch, digests in seen.items():
            self.assertEqual(len(digests), n)
            self.assertEqual(set(digests), set(self.ds.by_digest), f"epoch {epoch}: shards miss samples")
        self.assertEqual(len(class_of_label), len(set(self.ds.by_digest.values())))
        # Shuffled: epochs differ in order.
        self.assertNotEqual(seen[0], seen[1])

    def test_memory_tier_samples_are_copied_in_place_byte_exact(self):
        # The whole set fits the tier: epoch 0 fills it, epochs 1 and 2 are
        # copied straight out of it (tier_views, on by default), both in
        # whole kspeed batches (padding) and through the staging path (no
        # padding: DALI and kspeed batches out of step). DALI's outputs are
        # copies either way, so this checks the bytes, not that views were
        # taken: tests/c/capi_test.c shows the key reaching the loader
        # (span-less batches), and scripts/bench_dali.py shows the effect.
        batch, n = 16, 300
        for pad in (True, False):
            for views in (True, False):
                pipe = reader_pipeline(self.ds.space, batch, pad=pad,
                                       reader_kw=dict(tier_bytes="64MiB", tier_views=views))
                iters = -(-n // batch)
                for epoch in range(3):
                    got = [d for d, _ in self.read(pipe, iters)]
                    for d in got:
                        self.assertIn(d, self.ds.by_digest, f"pad={pad} views={views} epoch {epoch}")
                    if pad:
                        self.assertEqual(set(got[:n]), set(self.ds.by_digest), f"views={views} epoch {epoch}")

    def test_without_padding_the_stream_runs_on_into_the_next_epoch(self):
        batch, per_shard = 16, 150
        pipe = reader_pipeline(self.ds.space, batch, 1, 2, pad=False)
        got = [d for d, _ in self.read(pipe, 19)]  # 304 samples: two epochs and 4 more
        # Each epoch is a fresh permutation split across shards (as with
        # DistributedSampler), so a shard's samples differ between epochs;
        # within an epoch none repeats, and the batch that crosses the
        # boundary carries the next epoch's first samples, not padding.
        for part in (got[:per_shard], got[per_shard:2 * per_shard]):
            self.assertEqual(len(set(part)), per_shard)
            self.assertTrue(set(part) <= set(self.ds.by_digest))
        self.assertNotEqual(got[:per_shard], got[per_shard:2 * per_shard])
        self.assertNotEqual(got[per_shard], got[per_shard - 1])

    def test_checkpoint_resumes_where_it_stopped(self):
        # With padding, and without it past an epoch boundary (where DALI's
        # batches and kspeed's are out of step and a kspeed batch is held
        # half consumed).
        for pad, before in ((True, 7), (False, 21)):
            batch = 16
            pipe = reader_pipeline(self.ds.space, batch, pad=pad, enable_checkpointing=True)
            self.read(pipe, before)
            cpt = pipe.checkpoint()
            want = self.read(pipe, 12)

            @pipeline_def(batch_size=batch, num_threads=2, device_id=None, enable_checkpointing=True)
            def again():
                return tuple(fn.kspeed.reader(space=self.ds.space, random_shuffle=True, seed=7, name="Reader",
                                              pad_last_batch=pad, mlock=False, ring_bytes="32MiB"))
            p2 = again(checkpoint=cpt)
            p2.build()
            self.assertEqual(self.read(p2, 12), want, f"pad_last_batch={pad}")

    def test_checkpoint_resumes_at_another_shard_count_exactly_once(self):
        # 3 shards checkpoint; 2 shards resume from those checkpoints (any
        # old shard's: each gives the job's position) and read the rest of
        # the epoch. Together: every sample of the epoch exactly once. With
        # padding the checkpoint falls between kspeed batches; without it,
        # past the epoch boundary, 12 samples into a held kspeed batch.
        batch, n = 16, 300
        for pad, before in ((True, 3), (False, 7)):
            consumed = before * batch  # per old shard, in lock-step
            epoch_start = 0 if pad else -(-n // 3)  # 100 of epoch 0 first without padding
            firsts, cpts = [], []
            for shard in range(3):
                pipe = reader_pipeline(self.ds.space, batch, shard, 3, pad=pad, enable_checkpointing=True)
                firsts += [d for d, _ in self.read(pipe, before)][epoch_start:consumed]
                cpts.append(pipe.checkpoint())
                del pipe
            rest = n - len(firsts)
            per_new = -(-rest // 2)
            seconds = []
            for shard, cpt in ((0, cpts[2]), (1, cpts[0])):
                @pipeline_def(batch_size=batch, num_threads=2, device_id=None, enable_checkpointing=True)
                def again():
                    return tuple(fn.kspeed.reader(space=self.ds.space, shard_id=shard, num_shards=2,
                                                  random_shuffle=True, seed=7, name="Reader", pad_last_batch=pad,
                                                  mlock=False, ring_bytes="32MiB"))
                p2 = again(checkpoint=cpt)
                p2.build()
                got = [d for d, _ in self.read(p2, -(-per_new // batch))]
                # Rank r's step k is entry r + 2k of the rest; past it:
                # the padding duplicate of the odd remainder.
                seconds += [d for k, d in enumerate(got[:per_new]) if shard + 2 * k < rest]
                del p2
            together = firsts + seconds
            self.assertEqual(len(together), n, f"pad_last_batch={pad}")
            self.assertEqual(len(set(together)), n, f"pad_last_batch={pad}: a sample twice")
            self.assertEqual(set(together), set(self.ds.by_digest), f"pad_last_batch={pad}")

    def test_errors_are_clear(self):
        cases = [
            (dict(space=os.path.join(self.tmp, "no-such-space")), "no-such-space"),
            (dict(space=self.ds.space, shard_id=2, num_shards=2), "shard_id 2"),
            # Arguments go through kspeed's options table (ksp_config_set):
            # its message, naming the option.
            (dict(space=self.ds.space, tier_bytes="lots"), "option tier_bytes: "),
        ]
        corrupt = os.path.join(self.tmp, "corrupt")
        shutil.copytree(self.ds.space, corrupt)
        cat = os.path.join(corrupt, "catalog.ksc")
        with open(cat, "r+b") as f:
            f.truncate(os.path.getsize(cat) // 2)
        cases.append((dict(space=corrupt), "catalog"))
        for kwargs, needle in cases:
            @pipeline_def(batch_size=4, num_threads=1, device_id=None)
            def p():
                return tuple(fn.kspeed.reader(mlock=False, ring_bytes="8MiB", **kwargs))
            with self.assertRaises(RuntimeError) as cm:
                pipe = p()
                pipe.build()
                pipe.run()
            msg = str(cm.exception)
            self.assertIn("kspeed", msg)
            self.assertIn(needle, msg)

    def test_version_mismatch_is_refused(self):
        import nvidia.dali as dali
        real = dali.__version__
        dali.__version__ = "0.0.1"
        try:
            with self.assertRaises(RuntimeError) as cm:
                kspeed_dali.load()
            self.assertIn("built against DALI", str(cm.exception))
        finally:
            dali.__version__ = real


class CacheAreaTest(unittest.TestCase):
    def test_a_partial_space_keeps_its_source_samples_in_the_cache_area(self):
        """A space holding part of the dataset (`--max-bytes`): the rest is
        read from the source files, byte-exact, and kept in the cache area
        (`cache_dir`), whose journal names what it holds."""
        tmp = tempfile.mkdtemp(prefix="kspeed-dali-cache-")
        try:
            src = os.path.join(tmp, "src")
            sh(K, "gen", "--profile", "tiny", "--count", "200", "--out", src, "--seed", "2")
            want = {}
            for root, _dirs, files in os.walk(src):
                for f in files:
                    with open(os.path.join(root, f), "rb") as fh:
                        want[digest(fh.read())] = f
            space = os.path.join(tmp, "space")
            sh(K, "--progress", "none", "preload", "--source", src, "--space", space, "--max-bytes", "256KiB")
            cache = os.path.join(tmp, "cache")

            @pipeline_def(batch_size=16, num_threads=2, device_id=None)
            def p():
                data, label = fn.kspeed.reader(space=space, random_shuffle=True, seed=3, pad_last_batch=True,
                                               name="Reader", mlock=False, ring_bytes="8MiB",
                                               cache_dir=cache, cache_bytes="1MiB")
                return data, label
            pipe = p()
            pipe.build()
            seen = set()
            for _ in range(2 * 13):  # two epochs of 200 in batches of 16, padded
                data, _label = pipe.run()
                for i in range(len(data)):
                    d = digest(data.at(i))
                    self.assertIn(d, want, "a sample that is no file of the source")
                    seen.add(d)
            del pipe
            self.assertEqual(seen, set(want))
            journal = os.path.join(cache, "rank0", "cache.journal")
            self.assertTrue(os.path.getsize(journal) > 0, "the cache area kept nothing")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class MembersTest(unittest.TestCase):
    """A space of tar samples of three members each (`--members
    jpg,txt,json`): `members` outputs the listed ones, in the order given,
    each byte-exact, before the label; names the space does not have, or a
    space of single files, are refused by name."""

    @classmethod
    def setUpClass(cls):
        import tarfile
        cls.tmp = tempfile.mkdtemp(prefix="kspeed-dali-members-")
        cls.n = 40
        rng = np.random.default_rng(3)
        cls.jpg = {}
        shard = os.path.join(cls.tmp, "s.tar")
        with tarfile.open(shard, "w") as t:
            for i in range(cls.n):
                members = {
                    "jpg": rng.integers(0, 256, int(rng.integers(100, 5000)), dtype=np.uint8).tobytes(),
                    "txt": f"txt of {i}".encode(),
                    "json": f'{{"id": {i}}}'.encode(),
                }
                cls.jpg[i] = members["jpg"]
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{i:05}.{ext}")
                    info.size = len(data)
                    t.addfile(info, __import__("io").BytesIO(data))
        cls.space = os.path.join(cls.tmp, "space")
        sh(K, "--progress", "none", "preload", "--source", "tar:" + shard, "--space", cls.space,
           "--members", "jpg,txt,json")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def pipe(self, space, members, batch=8, pad=True):
        @pipeline_def(batch_size=batch, num_threads=2, device_id=None)
        def p():
            return tuple(fn.kspeed.reader(space=space, members=members, random_shuffle=True, seed=5,
                                          pad_last_batch=pad, name="Reader", mlock=False,
                                          ring_bytes="8MiB"))
        pipe = p()
        pipe.build()
        return pipe

    def test_members_are_outputs_of_their_own_byte_exact(self):
        # 40 samples in batches of 7: a short last batch (padded) and,
        # without padding, batches across the epoch boundary (staged).
        for pad in (True, False):
            p = self.pipe(self.space, ["txt", "jpg"], batch=7, pad=pad)
            seen = []
            for _ in range(12):
                outs = p.run()
                self.assertEqual(len(outs), 3, "txt, jpg, label")
                txt, jpg, label = outs
                for i in range(len(txt)):
                    t = bytes(np.array(txt.at(i)))
                    self.assertTrue(t.startswith(b"txt of "), t)
                    sid = int(t[len("txt of "):])
                    self.assertEqual(bytes(np.array(jpg.at(i))), self.jpg[sid], f"sample {sid}")
                    self.assertEqual(int(label.at(i)[0]), -1)
                    seen.append(sid)
            del p
            # The first epoch: every sample once (then the padding or the
            # next epoch).
            self.assertEqual(sorted(set(seen[:self.n])), list(range(self.n)), f"pad_last_batch={pad}")

    def test_one_member_and_the_whole_sample(self):
        p = self.pipe(self.space, ["json"])
        json_out, label = p.run()
        for i in range(len(json_out)):
            self.assertRegex(bytes(np.array(json_out.at(i))).decode(), r'^\{"id": \d+\}$')
        del p
        # Without `members`: the sample's bytes, members back to back.
        p = self.pipe(self.space, [])
        data, label = p.run()
        for i in range(len(data)):
            b = bytes(np.array(data.at(i)))
            self.assertIn(b"txt of ", b)
            self.assertIn(b'{"id": ', b)

    def test_members_the_space_lacks_are_refused_by_name(self):
        ds_tmp = tempfile.mkdtemp(prefix="kspeed-dali-single-")
        try:
            single = Dataset(ds_tmp, profile="tiny", count=20)
            for space, members, needles in (
                (self.space, ["png"], ['member "png"', "jpg,txt,json"]),
                (single.space, ["jpg"], ["single files", "--members"]),
            ):
                with self.assertRaises(RuntimeError) as cm:
                    self.pipe(space, members).run()
                for needle in needles:
                    self.assertIn(needle, str(cm.exception))
        finally:
            shutil.rmtree(ds_tmp, ignore_errors=True)


class JpegTest(unittest.TestCase):
    def test_decoded_images_equal_the_files_decoded_directly(self):
        from PIL import Image
        tmp = tempfile.mkdtemp(prefix="kspeed-dali-jpeg-")
        try:
            src = os.path.join(tmp, "src")
            rng = np.random.default_rng(5)
            for c in ("cat", "dog", "eel"):
                os.makedirs(os.path.join(src, c))
                for i in range(12):
                    h, w = int(rng.integers(16, 120)), int(rng.integers(16, 120))
                    # Smooth gradients plus noise: a real JPEG, not a flat one.
                    y, x = np.mgrid[0:h, 0:w]
                    img = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) * 127 // (w + h))], -1)
                    img = np.clip(img + rng.integers(0, 40, img.shape), 0, 255).astype(np.uint8)
                    Image.fromarray(img).save(os.path.join(src, c, f"{i}.jpg"), quality=85)
            ds = Dataset(tmp, src=src)

            @pipeline_def(batch_size=6, num_threads=2, device_id=None)
            def ks():
                raw, label = fn.kspeed.reader(space=ds.space, random_shuffle=True, seed=1, name="Reader",
                                              mlock=False, ring_bytes="8MiB")
                return raw, fn.decoders.image(raw, device="cpu"), label

            @pipeline_def(batch_size=6, num_threads=2, device_id=None)
            def files():
                raw, label = fn.readers.file(file_root=src, name="Reader")
                return raw, fn.decoders.image(raw, device="cpu")

            reference = {}
            p = files()
            p.build()
            for _ in range(6):
                raw, img = p.run()
                for i in range(len(raw)):
                    reference[digest(raw.at(i))] = np.array(img.at(i))
            self.assertEqual(len(reference), 36)
            p = ks()
            p.build()
            checked = 0
            for _ in range(6):
                raw, img, label = p.run()
                for i in range(len(raw)):
                    want = reference[digest(raw.at(i))]
                    got = np.array(img.at(i))
                    self.assertEqual(got.shape, want.shape)
                    self.assertTrue(np.array_equal(got, want), "decoded image differs")
                    checked += 1
            self.assertEqual(checked, 36)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
