"""Read access to a checkpoint's tensors by slice, so each rank reads only its shard.

Owns the open safetensors files of one checkpoint (memory-mapped; nothing is read until a slice is
indexed). `get_slice(name)[rows]` reads just those rows from the file: a rank never materialises a
whole tensor it keeps a part of, and rank 0 never scatters the model. `RowBlock` is one block of rows of a fused
tensor (Phi-3's qkv_proj, GLM-4's gate_up_proj) read the same way, as if it were a tensor of its own.

Host memory: a slice read is copied out of the mapping and the tensor's mapped pages are then dropped from the
process (`madvise(MADV_DONTNEED)`; the page cache keeps them, a later read faults them back in). Left mapped, every
page read counts in the process's RSS until the file is closed: a second copy of the weights beside the parameters
they were copied into (benchmarks/README.md, "One loader"). So loading holds one copy plus the slice being read.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch


class TensorSlice(Protocol):
    """A tensor in a file, read by indexing (safetensors' PySafeSlice satisfies it)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class SliceSource(Protocol):
    """Where layers load from: anything that hands out TensorSlices by checkpoint name."""

    def get_slice(self, name: str) -> TensorSlice: ...


class Checkpoint(SliceSource, Protocol):
    """A SliceSource that also says which names it holds (checkpoints differ in their experts' names and layouts)."""

    def __contains__(self, name: str) -> bool: ...


class WholeTensor:
    """A tensor in memory read like a checkpoint slice."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


class ModelSource:
    """Tensors by checkpoint name from a state dict (a preset built in memory, a transformers module's own
    tensors), read like a checkpoint."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get_slice(self, name: str) -> TensorSlice:
        return WholeTensor(self.tensors[name])


# safetensors' dtype names (the format's spec); F4 (two values a byte) is not read.
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}  # fmt: skip


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file: where its bytes lie in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets in the file
    stop: int


class SafetensorsFile:
    """One .safetensors file, memory-mapped: its header read and checked (every tensor's bytes inside the file,
    as many as its dtype and shape need), its tensors read by slice (`FileSlice`)."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            if size < 8:
                raise ValueError(f"{path}: {size} bytes, not a safetensors file")
            (header_size,) = struct.unpack("<Q", f.read(8))
            if header_size > size - 8:
                raise ValueError(f"{path}: its header claims {header_size} bytes, the file holds {size}")
            header = json.loads(f.read(header_size))
            if not isinstance(header, dict):
                raise ValueError(f"{path}: its header is not a JSON object")
            # a private mapping, since torch wants a writable buffer; nothing writes to it (reads copy from it)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.entries: dict[str, _Entry] = {}
        self.dtype_names: dict[str, str] = {}
        base = 8 + header_size
        for name, info in sorted(header.items()):
            if name == "__metadata__":
                continue
            self.entries[name] = entry = self._entry(name, info, base)
            self.dtype_names[name] = info["dtype"]
            if entry.stop > size:
                raise ValueError(f"{path}: tensor {name!r} ends at byte {entry.stop}, past the file's {size}")

    def _entry(self, name: str, info: Any, base: int) -> _Entry:
        dtype = _DTYPES.get(info.get("dtype", "")) if isinstance(info, dict) else None
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name!r} is {info!r}, not a tensor of a dtype cbq reads")
        try:
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{self.path}: tensor {name!r} has no shape and offsets in its header ({exc})"
            ) from None
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
            raise ValueError(f"{self.path}: tensor {name!r} holds {end - begin} bytes, its {dtype} {list(shape)} needs "
                             f"{math.prod(shape) * dtype.itemsize}")  # fmt: skip
        return _Entry(dtype, shape, base + begin, base + end)

    def read(self, entry: _Entry, index: Any) -> torch.Tensor:
        """`tensor[index]` of the tensor at `entry`, copied out of the file (contiguous, the process's own memory)."""
        with self.borrow(entry, index) as view:
            return view.clone(memory_format=torch.contiguous_format)

    @contextlib.contextmanager
    def borrow(self, entry: _Entry, index: Any) -> Iterator[torch.Tensor]:
        """`tensor[index]` as a view of the mapped file, for a copy made inside the block (no copy of its own); the
        tensor's mapped pages are dropped from the process when the block ends. The view must not outlive the block:
        a later read would fault the file's bytes back in, and an in-place write to it would be lost."""
        nbytes = entry.stop - entry.start
        if nbytes == 0:
            yield torch.empty(entry.shape, dtype=entry.dtype)[index]
            return
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=entry.start)
        if (
            entry.start % entry.dtype.itemsize
        ):  # a writer that did not align its tensors: its bytes copied first
            raw = raw.clone()
        try:
            yield raw.view(entry.dtype).view(entry.shape)[index]
        finally:
            del raw
            page = entry.start - entry.start % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, page, entry.stop - page)


class FileSlice:
    """A tensor of a `SafetensorsFile`, read by indexing (a `TensorSlice`), or borrowed (`read_view`)."""

    def __init__(self, file: SafetensorsFile, entry: _Entry, dtype_name: str):
        self.file, self.entry, self.dtype_name = file, entry, dtype_name

    def get_shape(self) -> list[int]:
        return list(self.entry.shape)

    def get_dtype(self) -> str:
        """Its dtype as the file names it ("F8_E4M3"), as safetensors' slices answer."""
        return self.dtype_name

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.file.read(self.entry, index)

    def borrow(self, index: Any) -> contextlib.AbstractContextManager[torch.Tensor]:
        return self.file.borrow(self.entry, index)


@contextlib.contextmanager
def read_view(loaded: TensorSlice, index: Any) -> Iterator[torch.Tensor]:
    """`loaded[index]` for a copy made inside the block: a view of the file where `loaded` is a file's tensor (read
    straight from the mapping into the copy's destination, its pages dropped after), else the slice read as usual.
    What the loaders copy a checkpoint's slice into a parameter with, so loading holds one copy of the weights."""
    borrow = getattr(loaded, "borrow", None)
    if borrow is None:
        yield loaded[index]
        return
    with borrow(index) as view:
        yield view


class SafetensorsCheckpoint:
    """The tensors of one or more .safetensors files, by name."""

    def __init__(self, paths: Sequence[str | Path]):
        if not paths:
            raise ValueError("a checkpoint needs at least one .safetensors file")
        self._files: dict[str, SafetensorsFile] = {}
        self._file_of: dict[str, Path] = {}
        for path in map(Path, paths):
            file = SafetensorsFile(path)
            self._files[str(path)] = file
            for name in file.entries:
                if name in self._file_of:
                    raise ValueError(f"tensor {name!r} is in both {self._file_of[name]} and {path}")
                self._file_of[name] = path

    @classmethod
    def from_dir(cls, directory: str | Path) -> SafetensorsCheckpoint:
        """The files of a checkpoint directory (model.safetensors or its sharded index)."""
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return cls([directory / name for name in files])
        paths = sorted(directory.glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no .safetensors files in {directory}")
        return cls(paths)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> Iterator[str]:
        return iter(self._file_of)

    def get_slice(self, name: str) -> TensorSlice:
        path = self._file_of.get(name)
        if path is None:
            raise KeyError(f"tensor {name!r} is not in the checkpoint ({len(self._file_of)} tensors)")
        file = self._files[str(path)]
        return FileSlice(file, file.entries[name], file.dtype_names[name])


class RowBlock:
    """Rows [start, stop) of a tensor in a file, as a TensorSlice of its own: indexing it reads only the rows asked
    for (a rank's q heads out of a fused q/k/v weight, its gate features out of a fused gate/up weight). `dim`: the
    tensor's dim that runs along the weight's rows (1 for a GPTQ or AWQ tensor, stored [K, N])."""

    def __init__(self, inner: TensorSlice, start: int, stop: int, name: str, dim: int = 0):
        rows = inner.get_shape()[dim]
        if not 0 <= start <= stop <= rows:
            raise ValueError(f"{name}: rows [{start}, {stop}) are outside its {rows} rows")
        self.inner, self.start, self.stop, self.dim = inner, start, stop, dim

    def get_shape(self) -> list[int]:
        shape = list(self.inner.get_shape())
        shape[self.dim] = self.stop - self.start
        return shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.inner[self._inner_index(index)]

    def borrow(self, index: Any) -> contextlib.AbstractContextManager[torch.Tensor]:
        return read_view(self.inner, self._inner_index(index))

    def _inner_index(self, index: Any) -> tuple[Any, ...]:
        index = list(index) if isinstance(index, tuple) else [index]
        index += [slice(None)] * (self.dim + 1 - len(index))
        rows = index[self.dim]
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"a RowBlock is read by a contiguous slice of rows, got {rows!r}")
        first, last, _ = rows.indices(self.stop - self.start)
        index[self.dim] = slice(self.start + first, self.start + max(first, last))
        return tuple(index)


class RenamedCheckpoint:
    """A checkpoint read under the model's names: a multimodal checkpoint's language model, whose family maps the
    checkpoint's names onto the text model's (`Family.wrappers`: regex -> replacement, the first that matches).
    Names no rename matches (the vision tower) are not visible, and never read."""

    def __init__(self, inner: SafetensorsCheckpoint, renames: dict[str, str]):
        self.inner = inner
        self.checkpoint_name: dict[str, str] = {}  # model name -> checkpoint name
        for name in inner.names():
            for pattern, replacement in renames.items():
                renamed, count = re.subn(pattern, replacement, name)
                if count:
                    self.checkpoint_name[renamed] = name
                    break

    def __contains__(self, name: str) -> bool:
        return name in self.checkpoint_name

    def get_slice(self, name: str) -> TensorSlice:
        if name not in self.checkpoint_name:
            raise KeyError(f"tensor {name!r} is not in the checkpoint's language model")
        return self.inner.get_slice(self.checkpoint_name[name])
