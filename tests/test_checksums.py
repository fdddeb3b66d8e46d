"""The checksum of checkpoint and snapshot files (checkpoint_format.checksum:
the native CRC-32C, kernels/crc32c.h) against a bit-at-a-time reference on
fresh random bytes, through the binding from tensors of every dtype a file
holds, and the copy that checksums in the same pass; and rank files of before it (zlib's CRC-32, under "crc32") still
read and checked."""
import zlib

import pytest
import torch

from zerocore import _native
from zerocore.io import checkpoint_format, safetensors_file


def _reference(data: bytes) -> int:
    """CRC-32C by its definition (reflected 0x82F63B78, all-ones in and out)."""
    reg = 0xFFFFFFFF
    for byte in data:
        reg ^= byte
        for _ in range(8):
            reg = (reg >> 1) ^ 0x82F63B78 if reg & 1 else reg >> 1
    return reg ^ 0xFFFFFFFF


def test_the_check_value():
    assert _native.crc32c(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)) == 0xE3069283
    assert checkpoint_format.checksum(torch.empty(0)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_a_tensor_checksum_is_the_crc32c_of_its_bytes(dtype):
    for n in (1, 3, 17, 1000, 13000):  # 13000 float32s: past the hardware path's 12 KiB blocks
        t = (torch.randn(n) * 1000).to(dtype) if dtype.is_floating_point else torch.randint(-99, 99, (n,)).to(dtype)
        data = bytes(safetensors_file.tensor_bytes(t))
        assert checkpoint_format.checksum(t) == _reference(data)
        cut = int(torch.randint(0, len(data) + 1, ()))  # continued from the CRC of the bytes before
        head = _native.crc32c(torch.frombuffer(bytearray(data[:cut]) or bytearray(1), dtype=torch.uint8)[:cut])
        tail = torch.frombuffer(bytearray(data[cut:]) or bytearray(1), dtype=torch.uint8)[:len(data) - cut]
        assert _native.crc32c(tail, head) == _reference(data)
    matrix = torch.randn(7, 5)  # a tensor of any shape: its bytes in order
    assert checkpoint_format.checksum(matrix) == _reference(bytes(safetensors_file.tensor_bytes(matrix)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_the_copy_with_its_checksum_in_one_pass(dtype):
    """A snapshot's copy (checkpoint_format.copy_with_checksum, the native
    copy_crc32c): the bytes copied exactly into their place and nowhere
    else, their CRC-32C the reference's, across the copy's 16 KiB blocks;
    sizes that differ refused."""
    for n in (0, 1, 4099, 20000):
        src = (torch.randn(n) * 1000).to(dtype) if dtype.is_floating_point else torch.randint(0, 256, (n,)).to(dtype)
        nbytes = n * src.element_size()
        file = torch.randint(0, 256, (nbytes + 8,), dtype=torch.uint8)
        before = file.clone()
        crc = checkpoint_format.copy_with_checksum(file[4:4 + nbytes], src)
        assert crc == _reference(bytes(safetensors_file.tensor_bytes(src)))
        assert torch.equal(file[4:4 + nbytes], src.view(torch.uint8))
        assert torch.equal(file[:4], before[:4]) and torch.equal(file[4 + nbytes:], before[4 + nbytes:])
    with pytest.raises(Exception, match="copy_crc32c"):
        checkpoint_format.copy_with_checksum(torch.empty(3, dtype=torch.uint8), torch.empty(1))


def test_a_rank_file_with_zlib_crc32s_is_still_checked(tmp_path):
    """A rank file written before CRC-32C carries zlib's CRC-32 under
    "crc32": opened, its checksums are computed that way, and a changed bit
    fails them."""
    tensors = {"param/w/0": torch.randn(100), "rng/cpu": torch.randint(0, 255, (32,), dtype=torch.uint8)}
    meta = checkpoint_format.rank_file_metadata("s", 0, 1, {})
    meta["zerocore"] = meta["zerocore"].replace('"crc32c":{}', '"crc32":' + str(
        {k: zlib.crc32(safetensors_file.tensor_bytes(t)) for k, t in tensors.items()}).replace("'", '"'))
    path = tmp_path / "rank.safetensors"
    safetensors_file.write(path, [(k, t.dtype, t.shape, t) for k, t in tensors.items()], meta, fsync=False)
    reader, info = checkpoint_format.open_rank_file(path)
    assert all(info["checksum"](reader.get(k)) == info["checksums"][k] for k in tensors)
    reader.close()
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01  # inside param/w/0's data (the last tensor's bytes: rng/cpu's 32, then w's)
    path.write_bytes(bytes(data))
    reader, info = checkpoint_format.open_rank_file(path)
    assert info["checksum"](reader.get("param/w/0")) != info["checksums"]["param/w/0"]
    reader.close()
