import pytest
import torch

from inference.ops.mxfp4 import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4


def random_packed(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def test_matches_transformers_bit_for_bit():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = random_packed(3, 40, 5)  # [E, rows, G] like an expert tensor
    for dtype in (torch.bfloat16, torch.float32):
        theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, G*32, rows]
        ours = dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
        assert ours.dtype == theirs.dtype
        assert torch.equal(
            ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            theirs.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        )


def test_nibble_order_and_scale():
    # One block: byte 0x21 holds code 1 (low nibble, first) then code 2; scale 2^(128-127) = 2.
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x21
    blocks[0, 1] = 0xF8  # codes 8 (-0) then 15 (-6)
    scales = torch.tensor([128], dtype=torch.uint8)
    values = dequantize_mxfp4(blocks, scales, torch.float32)
    assert values.shape == (32,)
    assert values[:4].tolist() == [2 * E2M1_VALUES[1], 2 * E2M1_VALUES[2], -0.0, 2 * E2M1_VALUES[15]]


def test_quantize_round_trip_is_exact_on_grid_values():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (4, 64), generator=g)
    values = torch.tensor(E2M1_VALUES)[codes] * 0.25
    values[:, ::32] = 6 * 0.25  # every block's max sets the same scale
    blocks, scales = quantize_mxfp4(values)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), values)


def test_rejects_bad_inputs():
    blocks, scales = random_packed(2, 3)
    with pytest.raises(TypeError):
        dequantize_mxfp4(blocks.int(), scales)
    with pytest.raises(ValueError):
        dequantize_mxfp4(blocks, scales[:, :2])
