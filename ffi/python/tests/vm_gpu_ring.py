"""Runs inside the soft-RoCE VM (../shared/rdma-vm/run-in-vm.sh), started by
test_gpu_ring.py with the CUDA driver stand-in (tests/c/fake_cuda.c built as
libcuda.so.1) first on LD_LIBRARY_PATH: a `kspeed serve --rdma` node pushes
every sample with RDMA WRITE into a Python loader's GPU ring, and the batches
are checked the way a PyTorch user's code sees them: `__dlpack_device__` is
(kDLCUDA, 0), the DLPack capsules describe device memory, numpy views are
refused, and every sample's bytes, copied out of "device" memory with the
driver's cuMemcpyDtoH at the addresses the capsules give, equal its source
file.

usage: vm_gpu_ring.py SOURCE SPACE TOKEN_FILE KSPEED_BIN
"""

import ctypes
import os
import select
import subprocess
import sys

import kspeed

KDL_CUDA, KDL_UINT = 2, 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
get_pointer.restype = ctypes.c_void_p
get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def tensor(capsule):
    """(data address, device, length) of a 1-D uint8 DLPack capsule."""
    t = DLManagedTensor.from_address(get_pointer(capsule, b"dltensor")).dl_tensor
    assert t.ndim == 1 and (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (KDL_UINT, 8, 1), "1-D uint8"
    assert not t.strides, "compact"
    return t.data + t.byte_offset, (t.device.device_type, t.device.device_id), t.shape[0]


class Driver:
    """The CUDA driver API as a user reaches it with ctypes (here: the
    stand-in kspeed itself loaded)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.ok(self.lib.cuInit(0), "cuInit")
        self.ctx = ctypes.c_void_p()
        self.ok(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), 0), "cuDevicePrimaryCtxRetain")
        self.ok(self.lib.cuCtxPushCurrent_v2(self.ctx), "cuCtxPushCurrent")

    @staticmethod
    def ok(rc, what):
        assert rc == 0, f"{what} failed with CUDA error {rc}"

    def copy_out(self, addr, n):
        buf = ctypes.create_string_buffer(max(n, 1))
        self.ok(self.lib.cuMemcpyDtoH_v2(buf, ctypes.c_ulonglong(addr), ctypes.c_size_t(n)), "cuMemcpyDtoH")
        return buf.raw[:n]

    def close(self):
        self.ok(self.lib.cuCtxPopCurrent_v2(None), "cuCtxPopCurrent")
        self.ok(self.lib.cuDevicePrimaryCtxRelease_v2(0), "cuDevicePrimaryCtxRelease")


def main():
    source, space, token_file, kspeed_bin = sys.argv[1:5]
    ip = os.environ["RDMA_VM_IP"]
    serve = subprocess.Popen([kspeed_bin, "serve", "--space", space, "--listen", f"{ip}:0", "--token-file",
                              token_file, "--pollers", "1", "--rdma"], stdout=subprocess.PIPE, text=True)
    try:
        # A deadline on the read (serve prints its one line at once).
        ready, _, _ = select.select([serve.stdout], [], [], 120)
        assert ready, "kspeed serve printed nothing in 120 s"
        line = serve.stdout.readline()
        assert line.startswith("serving"), f"kspeed serve said {line!r}"
        addr = line.strip().rsplit(" ", 1)[1]
        cat = kspeed.Catalog.open(space)
        want = {i: cat.read_source(i) for i in range(len(cat))}
        cuda = Driver()
        # A 512 KiB ring: batches wrap around its end now and then.
        loader = kspeed.Loader(source=source, catalog=os.path.join(space, "catalog.ksc"), cluster=[addr],
                               token_file=token_file, rdma=True, gpu_ring=0, batch_size=8, seed=4,
                               ring_bytes="512KiB", node_timeout=60)
        checked, nonempty, wrapped = 0, 0, 0
        for epoch in range(2):
            loader.set_epoch(epoch)
            ids = []
            for b in loader:
                assert b.__dlpack_device__() == (KDL_CUDA, 0), b.__dlpack_device__()
                for refused in (b.array, lambda: b.sample(0)):
                    try:
                        refused()
                        raise AssertionError("a host view of GPU memory was handed out")
                    except ValueError as e:
                        assert "GPU memory (CUDA device 0)" in str(e), e
                offs, lens = b.offsets.tolist(), b.lengths.tolist()
                if b.is_zero_copy:
                    cap = b.__dlpack__()
                    base, dev, span = tensor(cap)
                    assert dev == (KDL_CUDA, 0) and span >= offs[-1] + lens[-1], (dev, span)
                    assert b.views == 1, "the capsule holds the batch"
                    del cap
                else:
                    wrapped += 1
                    try:
                        b.__dlpack__()
                        raise AssertionError("a wrapped GPU batch exported as one tensor")
                    except ValueError as e:
                        assert "wraps around the end of a GPU ring" in str(e), e
                for i, sid in enumerate(b.ids.tolist()):
                    a, dev, n = tensor(b.sample_dlpack(i))
                    assert dev == (KDL_CUDA, 0) and n == lens[i] == len(want[sid]), (dev, n, lens[i])
                    if b.is_zero_copy:
                        assert a == base + offs[i], "sample i sits at offsets[i] of the batch's tensor"
                    assert cuda.copy_out(a, n) == want[sid], f"sample {sid}: bytes differ"
                    assert b.labels[i] == cat.labels[sid]
                    checked += 1
                    nonempty += 1 if n > 0 else 0  # an empty sample needs no transfer
                ids.extend(b.ids.tolist())
            assert sorted(ids) == list(range(len(cat))), f"epoch {epoch}: not every sample once"
        st = loader.stats()
        loader.close()
        cuda.close()
        assert st["remote_samples"] >= nonempty and st["source_reads"] == 0, st
        assert wrapped > 0, "no batch wrapped around the ring's end: the wrapped case went unchecked"
        print(f"ok: {checked} samples over RDMA into the GPU ring, {wrapped} wrapped batches")
    finally:
        serve.terminate()
        serve.wait()


if __name__ == "__main__":
    main()
