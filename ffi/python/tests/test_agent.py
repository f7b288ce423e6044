"""kspeed.Loader attached to a real `kspeed agent` process: the agent is
killed (SIGKILL) while the loader reads, a new agent starts on the same
socket, and with ``agent_restart_wait_ms`` the loader continues where it
stood: every sample of the epoch once, in the embedded loader's order,
byte for byte. Without the wait, the loss of the agent is a named error."""

import subprocess

import pytest

import kspeed
from conftest import CHILD_TIMEOUT_S, cli, kspeed_bin, make_tree, read_line, stop_and_stderr


class Agent:
    """A `kspeed agent` on a socket; SIGKILLed by `kill()` or at the end."""

    def __init__(self, space, sock, more_spaces=(), extra=()):
        more = [a for sp in more_spaces for a in ("--space", sp)]
        self.proc = subprocess.Popen(
            [kspeed_bin(), "agent", "--space", space, *more, "--socket", str(sock), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = read_line(self.proc)
        assert "agent serving" in line, f"agent printed {line!r}: {stop_and_stderr(self.proc)}"

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=CHILD_TIMEOUT_S)


def samples(loader, after_first=None):
    """Every (id, bytes) of one epoch; `after_first()` runs once, after the
    first batch is taken and released."""
    got = []
    for b in loader:
        got.extend((int(b.ids[i]), b.sample(i).tobytes()) for i in range(len(b)))
        if after_first is not None:
            after_first()
            after_first = None
    return got


def attached(space, sock, **kw):
    # A 256 KiB ring holds a few batches: the agent cannot have read the
    # epoch ahead before it is killed.
    return kspeed.Loader(space, batch_size=4, seed=5, ring_bytes="256KiB", pin=False,
                         agent="required", agent_socket=sock, **kw)


def held_samples(loader, after_fn, after=3, hold=2):
    """Every (id, bytes) of one epoch, holding the last `hold` batches with
    live numpy views while the next one is read; `after_fn()` runs once,
    after batch `after` was taken. Each batch's views are checked against
    the bytes it was handed out with when it is let go."""
    got, out = [], []
    for n, b in enumerate(loader, 1):
        views = b.samples()
        out.append((b, views, [(int(b.ids[i]), views[i].tobytes()) for i in range(len(b))]))
        if len(out) > hold:
            let_go(out.pop(0), got)
        if n == after:
            after_fn()
    while out:
        let_go(out.pop(0), got)
    return got


def let_go(held, got):
    b, views, first = held
    now = [(i, v.tobytes()) for (i, _), v in zip(first, views)]
    assert now == first, "a batch held across the agent's restart changed while out"
    views.clear()  # the list held the batch's only views
    b.release()
    got.extend(first)


def check_read_across_a_restart(space, tmp_path, read):
    """`read(loader, restart)` over an attached loader whose agent is
    killed and replaced once (when `read` calls `restart()`) delivers the
    embedded loader's epoch, byte for byte."""
    sock = tmp_path / "agent.sock"
    agents = [Agent(space, sock)]

    def restart():
        agents[0].kill()
        agents.append(Agent(space, sock))

    try:
        with attached(space, sock, agent_restart_wait_ms=60_000, batches_in_flight=3) as loader:
            got = read(loader, restart)
    finally:
        for a in agents:
            a.kill()
    with kspeed.Loader(space, batch_size=4, seed=5, ring_bytes="256KiB", pin=False, agent="off") as loader:
        want = samples(loader)
    assert len(agents) == 2
    assert [i for i, _ in got] == [i for i, _ in want]
    assert got == want


# Python reads with acquire_batch_keep: batches held by the caller (with
# views) stay valid across the re-attach, the dead attach's ring retired
# until they are released.
def test_a_restarted_agent_takes_the_loader_back_exactly_once(space, tmp_path):
    check_read_across_a_restart(space, tmp_path, lambda l, r: samples(l, after_first=r))


def test_batches_held_across_a_restarted_agent_stay_valid(space, tmp_path):
    check_read_across_a_restart(space, tmp_path, held_samples)


def test_without_the_wait_a_dead_agent_is_a_named_error(space, tmp_path):
    sock = tmp_path / "agent.sock"
    agent = Agent(space, sock)
    try:
        with attached(space, sock) as loader:
            with pytest.raises(kspeed.Error, match=r"kspeed agent at .*agent\.sock.* is gone"):
                samples(loader, after_first=agent.kill)
    finally:
        agent.kill()


def test_a_state_from_another_world_resumes_attached(space, tmp_path):
    """A job resumed on another number of GPUs through the agent: world 2
    takes 3 batches, its state is loaded by 3 attached ranks, and each
    delivers the rest of the epoch as an embedded rank of 3 does, byte for
    byte (the agent deals the epoch from the job position)."""
    sock = tmp_path / "agent.sock"
    agent = Agent(space, sock)
    try:
        def loader(rank, world, mode):
            return kspeed.Loader(space, batch_size=4, seed=5, ring_bytes="256KiB", pin=False,
                                 rank=rank, world=world, agent=mode, agent_socket=sock)

        with loader(0, 2, "off") as two:
            it = iter(two)
            for _ in range(3):
                next(it).release()
            state = two.state_dict()
        for rank in range(3):
            with loader(rank, 3, "required") as a, loader(rank, 3, "off") as e:
                a.load_state_dict(state)
                e.load_state_dict(state)
                got, want = samples(a), samples(e)
                assert got, f"rank {rank}: nothing left of the epoch"
                assert got == want, f"rank {rank} of 3"
    finally:
        agent.kill()


def test_a_mixture_reads_through_an_agent_serving_its_spaces(space, tmp_path):
    """``Loader(mix=...)`` of two spaces through an agent given both
    (``kspeed agent --space A --space B``): each rank of 2 reads what an
    embedded rank reads, in order and byte for byte, over two epochs."""
    second = str(tmp_path / "second")
    cli("preload", "--source", make_tree(str(tmp_path / "src2"), n=17, classes=("x", "y")),
        "--space", second)
    sock = tmp_path / "agent.sock"
    agent = Agent(space, sock, more_spaces=[second])
    try:
        def loader(rank, mode):
            return kspeed.Loader(mix=[(space, 0.7), (second, 0.3)], mix_epoch_size=60, batch_size=4,
                                 seed=5, ring_bytes="256KiB", pin=False, rank=rank, world=2,
                                 agent=mode, agent_socket=sock)

        for rank in range(2):
            with loader(rank, "required") as a, loader(rank, "off") as e:
                got, want = [], []
                for epoch in (1, 2):
                    a.set_epoch(epoch)
                    e.set_epoch(epoch)
                    got += samples(a)
                    want += samples(e)
                assert len(got) == 60, f"rank {rank}: {len(got)} samples"
                assert got == want, f"rank {rank} of 2"
                assert {i for i, _ in got if i >= len(kspeed.Catalog.open(space + "/catalog.ksc"))}, \
                    "no sample of the second space"
    finally:
        agent.kill()


def test_tier_views_through_the_agent_are_read_only_views_of_the_node_tier(space, tmp_path):
    """``tier_views=True`` attached to an agent with a node tier
    (``kspeed agent --tier-bytes``): once epoch 0 filled the tier, epoch 1's
    samples come as views of it (``sample_in_tier``), read-only numpy
    arrays (writing one raises), byte for byte what an embedded loader
    reads; a batch holding one is not ``in_ring``."""
    sock = tmp_path / "agent.sock"
    agent = Agent(space, sock, extra=("--tier-bytes", "16MiB", "--no-mlock"))
    try:
        kw = dict(batch_size=4, seed=5, ring_bytes="256KiB", pin=False, tier_views=True,
                  agent_socket=sock)
        with kspeed.Loader(space, agent="required", **kw) as a, kspeed.Loader(space, agent="off", **kw) as e:
            a.set_epoch(0)
            samples(a)
            a.set_epoch(1)
            got, views, out_of_ring = [], 0, 0
            for b in a:
                for i in range(len(b)):
                    v = b.sample(i)
                    got.append((int(b.ids[i]), v.tobytes()))
                    if b.sample_in_tier(i):
                        views += 1
                        assert not v.flags.writeable
                        with pytest.raises(ValueError):
                            v[0] = 0
                out_of_ring += not b.in_ring
            e.set_epoch(1)
            assert got == samples(e)
            # Epoch 0 filled the tier; only samples read ahead while it was
            # still filling come in the ring.
            assert views >= len(got) // 2, f"{views} views of {len(got)} samples"
            assert out_of_ring > 0
    finally:
        agent.kill()


def test_tier_views_held_across_a_restarted_agent_stay_valid(space, tmp_path):
    """Batches held with live views of the node tier (``tier_views=True``)
    while the agent is SIGKILLed and a new one takes the loader back
    (``agent_restart_wait_ms``): the held views keep their bytes (the dead
    agent's tier stays mapped until they are released), and the epoch is
    the embedded loader's, byte for byte, each sample once."""
    sock = tmp_path / "agent.sock"
    extra = ("--tier-bytes", "16MiB", "--no-mlock")
    agents = [Agent(space, sock, extra=extra)]
    got, out, views_at_restart = [], [], 0
    try:
        with attached(space, sock, agent_restart_wait_ms=60_000, batches_in_flight=3,
                      tier_views=True) as loader:
            loader.set_epoch(0)
            samples(loader)  # fills the node tier
            loader.set_epoch(1)
            for n, b in enumerate(loader, 1):
                views = b.samples()
                out.append((b, views, [(int(b.ids[i]), views[i].tobytes()) for i in range(len(b))]))
                if len(out) > 2:
                    let_go(out.pop(0), got)
                if n == 3:
                    views_at_restart = sum(h.sample_in_tier(i) for h, _, _ in out for i in range(len(h)))
                    agents[0].kill()
                    agents.append(Agent(space, sock, extra=extra))
            while out:
                let_go(out.pop(0), got)
    finally:
        for a in agents:
            a.kill()
    assert views_at_restart > 0, "no tier view was held across the restart"
    with kspeed.Loader(space, batch_size=4, seed=5, ring_bytes="256KiB", pin=False, agent="off") as e:
        e.set_epoch(1)
        want = samples(e)
    assert len(agents) == 2
    assert got == want
