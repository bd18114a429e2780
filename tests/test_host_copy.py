"""Host lists to tensors (engine/host_copy.py): the array fast path gives what torch.tensor gives, and on a GPU the
copy is queued without waiting for the stream."""

import time

import pytest
import torch

from baton.engine.host_copy import POINTER_ALIGN_BYTES, host_tensor, to_device, to_device_parts

CASES = [
    ([3, -1, 0, 2**40], torch.int64),
    ((7, 8, 9), torch.int64),
    ([5, 2**31 - 1, -(2**31)], torch.int32),
    ([True, False, 3], torch.int64),
    ([], torch.int64),
    ([[1, 2], [3, 4]], torch.int64),   # nested: torch.tensor's path
    ([1.0, 2.5], torch.float32),
    ([True, False], torch.bool),
]


@pytest.mark.parametrize("values,dtype", CASES)
def test_host_tensor_equals_torch_tensor(values, dtype):
    got = host_tensor(values, dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    got[...] = 0 if got.numel() else got  # writable (the runner's static buffers are written in place)


@pytest.mark.parametrize("values,dtype", [([2**40], torch.int32), (["x"], torch.int64), ([1, "x"], torch.int64)])
def test_host_tensor_refuses_what_torch_refuses(values, dtype):
    with pytest.raises(Exception) as want:
        torch.tensor(values, dtype=dtype)
    with pytest.raises(want.type, match=str(want.value)[:20].replace("(", ".")):
        host_tensor(values, dtype)


def test_the_fast_path_outlives_its_list():
    values = list(range(1000))
    t = host_tensor(values, torch.int64)
    del values
    assert t.sum().item() == 999 * 1000 // 2


def test_to_device_on_cpu():
    assert torch.equal(to_device([1, 2, 3], torch.int64, torch.device("cpu")), torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lengths", [(0, 0), (1, 3, 5), (4, 7), (5, 0, 2), (9,)])
def test_parts_of_one_copy_each_start_aligned(lengths, dtype):
    """Whatever the parts' lengths, each starts 16-byte aligned (a kernel taking it meets one pointer
    specialization), and holds exactly its values."""
    parts = [[100 * i + j for j in range(n)] for i, n in enumerate(lengths)]
    got = to_device_parts(parts, dtype, torch.device("cpu"))
    assert len(got) == len(parts)
    for t, p in zip(got, parts, strict=True):
        assert t.dtype == dtype and t.tolist() == p
        assert t.data_ptr() % POINTER_ALIGN_BYTES == 0


@pytest.mark.gpu
def test_gpu_to_device_is_queued_behind_the_stream_without_a_host_wait():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    values = list(range(20000))
    to_device(values, torch.int64, dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning queued on the stream
    t = time.perf_counter()
    got = to_device(values, torch.int64, dev)
    returned = time.perf_counter() - t
    assert returned < 0.2  # a blocking copy would have waited for the spin
    assert torch.equal(got.cpu(), torch.arange(20000))
