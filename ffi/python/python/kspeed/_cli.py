"""The `kspeed` console script: execs the `kspeed` binary the wheel carries
(kspeed/_bin/kspeed, built from the repository's root crate by the package's
build backend), so the command is the Rust CLI itself: same arguments,
output, exit status and signal handling."""

import os
import sys


def path():
    """Where the packaged `kspeed` binary is (it may be absent: a package
    built with KSPEED_CLI=0)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "kspeed")


def main():
    exe = path()
    if not os.access(exe, os.X_OK):
        sys.stderr.write(
            f"kspeed: this kspeed package carries no kspeed command ({exe} is missing: it was built with "
            f"KSPEED_CLI=0); reinstall with `pip install ./ffi/python`, or build it with "
            f"`cargo build --release --bin kspeed`\n"
        )
        return 127
    os.execv(exe, ["kspeed", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
