"""kspeed.Loader and the thin wrappers (preload, verify, NodeService, Catalog)."""

import numbers
import os
import re

from . import _kspeed
from .errors import LoaderError

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def _size(name, v, lo=0):
    """An int, or a string: '256MiB' and '256M' are binary, '256MB' decimal."""
    if isinstance(v, str):
        m = _SIZE.match(v)
        if not m:
            raise ValueError(f"{name}: {v!r} is not a size (use bytes, or e.g. '256MiB', '4GB')")
        n, unit, i, b = m.groups()
        base = 1000 if (unit and not i and b) else 1024
        v = int(n) * base ** _UNITS[unit.lower()]
    return _int(name, v, lo)


def _size_str(name, v):
    """A size string as bytes by the Python package's rule; ``"auto"`` and
    anything not a string as it is (the options table checks it)."""
    if isinstance(v, str) and v.strip() != "auto":
        m = _SIZE.match(v)
        if not m:
            also = " or 'auto'" if name == "ring_bytes" else ""
            raise ValueError(f"{name}: {v!r} is not a size (use bytes, or e.g. '256MiB', '4GB'{also})")
        n, unit, i, b = m.groups()
        base = 1000 if (unit and not i and b) else 1024
        return int(n) * base ** _UNITS[unit.lower()]
    return v


def _int(name, v, lo=None, hi=None):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(v).__name__} ({v!r})")
    v = int(v)
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be at least {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be at most {hi}, got {v}")
    return v


def _opt(name, v):
    """``v``, checked against the loader option ``name`` in the crate's one
    options table (its range and message, as in the C ABI and the CLI).
    numpy and other ``numbers.Integral``/``numbers.Real`` scalars are taken
    as the int or float they stand for (``seed=rng.integers(...)``), as
    before the table."""
    if not isinstance(v, bool):
        if isinstance(v, numbers.Integral) and not isinstance(v, int):
            v = int(v)
        elif isinstance(v, numbers.Real) and not isinstance(v, (int, float)):
            v = float(v)
    _kspeed._check_option(name, v)
    return v


def _mix_entries(mix):
    """``mix=`` as the options table's list of ``PATH:WEIGHT`` entries:
    from a dict ``{path: weight}``, pairs ``[(path, weight), ...]`` or the
    entries themselves (a list, or one comma-separated string). A weight is
    a proportion (a number) or ``"repeat=R"`` / ``"choose=N"``."""
    if isinstance(mix, str):
        return [e.strip() for e in mix.split(",")]
    items = mix.items() if isinstance(mix, dict) else mix
    out = []
    for e in items:
        if isinstance(e, (str, os.PathLike)):
            out.append(os.fspath(e))
        elif isinstance(e, (tuple, list)) and len(e) == 2:
            path, w = e
            if not isinstance(path, (str, os.PathLike)):
                raise TypeError(f"mix: a dataset must be a path, not {type(path).__name__}")
            if isinstance(w, bool) or not isinstance(w, (numbers.Real, str)):
                raise TypeError(f"mix: the weight of {os.fspath(path)} must be a number or 'repeat=R'/'choose=N', not {w!r}")
            out.append(f"{os.fspath(path)}:{w!r}" if isinstance(w, float) else f"{os.fspath(path)}:{w}")
        else:
            raise TypeError(f"mix: each entry is a path, 'PATH:WEIGHT' or a (path, weight) pair, not {e!r}")
    return out


def _opt_int(name, v, lo=None, hi=None):
    return None if v is None else _int(name, v, lo, hi)


def _bool(name, v):
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be True or False, not {type(v).__name__} ({v!r})")
    return v


def _path(name, v, must_exist=True):
    if not isinstance(v, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), not {type(v).__name__}")
    p = os.fspath(v)
    if must_exist and not os.path.exists(p):
        raise ValueError(f"{name}: {p} does not exist")
    return p


class LaunchEnv(tuple):
    """The launcher's view of this process, from :func:`launch_env`.

    A ``(rank, world, origin)`` tuple, with every field the Rust crate's
    ``kspeed::launcher::Launcher`` reads as attributes: ``launcher``
    (``"torchrun"``, ``"openmpi"``, ``"mpich"``, ``"slurm"`` or ``"none"``),
    ``rank``, ``world``, ``local_rank``, ``local_world_size``, ``node``,
    ``nodes``, ``nodelist`` (the SLURM hostlist, or None), ``rank_from``,
    ``local_rank_from``, ``node_from``, ``nodes_from`` (the variables each
    came from) and ``origin``.
    """

    def __new__(cls, fields):
        if fields["launcher"] == "none":
            origin = "defaults (no launcher's rank and world in the environment)"
        else:
            names = fields["rank_from"].split("/")
            origin = f"environment variables {names[0]}={fields['rank']}, {names[1]}={fields['world']}"
        self = super().__new__(cls, (fields["rank"], fields["world"], origin))
        self.__dict__.update(fields)
        self.origin = origin
        return self

    def __repr__(self):
        keys = ("launcher", "rank", "world", "local_rank", "local_world_size", "node", "nodes", "nodelist")
        return "LaunchEnv(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in keys) + ")"


def launch_env(env=None):
    """This process's place in the job from the launcher's environment, read
    by the Rust crate (the same reading as the loader's core placement and
    ``cluster="env"``): torchrun (RANK, WORLD_SIZE, LOCAL_RANK, ...), Open
    MPI (OMPI_COMM_WORLD_*), MPICH/PMI (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID,
    MPI_LOCALNRANKS), SLURM (SLURM_PROCID, ...), innermost first; rank 0 of 1
    without any. ``env``: a mapping to read instead of the process
    environment. Returns a :class:`LaunchEnv` (a ``(rank, world, origin)``
    tuple with more attributes); malformed or contradictory variables raise
    :class:`kspeed.ConfigError` (kind ``BadLauncher``) naming them."""
    fields = _kspeed._launch_env(None if env is None else {str(k): str(v) for k, v in env.items()})
    return LaunchEnv(fields)


def _rank_world(rank, world, ignore_launcher_env):
    """(rank, world, origin): the arguments, else the launcher's
    environment. Explicit values that contradict the launcher's
    (launch_env(): torchrun, Open MPI, MPICH/PMI or SLURM) are refused unless
    ``ignore_launcher_env``: world=1 under a 2-rank torchrun would read every
    sample twice per epoch."""
    launched = launch_env()
    env_rank, env_world, origin = launched
    if rank is None and world is None:
        rank, world = env_rank, env_world
    elif rank is None or world is None:
        raise ValueError("give both rank and world, or neither (then they come from the launcher: torchrun, mpirun or srun)")
    else:
        rank = _opt("rank", rank)
        world = _opt("world", world)
        if launched.launcher != "none" and (rank, world) != (env_rank, env_world) and not _bool("ignore_launcher_env", ignore_launcher_env):
            raise ValueError(
                f"rank={rank}, world={world} contradict the launcher's {origin}: with these the job's ranks "
                f"would not split the samples (some read twice, some never); leave rank and world out to take "
                f"the launcher's, or pass ignore_launcher_env=True if these are meant"
            )
        origin = "the rank and world arguments"
    rank = _opt("rank", rank)
    world = _opt("world", world)
    if rank >= world:
        raise ValueError(f"rank {rank} is not below world {world} (from {origin})")
    return rank, world, origin


# A token is at most 1024 bytes (the CLI's and the protocol's limit); a
# line end may follow. Reading one byte more tells a longer file apart
# without reading all of it (a token_file of /dev/zero must not fill memory).
_MAX_TOKEN_BYTES = 1024
_TOKEN_FILE_READ_BYTES = _MAX_TOKEN_BYTES + 3


def _read_token(path):
    with open(path, "rb") as f:
        raw = f.read(_TOKEN_FILE_READ_BYTES)
    if len(raw) == _TOKEN_FILE_READ_BYTES:
        raise ValueError(
            f"token_file: {path} holds more than {_TOKEN_FILE_READ_BYTES - 1} bytes; "
            f"a token is at most {_MAX_TOKEN_BYTES} bytes"
        )
    raw = raw.rstrip()
    if not raw:
        raise ValueError(f"token_file: {path} is empty")
    if len(raw) > _MAX_TOKEN_BYTES:
        raise ValueError(f"token_file: {path} holds a {len(raw)}-byte token; a token is at most {_MAX_TOKEN_BYTES} bytes")
    return raw


def options():
    """The loader's options: one dict per keyword argument of
    :class:`Loader` that is a loader option (``name``, ``type``, ``unit``,
    ``min``, ``max``, ``choices``, ``default``, ``doc``, ``alias_of``,
    ``cli``: the ``kspeed read`` flag, ``allowed``), from the crate's one
    options table, which the C ABI's ``ksp_config_set``, ``kspeed read`` and
    the DALI operator share."""
    return _kspeed._options()


def _options_doc():
    lines = ["", "    Loader options (from the crate's options table, ``kspeed.options()``):", ""]
    for o in _kspeed._options():
        alias = f" (alias of ``{o['alias_of']}``)" if o["alias_of"] else ""
        unit = f", in {o['unit']}" if o["unit"] else ""
        lines.append(f"    ``{o['name']}``{alias}: {o['doc']}; {o['allowed']}{unit}; default {o['default']}.")
    return "\n".join(lines) + "\n"


def _check_pid(obj):
    if obj._pid != os.getpid():
        raise LoaderError(
            f"this loader was built in process {obj._pid}; a forked child (a DataLoader worker, "
            f"multiprocessing) must build its own (KSpeedDataset does, in each worker)"
        )


class Loader:
    """Reads a rank's samples in sampler order into the landing ring.

    ``for batch in loader:`` yields the batches of the current epoch (the next
    epoch when the current one was read to its end); ``set_epoch(e)`` moves to
    epoch ``e`` as DistributedSampler does. See the package docs for every
    argument; sizes take ints or strings like ``"256MiB"``.

    Lifetime rule: a :class:`Batch` and every view of it (numpy arrays,
    memoryviews, DLPack capsules, tensors) keep its bytes. Its ring space goes
    back when the batch and all its views are gone, or at ``batch.release()``
    / the end of ``with batch:`` (refused while views exist). When the ring or
    ``batches_in_flight`` leaves no room for the next batch, batches that
    have no views are reclaimed, oldest first (their byte methods then raise
    :class:`kspeed.BatchReleasedError`; ``ids``/``labels`` stay readable);
    batches with views are never touched, and when they alone leave no room
    ``next()`` raises :class:`kspeed.BatchInUseError`. Memory that Python can
    still see is never reused.

    Views are read-only (numpy ``writeable=False``; DLPack 1.0 exports carry
    the read-only flag): the ring belongs to the loader, and a memory tier
    sample is served again every epoch. ``sample_dlpack(i)`` of a tier sample
    is a copy, since PyTorch ignores the flag.

    ``rank``/``world``: both or neither (then the launcher's, as
    :func:`kspeed.launch_env` reads them: torchrun, mpirun or srun); explicit
    values that contradict the launcher's environment raise ValueError
    unless ``ignore_launcher_env=True``. With ``source=`` and ``catalog=``,
    the catalog must have been built from that source.

    Memory tier views (``tier_views=True``, only useful with ``tier_bytes >
    0``, or attached to a node agent with a node tier, whose tier is then
    mapped read-only; refused with ``gpu_ring``): a sample served from the
    memory tier is not copied into the landing ring. Its per-sample views (``sample(i)``,
    ``samples()``, ``memoryview(i)``, ``batch[i]``, ``sample_dlpack(i)``)
    point into the tier without any copy and keep the batch (and so the tier)
    alive like any other view. A batch with tier samples is not one ring
    span: ``batch.in_ring`` is False, and whole-batch access (``array()``,
    ``__dlpack__``) makes one contiguous copy of it on first use, with the
    samples back to back at ``offsets`` (``is_zero_copy`` is False). Turn it
    on when you consume samples one by one (decode, transform); leave it off
    when you copy whole batches (to a GPU, ``output="batch"``).
    """

    def __init__(
        self,
        space=None,
        *,
        source=None,
        catalog=None,
        batch_size=64,
        seed=0,
        shuffle=True,
        shuffle_block=0,
        drop_last=False,
        rank=None,
        world=None,
        ring_bytes="auto",
        tier_bytes=0,
        tier_views=False,
        cache_dir=None,
        cache_bytes=0,
        cache_policy="next-use",
        cache_memory_bytes=0,
        pollers=None,
        queue_depth=None,
        submit_batch=None,
        max_read_bytes=None,
        lookahead=None,
        spin_us=None,
        sqpoll_idle_ms=None,
        coop_taskrun=False,
        pin=True,
        local_rank=None,
        local_world_size=None,
        poller_numa_node=None,
        sysfs_root=None,
        registered_buffers=True,
        registered_files=True,
        verify_crc32c=False,
        page_cache="auto",
        huge_pages=True,
        mlock=True,
        numa_node=None,
        gpu_pci=None,
        cuda="auto",
        gpu_ring=None,
        cluster=None,
        cluster_nodelist=None,
        cluster_nodes_dns=None,
        cluster_node_count=None,
        cluster_port=None,
        token=None,
        token_file=None,
        node_timeout=10.0,
        rdma=False,
        rdma_device=None,
        rdma_port=1,
        rdma_gid_index=None,
        local_node=None,
        mix=None,
        mix_epoch_size=None,
        agent="auto",
        agent_socket=None,
        agent_restart_wait_ms=0,
        s3_endpoint_url=None,
        s3_profile=None,
        start_epoch=0,
        end_epoch=None,
        batches_in_flight=2,
        ignore_launcher_env=False,
        _fault_injection=None,
    ):
        if (space is not None) + (source is not None) + (mix is not None) != 1:
            raise ValueError(
                "give exactly one of space= (a preloaded space), source= (files read directly) "
                "or mix= (several datasets with weights)"
            )
        cfg = {}
        if mix_epoch_size is not None:
            cfg["mix_epoch_size"] = _opt("mix_epoch_size", mix_epoch_size)
        if mix is not None:
            cfg["mix"] = _opt("mix", _mix_entries(mix))
        elif space is not None:
            cfg["space"] = _path("space", space)
        else:
            if not isinstance(source, (str, os.PathLike)):
                raise TypeError(f"source must be a path or 'list:FILE' / 'tar:PATH', not {type(source).__name__}")
            cfg["source"] = os.fspath(source)
        if catalog is not None:
            cfg["catalog"] = _path("catalog", catalog)
        # Every loader option is checked by the crate's one options table
        # (kspeed.options(); the same ranges and messages as the C ABI and
        # `kspeed read`), here in argument order so the first bad one is
        # named, and again when the extension builds the loader.
        for name, v in (
            ("batch_size", batch_size),
            ("seed", seed),
            ("shuffle", shuffle),
            ("shuffle_block", shuffle_block),
            ("drop_last", drop_last),
        ):
            cfg[name] = _opt(name, v)
        rank, world, origin = _rank_world(rank, world, ignore_launcher_env)
        cfg["rank"], cfg["world"] = rank, world
        # Size strings keep the Python package's documented rule ('256M' and
        # '256MiB' binary, '256MB' decimal; the C ABI and `kspeed read` read a
        # bare 'M' as decimal): converted here, then range-checked by the table.
        ring_bytes = _size_str("ring_bytes", ring_bytes)
        tier_bytes = _size_str("tier_bytes", tier_bytes)
        cache_bytes = _size_str("cache_bytes", cache_bytes)
        cache_memory_bytes = _size_str("cache_memory_bytes", cache_memory_bytes)
        max_read_bytes = _size_str("max_read_bytes", max_read_bytes)
        for name, v in (
            ("ring_bytes", ring_bytes),
            ("tier_bytes", tier_bytes),
            ("tier_views", tier_views),
            ("cache_bytes", cache_bytes),
            ("cache_policy", cache_policy),
            ("cache_memory_bytes", cache_memory_bytes),
            ("pollers", pollers),
            ("queue_depth", queue_depth),
            ("submit_batch", submit_batch),
            ("max_read_bytes", max_read_bytes),
            ("lookahead", lookahead),
            ("spin_us", spin_us),
            ("sqpoll_idle_ms", sqpoll_idle_ms),
            ("coop_taskrun", coop_taskrun),
            ("pin", pin),
            ("registered_buffers", registered_buffers),
            ("registered_files", registered_files),
            ("verify_crc32c", verify_crc32c),
            ("page_cache", page_cache),
            ("huge_pages", huge_pages),
            ("mlock", mlock),
        ):
            cfg[name] = _opt(name, v)
        # Placement on the node (docs/LOCAL_PATH.md): explicit values win
        # over KSPEED_LOCAL_RANK / LOCAL_RANK / ... and KSPEED_SYSFS_ROOT.
        if (local_rank is None) != (local_world_size is None):
            raise ValueError(
                "give both local_rank and local_world_size, or neither (then they come from "
                "KSPEED_LOCAL_RANK/LOCAL_RANK/OMPI_COMM_WORLD_LOCAL_RANK/MPI_LOCALRANKID/SLURM_LOCALID)"
            )
        if local_rank is not None:
            local_world_size = _opt("local_world_size", local_world_size)
            local_rank = _opt("local_rank", local_rank)
            if local_rank >= local_world_size:
                raise ValueError(f"local_rank {local_rank} is not below local_world_size {local_world_size}")
        cfg["local_rank"], cfg["local_world_size"] = local_rank, local_world_size
        cfg["poller_numa_node"] = _opt("poller_numa_node", poller_numa_node)
        cfg["sysfs_root"] = None if sysfs_root is None else _path("sysfs_root", sysfs_root)
        cfg["numa_node"] = _opt("numa_node", numa_node)
        cfg["gpu_pci"] = _opt("gpu_pci", gpu_pci)
        cfg["cuda"] = _opt("cuda", cuda)
        cfg["gpu_ring"] = _opt("gpu_ring", gpu_ring)
        # Cluster mode: `cluster`, or a node list by a hostlist or a name
        # pattern (as `kspeed read --nodelist/--nodes-dns`).
        listed = {
            name: v
            for name, v in (
                ("cluster_nodelist", cluster_nodelist),
                ("cluster_nodes_dns", cluster_nodes_dns),
                ("cluster_node_count", cluster_node_count),
                ("cluster_port", cluster_port),
            )
            if v is not None
        }
        if cluster is not None or listed:
            for name, v in listed.items():
                cfg[name] = _opt(name, v)
            if cluster is None:
                pass
            elif cluster == "env":
                cfg["cluster_env"] = True
            elif isinstance(cluster, (list, tuple)):
                if not cluster or not all(isinstance(a, str) and ":" in a for a in cluster):
                    raise ValueError("cluster as a list must hold 'host:port' strings, one per node in node order")
                cfg["cluster_nodes"] = list(cluster)
            elif isinstance(cluster, (str, os.PathLike)):
                cfg["cluster_file"] = _path("cluster", cluster)
            else:
                raise TypeError(f"cluster must be None, 'env', a cluster file path or a list of 'host:port', not {type(cluster).__name__}")
            if token is not None and token_file is not None:
                raise ValueError("give token or token_file, not both")
            if token_file is not None:
                token = _read_token(_path("token_file", token_file))
            if token is None:
                raise ValueError("cluster mode needs token= or token_file= (the job token every node checks)")
            if isinstance(token, str):
                token = token.encode()
            if not isinstance(token, (bytes, bytearray)) or not token:
                raise TypeError("token must be non-empty bytes or str")
            cfg["token"] = bytes(token)
            cfg["node_timeout"] = _opt("node_timeout", node_timeout)
            if _opt("rdma", rdma):
                if not _kspeed._has_rdma():
                    raise ValueError("rdma=True: this kspeed package was built without RDMA (no libibverbs at build time)")
                cfg["rdma"] = True
                cfg["rdma_device"] = _opt("rdma_device", rdma_device)
                cfg["rdma_port"] = _opt("rdma_port", rdma_port)
                cfg["rdma_gid_index"] = _opt("rdma_gid_index", rdma_gid_index)
            cfg["local_node"] = _opt("local_node", local_node)
        else:
            if rdma:
                raise ValueError("rdma=True is for cluster mode (cluster='env', a cluster file or a node list)")
            if token is not None or token_file is not None:
                raise ValueError("token/token_file are for cluster mode (give cluster= too)")
        # The node agent (docs/AGENT.md): 'auto' attaches in cluster mode
        # only where the agent can serve this loader, 'off' never,
        # 'required' or a named error.
        cfg["agent"] = _opt("agent", agent)
        if cache_dir is not None:
            cfg["cache_dir"] = _path("cache_dir", cache_dir, must_exist=False)
        if agent_socket is not None:
            cfg["agent_socket"] = _path("agent_socket", agent_socket, must_exist=False)
        # Attached: wait this long for a restarted agent and continue where
        # this rank stood (0: AgentGone at once).
        cfg["agent_restart_wait_ms"] = _opt("agent_restart_wait_ms", agent_restart_wait_ms)
        # A source in an object store (s3://): where and as whom to read it
        # when a sample comes from the bucket (process-wide settings).
        for key, value in (("s3_endpoint_url", s3_endpoint_url), ("s3_profile", s3_profile)):
            if value is not None:
                cfg[key] = _opt(key, value)
        cfg["start_epoch"] = _opt("start_epoch", start_epoch)
        if end_epoch is not None:
            end = _opt("end_epoch", end_epoch)
            if end <= start_epoch:
                raise ValueError(f"end_epoch {end} must be after start_epoch {start_epoch}")
            cfg["end_epoch"] = end
        cfg["batches_in_flight"] = _int("batches_in_flight", batches_in_flight, 1, 1024)
        if _fault_injection is not None:
            cfg["fault_injection"] = tuple(_fault_injection)
        self._l = _kspeed._Loader(cfg)
        self._pid = os.getpid()
        self._epoch = start_epoch
        self._catalog = None

    # Iteration.
    def __iter__(self):
        _check_pid(self)
        epoch, _ = self._l.position()
        if epoch > self._epoch:
            # The current epoch was read to its end: go on with the next.
            self.set_epoch(epoch)
        return self

    def __next__(self):
        _check_pid(self)
        b = self._l.next_batch()
        if b is None:
            raise StopIteration
        return b

    def next_batch(self):
        """The next batch of the current epoch, or None at its end."""
        _check_pid(self)
        return self._l.next_batch()

    def start_reading(self):
        """Starts reading now rather than at the first batch. A local
        loader's pollers wait for the first batch, so that a
        :meth:`load_state_dict` right after construction throws no read
        away; call this (after restoring, if you restore) to have the ring
        filled while you do other work first, such as building the model.
        A no-op once reading, and in cluster mode and attached, where
        reading starts with the loader."""
        _check_pid(self)
        self._l.start_reading()

    def set_epoch(self, epoch):
        """Moves to ``epoch`` (as ``DistributedSampler.set_epoch``)."""
        _check_pid(self)
        epoch = _int("epoch", epoch, 0)
        self._l.set_epoch(epoch)
        self._epoch = epoch

    @property
    def epoch(self):
        return self._epoch

    def position(self):
        """(epoch, index) of the next sample to be delivered."""
        _check_pid(self)
        return self._l.position()

    def __len__(self):
        """Batches per epoch for this rank."""
        n, b = self._l.epoch_len, self._l.batch_size
        return -(-n // b)

    @property
    def epoch_len(self):
        """Samples per epoch for this rank."""
        return self._l.epoch_len

    @property
    def batch_size(self):
        return self._l.batch_size

    @property
    def rank(self):
        return self._l.rank

    @property
    def world(self):
        return self._l.world

    # Checkpoints (torchdata StatefulDataLoader's protocol: plain values).
    def state_dict(self):
        """Where the next batch starts, as plain picklable values: this
        rank's position (``position``, with the exactly-once digest) and
        the job's (``job_position``, valid for any world size when the
        ranks are in lock-step, as DDP steps are; a mixture's also under
        other weights, ``mix_counts`` being this loader's)."""
        _check_pid(self)
        epoch, index = self._l.position()
        return {
            "kspeed_loader_state": 1,
            "epoch": epoch,
            "index": index,
            "position": bytes(self._l.save_position()),
            "job_position": bytes(self._l.save_job_position()),
            "seed": self._l.seed,
            "rank": self._l.rank,
            "world": self._l.world,
            "batch_size": self._l.batch_size,
            "catalog_samples": self._l.catalog_len,
            "catalog_identity": self._l.catalog_identity,
            "mix_counts": self._l.mix_counts,
        }

    def load_state_dict(self, state):
        """Continues exactly where ``state`` (from :meth:`state_dict`) was
        taken. A state of another rank or world size (a job resumed on
        another number of GPUs: load any rank's state on every rank)
        continues the job from its job position: the rest of the epoch,
        each sample not yet consumed exactly once across the new ranks.
        So does a mixture's state saved with other weights: the rest of the
        epoch follows this loader's weights, and nothing the job delivered
        in the epoch comes again."""
        _check_pid(self)
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from Loader.state_dict(), not {type(state).__name__}")
        if state.get("kspeed_loader_state") != 1:
            raise ValueError("state is not a kspeed Loader state (no kspeed_loader_state: 1)")
        job = state.get("job_position")
        # A mixture's job position (KSPDMIX1) carries its weights' counts
        # and what each dataset had used before the epoch's order.
        mix_job = isinstance(job, (bytes, bytearray)) and bytes(job[:8]) == b"KSPDMIX1"
        saved_counts, mine_counts = state.get("mix_counts"), self._l.mix_counts
        reweighted = (mix_job and saved_counts is not None and mine_counts is not None
                      and list(saved_counts) != list(mine_counts))
        elastic = reweighted or (state.get("rank"), state.get("world")) != (self._l.rank, self._l.world)
        if elastic and isinstance(job, (bytes, bytearray)):
            keys = ("seed", "catalog_samples", "catalog_identity")
        else:
            keys = ("seed", "rank", "world", "catalog_samples", "catalog_identity")
        for key in keys:
            mine = {
                "seed": self._l.seed,
                "rank": self._l.rank,
                "world": self._l.world,
                "catalog_samples": self._l.catalog_len,
                "catalog_identity": self._l.catalog_identity,
            }[key]
            if key not in state:
                raise ValueError(f"state[{key!r}] is missing")
            if state[key] != mine:
                raise ValueError(f"state[{key!r}] is {state[key]!r} but this loader has {mine!r}: the state belongs to another job or dataset")
        if elastic:
            self._l.restore_job_position(bytes(state["job_position"]))
            self._epoch = self._l.position()[0]
            return
        pos = state.get("position")
        if not isinstance(pos, (bytes, bytearray)):
            raise TypeError("state['position'] must be bytes")
        if mix_job:
            # The epoch may be the rest of one resumed under other weights,
            # which the rank position records only as a hash: its job
            # position first, then the rank's exact place and digest.
            self._l.restore_job_position(bytes(job))
        self._l.restore_position(bytes(pos))
        self._epoch = self._l.position()[0]

    def job_position(self):
        """(epoch, consumed): what the job has consumed of the epoch's
        global order, from this rank's position (the job's when the ranks
        are in lock-step)."""
        _check_pid(self)
        epoch, base, index, _, world = self._l.rank_position()
        return epoch, base + index * world

    def save_position(self):
        """This rank's position (bytes, ``KSPDPOS3``; a mixture's
        ``KSPDPOS4``), with the exactly-once digest: what
        :func:`kspeed.audit` checks."""
        _check_pid(self)
        return bytes(self._l.save_position())

    # Information.
    def stats(self):
        """Counters so far, as a dict."""
        _check_pid(self)
        return self._l.stats()

    def landing_info(self):
        _check_pid(self)
        return self._l.landing_info()

    @property
    def catalog(self):
        """The catalog: lengths, CRCs, labels, class names, source files."""
        if self._catalog is None:
            _check_pid(self)
            self._catalog = Catalog(self._l.catalog_dict())
        return self._catalog

    @property
    def batches_out(self):
        """Batches whose ring space is not back yet."""
        return self._l.batches_out()

    # Teardown.
    def close(self):
        """Stops the pollers and frees the ring, at once when no batch has
        views, else as soon as the last one goes. Batches without views
        become invalid (their methods raise BatchReleasedError)."""
        if self._pid == os.getpid():
            self._l.close()

    @property
    def closed(self):
        return self._l.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return (
            f"<kspeed.Loader rank {self.rank}/{self.world} batch_size {self.batch_size} "
            f"epoch_len {self.epoch_len}{' closed' if self.closed else ''}>"
        )


Loader.__doc__ = (Loader.__doc__ or "") + _options_doc()


class Catalog:
    """A catalog as numpy columns: ``lengths``, ``crc32c``, ``labels`` (-1:
    none), ``file_index``, ``file_offset``; ``file_paths``, ``class_names``,
    ``source``. ``Catalog.open(path)`` takes a space or a catalog file."""

    def __init__(self, d):
        self.lengths = d["lengths"]
        self.crc32c = d["crc32c"]
        self.labels = d["labels"]
        self.file_index = d["file_index"]
        self.file_offset = d["file_offset"]
        self.file_paths = d["file_paths"]
        self.class_names = d["class_names"]
        self.source = d["source"]
        self.identity = d["identity"]
        self.total_bytes = d["total_bytes"]
        self.max_sample_bytes = d["max_sample_bytes"]

    @classmethod
    def open(cls, path):
        return cls(_kspeed._open_catalog(_path("path", path)))

    def __len__(self):
        return len(self.lengths)

    def path(self, i):
        """The source file of sample ``i``."""
        return self.file_paths[int(self.file_index[i])]

    def read_source(self, i):
        """Sample ``i``'s bytes read from its source file (for checks)."""
        with open(self.path(i), "rb") as f:
            f.seek(int(self.file_offset[i]))
            return f.read(int(self.lengths[i]))

    def __repr__(self):
        return f"<kspeed.Catalog {len(self)} samples, {len(self.class_names)} classes, source {self.source}>"


def preload(source=None, space=None, *, catalog=None, nodes=1, node_index=0, replicas=1, align_bytes=None,
            extent_bytes=None, threads=None, refresh=False, max_bytes_per_sec=None, max_bytes=None):
    """Copies the samples this node holds into ``space`` (``kspeed preload``).
    Idempotent and resumable; returns the report as a dict. ``max_bytes``
    makes a partial space (``--max-bytes``): at most that many bytes of the
    node's share are held, and loaders read the rest from the source."""
    if space is None:
        raise ValueError("space is required")
    cfg = {"space": _path("space", space, must_exist=False)}
    if source is not None:
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(f"source must be a path or 'list:FILE' / 'tar:PATH', not {type(source).__name__}")
        cfg["source"] = os.fspath(source)
    if catalog is not None:
        cfg["catalog"] = _path("catalog", catalog)
    cfg["nodes"] = _int("nodes", nodes, 1, 65535)
    cfg["node_index"] = _int("node_index", node_index, 0, cfg["nodes"] - 1)
    cfg["replicas"] = _int("replicas", replicas, 1, cfg["nodes"])
    cfg["align_bytes"] = None if align_bytes is None else _size("align_bytes", align_bytes, 512)
    cfg["extent_bytes"] = None if extent_bytes is None else _size("extent_bytes", extent_bytes, 4096)
    cfg["threads"] = _opt_int("threads", threads, 1, 1024)
    cfg["refresh"] = _bool("refresh", refresh)
    cfg["max_bytes_per_sec"] = None if max_bytes_per_sec is None else _size("max_bytes_per_sec", max_bytes_per_sec, 1)
    cfg["max_held_bytes"] = None if max_bytes is None else _size("max_bytes", max_bytes, 1)
    return _kspeed._preload(cfg)


def catalog(source, out, *, threads=None, skip_special=False, follow_symlinks=False, skip_bad_members=False,
            members=None, file_mode=0o600):
    """Builds a catalog of ``source`` into the file ``out`` (``kspeed
    catalog``): every sample's place, length, label and CRC32C, for
    ``Loader(source=..., catalog=out)``, ``KSpeedDataset(source=...,
    catalog=out)`` and ``preload(..., catalog=out)``. ``source`` is a
    directory (ImageFolder), ``list:FILE``, ``tar:SHARD.tar`` or
    ``tar:DIR``; the scan options are the CLI's ``--skip-special``,
    ``--follow-symlinks``, ``--skip-bad-members`` and ``--members``.
    Returns ``{"catalog", "source", "samples", "bytes", "classes",
    "notes"}`` (``notes``: what the scan skipped, one line each)."""
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a path or 'list:FILE' / 'tar:PATH', not {type(source).__name__}")
    cfg = {"source": os.fspath(source), "out": _path("out", out, must_exist=False)}
    cfg["threads"] = _opt_int("threads", threads, 1, 1024)
    for name, v in (("skip_special", skip_special), ("follow_symlinks", follow_symlinks),
                    ("skip_bad_members", skip_bad_members)):
        cfg[name] = _bool(name, v)
    if members is not None:
        if isinstance(members, str):
            members = members.split(",")
        if not all(isinstance(m, str) and m for m in members):
            raise TypeError("members must be a list of member extensions, e.g. ['jpg', 'cls']")
        cfg["members"] = list(members)
    cfg["file_mode"] = _int("file_mode", file_mode, 0, 0o7777)
    return _kspeed._catalog(cfg)


def audit(positions):
    """Checks that a job delivered each sample of an epoch exactly once,
    across resumes at other world sizes (a mixture's also under other
    weights), from its ranks' saved positions
    (``Loader.save_position()`` bytes, ``state_dict()`` dicts or files: the
    last one of every rank of every world that dealt the epochs). Returns
    one line per epoch ("epoch 3: 1,281,167 samples, each exactly once");
    raises :class:`kspeed.DataError` (kind ``AuditMismatch``) naming the
    first sample skipped or delivered twice."""
    blobs = []
    for i, p in enumerate(positions):
        if isinstance(p, dict):
            # A KSpeedDataset state taken inside a batch: the batch's
            # start (what it resumes from) advanced by the samples it had
            # handed out.
            p = p.get("audit_position", p.get("position"))
        elif isinstance(p, (str, os.PathLike)):
            with open(p, "rb") as f:
                p = f.read()
        if not isinstance(p, (bytes, bytearray)):
            raise TypeError(f"positions[{i}] must be bytes, a state dict or a path, not {type(p).__name__}")
        blobs.append(bytes(p))
    return _kspeed._audit(blobs)


def verify(space, *, threads=None):
    """Re-reads every sample of ``space`` and checks its CRC32C
    (``kspeed verify``) and every extent's length against the manifest.
    Returns ``{"checked", "bytes", "bad": [...], "bad_extents": [...], "ok"}``
    (``bad_extents``: ``{"index", "path", "actual_bytes", "manifest_bytes"}``
    of each extent of the wrong length)."""
    threads = _opt_int("threads", threads, 1, 1024) or max(1, min(8, os.cpu_count() or 1))
    r = _kspeed._verify(_path("space", space), threads)
    r["ok"] = not r["bad"] and not r["bad_extents"]
    return r


class NodeService:
    """The node service (``kspeed serve``) in this process: serves ``space``
    to remote loaders on ``listen`` (port 0 picks one; see ``address``)."""

    def __init__(self, space, *, listen="127.0.0.1:0", token=None, token_file=None, pollers=None,
                 staging_bytes=None, chunk_bytes=None, page_cache=False, rdma=False, rdma_device=None,
                 rdma_port=1, rdma_gid_index=None):
        cfg = {"space": _path("space", space)}
        if not isinstance(listen, str) or ":" not in listen:
            raise ValueError(f"listen must be 'host:port', got {listen!r}")
        cfg["listen"] = listen
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        if token_file is not None:
            token = _read_token(_path("token_file", token_file))
        if token is None:
            raise ValueError("NodeService needs token= or token_file= (the job token consumers present)")
        cfg["token"] = token.encode() if isinstance(token, str) else bytes(token)
        cfg["pollers"] = _opt_int("pollers", pollers, 1, 1024)
        cfg["staging_bytes"] = None if staging_bytes is None else _size("staging_bytes", staging_bytes, 4096)
        cfg["chunk_bytes"] = None if chunk_bytes is None else _size("chunk_bytes", chunk_bytes, 4096)
        cfg["page_cache"] = _bool("page_cache", page_cache)
        if _bool("rdma", rdma):
            if not _kspeed._has_rdma():
                raise ValueError("rdma=True: this kspeed package was built without RDMA")
            cfg["rdma"] = (rdma_device, _int("rdma_port", rdma_port, 1, 255), _opt_int("rdma_gid_index", rdma_gid_index, 0, 255))
        self._s = _kspeed._NodeService(cfg)

    @property
    def address(self):
        """The address it listens on (``host:port``)."""
        return self._s.address

    def stats(self):
        return self._s.stats()

    def stop(self):
        self._s.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False
