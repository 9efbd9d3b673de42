"""Committed state: commit, restore and sync over adapters, with commit ids.

:class:`State` holds named objects (a model, an optimizer, a sampler, the
epoch counter...). ``commit()`` snapshots them into host buffers that are
reused from one commit to the next; ``restore()`` brings every object back
to the last commit bitwise; ``sync()`` makes every rank hold the same commit
and checks that ranks which already held state agree on it.

Commit protocol (why it is safe under failures):

1. *Capture*: every adapter names its arrays and metadata. Nothing is copied
   and no buffer is touched, so a bad object (wrong type, a dict with a
   non-str key...) raises ``StateError`` and leaves the previous commit as it
   was. Shapes and dtypes are checked against the buffers here too.
2. *Copy*: arrays are copied into the buffers. With ``commit_buffers=1`` an
   interruption here (an exception from a framework copy) marks the commit
   *torn*: it is never restored from, and ``sync()`` treats this rank as a
   newcomer. With ``commit_buffers=2`` the copy goes to a spare set that is
   swapped in at the end, so the previous commit survives even that.
3. *Agree*: the commit id goes up by one, then the host-update check does a
   max-allreduce, which also carries the commit id (as max of id and of
   -id), so ranks that disagree on it fail at that very commit. No rank
   finishes commit N+1 before every rank has captured N+1, so after a
   failure the surviving ranks hold ids that differ by at most one, and the
   newest is a consistent state (its step's allreduce completed). ``sync()``
   picks it, so nobody goes back past its own commit.

What must agree across ranks (checked by ``sync()``): parameters, optimizer
state, plain values, sampler positions: every synced array and all metadata,
except *buffers*, which an adapter names (``buffer_keys``: torch module
buffers such as BatchNorm running statistics, Keras non-trainable
variables). Buffers may differ; ``sync()`` gives every rank the root's, as
Horovod's broadcast does. Per-rank objects (RNG streams, and any object named
in ``State(per_rank=...)``) are never compared nor broadcast.

Durable checkpoints (``config.checkpoint_dir``, see :mod:`elastic_ext.checkpoint`):
once a commit is agreed (step 3), rank 0 hands its synced buffers to a
background writer; later commits copy into other buffers until the write is
done. A sync with no survivors (a fresh job) loads the newest valid
checkpoint on the root before broadcasting it.
"""

from __future__ import annotations

import json
import logging
import queue
import time
import zlib
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

import numpy as np

from elastic_ext import adapters as _adapters
from elastic_ext import watchdog
from elastic_ext.adapters import Adapter, Capture, Entry
from elastic_ext.binding import Binding, broadcast_arrays, broadcast_json, get_binding, guess_framework
from elastic_ext.config import ElasticConfig
from elastic_ext.errors import CheckpointError, NotCommittedError, StateDivergenceError, StateError
from elastic_ext.events import EventLog
from elastic_ext.tree import describe_key

logger = logging.getLogger(__name__)

# Horovod's HostUpdateResult flags, repeated here so the core needs no Horovod import.
_HOSTS_REMOVED = 1
_HOSTS_ADDED = 2

# Columns of the table sync() allgathers, one row per rank.
_ID, _PARTICIPATED, _GENERATION, _DIGEST, _FULL_DIGEST = range(5)


class State:
    """Committed state of a training job, for PyTorch or TensorFlow.

    Every keyword argument becomes an attribute (``state.model``,
    ``state.epoch``) whose object is committed, restored and synced by the
    adapter that handles its type. Assigning a new value to such an attribute
    (``state.epoch += 1``) replaces the tracked object.

    Args:
        framework: "torch" or "tensorflow"; guessed from the objects, or from
            which Horovod module is imported, when left out.
        binding: explicit Horovod operations (tests); overrides ``framework``.
        adapters: extra adapters tried before the built-in ones, for this
            instance only.
        config: an :class:`ElasticConfig`; read from the environment if None.
        per_rank: names of objects that each rank keeps for itself (a
            per-rank metric, a rank's own data-loader state): committed and
            restored locally, never compared nor broadcast, not in durable
            checkpoints, like RNG streams.
        **objects: the objects to track, by name.

    Raises:
        StateError: an object has no adapter, a name is reserved (a public
            member of State, or starts with ``_``) or not an identifier, or
            ``per_rank`` names an object that is not tracked.
        ConfigError: the framework cannot be determined.
    """

    def __init__(self, *, framework: Optional[str] = None, binding: Optional[Binding] = None,
                 adapters: Iterable[Adapter] = (), config: Optional[ElasticConfig] = None,
                 per_rank: Iterable[str] = (), **objects: Any) -> None:
        if not objects:
            raise StateError("State() needs at least one object to track, e.g. State(model=model, epoch=0)")
        for name in objects:
            if name in reserved_names() or name.startswith("_"):
                raise StateError(f"object name {name!r} is reserved (State has a member of that name, or it "
                                 "starts with '_'); choose another keyword")
            if not name.isidentifier():
                raise StateError(f"object name {name!r} must be a Python identifier")
        if isinstance(per_rank, str):
            per_rank = (per_rank,)
        unknown = sorted(set(per_rank) - set(objects))
        if unknown:
            raise StateError(f"per_rank names {unknown} that are not tracked objects (tracked: {sorted(objects)})")
        s = object.__setattr__
        s(self, "_objects", dict(objects))
        s(self, "_per_rank", frozenset(per_rank))
        s(self, "_config", config or ElasticConfig.from_env())
        table = list(adapters)
        frameworks = set()
        for loader in _framework_adapter_loaders():
            table.extend(loader())
        table.extend(_adapters.core_adapters())
        s(self, "_table", table)
        s(self, "_adapter_of", {})
        used = []
        for name, obj in objects.items():
            adapter = self._find_adapter(name, obj)
            if adapter not in used:
                used.append(adapter)
            fw = getattr(adapter, "framework", None)
            if fw:
                frameworks.add(fw)
        for adapter in used:
            # e.g. Keras optimizers build their slots here, before any sync.
            prepare = getattr(adapter, "prepare", None)
            if callable(prepare):
                prepare(self._objects)
        if binding is None:
            if len(frameworks) > 1 and framework is None:
                raise StateError(f"objects from several frameworks {sorted(frameworks)} in one State; "
                                 "pass framework= to choose the one whose Horovod runs the collectives")
            binding = get_binding(framework or (frameworks.pop() if frameworks else guess_framework()))
        s(self, "_binding", binding)
        s(self, "_entries", None)        # name -> Entry, the last commit
        s(self, "_spare", None)          # second buffer set (commit_buffers=2)
        s(self, "_commit_id", 0)
        s(self, "_commit_time", None)
        s(self, "_torn", False)
        s(self, "_participated", False)  # True once this process went through a sync
        s(self, "_generation", 0)        # +1 per sync or verified resize, agreed by all ranks
        s(self, "_host_messages", queue.Queue())
        s(self, "_last_updated_timestamp", 0)
        s(self, "_reset_callbacks", [])
        s(self, "_rollbacks_without_progress", 0)
        s(self, "_rollback_commit_id", -1)
        s(self, "_events", EventLog(self._config.events_path, binding.rank, binding.size))
        s(self, "_checkpointer", None)
        if self._config.checkpoint_dir is not None:
            from elastic_ext.checkpoint import Checkpointer
            s(self, "_checkpointer", Checkpointer(self._config, self._events.emit,
                                                  lambda: (self._entries, self._spare)))

    # ------------------------------------------------------------ attributes

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects")
        if objects is not None and name in objects:
            return objects[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._objects:
            self._objects[name] = value
        else:
            object.__setattr__(self, name, value)

    @property
    def commit_id(self) -> int:
        """Id of the last commit: 0 before the first, then +1 per commit."""
        return self._commit_id

    @property
    def generation(self) -> int:
        """How many times the job (re)started its training function: 1 after the
        first sync, +1 after every reset. The same on every rank."""
        return self._generation

    @property
    def objects(self) -> Dict[str, Any]:
        """The tracked objects by name (a copy of the mapping)."""
        return dict(self._objects)

    @property
    def config(self) -> ElasticConfig:
        return self._config

    @property
    def binding(self) -> Binding:
        return self._binding

    @property
    def events(self) -> EventLog:
        return self._events

    def register_adapter(self, adapter: Adapter) -> None:
        """Adds ``adapter`` in front of this instance's lookup table."""
        self._table.insert(0, adapter)
        self._adapter_of.clear()

    def _find_adapter(self, name: str, obj: Any) -> Adapter:
        cached = self._adapter_of.get(name)
        if cached is not None and cached.handles(obj):
            return cached
        for adapter in self._table:
            if adapter.handles(obj):
                self._adapter_of[name] = adapter
                return adapter
        raise StateError(f"no adapter for {name!r} of type {type(obj).__module__}.{type(obj).__qualname__}; "
                         "register one with State(adapters=[...]) or state.register_adapter()")

    # ---------------------------------------------------------------- commit

    def commit(self) -> None:
        """Snapshots every object to host memory, then checks for host updates.

        Raises:
            StateError: an object cannot be snapshotted; the previous commit
                is left intact.
            HostsUpdatedInterrupt: hosts were added or removed (after the
                commit has been made).
        """
        started = time.perf_counter()
        watchdog.progress()
        self.save()
        if self._config.log_commits:
            self._events.emit("commit", commit_id=self._commit_id,
                              duration_s=time.perf_counter() - started)
        if self._checkpointer is None:
            self.check_host_updates()
            return
        try:
            self.check_host_updates()
        except Exception as exc:
            if type(exc).__name__ == "HostsUpdatedInterrupt":  # the commit is agreed all the same
                self._checkpoint_commit()
            raise
        self._checkpoint_commit()

    def save(self) -> None:
        """The local half of :meth:`commit`: snapshot without any collective."""
        captures = self._capture_all()
        base = self._entries if self._config.commit_buffers == 1 else self._spare
        if self._checkpointer is not None:
            base = self._checkpointer.writable(base)  # never overwrite what a checkpoint write reads
        plan, entries = _plan_copy(captures, base)
        if self._config.commit_buffers == 1:
            # From here on the buffers of the previous commit are being overwritten.
            self._torn = self._entries is not None
        try:
            for source, buffer in plan:
                source.copy_into(buffer)
        except BaseException:
            if self._config.commit_buffers == 1 and self._entries is not None:
                logger.error("[rank %s] commit %d interrupted while copying; the previous commit is torn "
                             "and will not be restored from", self._safe_rank(), self._commit_id + 1)
            else:
                self._torn = False
            raise
        if self._config.commit_buffers == 2:
            self._spare = self._entries
        self._entries = entries
        self._torn = False
        self._commit_id += 1
        self._commit_time = time.time()

    def _capture_all(self) -> Dict[str, Tuple[Adapter, Capture]]:
        captures = {}
        for name, obj in self._objects.items():
            adapter = self._find_adapter(name, obj)
            try:
                captures[name] = (adapter, adapter.capture(obj))
            except StateError as exc:
                raise StateError(f"cannot commit {name!r}: {exc}") from exc
        return captures

    def _safe_rank(self) -> int:
        try:
            return self._binding.rank()
        except Exception:  # noqa: BLE001 - only used in log prefixes
            return -1

    # --------------------------------------------------------------- restore

    def restore(self) -> None:
        """Brings every object back to the last commit, bitwise.

        Raises:
            NotCommittedError: nothing was committed yet.
            StateError: the last commit is torn (an interrupted copy).
        """
        if self._entries is None:
            raise NotCommittedError("restore() called before any commit(); call commit() first")
        if self._torn:
            raise StateError(f"commit {self._commit_id} is torn (a commit was interrupted while copying); "
                             "it cannot be restored. Use commit_buffers=2 to keep the previous commit intact")
        for name, entry in self._entries.items():
            obj = self._objects[name]
            self._objects[name] = self._find_adapter(name, obj).apply(obj, entry)

    # ------------------------------------------------------------------ sync

    def sync(self) -> None:
        """Makes every rank hold the same commit and the same live synced objects.

        Every rank first allgathers one row ``(commit id, survivor?,
        generation, digest, full digest)``: the same collective whatever the
        rank's history, so survivors of a resize and newcomers filling a freed
        slot always meet. Survivors (ranks that went through an earlier sync)
        may hold ids one apart; the newest is chosen and broadcast from the
        lowest rank that holds it, and every rank not already holding exactly
        those bytes loads it. When every rank is a survivor at that commit
        with the same bytes (a removal-only resize, a rollback with no
        newcomer), nothing more is sent. Per-rank objects stay local.

        Raises:
            StateDivergenceError: survivors' commit ids differ by more than
                one, or survivors with the same id differ in something that
                must agree (parameters, optimizer state, plain values, sampler
                position); the message names the first differing entry.
        """
        started = time.perf_counter()
        b = self._binding
        if self._entries is None or self._torn:
            # A newcomer (or a torn survivor) snapshots what it has, so that
            # a fresh job starts from rank 0's initial objects.
            self._torn = False
            self.save()
            self._commit_id = 0
            self._participated = False
        items = self._digest_items() if self._config.verify_sync else []
        digest, full = _combine(items, strict_only=True), _combine(items, strict_only=False)
        mine = np.array([[self._commit_id, int(self._participated), self._generation, digest, full]],
                        dtype=np.int64)
        table = b.allgather(mine, "elastic_ext.sync.ids")
        root, target = _choose_root(table)
        if self._config.verify_sync:
            self._check_agreement(table, root, target, items)
        if (self._config.verify_sync and table[:, _PARTICIPATED].all() and (table[:, _ID] == target).all()
                and (table[:, _FULL_DIGEST] == table[root, _FULL_DIGEST]).all()
                and (table[:, _GENERATION] == table[root, _GENERATION]).all()):
            # Everyone already holds these bytes: no broadcast (the old verify()).
            self._generation += 1
            self._events.emit("sync", commit_id=target, generation=self._generation, root=root, loaded=False,
                              newcomers=0, broadcast=False, duration_s=time.perf_counter() - started)
            return
        resume_error = None
        if self._checkpointer is not None and not table[:, _PARTICIPATED].any() and b.rank() == root:
            resume_error = self._resume_from_checkpoint()
        meta = self._sync_meta()
        if self._checkpointer is not None:
            meta["resume_error"] = resume_error
        meta = broadcast_json(b, meta, root, "elastic_ext.sync.meta")
        if meta.get("resume_error"):  # raised on every rank together, so none waits in a broadcast
            raise CheckpointError(meta["resume_error"])
        if "resume_error" in meta:
            target = int(meta["commit_id"])  # the checkpoint a fresh job resumed from, if any
        arrays = broadcast_arrays(b, self._synced_arrays(), meta["layout"], root, "elastic_ext.sync.arrays")
        # Buffers (BatchNorm statistics) may differ: a rank loads unless its
        # *full* digest, buffers included, matches the root's.
        up_to_date = (self._participated and self._commit_id == target and self._config.verify_sync
                      and full == int(table[root, _FULL_DIGEST]))
        if b.rank() != root and not up_to_date:
            self._load_synced(meta, arrays)
        self._commit_id = target
        self._last_updated_timestamp = meta["last_updated_timestamp"]
        self._rollbacks_without_progress = meta["rollbacks_without_progress"]
        self._rollback_commit_id = meta["rollback_commit_id"]
        self._generation = meta["generation"] + 1
        self._participated = True
        self._events.emit("sync", commit_id=target, generation=self._generation, root=root,
                          loaded=bool(b.rank() != root and not up_to_date), broadcast=True,
                          newcomers=int((table[:, _PARTICIPATED] == 0).sum()), duration_s=time.perf_counter() - started)

    def verify(self) -> None:
        """The same as :meth:`sync` (kept for callers of the old name).

        It used to be a separate, smaller allgather run after removal-only
        resizes; a newcomer filling a freed slot ran ``sync()``'s collective
        instead and the two never met (a hang). ``sync()`` now sends nothing
        more than that one allgather when every rank already agrees.
        """
        self.sync()

    def _check_agreement(self, table: np.ndarray, root: int, target: int,
                         items: List[Tuple[str, int, bool]]) -> None:
        """Raises StateDivergenceError if survivors at ``target`` differ from the root in
        what must agree. Cheap unless they do: then one more broadcast and allgather
        find the first differing entry, on every rank together."""
        same = np.flatnonzero((table[:, _PARTICIPATED] == 1) & (table[:, _ID] == target))
        bad = [int(r) for r in same if table[r, _DIGEST] != table[root, _DIGEST]]
        if not bad:
            return
        b = self._binding
        labels = broadcast_json(b, [label for label, _, strict in items if strict] if b.rank() == root else None,
                                root, "elastic_ext.sync.diagnose.labels")
        crcs = dict((label, crc) for label, crc, strict in items if strict)
        row = np.array([[crcs.get(label, -1) for label in labels]], dtype=np.int64)
        found = b.allgather(row, "elastic_ext.sync.diagnose.digests") if labels else np.zeros((b.size(), 0))
        first, differing = None, bad
        for column, label in enumerate(labels):
            ranks = [r for r in bad if found[r, column] != found[root, column]]
            if ranks:
                first, differing = label, ranks
                break
        what = (f"first difference: {first}" if first is not None
                else "the entries differ in which arrays they hold")
        raise StateDivergenceError(
            f"ranks {differing} hold commit {target} with different values than rank {root} in state that must "
            f"agree across ranks ({what}; checksums {int(table[bad[0], _DIGEST]):#010x} vs "
            f"{int(table[root, _DIGEST]):#010x}). Parameters, optimizer state, plain values and sampler "
            "positions must agree; buffers may differ. Mark an object that is legitimately per rank with "
            "State(..., per_rank=(name,))")

    def _synced_names(self) -> List[str]:
        return [name for name in self._entries
                if name not in self._per_rank and self._find_adapter(name, self._objects[name]).synced]

    def _synced_arrays(self) -> Dict[str, np.ndarray]:
        return {f"{name}/{key}": array for name in self._synced_names()
                for key, array in self._entries[name].arrays.items()}

    def _sync_meta(self) -> dict:
        names = self._synced_names()
        return {
            "commit_id": self._commit_id,
            "names": names,
            "meta": {name: self._entries[name].meta for name in names},
            "layout": [[f"{name}/{key}", array.dtype.str, list(array.shape)]
                       for name in names for key, array in self._entries[name].arrays.items()],
            "last_updated_timestamp": self._last_updated_timestamp,
            "rollbacks_without_progress": self._rollbacks_without_progress,
            "rollback_commit_id": self._rollback_commit_id,
            "generation": self._generation,
        }

    def _load_synced(self, meta: dict, arrays: Dict[str, np.ndarray]) -> None:
        missing = set(meta["names"]) - set(self._objects)
        if missing:
            raise StateDivergenceError(f"the root commits objects {sorted(missing)} that this rank does not "
                                       f"track (this rank tracks {sorted(self._objects)})")
        for name in meta["names"]:
            prefix = name + "/"
            received = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
            old = self._entries.get(name)
            if self._checkpointer is not None and self._checkpointer.is_leased(old):
                old = None  # a checkpoint write is reading those buffers
            entry_arrays = {}
            for key, value in received.items():
                buffer = old.arrays.get(key) if old is not None else None
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    buffer = np.empty(value.shape, dtype=value.dtype)
                np.copyto(buffer, value)
                entry_arrays[key] = buffer
            self._entries[name] = Entry(arrays=entry_arrays, meta=meta["meta"][name])
            obj = self._objects[name]
            self._objects[name] = self._find_adapter(name, obj).apply(obj, self._entries[name])

    def _buffer_keys(self, name: str) -> FrozenSet[str]:
        obj = self._objects[name]
        keys = getattr(self._find_adapter(name, obj), "buffer_keys", None)
        return frozenset(keys(obj)) if callable(keys) else frozenset()

    def _digest_items(self) -> List[Tuple[str, int, bool]]:
        """``(label, CRC32, must agree?)`` for the metadata and every array of the synced
        part of the last commit, in commit order; buffers are the ones that need not agree."""
        items = []
        for name in self._synced_names():
            entry = self._entries[name]
            items.append((f"{name} (metadata)", zlib.crc32(json.dumps(entry.meta, sort_keys=True).encode()), True))
            buffers = self._buffer_keys(name)
            for key, array in entry.arrays.items():
                crc = zlib.crc32(f"{array.dtype.str}:{array.shape}".encode())
                crc = zlib.crc32(np.ascontiguousarray(array).view(np.uint8).data, crc)
                items.append((f"{name}{describe_key(key)}", crc, key not in buffers))
        return items

    # --------------------------------------------------- durable checkpoints

    def wait_for_checkpoint(self, timeout_s: Optional[float] = None) -> Optional[int]:
        """Waits (at most ``timeout_s``) for the running checkpoint write; returns the
        newest commit id this process wrote or resumed from, or None.

        Call it before the script exits to make the last checkpoint durable.
        A no-op without ``checkpoint_dir`` and on ranks that do not write.
        """
        if self._checkpointer is None:
            return None
        self._checkpointer.wait(timeout_s)
        return self._checkpointer.last_written

    def checkpoint_now(self) -> None:
        """Rank 0 starts writing the agreed commit even if it is not due (a leave, a resize).

        A no-op without ``checkpoint_dir``, on other ranks, and if this commit
        is written already. Pair with :meth:`wait_for_checkpoint` before exiting.
        """
        if self._checkpointer is not None and self._entries is not None:
            self._checkpoint_commit(force=True)

    def phase(self, name: str):
        """``with state.phase("eval"):`` a long phase the stall check does not count (see watchdog.phase)."""
        return watchdog.phase(name)

    def _checkpoint_commit(self, force: bool = False) -> None:
        """Rank 0 hands the agreed commit's synced buffers to the background writer."""
        if self._safe_rank() != 0 or not (force or self._checkpointer.due(self._commit_id)):
            return
        from elastic_ext.sampler import ElasticPartitioner
        from elastic_ext.tree import join
        names = self._synced_names()
        cursors = {name: {k: v for k, v in join(self._entries[name].meta, {}).items() if k in ("epoch", "cursor")}
                   for name in names if isinstance(self._objects[name], ElasticPartitioner)}
        info = {"world_size": self._binding.size(), "written_by_rank": 0, "generation": self._generation,
                "commit_time": self._commit_time, "data_cursor": cursors,
                "adapters": {name: self._find_adapter(name, self._objects[name]).name for name in names}}
        self._checkpointer.on_commit(self._commit_id, {name: self._entries[name] for name in names}, info,
                                     force=force)

    def _resume_from_checkpoint(self) -> Optional[str]:
        """On the root of a fresh job: loads the newest valid checkpoint; returns an error message or None."""
        try:
            loaded = self._checkpointer.store.load_newest()
        except CheckpointError as exc:  # e.g. the directory cannot be listed
            return f"cannot look for checkpoints in {self._config.checkpoint_dir}: {exc}"
        if loaded is None:
            return None
        synced = set(self._synced_names())
        try:
            foreign = sorted(set(loaded.entries) - synced)
            if foreign:
                raise CheckpointError(f"it holds objects {foreign} that this State does not track as synced "
                                      f"objects (it tracks {sorted(synced)})")
            for name, entry in loaded.entries.items():
                self._entries[name] = entry
                obj = self._objects[name]
                self._objects[name] = self._find_adapter(name, obj).apply(obj, entry)
        except Exception as exc:  # noqa: BLE001 - every rank raises it as CheckpointError in sync()
            return f"cannot resume from checkpoint {loaded.path}: {type(exc).__name__}: {exc}"
        missing = sorted(synced - set(loaded.entries))
        if missing:
            logger.warning("[rank 0] checkpoint %s holds no %s; they keep their initial values", loaded.path, missing)
        self._commit_id = loaded.commit_id
        self._generation = int(loaded.manifest.get("generation", 0))
        self._checkpointer.resumed(loaded.commit_id)
        self._events.emit("checkpoint_resumed", commit_id=loaded.commit_id, path=loaded.path,
                          world_size=loaded.manifest.get("world_size"), data_cursor=loaded.manifest.get("data_cursor"))
        return None

    # --------------------------------------------- Horovod listener interface

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Callbacks run after every reset (worker added or removed), e.g. to rescale the LR."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Tells objects that track the world size (samplers) that it changed."""
        for obj in self._objects.values():
            hook = getattr(obj, "on_world_change", None)
            if callable(hook):
                hook()

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        """Called by Horovod's notification service (on the coordinator)."""
        self._host_messages.put((timestamp, int(update_res)))

    def host_update_pending(self) -> bool:
        """True if Horovod has announced a host change this rank has not acted on yet."""
        return not self._host_messages.empty()

    def check_host_updates(self) -> None:
        """Raises ``HostsUpdatedInterrupt`` on every rank together if hosts changed.

        Horovod notifies only the coordinator; a max-allreduce (rather than a
        broadcast from rank 0) lets any rank's notification count.
        """
        newest = self._last_updated_timestamp
        flags = 0
        while not self._host_messages.empty():
            timestamp, update = self._host_messages.get()
            if timestamp > self._last_updated_timestamp:
                newest = max(newest, timestamp)
                flags |= update
        # The fourth element says that some rank was told to leave (SIGTERM):
        # everyone resizes here, right after a commit, so nothing is lost.
        # The last two (max of the id and of -id) catch ranks that disagree on
        # the commit id at the commit where it happens, not at the next sync.
        vector = np.array([newest, flags & _HOSTS_REMOVED, (flags & _HOSTS_ADDED) >> 1, int(watchdog.leaving()),
                           self._commit_id, -self._commit_id], dtype=np.int64)
        reduced = self._binding.allreduce_max(vector, "elastic_ext.hosts")
        newest, removed, added, leaving, highest, negated_lowest = (int(x) for x in reduced)
        lowest = -negated_lowest
        if highest != lowest:
            raise StateDivergenceError(
                f"ranks hold different commit ids at this commit: from {lowest} to {highest} (this rank: "
                f"{self._commit_id}); every rank must call commit() the same number of times between syncs "
                "(save() is local and does not count for the others)")
        if newest > self._last_updated_timestamp or leaving:
            self._last_updated_timestamp = newest
            from horovod.common.exceptions import HostsUpdatedInterrupt
            # Removals need no sync: every remaining rank holds this commit.
            raise HostsUpdatedInterrupt(bool(removed or leaving) and not added)

    # ------------------------------------------------------------- rollbacks

    def note_rollback(self) -> int:
        """Counts a rollback; returns how many happened in a row without a new commit."""
        if self._commit_id == self._rollback_commit_id:
            self._rollbacks_without_progress += 1
        else:
            self._rollbacks_without_progress = 1
            self._rollback_commit_id = self._commit_id
        return self._rollbacks_without_progress

    @property
    def seconds_since_commit(self) -> Optional[float]:
        return None if self._commit_time is None else time.time() - self._commit_time

    def value_if_int(self, name: str) -> Optional[int]:
        value = self._objects.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def committed_value(self, name: str) -> Any:
        """The committed value of a plain object (e.g. ``step``), or None."""
        if not self._entries or name not in self._entries:
            return None
        adapter = self._find_adapter(name, self._objects[name])
        if not isinstance(adapter, _adapters.PlainAdapter):
            return None
        return adapter.apply(None, self._entries[name])


def _plan_copy(captures: Dict[str, Tuple[Adapter, Capture]], base: Optional[Dict[str, Entry]]):
    """Pairs every source with a buffer: reused from ``base`` when shape and dtype match."""
    plan = []
    entries: Dict[str, Entry] = {}
    for name, (_, capture) in captures.items():
        old = base.get(name) if base else None
        arrays = {}
        for key, source in capture.arrays.items():
            shape, dtype = tuple(source.shape), np.dtype(source.dtype)
            buffer = old.arrays.get(key) if old is not None else None
            if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
                buffer = np.empty(shape, dtype=dtype)
            plan.append((source, buffer))
            arrays[key] = buffer
        entries[name] = Entry(arrays=arrays, meta=_adapters.copy.deepcopy(capture.meta))
    return plan, entries


def _combine(items: List[Tuple[str, int, bool]], strict_only: bool) -> int:
    """One CRC32 over the per-entry ones (labels included, so a renamed entry counts)."""
    crc = 0
    for label, value, strict in items:
        if strict or not strict_only:
            crc = zlib.crc32(f"{label}={value};".encode(), crc)
    return crc


def _choose_root(table: np.ndarray) -> Tuple[int, int]:
    """Picks the sync root and commit id from the allgathered rows (see :meth:`State.sync`).

    Raises:
        StateDivergenceError: survivors' ids differ beyond what a failure mid-commit explains.
    """
    survivors = np.flatnonzero(table[:, _PARTICIPATED] == 1)
    if survivors.size == 0:
        return 0, int(table[0, _ID])
    ids = table[survivors, _ID]
    newest, oldest = int(ids.max()), int(ids.min())
    if newest - oldest > 1:
        detail = ", ".join(f"rank {r}: {int(table[r, _ID])}" for r in survivors)
        raise StateDivergenceError(f"surviving ranks hold commit ids {oldest}..{newest} ({detail}); "
                                   "ids may differ by at most 1 (a failure during commit)")
    return int(survivors[ids == newest][0]), newest


def reserved_names() -> FrozenSet[str]:
    """Names no tracked object may take: every public member of :class:`State`
    (methods, properties, attributes) and its constructor's own keywords."""
    return _RESERVED


_RESERVED: FrozenSet[str] = frozenset(
    {name for name in dir(State) if not name.startswith("_")}
    | {"framework", "binding", "adapters", "config", "per_rank"})


def _framework_adapter_loaders() -> List[Callable[[], list]]:
    """Framework adapter tables, loaded only for frameworks already imported."""
    import sys
    loaders = []
    if "torch" in sys.modules:
        def torch_adapters() -> list:
            from elastic_ext.torch.adapters import adapters
            return adapters()
        loaders.append(torch_adapters)
    if "tensorflow" in sys.modules or "keras" in sys.modules or "tf_keras" in sys.modules:
        def tf_adapters() -> list:
            from elastic_ext.tensorflow.adapters import adapters
            return adapters()
        loaders.append(tf_adapters)
    return loaders
