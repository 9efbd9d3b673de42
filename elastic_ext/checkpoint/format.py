"""The on-disk checkpoint format: names, manifest rules, dtype guard, checksums.

A checkpoint is one directory per commit id, ``<dir>/ckpt-<commit id>/``:

- ``arrays.bin``: the raw bytes of every committed array, one after the
  other (each starts on a 64-byte boundary, arrays of 1 MiB or more on a
  4096-byte one, so that they can be written with ``O_DIRECT``);
- ``manifest.json``, written last: commit id, world size, generation, data
  cursor, versions and times, each object's JSON metadata (the ``Entry.meta``
  skeleton), the ``[name, key, dtype, shape, offset, bytes]`` table of the
  arrays, the size and checksum of ``arrays.bin`` (format version 2: XXH3-64;
  version 1, still read: CRC-32), and the CRC-32 of the manifest itself.

This module holds the rules both sides follow: :func:`parse_manifest` and
:func:`check_manifest` validate every field a reader uses before it is used,
and :func:`safe_dtype` admits plain numeric dtypes only, so loading cannot
execute code nor allocate more than the data file holds. Reading and writing
the two files is :mod:`elastic_ext.checkpoint.files`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import re
import sys
import zlib
from typing import Any, Dict, Iterable, Optional, Tuple, Type, Union

import numpy as np
import xxhash

from elastic_ext.state.buffers import ALIGNED_MIN_BYTES, PAGE_BYTES
from elastic_ext.errors import CorruptCheckpointError, UnsupportedCheckpointError
from elastic_ext.state.snapshot import Entry

FORMAT = "elastic_ext.checkpoint"
FORMAT_VERSION = 2  # what the writer writes; the reader also takes version 1 (CRC-32 of the data)
DATA_FILE = "arrays.bin"
MANIFEST_FILE = "manifest.json"
ALIGN_BYTES = 64
CHUNK_BYTES = 64 << 20
SKIP_BYTES = 64 << 10
# At most 18 digits: any longer name is not ours, and int() of a huge one is slow or refused.
NAME_PATTERN = re.compile(r"^ckpt-(\d{1,18})$")
SAFE_KINDS = "biufc"  # bool, ints, floats, complex: dtypes that cannot hold objects
# What the writer records (``array.dtype.str``): byte order, kind, item size. Anything
# else is refused before numpy parses it.
DTYPE_TEXT = re.compile(r"^[<>|=]?[biufc][0-9]{1,2}$")
HEX_TEXT = re.compile(r"^[0-9a-f]+$")
# Deepest JSON nesting a manifest may have. The metadata skeletons of real
# optimizers nest about a dozen levels; the bound keeps every later walk of
# the manifest (checksum, consumers) far from Python's recursion limit.
MAX_JSON_DEPTH = 200
MAX_NDIM = 32  # numpy's own limit
MAX_MANIFEST_BYTES = 64 << 20  # a manifest grows with the number of arrays: megabytes at most
# How a message names the way to start from the initial state despite unusable checkpoints.
FRESH_START_HINT = "checkpoint_fresh_start=True (ELASTIC_EXT_CHECKPOINT_FRESH_START=1)"


def checkpoint_name(commit_id: int) -> str:
    return f"ckpt-{commit_id:012d}"


@dataclasses.dataclass
class Loaded:
    """A verified checkpoint: its manifest and the committed entries by object name."""

    path: str
    commit_id: int
    manifest: dict
    entries: Dict[str, Entry]


class Crc32:
    """zlib's CRC-32 with hashlib's update/hexdigest shape: the manifest's own
    checksum, and the data file's in format version 1."""

    def __init__(self, data: bytes = b"") -> None:
        self.value = zlib.crc32(data)

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


class Xxh3:
    """XXH3-64 of the data file (format version 2), hashlib's shape.

    Not CRC-32 any more: on a 2-core EPYC VM CRC-32 ran at 4 GB/s, XXH3 at
    20 to 30 GB/s (memory speed), and the CRC pass was half of the
    background writer's CPU time, taken from training when every core
    trains. A 64-bit hash misses a random corruption with probability 2^-64
    (CRC-32: 2^-32, plus its guarantee for errors of up to 3 bits, which
    checkpoints do not need); neither resists a deliberate edit. Like zlib,
    it releases the GIL while it hashes.
    """

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def update(self, data: Any) -> None:
        self._state.update(data)

    def hexdigest(self) -> str:
        return self._state.hexdigest()


Digest = Union[Crc32, Xxh3]
# format version -> (field of files.arrays.bin, checksum, hex digits of its value)
DATA_DIGESTS: Dict[int, Tuple[str, Type[Digest], int]] = {
    1: ("crc32", Crc32, 8),
    2: ("xxh3_64", Xxh3, 16),
}


def data_digest(manifest: dict) -> Tuple[str, Digest]:
    """The checksum field of ``arrays.bin`` in a parsed manifest, and a fresh digest to compare with it."""
    field, kind, _ = DATA_DIGESTS[manifest["format_version"]]
    return field, kind()


def array_offset(offset: int, nbytes: int) -> int:
    """Where an array of ``nbytes`` starts in ``arrays.bin`` when the previous one ends at ``offset``."""
    align = PAGE_BYTES if nbytes >= ALIGNED_MIN_BYTES else ALIGN_BYTES  # as the commit buffers
    return offset + (-offset % align)


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")


def versions() -> Dict[str, str]:
    found = {"python": platform.python_version(), "numpy": np.__version__}
    # The package is imported by now; an import statement here would make a circle with it.
    found["elastic_ext"] = str(getattr(sys.modules.get("elastic_ext"), "__version__", "unknown"))
    for module in ("torch", "tensorflow", "keras", "horovod"):
        loaded = sys.modules.get(module)  # record what the job runs, import nothing
        if loaded is not None and hasattr(loaded, "__version__"):
            found[module] = str(loaded.__version__)
    return found


def parse_manifest(path: str, raw: bytes) -> dict:
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} ({len(raw)} bytes) nests deeper than the "
                                     f"JSON parser can follow; a manifest nests at most {MAX_JSON_DEPTH} "
                                     "levels") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} ({len(raw)} bytes) is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} holds a JSON {type(manifest).__name__}, not an "
                                     f"object: it is not an {FORMAT} manifest")
    depth = json_depth(manifest)
    if depth > MAX_JSON_DEPTH:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} nests {depth} levels deep; the limit is "
                                     f"{MAX_JSON_DEPTH}")
    if manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} format ({quote(manifest.get('format'))}) must be "
                                     f"{FORMAT!r}")
    version = manifest.get("format_version")
    if type(version) is int and version > FORMAT_VERSION:
        raise UnsupportedCheckpointError(
            f"{path}: written in a newer format_version {version} (this elastic_ext reads "
            f"{sorted(DATA_DIGESTS)}): resume it with the elastic_ext that wrote it, or allow a fresh start "
            f"with {FRESH_START_HINT}")
    if type(version) is not int or version not in DATA_DIGESTS:
        raise CorruptCheckpointError(f"{path}: format_version ({quote(version)}) must be one of "
                                     f"{sorted(DATA_DIGESTS)}")
    recorded = manifest.pop("manifest_crc32", None)
    actual = Crc32(canonical(manifest)).hexdigest()
    if recorded != actual:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} checksum ({actual}) does not match the "
                                     f"recorded one ({quote(recorded)})")
    return manifest


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion (1 for a flat object)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def quote(value: Any, limit: int = 80) -> str:
    """A bad value for an error message: repr, cut short (manifest values can be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def is_count(value: Any) -> bool:
    """A JSON integer >= 0 (JSON true/false parse as bool, a subclass of int: refused)."""
    return type(value) is int and value >= 0


def check_manifest(path: str, manifest: dict, expected_id: Optional[int]) -> None:
    """Validates every manifest field the loader or State uses; raises CorruptCheckpointError."""

    def bad(field: str, value: Any, rule: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: manifest field {field} ({quote(value)}) {rule}")

    commit_id = manifest.get("commit_id")
    if not is_count(commit_id):
        raise bad("commit_id", commit_id, "must be an integer >= 0")
    if expected_id is not None and commit_id != expected_id:
        raise bad("commit_id", commit_id, f"must match the directory name ({checkpoint_name(expected_id)})")
    for field in ("generation", "world_size"):
        if field in manifest and not is_count(manifest[field]):
            raise bad(field, manifest[field], "must be an integer >= 0")
    files = manifest.get("files")
    record = files.get(DATA_FILE) if isinstance(files, dict) else None
    if not isinstance(record, dict):
        raise bad("files", files, f"must be an object with an object for {DATA_FILE}")
    if not is_count(record.get("bytes")):
        raise bad(f"files.{DATA_FILE}.bytes", record.get("bytes"), "must be an integer >= 0")
    field, _, digits = DATA_DIGESTS[manifest["format_version"]]
    value = record.get(field)
    if not isinstance(value, str) or len(value) != digits or not HEX_TEXT.match(value):
        raise bad(f"files.{DATA_FILE}.{field}", value, f"must be {digits} lowercase hex digits")
    objects = manifest.get("objects")
    if not isinstance(objects, dict) or not all(isinstance(o, dict) and "meta" in o for o in objects.values()):
        raise bad("objects", objects, 'must map each object name to {"meta": ...}')
    rows = manifest.get("arrays")
    if not isinstance(rows, list):
        raise bad("arrays", rows, "must be a list of [object, key, dtype, shape, offset, bytes] rows")
    seen, position = set(), 0
    for index, row in enumerate(rows):
        field = f"arrays[{index}]"
        if not isinstance(row, list) or len(row) != 6:
            raise bad(field, row, "must be a list of 6: [object, key, dtype, shape, offset, bytes]")
        name, key, dtype_text, shape, offset, nbytes = row
        if not isinstance(name, str) or name not in objects:
            raise bad(field, row, f"names object {quote(name)}, which is not in objects")
        if not isinstance(key, str) or (name, key) in seen:
            raise bad(field, row, "must have a string key, once per object")
        seen.add((name, key))
        dtype = safe_dtype(path, dtype_text)
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(is_count(d) for d in shape)):
            raise bad(field, row, f"shape must be a list of at most {MAX_NDIM} integers >= 0")
        # Python integers: a product cannot wrap around as an int64 one does.
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2 ** 62:
            raise bad(field, row, "shape is too large for any array")
        if not is_count(nbytes) or math.prod(shape) * dtype.itemsize != nbytes:
            raise bad(field, row, f"bytes must be the shape's element count times the item size "
                                  f"({dtype.itemsize})")
        if not is_count(offset) or offset < position:
            raise bad(field, row, f"offset must be an integer >= {position} (where the previous array ends)")
        if offset + nbytes > record["bytes"]:
            raise bad(field, row, f"ends at byte {offset + nbytes}, past the end of {DATA_FILE} "
                                  f"({record['bytes']} bytes)")
        position = offset + nbytes


def safe_dtype(path: str, text: Any) -> np.dtype:
    dtype = None
    if isinstance(text, str) and DTYPE_TEXT.match(text):
        try:
            dtype = np.dtype(text)
        except (TypeError, ValueError):  # e.g. '<f3': no such item size
            dtype = None
    if dtype is None or dtype.kind not in SAFE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise CorruptCheckpointError(f"{path}: array dtype ({quote(text)}) is not a plain numeric dtype such as "
                                     "'<f4'; refused (a checkpoint never holds objects)")
    return dtype
