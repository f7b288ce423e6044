"""The loader's one options table from Python: every key of
``kspeed.options()`` takes the same range as the C ABI (``ksp_config_set``
parses strings through the same table: ``_check_option(..., from_str=True)``
is that parser, and tests/options.rs checks the C ABI against it), and
``kspeed.Loader`` refuses one below the minimum, one above the maximum and a
value of the wrong type with the same message."""

import inspect

import pytest

import kspeed
from kspeed import _kspeed

LOADER_ARGS = set(inspect.signature(kspeed.Loader).parameters)
# Keys that need another argument first (checked through the table's typed
# path, which Loader uses too).
PAIRED = {"rank", "world", "local_rank", "local_world_size"}
CLUSTER = {"rdma", "node_timeout", "local_node", "rdma_device", "rdma_port", "rdma_gid_index"}
LISTED = {"cluster_nodelist", "cluster_nodes_dns", "cluster_node_count", "cluster_port"}


def c_message(name, text):
    """The message of the string parser (the C ABI's), or None if accepted."""
    try:
        _kspeed._check_option(name, text, from_str=True)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def cases(o):
    """(Python value, the same value as a C string, accepted)."""
    t = o["type"]
    if t in ("int", "size", "int or auto", "size or auto"):
        lo, hi = o["min"], o["max"]
        out = [(lo, str(lo), True), (hi, str(hi), True)]
        if lo > 0:
            out.append((lo - 1, str(lo - 1), False))
        if hi < 2**64 - 1 or t not in ("size", "size or auto"):
            out.append((hi + 1, str(hi + 1), False))
        out.append(("x", "x", False))
        if t.endswith("or auto"):
            out.append(("auto", "auto", True))
        return out
    if t == "seconds":
        lo, hi = o["min"] / 1000, o["max"] / 1000
        return [(lo, str(lo), True), (hi, str(hi), True), (0.0, "0", False), (hi + 1, str(hi + 1), False),
                ("x", "x", False)]
    if t == "bool":
        return [(True, "true", True), (False, "false", True), ("x", "x", False)]
    if t == "choice":
        return [(w, w, True) for w in o["choices"]] + [("yes", "yes", False)]
    return []


def loader_kwargs(name, v):
    kw = {name: v}
    if name in CLUSTER or name in LISTED:
        kw["token"] = "t"
    if name in CLUSTER:
        kw["cluster"] = ["127.0.0.1:9"]
    if name.startswith("rdma_"):
        kw["rdma"] = True
    return kw


def test_the_table_is_the_crate_s():
    names = [o["name"] for o in kspeed.options()]
    assert len(names) == len(set(names))
    for key in ("max_read_bytes", "spin_us", "sqpoll_idle_ms", "registered_buffers", "registered_files", "gpu_pci",
                "cuda", "local_node", "cluster_nodelist", "cluster_nodes_dns", "cluster_port", "node_timeout_ms"):
        assert key in names, key
    qd = next(o for o in kspeed.options() if o["name"] == "queue_depth")
    assert (qd["min"], qd["max"], qd["default"]) == (1, 16384, "32")
    assert "queue_depth" in kspeed.Loader.__doc__
    nt = next(o for o in kspeed.options() if o["name"] == "node_timeout")
    assert nt["alias_of"] == "node_timeout_ms"


def test_every_key_takes_the_same_range_and_message_as_the_c_abi(tmp_path):
    checked = 0
    for o in kspeed.options():
        name = o["name"]
        for v, text, ok in cases(o):
            want = c_message(name, text)
            assert (want is None) == ok, (name, text, want)
            # The typed path every keyword argument takes.
            try:
                _kspeed._check_option(name, v)
                got = None
            except (TypeError, ValueError) as e:
                got = str(e)
            assert got == want, (name, v)
            # And kspeed.Loader itself, for the keys it takes on their own.
            if not ok and name in LOADER_ARGS and name not in PAIRED:
                if name.startswith("rdma_") and not kspeed.HAS_RDMA:
                    continue
                if o["type"] in ("size", "size or auto") and isinstance(v, str):
                    # Loader reads size strings by the Python package's own
                    # unit rule ('256M' is binary) before the table's range
                    # check; the typed path above is the table's.
                    continue
                with pytest.raises((TypeError, ValueError)) as e:
                    kspeed.Loader(str(tmp_path), **loader_kwargs(name, v))
                assert str(e.value) == want, (name, v)
            checked += 1
    assert checked > 150


def test_types_and_values_raise_type_error_and_config_error(tmp_path):
    with pytest.raises(TypeError, match=r'option queue_depth: "8" is not an integer'):
        kspeed.Loader(str(tmp_path), queue_depth="8")
    with pytest.raises(kspeed.ConfigError, match="option queue_depth: 32768 is above the maximum") as e:
        kspeed.Loader(str(tmp_path), queue_depth=32768)
    assert e.value.kind == "InvalidOption"
    # Sizes take strings (their own form); a bad one is a bad value.
    with pytest.raises(ValueError, match=r'option ring_bytes: "12XB" is not a size'):
        _kspeed._check_option("ring_bytes", "12XB")
    with pytest.raises(ValueError, match="ring_bytes"):
        kspeed.Loader(str(tmp_path), ring_bytes="12XB")
    with pytest.raises(ValueError, match="option ring_bytes: 2048 is below the minimum"):
        kspeed.Loader(str(tmp_path), ring_bytes="2KiB")
    # node_timeout (seconds) is the documented alias of node_timeout_ms.
    with pytest.raises(ValueError, match="option node_timeout: 0 is below the minimum"):
        kspeed.Loader(str(tmp_path), cluster=["127.0.0.1:9"], token="t", node_timeout=0)


def test_numpy_scalars_are_the_numbers_they_stand_for(tmp_path):
    """``batch_size=np.int64(64)`` and ``seed=rng.integers(...)`` are common;
    numpy's scalars are not int/float subclasses, so the table's typed path
    would call them the wrong type. They are checked as their value: out of
    range is a ConfigError, not a TypeError."""
    np = pytest.importorskip("numpy")
    from kspeed._loader import _opt

    assert _opt("seed", np.uint64(7)) == 7 and type(_opt("seed", np.uint64(7))) is int
    assert _opt("batch_size", np.int32(64)) == 64
    assert type(_opt("node_timeout", np.float32(2.5))) is float
    with pytest.raises(kspeed.ConfigError, match="option queue_depth: 32768 is above the maximum"):
        kspeed.Loader(str(tmp_path), queue_depth=np.int64(32768))
    with pytest.raises(ValueError, match="option node_timeout: 0 is below the minimum"):
        kspeed.Loader(str(tmp_path), cluster=["127.0.0.1:9"], token="t", node_timeout=np.float64(0.0))


# Table keys that kspeed.Loader takes under another keyword: the cluster
# comes as one ``cluster=`` argument (a file, a list or 'env'), the node
# timeout in seconds.
UNDER_ANOTHER_NAME = {"cluster_file": "cluster", "cluster_nodes": "cluster", "cluster_env": "cluster",
                      "node_timeout_ms": "node_timeout"}


def test_every_table_key_is_a_loader_keyword():
    missing = [o["name"] for o in kspeed.options()
               if o["name"] not in LOADER_ARGS and UNDER_ANOTHER_NAME.get(o["name"]) not in LOADER_ARGS]
    assert not missing, f"options of the table that kspeed.Loader does not take: {missing}"


def test_agent_required_without_an_agent_is_named(tmp_path, space):
    sock = tmp_path / "no-agent.sock"
    with pytest.raises(kspeed.NetworkError, match=r"no kspeed agent at .*no-agent\.sock"):
        kspeed.Loader(space, agent="required", agent_socket=sock, ring_bytes="4MiB", pin=False)
    with pytest.raises(ValueError, match="agent"):
        kspeed.Loader(space, agent="sometimes")
    # Off never looks for one.
    kspeed.Loader(space, agent="off", agent_socket=sock, ring_bytes="4MiB", pin=False).close()
