"""Loads the kspeed DALI plugin: `import kspeed_dali; kspeed_dali.load()` and
then `nvidia.dali.fn.kspeed.reader(...)` exists.

A DALI plugin must run with the exact DALI it was compiled against; load()
checks that first and raises a clear error instead of a crash or an obscure
symbol error.
"""

import ctypes
import os

import nvidia.dali as dali
import nvidia.dali.plugin_manager as plugin_manager

HERE = os.path.dirname(os.path.abspath(__file__))


def load(path=None):
    """Loads libkspeed_dali.so (default: next to this file, or $KSPEED_DALI_PLUGIN)."""
    path = path or os.environ.get("KSPEED_DALI_PLUGIN") or os.path.join(HERE, "libkspeed_dali.so")
    if not os.path.exists(path):
        raise RuntimeError(f"kspeed DALI plugin not found at {path}: build it with ffi/dali/build_and_test.sh")
    # RTLD_LOCAL: just read the version string; DALI loads it for real below.
    lib = ctypes.CDLL(path, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    lib.kspeed_dali_built_against.restype = ctypes.c_char_p
    built = lib.kspeed_dali_built_against().decode()
    if built != dali.__version__:
        raise RuntimeError(
            f"the kspeed DALI plugin at {path} was built against DALI {built}, but this is DALI "
            f"{dali.__version__}: rebuild it (ffi/dali/build_and_test.sh) with this DALI")
    plugin_manager.load_library(path)
    return path
