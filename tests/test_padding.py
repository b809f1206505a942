import pytest
import torch

from lightning_mem.padding import pad_sequences


def test_right_and_left_padding_with_their_masks():
    ids, mask = pad_sequences([[1, 2, 3], [4]], 0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, mask = pad_sequences([[1, 2, 3], [4]], 9, side="left")
    assert ids.tolist() == [[1, 2, 3], [9, 9, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == torch.long and mask.dtype == torch.long


def test_tensors_a_fixed_length_an_empty_row_and_the_dtype():
    ids, mask = pad_sequences([torch.tensor([5, 6], dtype=torch.int32), torch.tensor([], dtype=torch.int32)], -100,
                              length=4, dtype=torch.int32)
    assert ids.tolist() == [[5, 6, -100, -100], [-100] * 4] and mask.sum().item() == 2
    assert ids.dtype == torch.int32


def test_a_length_shorter_than_a_sequence_is_an_error():
    with pytest.raises(ValueError, match="length=1 is shorter than the longest sequence"):
        pad_sequences([[1, 2]], 0, length=1)
    with pytest.raises(ValueError, match="side must be"):
        pad_sequences([[1]], 0, side="middle")
