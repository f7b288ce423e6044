"""Fixtures: real datasets on disk, real spaces made with the `kspeed` CLI,
and a `kspeed serve` process on loopback."""

import os
import select
import shutil
import signal
import subprocess
import sys
import time
import zlib

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def kspeed_bin():
    """The `kspeed` CLI: $KSPEED_BIN, else the repository's build (built if missing)."""
    b = os.environ.get("KSPEED_BIN")
    if b:
        return b
    for prof in ("debug", "release"):
        p = os.path.join(REPO, "target", prof, "kspeed")
        if os.path.exists(p):
            return p
    subprocess.run(["cargo", "build", "--quiet", "--bin", "kspeed"], cwd=REPO, check=True, timeout=1800)
    return os.path.join(REPO, "target", "debug", "kspeed")


def cli(*args):
    r = subprocess.run([kspeed_bin(), "--progress", "none", *map(str, args)], capture_output=True, text=True,
                       timeout=CHILD_TIMEOUT_S)
    assert r.returncode == 0, f"kspeed {' '.join(map(str, args))}: {r.stdout}{r.stderr}"
    return r.stdout


def sample_bytes(i, n):
    """Deterministic bytes for sample i (cheap: a repeated CRC-seeded pattern)."""
    seed = zlib.crc32(i.to_bytes(8, "little")).to_bytes(4, "little")
    block = bytes((seed[j % 4] + j * 31 + i) & 0xFF for j in range(257))
    return (block * (n // 257 + 1))[:n]


def make_tree(root, n=123, max_len=20000, classes=("ant", "bee", "cat", "dog")):
    """An ImageFolder tree: n files with awkward sizes (0, 1, 4095, 4096, 4097...)."""
    awkward = [0, 1, 4095, 4096, 4097, 8191, 8192, 12345]
    for i in range(n):
        size = awkward[i] if i < len(awkward) else (i * 7919) % max_len
        d = os.path.join(root, classes[i % len(classes)])
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"s{i:05d}.bin"), "wb") as f:
            f.write(sample_bytes(i, size))
    return root


@pytest.fixture(scope="session")
def tree(tmp_path_factory):
    return make_tree(str(tmp_path_factory.mktemp("src")))


@pytest.fixture(scope="session")
def space(tree, tmp_path_factory):
    """A space preloaded with the CLI."""
    sp = str(tmp_path_factory.mktemp("sp") / "space")
    cli("preload", "--source", tree, "--space", sp)
    return sp


@pytest.fixture(scope="session")
def token_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("tok") / "token"
    p.write_text("pytest-job-token\n")
    return str(p)


#: The longest any test waits for one answer from a child process.
CHILD_TIMEOUT_S = 120


def default_sigint():
    """preexec_fn for a child that must answer Ctrl-C: SIGINT back to its
    default. A shell runs background commands (`cmd &`, as CI harnesses do)
    with SIGINT ignored, children inherit that, and Python then installs no
    KeyboardInterrupt handler: a SIGINT would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_line(proc, timeout_s=CHILD_TIMEOUT_S):
    """The next line of `proc`'s stdout (without its newline), waiting at
    most `timeout_s` (a select loop on the pipe, never a blocking read);
    fails with what the child said on stderr when the deadline passes or the
    child ends first. Read a child's stdout only through this function."""
    buf = proc.__dict__.setdefault("_line_buf", bytearray())
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no line from the child in {timeout_s} s (got {bytes(buf)!r}); "
                                 f"stderr: {stop_and_stderr(proc)}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"the child closed its stdout (got {bytes(buf)!r}); "
                                     f"stderr: {stop_and_stderr(proc)}")
            buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line.decode()


def read_to_eof(fd, timeout_s=CHILD_TIMEOUT_S):
    """Everything written to the pipe `fd` until its last writer closes it,
    waiting at most `timeout_s` in all (a select loop); fails past it."""
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the child did not close the pipe in {timeout_s} s (got {bytes(out)!r})")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return bytes(out)
            out += chunk


def stop_and_stderr(proc, timeout_s=10):
    """Kills `proc` if it still runs and returns its stderr (for messages;
    never blocks past `timeout_s`)."""
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=timeout_s)
        err = proc.stderr.read() if proc.stderr else ""
    except (subprocess.TimeoutExpired, ValueError, OSError) as e:
        err = f"<unreadable: {e}>"
    return err.decode(errors="replace") if isinstance(err, bytes) else err


class Serve:
    """A `kspeed serve` process on 127.0.0.1."""

    def __init__(self, space, token_file):
        self.proc = subprocess.Popen(
            [kspeed_bin(), "serve", "--space", space, "--listen", "127.0.0.1:0", "--token-file", token_file,
             "--pollers", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = read_line(self.proc)
        self.addr = line.strip().rsplit(" ", 1)[-1]
        assert ":" in self.addr, f"serve printed {line!r}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=CHILD_TIMEOUT_S)


@pytest.fixture
def serve(space, token_file):
    s = Serve(space, token_file)
    yield s
    s.stop()


@pytest.fixture
def python():
    return sys.executable


def have(mod):
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


def must_run(why):
    """Skips a test that cannot run here, saying `why`, except in CI
    (KSPEED_PY_REQUIRE_ALL=1), where everything must run: a failure."""
    if os.environ.get("KSPEED_PY_REQUIRE_ALL") == "1" or os.environ.get("CI"):
        pytest.fail(f"this test must run here (KSPEED_PY_REQUIRE_ALL/CI), but {why}")
    pytest.skip(why)


def require(mod):
    """Skips without `mod`, except in CI (see `must_run`)."""
    if not have(mod):
        must_run(f"{mod} is not installed")


__all__ = ["cli", "kspeed_bin", "make_tree", "must_run", "sample_bytes", "Serve", "require", "shutil", "read_line",
           "read_to_eof",
           "stop_and_stderr", "default_sigint", "CHILD_TIMEOUT_S"]
