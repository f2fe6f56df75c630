"""Read access to a checkpoint's tensors by slice, so each rank reads only its shard.

Owns the open safetensors handles of one checkpoint (memory-mapped; nothing is read until a slice is
indexed). `get_slice(name)[rows]` reads just those rows from the file: a rank never materialises a
whole tensor it keeps a part of, and rank 0 never scatters the model. `RowBlock` is one block of rows of a fused
tensor (Phi-3's qkv_proj, GLM-4's gate_up_proj) read the same way, as if it were a tensor of its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
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


class SafetensorsCheckpoint:
    """The tensors of one or more .safetensors files, by name."""

    def __init__(self, paths: Sequence[str | Path]):
        from safetensors import safe_open

        if not paths:
            raise ValueError("a checkpoint needs at least one .safetensors file")
        self._handles: dict[str, Any] = {}
        self._file_of: dict[str, Path] = {}
        for path in map(Path, paths):
            handle = safe_open(str(path), framework="pt", device="cpu")
            self._handles[str(path)] = handle
            for name in handle.keys():
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
        return self._handles[str(path)].get_slice(name)


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
        index = list(index) if isinstance(index, tuple) else [index]
        index += [slice(None)] * (self.dim + 1 - len(index))
        rows = index[self.dim]
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"a RowBlock is read by a contiguous slice of rows, got {rows!r}")
        first, last, _ = rows.indices(self.stop - self.start)
        index[self.dim] = slice(self.start + first, self.start + max(first, last))
        return self.inner[tuple(index)]


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
