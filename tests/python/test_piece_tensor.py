"""PieceTensor and boxes_of_range (python/shardkit/checkpoint/_sharded_state.py): a flat layout's piece of a
parameter, shown to torch.distributed.checkpoint as the boxes of the parameter it covers. In-process: no ranks.

What each catches: a box that is not the range's elements in order (a checkpoint written or read at the wrong
place), a piece that DCP's or pickle's generic paths would turn into a wrong whole tensor, a piece of another
layout accepted for this rank's.
"""

from __future__ import annotations

import copy
import io
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from shardkit.checkpoint._sharded_state import PieceTensor, boxes_of_range, check_piece

SHAPES = [(), (7,), (1, 6), (4, 1), (3, 5), (2, 3, 4), (2, 1, 3), (3, 2, 2, 2)]


def _every_range(numel: int):
    return itertools.combinations(range(numel + 1), 2)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_boxes_cover_the_range_in_order_each_a_contiguous_run(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)  # each element's flat position
    for begin, end in _every_range(numel):
        boxes = boxes_of_range(shape, begin, end)
        covered = []
        for offsets, sizes, first in boxes:
            box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else index
            flat = box.reshape(-1).tolist()
            assert flat == list(range(first, first + len(flat))), (shape, begin, end, offsets, sizes)
            covered += flat
        assert covered == list(range(begin, end)), (shape, begin, end, boxes)
        assert len(boxes) <= max(1, 2 * (len(shape) - 1) + 1), (shape, begin, end, boxes)


def test_a_piece_is_the_parameters_shape_to_dcp_and_its_boxes_view_the_piece():
    from torch.distributed.checkpoint.metadata import MetadataIndex

    whole = torch.arange(15.0).view(3, 5)
    piece = PieceTensor.of(whole.reshape(-1)[6:13], torch.Size([3, 5]), 6)
    assert piece.size() == piece.shape == torch.Size([3, 5]) and piece.size(1) == 5
    items = piece.__create_write_items__("w", piece)
    boxes = [(list(i.index.offset), list(i.tensor_data.chunk.sizes)) for i in items]
    assert boxes == [([1, 1], [1, 4]), ([2, 0], [1, 3])]
    assert all(i.tensor_data.size == torch.Size([3, 5]) for i in items)
    for item in items:
        box = piece.__get_tensor_shard__(MetadataIndex("w", item.index.offset))
        offsets, sizes = item.tensor_data.chunk.offsets, item.tensor_data.chunk.sizes
        assert torch.equal(box, whole[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]])
        assert box.untyped_storage().nbytes() == box.nbytes  # exactly its bytes: DCP's writer does not copy it
        box.fill_(-1.0)
    assert (whole.reshape(-1)[6:13] == -1).all() and (whole.reshape(-1)[:6] >= 0).all()  # the same memory


def test_a_piece_survives_deepcopy_and_torch_save_and_refuses_to_be_broadcast_into_a_whole():
    piece = PieceTensor.of(torch.arange(7.0), torch.Size([3, 5]), 6)
    for again in (copy.deepcopy(piece), _saved_and_loaded(piece)):
        assert isinstance(again, PieceTensor) and again.size() == torch.Size([3, 5]) and again.begin == 6
        assert torch.equal(again.local, piece.local) and again.boxes == piece.boxes
    assert "elements 6..13 of shape [3, 5]" in repr(piece)
    with pytest.raises(TypeError, match=r"cannot be copied into a tensor of shape \[3, 5\].*not dcp.async_save"):
        torch.empty(3, 5).copy_(piece)  # what dcp.async_save's stagers do with a value of that size
    plain = torch.empty(7)
    plain.copy_(piece)  # its own shape: the piece as it is
    assert torch.equal(plain, torch.arange(7.0))


def _saved_and_loaded(piece: PieceTensor) -> PieceTensor:
    buffer = io.BytesIO()
    torch.save({"p": piece}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)["p"]


def test_a_piece_of_another_layout_is_refused_naming_both_ranges():
    piece = PieceTensor.of(torch.zeros(3), torch.Size([6]), 3)
    check_piece("here", "parameter 'a'", piece, SimpleNamespace(param_begin=3, numel=3))
    with pytest.raises(RuntimeError, match=r"here: parameter 'a' holds elements 3\.\.6 of it, but this rank's piece "
                                           r"is elements 2\.\.5: a state dict of another layout"):
        check_piece("here", "parameter 'a'", piece, SimpleNamespace(param_begin=2, numel=3))
