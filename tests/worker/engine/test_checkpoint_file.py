"""The safetensors reader (checkpoint.py `SafetensorsFile`): what it reads equals safetensors' own reading, slice by
slice and dtype by dtype; a file whose header does not fit it is refused in one line; and a tensor's mapped pages
leave the process once it is read (the loader's host memory holds one copy of the weights, benchmarks/README.md)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from worker.engine.checkpoint import RowBlock, SafetensorsCheckpoint, read_view

INDEXES = [..., slice(None), slice(3, 7), (slice(2, 5), slice(1, 4)), (slice(None), slice(5, 8)), 2]


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    values = torch.randn(9, 8)
    return {
        "f32": values,
        "bf16": values.bfloat16(),
        "f16": values.half(),
        "fp8": values.to(torch.float8_e4m3fn),
        "i32": torch.arange(72, dtype=torch.int32).reshape(9, 8),
        "u8": torch.arange(72, dtype=torch.uint8).reshape(9, 8),
        "bias": torch.randn(9),  # 1-D, 36 bytes: the tensors after it start off an 8-byte boundary
        "empty": torch.zeros(0, 8),
    }


def test_slices_equal_safetensors_reading(tmp_path, tensors):
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    ckpt = SafetensorsCheckpoint([path])
    with safe_open(str(path), framework="pt") as reference:
        for name in tensors:
            ours, theirs = ckpt.get_slice(name), reference.get_slice(name)
            assert ours.get_shape() == theirs.get_shape() and ours.get_dtype() == theirs.get_dtype()
            for index in (
                INDEXES if tensors[name].dim() == 2 and tensors[name].numel() else [..., slice(1, 3)]
            ):
                want = theirs[index]
                got = ours[index]
                assert got.dtype == want.dtype and torch.equal(
                    got.view(torch.uint8), want.view(torch.uint8)
                ), (name, index)
                with read_view(ours, index) as view:  # the borrowed view holds the same values
                    assert torch.equal(view.contiguous().view(torch.uint8), want.view(torch.uint8)), (
                        name,
                        index,
                    )
    block = RowBlock(ckpt.get_slice("f32"), 2, 6, "f32")
    assert torch.equal(block[1:3], tensors["f32"][3:5])
    with read_view(block, (slice(1, 3), slice(2, 4))) as view:
        assert torch.equal(view, tensors["f32"][3:5, 2:4])


def test_a_read_is_a_copy_the_file_does_not_see(tmp_path, tensors):
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    ckpt = SafetensorsCheckpoint([path])
    read = ckpt.get_slice("f32")[...]
    read.add_(1)
    assert torch.equal(ckpt.get_slice("f32")[...], tensors["f32"])


def _file_rss_kb(path: Path) -> int:
    """The resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's first line: its addresses ... its path
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_a_tensors_pages_leave_the_process_once_read(tmp_path):
    path = tmp_path / "big.safetensors"
    save_file({"w": torch.randn(1024, 2048)}, str(path))  # 8 MiB
    ckpt = SafetensorsCheckpoint([path])
    into = torch.empty(1024, 2048)
    with read_view(ckpt.get_slice("w"), slice(None)) as view:
        into.copy_(view)
        assert _file_rss_kb(path) > 4096  # the copy read the file through the mapping
    assert _file_rss_kb(path) < 64  # ... and its pages left when the block ended
    ckpt.get_slice("w")[100:200]
    assert _file_rss_kb(path) < 64


def _write(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "header, data, refusal",
    [
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "past the file's"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8, "holds 8 bytes"),
        (
            {"w": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}},
            b"\0" * 2,
            "not a tensor of a dtype cbq reads",
        ),
        ({"w": {"dtype": "F32", "shape": [4]}}, b"\0" * 16, "has no shape and offsets"),
    ],
)
def test_a_header_that_does_not_fit_is_refused_naming_the_tensor(tmp_path, header, data, refusal):
    path = tmp_path / "bad.safetensors"
    _write(path, header, data)
    with pytest.raises(ValueError, match=refusal):
        SafetensorsCheckpoint([path])


def test_a_truncated_file_is_refused(tmp_path, tensors):
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError):
        SafetensorsCheckpoint([path])
