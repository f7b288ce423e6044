"""PEP 517 backend for the kspeed package: maturin's, plus one decision.

The `rdma` feature (RDMA verbs through libibverbs) is turned on when
libibverbs' development files are installed, so `pip install ./ffi/python`
gives the RDMA transport where it can be built and a TCP-only package
elsewhere. KSPEED_RDMA=1 forces it on (the build fails without libibverbs),
KSPEED_RDMA=0 forces it off. Arguments given with MATURIN_PEP517_ARGS or
`--config-settings build-args=...` are kept.
"""

import os
import shutil
import subprocess

import maturin as _maturin
from maturin import (  # noqa: F401  (the rest of the PEP 517 interface)
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)


def has_libibverbs():
    """Whether libibverbs can be compiled and linked against here."""
    if shutil.which("pkg-config"):
        r = subprocess.run(["pkg-config", "--exists", "libibverbs"], check=False)
        if r.returncode == 0:
            return True
    return os.path.exists("/usr/include/infiniband/verbs.h")


def rdma_wanted():
    v = os.environ.get("KSPEED_RDMA", "auto")
    if v not in ("auto", "0", "1"):
        raise ValueError(f"KSPEED_RDMA must be auto, 0 or 1, not {v!r}")
    return v == "1" or (v == "auto" and has_libibverbs())


def _with_features(config_settings):
    if not rdma_wanted():
        print("kspeed: building without RDMA (no libibverbs development files; TCP and local only)")
        return config_settings
    print("kspeed: building with the rdma feature (libibverbs found)")
    cs = dict(config_settings or {})
    key = "maturin.build-args" if "maturin.build-args" in cs else "build-args"
    if key in cs:
        args = cs[key]
        cs[key] = (args + " --features rdma") if isinstance(args, str) else list(args) + ["--features", "rdma"]
    else:
        cs[key] = (os.environ.get("MATURIN_PEP517_ARGS", "") + " --features rdma").strip()
    return cs


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _maturin.build_wheel(wheel_directory, _with_features(config_settings), metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _maturin.build_editable(wheel_directory, _with_features(config_settings), metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _maturin.build_sdist(sdist_directory, config_settings)
