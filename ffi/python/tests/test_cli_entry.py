"""`pip install ./ffi/python` installs the `kspeed` command: the console
script beside this interpreter execs the Rust CLI the wheel carries."""

import os
import shutil
import subprocess
import sys

import kspeed
from conftest import CHILD_TIMEOUT_S, must_run


def venv_kspeed():
    exe = os.path.join(os.path.dirname(sys.executable), "kspeed")
    if not os.path.exists(exe):
        must_run(f"{exe} is not installed (this interpreter has no pip-installed kspeed package)")
    return exe


def run(*args):
    r = subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert r.returncode == 0, f"{args}: {r.stdout}{r.stderr}"
    return r.stdout


def test_the_kspeed_command_is_installed_and_works(tmp_path):
    exe = venv_kspeed()
    assert os.access(exe, os.X_OK)
    # The package's own binary, not one from PATH.
    from kspeed import _cli

    assert os.access(_cli.path(), os.X_OK), _cli.path()
    assert run(exe, "--version").strip() == f"kspeed {kspeed.__version__}"
    src, space = tmp_path / "gen", tmp_path / "space"
    out = run(exe, "--progress", "none", "gen", "--profile", "tiny", "--count", "40", "--out", src, "--classes", "3")
    assert os.path.isdir(src), out
    run(exe, "--progress", "none", "preload", "--source", src, "--space", space)
    with kspeed.Loader(str(space), batch_size=8) as loader:
        cat = loader.catalog
        assert len(cat) == 40
        for b in loader:
            for i, sid in enumerate(b.ids.tolist()):
                assert b.tobytes(i) == cat.read_source(sid)
    # Exit status and stderr are the CLI's own.
    r = subprocess.run([exe, "verify", "--space", str(tmp_path / "missing")], capture_output=True, text=True,
                       timeout=CHILD_TIMEOUT_S)
    assert r.returncode != 0 and "missing" in r.stderr, r
    # On PATH as `kspeed` once the venv's bin is.
    env = dict(os.environ, PATH=os.path.dirname(exe) + os.pathsep + os.environ.get("PATH", ""))
    assert shutil.which("kspeed", path=env["PATH"]) == exe
