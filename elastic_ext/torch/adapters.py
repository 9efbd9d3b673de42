"""Adapters for PyTorch objects.

Tensors are copied with ``torch.Tensor.copy_`` straight into numpy-backed
host buffers (``torch.from_numpy``), so a commit never makes a second copy on
the accelerator and reuses the same host memory every time. Dtypes numpy
lacks (bfloat16, float8) travel as same-width unsigned integers.

Committed entries are device-neutral: a tensor's tag holds its dtype (and
``requires_grad``), never its device. A restored tensor goes where the live
object keeps it on *this* rank: module parameters and buffers are copied in
place; optimizer and other ``state_dict`` tensors go to the device of the
live tensor at the same key, else stay on the CPU, where
``Optimizer.load_state_dict`` moves them to their parameter's device. So two
ranks of one host (``cuda:0`` and ``cuda:1``) commit identical entries, and
a commit or checkpoint made on a GPU restores on a CPU and the other way
round. A ``"device"`` field in an older tag is ignored.
"""

from __future__ import annotations

from typing import Any, FrozenSet, Optional, Tuple

import numpy as np
import torch

from elastic_ext.state import written
from elastic_ext.state.adapters import StatefulAdapter
from elastic_ext.errors import StateError
from elastic_ext.state.snapshot import Capture, Entry
from elastic_ext.state.tree import join, path_key, split
from elastic_ext.torch.identities import STATEFUL_TYPES, check_schedulers, load_keeping_identities

# torch dtypes without a numpy twin, stored bit for bit as unsigned ints
_BIT_VIEWS = {torch.bfloat16: np.uint16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _BIT_VIEWS[getattr(torch, _name)] = np.uint8


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype in _BIT_VIEWS:
        return np.dtype(_BIT_VIEWS[dtype])
    return torch.empty(0, dtype=dtype).numpy().dtype


class TorchSource:
    """A live tensor to be copied into a host buffer at commit time."""

    def __init__(self, tensor: torch.Tensor, where: str) -> None:
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise StateError(f"{where} is a {tensor.layout} tensor; only dense (strided) tensors can be committed")
        try:
            self.dtype = _numpy_dtype(tensor.dtype)
        except TypeError:
            raise StateError(f"{where} has dtype {tensor.dtype}, which cannot be committed") from None
        self.tensor = tensor.detach()
        self.live = tensor  # the object itself, which a restore in place hands back
        self.shape = tuple(tensor.shape)

    def copy_into(self, buffer: np.ndarray) -> None:
        if watchable(self.tensor):
            written.copy(self.tensor.data_ptr(), _nbytes(self.tensor), buffer, to_buffer=True, move=_move)
            return
        target = torch.from_numpy(buffer)
        if self.tensor.dtype in _BIT_VIEWS:
            target = target.view(self.tensor.dtype)
        target.copy_(self.tensor)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _move(dst: np.ndarray, src: np.ndarray) -> None:
    torch.from_numpy(dst).copy_(torch.from_numpy(src))  # on torch's threads, as a tensor's own copy_


def watchable(tensor: torch.Tensor) -> bool:
    """True if copies of ``tensor`` may move only its written pages (:mod:`elastic_ext.state.written`):
    large, contiguous, and in this process's CPU memory (a pinned tensor is written by DMA, which
    the CPU's page tables do not see)."""
    return (tensor.device.type == "cpu" and _nbytes(tensor) >= written.MIN_BYTES and tensor.is_contiguous()
            and not tensor.is_pinned())


def copy_back(tensor: torch.Tensor, array: np.ndarray, tag: dict) -> None:
    """``tensor.copy_`` of the committed ``array`` (same shape and dtype), moving only the pages
    written since they were last equal where it can."""
    with torch.no_grad():
        if watchable(tensor) and array.flags.c_contiguous and array.nbytes == _nbytes(tensor):
            written.copy(tensor.data_ptr(), array.nbytes, array, to_buffer=False, move=_move)
        else:
            tensor.copy_(host_view(array, tag))


def _tag(tensor: torch.Tensor) -> dict:
    # No device: it differs between the ranks of a host and between machines.
    return {"dtype": str(tensor.dtype).replace("torch.", ""), "requires_grad": bool(tensor.requires_grad)}


def tensor_leaf(value: Any) -> Optional[Tuple[TorchSource, dict]]:
    """tree.Leaf for torch tensors."""
    if isinstance(value, torch.Tensor):
        return TorchSource(value, "tensor"), _tag(value)
    return None


def host_view(array: np.ndarray, tag: dict) -> torch.Tensor:
    """The buffer as a CPU tensor of the recorded dtype, sharing memory."""
    # (np.ascontiguousarray would turn a 0-d array into 1-d, e.g. Adam's step)
    tensor = torch.from_numpy(array if array.flags.c_contiguous else array.copy())
    dtype = getattr(torch, tag["dtype"])
    return tensor.view(dtype) if dtype in _BIT_VIEWS else tensor


def make_tensor(array: np.ndarray, tag: dict, key: str = "",
                device: Optional[torch.device] = None) -> torch.Tensor:
    """tree.Make: a fresh tensor (never aliasing the buffer) on ``device``, the CPU if None.

    The tag's own ``"device"`` (written by older versions) is ignored: it
    named the committing rank's device, not this one's.
    """
    tensor = host_view(array, tag)
    tensor = tensor.clone() if device is None or device.type == "cpu" else tensor.to(device)
    if tag.get("requires_grad"):
        tensor.requires_grad_(True)
    return tensor


class ModuleAdapter:
    """``torch.nn.Module``: its ``state_dict`` (parameters and buffers)."""

    name = "torch.module"
    framework = "torch"
    synced = True

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, torch.nn.Module)

    def capture(self, obj: torch.nn.Module) -> Capture:
        arrays, skeleton = split(obj.state_dict(), tensor_leaf)
        return Capture(arrays=arrays, meta=skeleton)

    def buffer_keys(self, obj: torch.nn.Module) -> FrozenSet[str]:
        """Buffers (BatchNorm running statistics...) may differ between ranks; parameters may not."""
        return frozenset(path_key([name]) for name, _ in obj.named_buffers())

    def apply(self, obj: torch.nn.Module, entry: Entry) -> torch.nn.Module:
        # load_state_dict copies into the existing parameters (param.copy_),
        # on whatever device they live: CPU views of the buffers are enough
        # and nothing aliases them. A large CPU tensor is brought back here,
        # only its written pages, and handed to load_state_dict as itself
        # (copy_ from a tensor onto its own memory returns at once).
        live, _ = split(obj.state_dict(), tensor_leaf)

        def restore(array: np.ndarray, tag: dict, key: str) -> torch.Tensor:
            source = live.get(key)
            if isinstance(source, TorchSource) and watchable(source.tensor) and fits(source.tensor, array, tag,
                                                                                     grad=False):
                copy_back(source.tensor, array, tag)
                return source.tensor
            return host_view(array, tag)

        obj.load_state_dict(join(entry.meta, entry.arrays, restore), strict=True)
        return obj


class TorchStatefulAdapter(StatefulAdapter):
    """Optimizers, LR schedulers, gradient scalers and other ``state_dict`` objects.

    Restored tensors never alias the committed buffers (an optimizer step
    would write into them: ``Optimizer.load_state_dict`` keeps tensors that
    already have the right dtype and device). An optimizer's own state
    tensors (Adam's moments) are restored in place, copied into the live
    tensor at the same key when its shape and dtype match, so a rollback
    allocates nothing; every other tensor is a fresh copy. An optimizer keeps
    its ``param_groups`` list, group dicts and per-parameter state dicts
    (:func:`elastic_ext.torch.identities.load_keeping_identities`): a scheduler or a user's reference to
    them goes on working after a restore or a sync.
    """

    name = "torch.stateful"
    framework = "torch"
    leaf = staticmethod(tensor_leaf)
    make = staticmethod(make_tensor)

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, STATEFUL_TYPES)

    def prepare(self, objects: dict) -> None:
        """Refuses an LR scheduler whose optimizer the State does not hold (raises StateError)."""
        check_schedulers(objects)

    def apply(self, obj: Any, entry: Entry) -> Any:
        # Where this rank's live object keeps a tensor (an optimizer's
        # exp_avg on cuda:<local_rank>), the restored one goes there too.
        live, _ = split(obj.state_dict(), tensor_leaf)
        devices = {key: source.tensor.device for key, source in live.items() if isinstance(source, TorchSource)}
        # Only an optimizer's state is private to it; a scheduler's tensors may be shared.
        reusable = live if isinstance(obj, torch.optim.Optimizer) else {}

        def restore(array: np.ndarray, tag: dict, key: str) -> torch.Tensor:
            source = reusable.get(key)
            if isinstance(source, TorchSource) and fits(source.tensor, array, tag):
                copy_back(source.tensor, array, tag)
                return source.live
            return make_tensor(array, tag, key, devices.get(key))

        state_dict = join(entry.meta, entry.arrays, restore)
        if isinstance(obj, torch.optim.Optimizer):
            load_keeping_identities(obj, state_dict)
        else:
            obj.load_state_dict(state_dict)
        return obj


def fits(tensor: torch.Tensor, array: np.ndarray, tag: dict, grad: bool = True) -> bool:
    """True if the committed ``array`` (``tag``) can be copied into the live ``tensor`` in place
    (``grad``: its ``requires_grad`` must match the tag's too)."""
    return (tuple(tensor.shape) == array.shape and str(tensor.dtype) == f"torch.{tag['dtype']}"
            and (not grad or tensor.requires_grad == bool(tag.get("requires_grad"))) and tensor.is_contiguous())


class TensorAdapter:
    """A bare ``torch.Tensor`` in the state: restored in place."""

    name = "torch.tensor"
    framework = "torch"
    synced = True

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def capture(self, obj: torch.Tensor) -> Capture:
        return Capture(arrays={"tensor": TorchSource(obj, "tensor")}, meta=_tag(obj))

    def apply(self, obj: torch.Tensor, entry: Entry) -> torch.Tensor:
        array = entry.arrays["tensor"]
        if fits(obj, array, entry.meta, grad=False):
            copy_back(obj, array, entry.meta)
        else:
            with torch.no_grad():
                obj.copy_(host_view(array, entry.meta))
        return obj


class GeneratorAdapter:
    """A ``torch.Generator``: per-rank, like every RNG stream."""

    name = "torch.generator"
    framework = "torch"
    synced = False

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, torch.Generator)

    def capture(self, obj: torch.Generator) -> Capture:
        return Capture(arrays={"state": TorchSource(obj.get_state(), "generator state")}, meta=None)

    def apply(self, obj: torch.Generator, entry: Entry) -> torch.Generator:
        obj.set_state(torch.from_numpy(entry.arrays["state"].copy()))
        return obj


def adapters() -> list:
    """PyTorch adapters in lookup order (tried before the framework-free ones)."""
    return [ModuleAdapter(), TorchStatefulAdapter(), TensorAdapter(), GeneratorAdapter()]
