"""PEP 517 backend for the kspeed package: maturin's, plus two things.

The `rdma` feature (RDMA verbs through libibverbs) is turned on when
libibverbs' development files are installed, so `pip install ./ffi/python`
gives the RDMA transport where it can be built and a TCP-only package
elsewhere. KSPEED_RDMA=1 forces it on (the build fails without libibverbs),
KSPEED_RDMA=0 forces it off. Arguments given with MATURIN_PEP517_ARGS or
`--config-settings build-args=...` are kept.

The `kspeed` command: the wheel carries the repository's `kspeed` binary
(`cargo build --release --bin kspeed` of the root crate, with the same
`rdma` choice) as kspeed/_bin/kspeed, and the `kspeed` console script
(kspeed._cli) execs it, so `pip install ./ffi/python` puts the same CLI the
docs use on PATH. It is built into the extension's own target directory,
ffi/python/target, or CARGO_TARGET_DIR where that is set, as maturin does
(KSPEED_CLI_TARGET_DIR to move it elsewhere), before the extension: the two builds run one after the other and share every
dependency built with the same features (the object-store client, TLS,
the async runtime), where separate directories built each twice (about
2 minutes more on 2 cores); the kspeed library itself is built once per
feature set, side by side, so neither rebuilds the other's. KSPEED_CLI=0
leaves the command out (the console script then says how to get it).
KSPEED_CLI_BIN=/path/to/kspeed carries that binary instead of building one
(for example the `cargo build --release` of this checkout, which the test
script already has: the wheel's command is then that build, features and
all; it must run `--version`).
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


HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(HERE)  # ffi/python
REPO = os.path.dirname(os.path.dirname(PACKAGE))
BIN_DIR = os.path.join(PACKAGE, "python", "kspeed", "_bin")


def _build_cli():
    """Builds the `kspeed` binary and puts it at kspeed/_bin/kspeed."""
    want = os.environ.get("KSPEED_CLI", "1")
    if want not in ("0", "1"):
        raise ValueError(f"KSPEED_CLI must be 0 or 1, not {want!r}")
    exe = os.path.join(BIN_DIR, "kspeed")
    if want == "0":
        print("kspeed: KSPEED_CLI=0: the wheel carries no kspeed command")
        if os.path.exists(exe):
            os.remove(exe)
        return
    prebuilt = os.environ.get("KSPEED_CLI_BIN")
    if prebuilt:
        # The backend may run in another folder than the caller's.
        prebuilt = os.path.abspath(prebuilt)
        try:
            r = subprocess.run([prebuilt, "--version"], capture_output=True, text=True, check=False, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"kspeed: KSPEED_CLI_BIN={prebuilt!r} could not be run: {e}") from e
        if r.returncode != 0 or not r.stdout.startswith("kspeed "):
            raise RuntimeError(
                f"kspeed: KSPEED_CLI_BIN={prebuilt!r} is not a kspeed command "
                f"(`{prebuilt} --version` gave exit {r.returncode}: {(r.stdout + r.stderr).strip()[:200]!r})"
            )
        print(f"kspeed: carrying the prebuilt command {prebuilt} ({r.stdout.strip()})", flush=True)
        _install_cli(prebuilt, exe)
        return
    manifest = os.path.join(REPO, "Cargo.toml")
    if not os.path.exists(os.path.join(REPO, "src", "bin", "kspeed", "main.rs")):
        raise RuntimeError(
            f"kspeed: cannot build the kspeed command: {manifest} is not the kspeed repository "
            f"(build from a checkout, or set KSPEED_CLI=0 for a package without the command)"
        )
    # Where maturin builds the extension too (cargo's CARGO_TARGET_DIR, else
    # the package's own target/), so the two share their dependencies.
    target = (os.environ.get("KSPEED_CLI_TARGET_DIR") or os.environ.get("CARGO_TARGET_DIR")
              or os.path.join(PACKAGE, "target"))
    # s3: the command reads sources in object stores, as the extension does.
    features = "cli,s3,rdma" if rdma_wanted() else "cli,s3"
    cmd = ["cargo", "build", "--release", "--locked", "--bin", "kspeed", "--no-default-features",
           "--features", features, "--manifest-path", manifest, "--target-dir", target]
    print("kspeed: building the kspeed command:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    _install_cli(os.path.join(target, "release", "kspeed"), exe)


def _install_cli(src, exe):
    """Copies the binary `src` to `exe` (kspeed/_bin/kspeed), atomically."""
    os.makedirs(BIN_DIR, exist_ok=True)
    tmp = exe + ".tmp"
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, exe)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _build_cli()
    return _maturin.build_wheel(wheel_directory, _with_features(config_settings), metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _build_cli()
    return _maturin.build_editable(wheel_directory, _with_features(config_settings), metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _maturin.build_sdist(sdist_directory, config_settings)
