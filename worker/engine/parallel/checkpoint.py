"""Read access to a checkpoint's tensors by slice, so each rank reads only its shard.

Owns the open safetensors handles of one checkpoint (memory-mapped; nothing is read until a slice is
indexed). `get_slice(name)[rows]` reads just those rows from the file: a rank never materialises a
whole tensor it keeps a part of, and rank 0 never scatters the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
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
