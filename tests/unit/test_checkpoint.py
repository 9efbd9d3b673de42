"""Durable checkpoints: bitwise round trip, corruption and truncation detected, retention,
no pickle, the background write's buffer lease, and resuming a State from storage."""

import json
import logging
import os
import pickle
import threading

import numpy as np
import pytest
import torch

from elastic_ext import GlobalRNG, checkpoint
from elastic_ext.state import tree
from elastic_ext.state.snapshot import Entry
from elastic_ext.checkpoint import CheckpointStore, read_checkpoint, write_checkpoint
from elastic_ext.config import ElasticConfig
from elastic_ext.errors import CheckpointError, ConfigError, CorruptCheckpointError
from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.testing import SoloBinding
from elastic_ext.testing import state_on


def sample_entries(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "model": Entry(arrays={"w": rng.standard_normal((5, 7)).astype(np.float32),
                               "b": rng.standard_normal(3),
                               "bf16": rng.integers(0, 2 ** 16, size=(4,), dtype=np.uint16),
                               "scalar": np.array(3.5, dtype=np.float32),
                               "empty": np.zeros((0, 4), dtype=np.int64)},
                       meta={"__map__": [["w", {"__ndarray__": "w"}]], "nan": {"__float__": "nan"}}),
        "mask": Entry(arrays={"m": rng.integers(0, 2, size=(9,)).astype(bool),
                              "c": (rng.standard_normal(2) + 1j).astype(np.complex64)}, meta=None),
        "epoch": Entry(arrays={}, meta=3),
    }


def assert_entries_equal(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert json.dumps(a[name].meta) == json.dumps(b[name].meta), name
        assert sorted(a[name].arrays) == sorted(b[name].arrays), name
        for key, array in a[name].arrays.items():
            other = b[name].arrays[key]
            assert array.dtype == other.dtype and array.shape == other.shape, (name, key)
            assert array.tobytes() == other.tobytes(), (name, key)


def write(directory, commit_id, seed=None):
    entries = sample_entries(commit_id if seed is None else seed)
    write_checkpoint(str(directory), commit_id, entries, {"world_size": 4, "generation": 1})
    return entries


def flip_byte(path, offset):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))


def truncate(path, keep):
    with open(path, "r+b") as handle:
        handle.truncate(keep)


# ------------------------------------------------------------------ format

def test_round_trip_is_bitwise_and_manifest_records_the_commit(tmp_path):
    entries = write(tmp_path, 7)
    loaded = read_checkpoint(os.path.join(tmp_path, checkpoint.checkpoint_name(7)))
    assert loaded.commit_id == 7
    assert_entries_equal(entries, loaded.entries)
    manifest = loaded.manifest
    assert manifest["world_size"] == 4 and manifest["generation"] == 1
    assert manifest["versions"]["numpy"] == np.__version__ and "python" in manifest["versions"]
    assert manifest["written_time"] > 0
    assert manifest["format_version"] == 2 and len(manifest["files"]["arrays.bin"]["xxh3_64"]) == 16
    assert all(row[4] % checkpoint.ALIGN_BYTES == 0 for row in manifest["arrays"])
    # Loaded arrays are fresh, writable buffers.
    assert loaded.entries["model"].arrays["w"].flags.writeable


def test_rewriting_a_commit_id_replaces_it(tmp_path):
    write(tmp_path, 3, seed=1)
    entries = write(tmp_path, 3, seed=2)
    assert_entries_equal(entries, read_checkpoint(os.path.join(tmp_path, checkpoint.checkpoint_name(3))).entries)
    assert not [n for n in os.listdir(tmp_path / checkpoint.checkpoint_name(3)) if n.endswith(".tmp")]


@pytest.mark.parametrize("damage, reason", [
    ("flip_data", "arrays.bin checksum"),
    ("flip_manifest", "manifest.json"),
    ("truncate_data", "has 100 bytes, the manifest records"),
    ("truncate_manifest", "not valid JSON"),
    ("no_manifest", "partial"),
    ("no_data", "arrays.bin is missing"),
])
def test_damaged_newest_is_detected_and_the_previous_one_is_loaded(tmp_path, caplog, damage, reason):
    older = write(tmp_path, 4)
    write(tmp_path, 8)
    newest = tmp_path / checkpoint.checkpoint_name(8)
    data, manifest = newest / "arrays.bin", newest / "manifest.json"
    if damage == "flip_data":
        flip_byte(data, os.path.getsize(data) // 2)
    elif damage == "flip_manifest":
        text = manifest.read_bytes()
        flip_byte(manifest, text.index(b'"world_size": 4') + len(b'"world_size": '))
    elif damage == "truncate_data":
        truncate(data, 100)
    elif damage == "truncate_manifest":
        truncate(manifest, os.path.getsize(manifest) // 2)
    elif damage == "no_manifest":
        manifest.unlink()
    else:
        data.unlink()
    with pytest.raises(CorruptCheckpointError, match=reason):
        read_checkpoint(str(newest))
    with caplog.at_level(logging.WARNING, logger="elastic_ext.checkpoint"):
        loaded = CheckpointStore(str(tmp_path)).load_newest()
    assert loaded.commit_id == 4
    assert_entries_equal(older, loaded.entries)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(newest) in w and reason.split()[0] in w for w in warnings), warnings


def test_every_single_byte_flip_in_the_data_is_caught(tmp_path):
    write(tmp_path, 1)
    path = tmp_path / checkpoint.checkpoint_name(1)
    size = os.path.getsize(path / "arrays.bin")
    for offset in range(0, size, max(1, size // 50)):
        flip_byte(path / "arrays.bin", offset)
        with pytest.raises(CorruptCheckpointError):
            read_checkpoint(str(path))
        flip_byte(path / "arrays.bin", offset)
    read_checkpoint(str(path))


def test_no_valid_checkpoint_means_a_fresh_start_with_a_warning(tmp_path, caplog):
    assert CheckpointStore(str(tmp_path / "missing")).load_newest() is None
    write(tmp_path, 2)
    (tmp_path / checkpoint.checkpoint_name(2) / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="elastic_ext.checkpoint"):
        assert CheckpointStore(str(tmp_path)).load_newest() is None
    assert any("no valid checkpoint" in r.getMessage() for r in caplog.records)


class _Trap:
    """Unpickling this creates a marker file: proof that loading ran code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def xxh3(payload):
    digest = checkpoint.Xxh3()
    digest.update(payload)
    return digest.hexdigest()


def _craft(directory, commit_id, dtype_text, payload):
    """A checkpoint whose checksums are all correct but whose array claims ``dtype_text``."""
    path = directory / checkpoint.checkpoint_name(commit_id)
    path.mkdir(parents=True)
    (path / "arrays.bin").write_bytes(payload)
    body = {"format": checkpoint.FORMAT, "format_version": checkpoint.FORMAT_VERSION, "commit_id": commit_id,
            "arrays": [["model", "w", dtype_text, [1], 0, len(payload)]],
            "objects": {"model": {"meta": None}},
            "files": {"arrays.bin": {"bytes": len(payload), "xxh3_64": xxh3(payload)}}}
    body["manifest_crc32"] = checkpoint.Crc32(checkpoint.format.canonical(body)).hexdigest()
    (path / "manifest.json").write_text(json.dumps(body))
    return path


@pytest.mark.parametrize("dtype_text", ["|O", "O", "<V8", "[('a', '<f4')]", "object", 5])
def test_a_pickle_payload_is_refused_and_never_executed(tmp_path, dtype_text):
    marker = tmp_path / "code-ran"
    payload = pickle.dumps(np.array([_Trap(str(marker))], dtype=object), protocol=2)
    path = _craft(tmp_path / "ckpts", 5, dtype_text, payload)
    with pytest.raises(CorruptCheckpointError, match="dtype"):
        read_checkpoint(str(path))
    with pytest.raises(CheckpointError, match="checkpoint_fresh_start"):  # none usable: no silent fresh start
        CheckpointStore(str(tmp_path / "ckpts")).load_newest()
    assert CheckpointStore(str(tmp_path / "ckpts")).load_newest(fresh_start=True) is None
    assert not marker.exists()


def test_inconsistent_array_table_is_refused(tmp_path):
    path = _craft(tmp_path, 6, "<f4", b"\0" * 8)  # 8 bytes do not make one float32
    with pytest.raises(CorruptCheckpointError, match="inconsistent"):
        read_checkpoint(str(path))


def test_fsspec_url_round_trip_and_corruption():
    import fsspec  # a test dependency (tools/requirements-common.txt): never skipped
    fs = fsspec.filesystem("memory")
    root = "memory://elastic-ext-test"
    if fs.exists("/elastic-ext-test"):
        fs.rm("/elastic-ext-test", recursive=True)
    entries = sample_entries(1)
    write_checkpoint(root, 1, entries, {})
    write_checkpoint(root, 2, sample_entries(2), {})
    store = CheckpointStore(root)
    assert store.commit_ids() == [2, 1]
    assert_entries_equal(sample_entries(2), store.load_newest().entries)
    data = f"/elastic-ext-test/{checkpoint.checkpoint_name(2)}/arrays.bin"
    blob = bytearray(fs.cat(data))
    blob[10] ^= 0xFF
    fs.pipe(data, bytes(blob))
    loaded = store.load_newest()
    assert loaded.commit_id == 1
    assert_entries_equal(entries, loaded.entries)


# --------------------------------------------------------------- retention

def test_retention_keeps_the_last_k(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for commit_id in range(1, 13):
        write(tmp_path, commit_id)
        store.apply_retention(commit_id, keep_last=2)
    assert store.commit_ids() == [12, 11]


def test_retention_removes_older_partials_and_leaves_newer_ids_alone(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for commit_id in (1, 2, 3, 9):
        write(tmp_path, commit_id)
    (tmp_path / checkpoint.checkpoint_name(2) / "manifest.json").unlink()
    (tmp_path / checkpoint.checkpoint_name(9) / "manifest.json").unlink()  # a cut write of an earlier run
    write(tmp_path, 4)
    assert store.apply_retention(4, keep_last=2) == [2, 1]
    assert store.commit_ids() == [9, 4, 3]


# ---------------------------------------------------------------- config

def test_checkpoint_config_from_env_and_validation():
    env = {"ELASTIC_EXT_CHECKPOINT_DIR": "/ckpt", "ELASTIC_EXT_CHECKPOINT_EVERY": "5",
           "ELASTIC_EXT_CHECKPOINT_KEEP_LAST": "2"}
    config = ElasticConfig.from_env(env)
    assert (config.checkpoint_dir, config.checkpoint_every, config.checkpoint_keep_last) == ("/ckpt", 5, 2)
    assert ElasticConfig.from_env({}).checkpoint_dir is None
    with pytest.raises(ConfigError, match=r"checkpoint_every \(0\) must be an integer >= 1"):
        ElasticConfig(checkpoint_every=0)
    with pytest.raises(ConfigError, match=r"checkpoint_keep_last \(0\) must be an integer >= 1"):
        ElasticConfig(checkpoint_keep_last=0)
    with pytest.raises(ConfigError, match=r"ELASTIC_EXT_CHECKPOINT_EVERY \('often'\) must be an integer"):
        ElasticConfig.from_env({"ELASTIC_EXT_CHECKPOINT_EVERY": "often"})
    with pytest.raises(ConfigError, match=r"checkpoint_dir \(' '\) must be a non-empty path"):
        ElasticConfig(checkpoint_dir=" ")


# -------------------------------------------------------- State integration

class Job:
    """A tiny torch training job in a world of one, with a sampler and per-rank RNG."""

    def __init__(self, directory, seed=0, wait_each=True, **config):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.sampler = ElasticPartitioner(64, batch_size=4, world=lambda: (0, 1))
        self.wait_each = wait_each  # wait for each commit's write, so that every due commit is written
        config.setdefault("checkpoint_every", 1)  # the writes themselves are tested: every commit is due
        self.state = state_on(SoloBinding(), config=ElasticConfig(checkpoint_dir=str(directory), **config),
                           model=self.model, optimizer=self.optimizer, sampler=self.sampler, step=0, rng=GlobalRNG())

    def steps(self, count, commit_every=1):
        for _ in range(count):
            indices = torch.from_numpy(next(iter(self.sampler.batches()))[0].astype(np.int64))
            x = torch.sin(indices[:, None].float() * torch.arange(1, 7).float())
            loss = self.model(x).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.sampler.record_step()
            self.state.step += 1
            if self.state.step % commit_every == 0:
                self.state.commit()
                if self.wait_each:
                    self.state.wait_for_checkpoint()

    def weights(self):
        arrays = {f"m/{k}": v.detach().numpy().copy() for k, v in self.model.state_dict().items()}
        for pid, st in self.optimizer.state_dict()["state"].items():
            arrays.update({f"o/{pid}/{k}": v.numpy().copy() for k, v in st.items()})
        return arrays


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].tobytes() == b[key].tobytes(), key


def test_a_fresh_state_resumes_bitwise_and_continues_like_an_uninterrupted_run(tmp_path):
    reference = Job(tmp_path / "ref")
    reference.state.sync()
    reference.steps(10)
    expected = reference.weights()

    first = Job(tmp_path / "ckpt")
    first.state.sync()
    first.steps(6)
    assert first.state.wait_for_checkpoint() == 6
    manifest = read_checkpoint(str(tmp_path / "ckpt" / checkpoint.checkpoint_name(6))).manifest
    assert manifest["data_cursor"] == {"sampler": {"epoch": 0, "cursor": 24}}
    assert "rng" not in manifest["objects"], "per-rank RNG streams are not checkpointed"
    first.steps(1, commit_every=100)  # work after the last checkpoint is lost with the process

    second = Job(tmp_path / "ckpt", seed=123)  # different initial weights: all must come from storage
    second.state.sync()
    assert second.state.commit_id == 6 and second.state.step == 6 and second.sampler.cursor == 24
    assert second.state.generation == 2
    assert any(e["event"] == "checkpoint_resumed" for e in second.state.events.history)
    second.steps(4)
    assert_same(expected, second.weights())
    assert second.state.wait_for_checkpoint() == 10


def test_resume_falls_back_past_a_corrupt_newest_checkpoint(tmp_path, caplog):
    first = Job(tmp_path)
    first.state.sync()
    first.steps(5)
    first.state.wait_for_checkpoint()
    flip_byte(tmp_path / checkpoint.checkpoint_name(5) / "arrays.bin", 70)
    second = Job(tmp_path, seed=9)
    with caplog.at_level(logging.WARNING, logger="elastic_ext.checkpoint"):
        second.state.sync()
    assert second.state.commit_id == 4 and second.state.step == 4
    assert any(checkpoint.checkpoint_name(5) in r.getMessage() and "checksum" in r.getMessage()
               for r in caplog.records)


def test_resume_refuses_a_checkpoint_of_other_objects(tmp_path):
    first = Job(tmp_path)
    first.state.sync()
    first.steps(2)
    first.state.wait_for_checkpoint()
    other = state_on(SoloBinding(), config=ElasticConfig(checkpoint_dir=str(tmp_path), checkpoint_every=1),
                  model=torch.nn.Linear(2, 2), step=0)
    with pytest.raises(CheckpointError, match=r"holds objects \['optimizer', 'sampler'\]"):
        other.sync()


@pytest.mark.parametrize("commit_buffers", [1, 2])
def test_a_slow_write_reads_its_own_commit_while_training_commits_on(tmp_path, monkeypatch, commit_buffers):
    gate = threading.Event()
    real = checkpoint.write_checkpoint  # the writer thread calls its module's name

    def slow(directory, commit_id, entries, info):
        gate.wait(30)
        return real(directory, commit_id, entries, info)

    monkeypatch.setattr(checkpoint.writer, "write_checkpoint", slow)
    job = Job(tmp_path, wait_each=False, commit_buffers=commit_buffers)
    job.state.sync()
    job.steps(1)
    expected = job.weights()
    job.steps(3)  # commits 2-4 must not touch commit 1's buffers; their checkpoints are skipped
    skipped = [e["commit_id"] for e in job.state.events.history if e["event"] == "checkpoint_skipped"]
    assert skipped == [2, 3, 4]
    gate.set()
    assert job.state.wait_for_checkpoint() == 1
    loaded = read_checkpoint(str(tmp_path / checkpoint.checkpoint_name(1)))
    # Entry keys are tree paths: a state_dict name such as "0.bias" is one escaped component.
    got = {f"m/{'.'.join(map(str, tree.parse_key(k)))}": v for k, v in loaded.entries["model"].arrays.items()}
    assert_same({k: v for k, v in expected.items() if k.startswith("m/")}, got)
    assert job.state.step == 4
    job.state.restore()  # the in-memory commit (4) is intact too
    assert job.state.step == 4 and not np.array_equal(job.weights()["m/0.weight"], expected["m/0.weight"])
    job.steps(1)  # the owed checkpoint goes to the next commit
    assert job.state.wait_for_checkpoint() == 5
    # Once the write is done, its buffers are reused: one extra host copy at most.
    ids = set()
    for _ in range(6):
        job.steps(1)
        job.state.wait_for_checkpoint()
        ids.add(id(job.state._entries["model"].arrays[tree.path_key(["0.weight"])]))
    assert len(ids) <= commit_buffers + 1


def test_without_a_checkpoint_dir_nothing_changes(tmp_path):
    state = state_on(SoloBinding(), config=ElasticConfig(), model=torch.nn.Linear(2, 2), step=0)
    assert state._checkpointer is None and state.wait_for_checkpoint() is None
    state.sync()
    state.commit()
    assert not os.listdir(tmp_path)


def test_tensorflow_keras_state_resumes_bitwise(tmp_path):
    import tensorflow as tf
    import tf_keras

    def build(seed):
        tf.random.set_seed(seed)
        model = tf_keras.Sequential([tf_keras.layers.Dense(8, activation="relu", input_shape=(4,)),
                                     tf_keras.layers.Dense(2)])
        optimizer = tf_keras.optimizers.Adam(0.01)
        state = state_on(SoloBinding(), framework="tensorflow",
                      config=ElasticConfig(checkpoint_dir=str(tmp_path), checkpoint_every=1),
                      model=model, optimizer=optimizer, step=0)
        return model, optimizer, state

    def train(model, optimizer, state, count):
        for i in range(count):
            x = tf.constant(np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4) * (i + 1))
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                          model.trainable_variables))
            state.step += 1
            state.commit()
            state.wait_for_checkpoint()

    model, optimizer, state = build(0)
    state.sync()
    train(model, optimizer, state, 3)
    state.wait_for_checkpoint()
    expected = [v.numpy().copy() for v in model.variables + optimizer.variables()]
    model2, optimizer2, state2 = build(7)
    state2.sync()
    assert state2.commit_id == 3 and state2.step == 3
    got = [v.numpy() for v in model2.variables + optimizer2.variables()]
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert a.tobytes() == b.tobytes()


def test_a_failed_write_is_reported_and_retried_at_the_next_commit(tmp_path, monkeypatch, caplog):
    real = checkpoint.write_checkpoint  # the writer thread calls its module's name
    calls = []

    def failing_once(directory, commit_id, entries, info):
        calls.append(commit_id)
        if len(calls) == 1:
            raise CheckpointError(f"cannot write checkpoint {directory}: disk full")
        return real(directory, commit_id, entries, info)

    monkeypatch.setattr(checkpoint.writer, "write_checkpoint", failing_once)
    job = Job(tmp_path, checkpoint_every=10)
    job.state.sync()
    with caplog.at_level(logging.ERROR, logger="elastic_ext.checkpoint"):
        job.steps(10)
        assert job.state.wait_for_checkpoint() is None
    assert any("disk full" in r.getMessage() for r in caplog.records)
    assert [e["commit_id"] for e in job.state.events.history if e["event"] == "checkpoint_failed"] == [10]
    job.steps(1)  # commit 11 is not a multiple of 10, but the failed checkpoint is owed
    assert job.state.wait_for_checkpoint() == 11 and calls == [10, 11]
