"""Ctrl-C interrupts a loader that waits for data, promptly, and loses no batch."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import kspeed
from conftest import CHILD_TIMEOUT_S, Serve, default_sigint, read_line, stop_and_stderr

CHILD = textwrap.dedent(
    """
    import json, sys, traceback, kspeed
    loader = kspeed.Loader(source=sys.argv[1], catalog=sys.argv[2], cluster=[sys.argv[3]], token_file=sys.argv[4],
                           batch_size=4, seed=3, ring_bytes="128KiB", node_timeout=300)
    print("ready", flush=True)
    sys.stdin.readline()  # the server is stopped now
    got = []
    try:
        while True:
            b = loader.next_batch()
            if b is None:
                break
            got.extend(b.ids.tolist())
            del b
    except KeyboardInterrupt:
        tb = traceback.format_exc()
        print("interrupted in_next_batch=%s" % ("next_batch" in tb), flush=True)
    sys.stdin.readline()  # the server runs again
    if sys.argv[5] == "restart":
        # Another epoch: the batch the interrupted wait was for is dropped.
        loader.set_epoch(1)
        got = []
    for b in loader:
        assert not b.released
        got.extend(b.ids.tolist())
    print(json.dumps(got), flush=True)
    """
)


def main_thread_waits(pid):
    """The process's main thread sleeps in a futex wait (the loader's wait
    loop, GIL released), seen on two reads in a row."""
    for _ in range(2):
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/task/{pid}/wchan") as f:
            wchan = f.read()
        # wchan reads "0" where the kernel hides it; the state must be S.
        if state != "S" or ("futex" not in wchan and wchan.strip() != "0"):
            return False
    return True


@pytest.mark.parametrize("after", ["resume", "restart"])
def test_ctrl_c_interrupts_a_wait_and_the_batch_is_not_lost(tree, space, token_file, after):
    """resume: the same epoch goes on with exactly the remaining batches;
    restart: set_epoch(1) after the interrupt reads epoch 1 from its start."""
    cat = os.path.join(space, "catalog.ksc")
    with kspeed.Loader(space, batch_size=4, seed=3, ring_bytes="128KiB") as ref:
        if after == "restart":
            ref.set_epoch(1)
        want = [i for b in ref for i in b.ids.tolist()]
    serve = Serve(space, token_file)
    # default_sigint: under a harness that runs the suite with SIGINT
    # ignored (a background job of a shell), the child would inherit that and
    # the SIGINT below would do nothing (the child then waited out the
    # node timeout and blocked in its next readline).
    child = subprocess.Popen([sys.executable, "-c", CHILD, tree, cat, serve.addr, token_file, after],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=default_sigint)
    try:
        assert read_line(child).strip() == "ready"
        os.kill(serve.proc.pid, signal.SIGSTOP)
        child.stdin.write("\n")
        child.stdin.flush()
        # Wait (with a deadline) until the child is blocked in the loader:
        # the 64 KiB ring holds a few batches read ahead, then it waits for
        # the stopped server (300 s before failover).
        deadline = time.monotonic() + 60
        while not main_thread_waits(child.pid):
            assert time.monotonic() < deadline, "the child never blocked"
            assert child.poll() is None, stop_and_stderr(child)
            time.sleep(0.02)
        child.send_signal(signal.SIGINT)
        # Promptly: the wait checks for signals every 50 ms; a 60 s deadline
        # is far below the 300 s the wait would otherwise last.
        line = read_line(child, timeout_s=60).strip()
        assert line == "interrupted in_next_batch=True", (line, stop_and_stderr(child))
        os.kill(serve.proc.pid, signal.SIGCONT)
        child.stdin.write("\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
        assert child.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got == want, "a batch was lost or repeated around the interrupt"
    finally:
        if child.poll() is None:
            child.kill()
        os.kill(serve.proc.pid, signal.SIGCONT)
        serve.stop()


RACE_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time, kspeed
    tree, cat, addr, token_file, serve_pid, rounds = sys.argv[1:7]
    serve_pid, rounds = int(serve_pid), int(rounds)
    loader = kspeed.Loader(source=tree, catalog=cat, cluster=[addr], token_file=token_file, batch_size=2, seed=5,
                           ring_bytes="64KiB", node_timeout=300)
    main_tid = threading.get_native_id()
    # KeyboardInterrupt only while next_batch is being called ("armed"):
    # raised there, it must not lose the batch the call was waiting for.
    armed = False
    interrupts = 0
    sent = 0

    def on_sigint(sig, frame):
        if armed:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    done = False

    def blocked():
        with open(f"/proc/self/task/{main_tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "S"

    def helper():
        global sent
        # Each round: stop the server, wait until the main thread waits in
        # next_batch for data, then SIGINT and at once SIGCONT, so that the
        # batch arrives while the signal is pending (the same 50 ms slice).
        for _ in range(rounds):
            os.kill(serve_pid, signal.SIGSTOP)
            deadline = time.monotonic() + 60
            while not done and not (armed and blocked() and (time.sleep(0.02) or (armed and blocked()))):
                assert time.monotonic() < deadline, "the main thread never waited"
                time.sleep(0.005)
            sent += 1
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(serve_pid, signal.SIGCONT)
            if done:
                return
            before = interrupts
            deadline = time.monotonic() + 60
            while not done and interrupts == before:
                assert time.monotonic() < deadline, "no interrupt"
                time.sleep(0.005)

    t = threading.Thread(target=helper, daemon=True)
    t.start()
    got = []
    while True:
        armed = True
        try:
            b = loader.next_batch()
        except KeyboardInterrupt:
            armed = False
            interrupts += 1
            continue
        armed = False
        if b is None:
            if loader.epoch == 1:
                break
            loader.set_epoch(1)
            continue
        got.extend(b.ids.tolist())
        del b
    done = True
    t.join(60)
    os.kill(serve_pid, signal.SIGCONT)
    print(json.dumps({"ids": got, "interrupts": interrupts, "sent": sent}), flush=True)
    """
)


def test_ctrl_c_as_the_batch_arrives_loses_nothing(tree, space, token_file):
    """SIGINT while next_batch waits, with the batch arriving in the same
    50 ms slice (the server is resumed right after the signal): the
    KeyboardInterrupt comes from inside next_batch and the batch comes with
    the next call. (Before, the batch was returned with the signal pending
    and the interpreter's check right after the call dropped it.)"""
    cat = os.path.join(space, "catalog.ksc")
    with kspeed.Loader(space, batch_size=2, seed=5, ring_bytes="64KiB") as ref:
        want = [i for b in ref for i in b.ids.tolist()]
        ref.set_epoch(1)
        want += [i for b in ref for i in b.ids.tolist()]
    serve = Serve(space, token_file)
    rounds = 4
    child = subprocess.Popen([sys.executable, "-c", RACE_CHILD, tree, cat, serve.addr, token_file,
                              str(serve.proc.pid), str(rounds)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
        assert child.returncode == 0, err
        r = json.loads(out.strip().splitlines()[-1])
        # Every SIGINT came while next_batch waited (the helper checks the
        # main thread sleeps there first). Nearly always each raises from
        # inside next_batch; one that lands in the microseconds between
        # next_batch's last check and its return reaches the handler after
        # `armed` is cleared and is ignored (the batch was returned: nothing
        # lost). Rounds stop early if the two epochs end first, as they can
        # on a loaded machine. What must hold every time: no batch lost or
        # repeated, and at least one interrupt raised from the wait.
        assert 1 <= r["interrupts"] <= r["sent"] <= rounds, (r["interrupts"], r["sent"], err)
        assert r["ids"] == want, "a batch was lost or repeated around an interrupt"
    finally:
        if child.poll() is None:
            child.kill()
        os.kill(serve.proc.pid, signal.SIGCONT)
        serve.stop()
