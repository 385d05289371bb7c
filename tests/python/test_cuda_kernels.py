"""shardkit's CUDA kernels (csrc/cuda/) against torch references, on a GPU (marked ``cuda``; skipped elsewhere).

Inputs are random; outputs start poisoned (NaN) so an element a kernel forgets shows; sizes are odd and
misaligned (views starting 1..7 elements into a buffer) so the 16-byte path, the 4-byte path and the byte
path of pack/unpack all run, and batches cross the 64-tensor launch boundary. Exact equality where the kernel
only moves bytes or where torch rounds once the same way; a tolerance only where summation order differs
(Gram-Schmidt's norms and projections).
"""

from __future__ import annotations

import pytest
import torch

from shardkit import _C

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (_C.with_cuda and torch.cuda.is_available()),
                       reason="needs a CUDA GPU and shardkit's CUDA build (make gpu-test)"),
]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SIZES = [0, 1, 3, 7, 17, 1000, 4097, 100_003]


def _random(numel: int, dtype: torch.dtype, offset: int = 0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(numel + offset, device="cuda", generator=g, dtype=torch.float32).to(dtype)
    return base[offset:]  # starts `offset` elements in: misaligned for offset % (16 / itemsize) != 0


def _poisoned(numel: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    return torch.full((numel + offset,), float("nan"), device="cuda", dtype=dtype)[offset:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 5, 64, 65, 150])
def test_pack_then_unpack_moves_every_byte(dtype, count):
    sizes = [SIZES[(i * 7) % len(SIZES)] % 5000 + (i % 3) for i in range(count)]
    tensors = [_random(n, dtype, offset=i % 8, seed=i) for i, n in enumerate(sizes)]
    offsets, total = [], 3  # a gap at the front and between tensors: the kernel must not touch it
    for n in sizes:
        offsets.append(total)
        total += n + (total % 2)
    flat = _poisoned(total, dtype, offset=1)
    _C.cuda_pack_(flat, tensors, offsets)
    for t, o in zip(tensors, offsets):
        assert torch.equal(flat[o:o + t.numel()], t)
    untouched = torch.ones(total, dtype=torch.bool, device="cuda")
    for t, o in zip(tensors, offsets):
        untouched[o:o + t.numel()] = False
    assert torch.isnan(flat[untouched].float()).all()  # the gaps before and between the tensors
    outs = [_poisoned(n, dtype, offset=(i + 3) % 8) for i, n in enumerate(sizes)]
    _C.cuda_unpack_(flat, outs, offsets)
    for i, (out, t) in enumerate(zip(outs, tensors)):
        assert torch.equal(out, t), f"tensor {i}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_with_factor_is_the_average_fused_into_the_copy(dtype):
    sizes = [5, 4096, 1, 333]
    flat = _random(sum(sizes), dtype, offset=1)
    offsets = [0, 5, 4101, 4102]
    outs = [_poisoned(n, dtype) for n in sizes]
    _C.cuda_unpack_(flat, outs, offsets, 1 / 3)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    for out, o, n in zip(outs, offsets, sizes):
        want = (flat[o:o + n].to(compute) * (1 / 3)).to(dtype)  # computed wide, rounded once
        assert torch.equal(out, want)


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
# (elements, src offset, dst offset): misaligned (element by element), and aligned (16-byte vectors) with and
# without a tail of count % (elements per vector)
@pytest.mark.parametrize("numel,src_offset,dst_offset", [(0, 0, 0), (1, 1, 3), (1001, 1, 3), (65_537, 2, 3),
                                                         (65_536, 0, 0), (4_103, 0, 0)])
def test_cast_scale_matches_torch(src_dtype, dst_dtype, numel, src_offset, dst_offset):
    src = _random(numel, src_dtype, offset=src_offset)
    dst = _poisoned(numel, dst_dtype, offset=dst_offset)
    _C.cuda_cast_scale_(dst, src, 0.25)  # a power of two: exact in every dtype, so torch's order does not matter
    compute = torch.float64 if torch.float64 in (src_dtype, dst_dtype) else torch.float32
    assert torch.equal(dst, (src.to(compute) * 0.25).to(dst_dtype))


def _torch_gram_schmidt(matrices: torch.Tensor, epsilon: float) -> torch.Tensor:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize_gram_schmidt

    out = matrices.clone()
    _orthogonalize_gram_schmidt(out, epsilon)
    return out


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.float64, 1e-12),
                                             (torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shape", [(1, 5, 1), (7, 300, 2), (3, 1000, 4), (40, 64, 8)])
@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
def test_orthogonalize_matches_torchs_gram_schmidt(dtype, tolerance, shape, epsilon):
    matrices = _random(shape[0] * shape[1] * shape[2], dtype).view(shape)
    want = _torch_gram_schmidt(matrices, epsilon)
    got = matrices.clone()
    _C.cuda_orthogonalize_(got, epsilon)
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    if epsilon == 0:  # with epsilon, columns are divided by norm + epsilon: orthonormal only to ~epsilon / norm
        gram = got.double().transpose(1, 2) @ got.double()
        eye = torch.eye(shape[2], dtype=torch.float64, device="cuda").expand_as(gram)
        torch.testing.assert_close(gram, eye, rtol=0, atol=10 * tolerance)


def test_bad_input_names_the_op_and_the_tensor():
    flat = torch.zeros(10, device="cuda")
    with pytest.raises(RuntimeError, match=r"shardkit cuda_pack_: tensor 1 has dtype Half, the flat buffer Float"):
        _C.cuda_pack_(flat, [torch.zeros(2, device="cuda"), torch.zeros(2, device="cuda", dtype=torch.half)], [0, 2])
    with pytest.raises(RuntimeError, match=r"shardkit cuda_pack_: tensor 0 \(8 elements at offset 5\) does not fit "
                                           r"the flat buffer of 10 elements"):
        _C.cuda_pack_(flat, [torch.zeros(8, device="cuda")], [5])
    with pytest.raises(RuntimeError, match=r"shardkit cuda_pack_: tensor 0 is on cpu, expected cuda:0"):
        _C.cuda_pack_(flat, [torch.zeros(2)], [0])
    with pytest.raises(RuntimeError, match=r"shardkit cuda_cast_scale_: dst has 3 elements, src 10"):
        _C.cuda_cast_scale_(torch.zeros(3, device="cuda"), flat)
