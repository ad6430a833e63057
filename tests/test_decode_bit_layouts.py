"""The cost model of `benchmarks/decode_bit_layouts.py` against the shipped MXFP4 layout, and its
simulation of an unpacking sequence."""

import pytest
import torch

from tests.triton_interpreter import HAVE_TRITON  # noqa: E402  (first: sets TRITON_INTERPRET on CPU)

if not HAVE_TRITON:
    pytest.skip("planar_tiles lives in the Triton MoE module", allow_module_level=True)
from inference.kernels.moe_triton import planar_tiles  # noqa: E402
from tests.benchmark_scripts import load_benchmark  # noqa: E402

layouts = load_benchmark("decode_bit_layouts")


def _bit_of(value: int, code: int) -> int:
    """Which bit of the first 16-bit half of tile 0 `planar_tiles` sets when value `value` of a
    row has e2m1 code `code` and every other value is 0."""
    blocks = torch.zeros(2, 16, dtype=torch.uint8)  # one row, 2 blocks = one 64-value tile
    block = blocks[value // 32]
    block[(value % 32) // 2] = code << (4 * (value % 2))
    half = planar_tiles(blocks, 2)[0, :2].to(torch.int32)
    bits = int(half[0]) | int(half[1]) << 8
    assert bits and bits & (bits - 1) == 0, f"value {value}, code {code}: bits {bits:#x}"
    return bits.bit_length() - 1


def test_model_slots_are_where_planar_tiles_puts_the_bits():
    # Bytes 0 and 1 of a tile hold values 0 and 1 in their low halves, 32 and 33 in their high.
    for slot, value in zip(layouts.current_layout(), (0, 1, 32, 33)):
        # e2m1 code bits: mantissa 1, exponent 2 and 4, sign 8; the slots list (m, e0, e1, s)
        assert tuple(_bit_of(value, code) for code in (1, 2, 4, 8)) == slot


def test_shipped_costs_match_the_kernels_sequences():
    # `_WORD_DECODE_PTX`: three AND-multiply-AND pairs, and AND, two shifts, OR+AND for the last
    assert [layouts.gemv_cost(p) for p in layouts.current_layout()] == [3, 3, 3, 4]
    # `GROUPED_DEQUANT_PTX`: one byte permute, then AND-multiply-AND for each bf16 pair
    assert layouts.grouped_cost(layouts.current_layout()) == 7


def test_simulation_accepts_the_9_instruction_layout_and_catches_a_wrong_one():
    best = [(0, 1, 2, 14), (3, 4, 5, 13), (6, 7, 8, 12), (9, 10, 11, 15)]
    assert sum(layouts.gemv_cost(p) for p in best) == 9
    layouts.simulate_gemv(best)
    # a slot whose sign shift would collide: the model prices it out, the simulation fails it
    wrong = (0, 1, 2, 7)  # sign copy shifted by 8 lands on the magnitude's source copy
    assert layouts.gemv_cost(wrong) == 99
    with pytest.raises(AssertionError):
        layouts.simulate_gemv([wrong])
