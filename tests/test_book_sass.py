"""Instructions per key of the compiled decode step (rqlib.book.sass), counted without a GPU.

The listing parser and the loop count are checked on a hand-written listing whose counts are
known. The compiled count is checked against what the tile must do. The weighted values are two
fp16 tensor-core products (``split_dot``), ``HMMA.16816`` (16 x 8 x 16 multiply-adds) blocks of
the tile, which the warps share without repeating one another. The scores of BLOCK_ROWS rows and
BLOCK_S keys are two more tensor-core products in the tensor-core configuration (a tile of
16 x 16 scores has fewer blocks than a block has warps to spread them over, so a warp may repeat
another's, but none does more than the whole tile), or IEEE fp32 ``tl.dot`` products on the CUDA
cores in the other (head dimension 256), which ptxas turns into one FFMA per product and
thread. A count that missed
the trips of the loop over the coordinates (the scores' chunks) finds far fewer, and the test
shows that it fails.
"""

from __future__ import annotations

import pytest

from rqlib.book import sass
from rqlib.kernels import limits as geo

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FFMA R3, R4, R5, R3 ;
        /*0020*/                   IMAD R6, R7, R8, R9 ;
        /*0030*/                   FFMA R3, R4, R5, R3 ;
        /*0040*/               @P0 BRA 0x20 ;
        /*0050*/                   LDG.E.U8 R10, desc[UR4][R2.64] ;
        /*0060*/              @!P1 BRA 0x10 ;
        /*0070*/               @P2 BRA 0x90 ;
        /*0080*/                   EXIT ;
        /*0090*/                   EXIT ;
"""


def test_one_tile_counts_the_nested_loop_trips_times():
    instructions = sass.parse_sass(LISTING)
    assert [i.opcode for i in instructions[:3]] == ["MOV", "FFMA", "IMAD"]
    assert sass.loops(instructions) == [(0x10, 0x60), (0x20, 0x40)]
    counts = sass.tile_counts(instructions, trips=3)
    # main loop 0x10-0x60: FFMA, LDG, BRA once; nested 0x20-0x40: IMAD, FFMA, BRA three times
    assert counts == {"FFMA": 4, "IMAD": 3, "BRA": 4, "LDG": 1}
    second = LISTING.replace("LDG.E.U8 R10, desc[UR4][R2.64]", "BRA 0x50")
    with pytest.raises(LookupError, match="holds 2 loops"):
        sass.tile_counts(sass.parse_sass(second), trips=3)
    with pytest.raises(LookupError, match="no loop"):
        sass.tile_counts(
            sass.parse_sass(LISTING.replace("BRA 0x20", "NOP").replace("BRA 0x10", "NOP")), 3
        )
    with pytest.raises(ValueError, match="no SASS"):
        sass.parse_sass("nothing here")


@pytest.mark.parametrize("head_dim", [64, 256])
def test_the_count_finds_the_multiply_adds_of_the_tile(head_dim):
    count = sass.compile_decode_path(90, head_dim, 3, 3, 16)
    threads = 32 * count.warps
    block = 16 * 8 * 16  # multiply-adds of one HMMA.16816

    def blocks(n):  # HMMA blocks of a BLOCK_ROWS x BLOCK_S x n tile, two products (parts)
        return 2 * geo.BLOCK_ROWS * count.keys * n // block

    values = blocks(geo.value_block(head_dim)) // count.warps  # shared by the warps
    # elementwise work adds a few FFMA for each (row, key) pair a thread owns: the scores' scale
    # and centering, the softmax and softcap, and the split of the weights p ||v|| into fp16
    # parts (its remainder fuses with the product): at most 12 a pair, where the scores'
    # products on the CUDA cores take head_dim a pair (64 or 256 here)
    softmax = 12 * max(1, geo.BLOCK_ROWS * count.keys // threads)
    hmma, ffma = count.per_tile.get("HMMA", 0), count.per_tile.get("FFMA", 0)
    where = "tensor cores" if count.score_tensor_cores else "CUDA cores"
    print(f"head_dim {head_dim}, scores on {where}: {ffma} FFMA, {hmma} HMMA a tile")
    if count.score_tensor_cores:
        scores = blocks(head_dim)
        assert values + scores // count.warps <= hmma <= values + scores
        assert ffma <= softmax
        tensor_line = "split_dot"
    else:
        # scores: BLOCK_ROWS x BLOCK_S x d products, one FFMA each
        products = geo.BLOCK_ROWS * count.keys * head_dim // threads
        assert products <= ffma <= products + softmax
        assert hmma == values
        tensor_line = "tl.dot"
    assert count.trips == -(-head_dim // geo.attention_chunk(geo.value_block(head_dim)))
    if count.trips > 1:  # head_dim 256: the scores walk the coordinates in chunks
        missing = sass.tile_counts(list(count.instructions), trips=1)
        if count.score_tensor_cores:
            assert missing["HMMA"] < values + blocks(head_dim) // count.warps
        else:
            assert missing["FFMA"] < products  # the check rejects a count without the trips
    by_class = count.by_class()
    assert sum(by_class.values()) == pytest.approx(count.warp_instructions_per_key)
    lines = count.by_source(top=1000)
    assert sum(per_key for *_, per_key in lines) == pytest.approx(count.warp_instructions_per_key)
    texts = [text for _, text, _ in lines]
    assert any(tensor_line in text for text in texts)  # the source lines are the kernel's
    assert by_class["tensor-core products (HMMA)"] == pytest.approx(hmma * count.warps / count.keys)


@pytest.mark.parametrize(("arch", "head_dim"), [(80, 64), (90, 128)])
def test_a_decode_step_in_the_presets_format_runs_in_the_tensor_core_configuration(arch, head_dim):
    """A decode step in the presets' format (3-bit keys, 2-bit values, a band of 8-bit codes,
    11-bit norms) compiles in ``limits.ATTENTION_CONFIG``: its warps, its scores on tensor
    cores, its key tile."""
    count = sass.compile_decode_path(arch, head_dim, 3, 2, 11)
    config = geo.ATTENTION_CONFIG
    assert count.score_tensor_cores and config.score_tensor_cores
    assert (count.warps, count.keys) == (config.num_warps, config.block_s)
    assert count.warp_instructions_per_key > 0


def test_issue_budget():
    # 132 SMs x 4 schedulers x 2 GHz = 1056 G warp instructions a second; 100 bytes at 2 TB/s
    # take 50 ps, in which they issue 52.8
    assert sass.issue_budget(100, 2000, 132, 2.0) == pytest.approx(52.8)
    with pytest.raises(ValueError, match="positive"):
        sass.issue_budget(100, 0, 132, 2.0)


def test_issue_summary_of_a_known_count():
    # 16 keys a tile, 8 warps: 320 FFMA + 160 IMAD + 160 LDG a tile = 320 warp instructions a key
    count = sass.IssueCount({"FFMA": 320, "IMAD": 160, "LDG": 160}, keys=16, warps=8, trips=1)
    hardware = dict(hbm_gbs=2000, sm_count=132, clock_ghz=2)
    summary = sass.issue_summary(count, 100, 500, rows=4, head_dim=128, **hardware)
    more_rows = sass.issue_summary(count, 100, 500, rows=8, head_dim=128, **hardware)
    assert more_rows["padding_share"] == 0.5 * 8 / 16  # 8 rows: 8 of 16 rows hold none
    assert summary["per_key"] == 320
    assert summary["budget_packed"] == pytest.approx(52.8)  # see test_issue_budget
    assert summary["budget_fp16"] == pytest.approx(5 * 52.8)
    assert summary["ratio"] == pytest.approx(320 / 52.8)
    assert summary["fma_share"] == 0.5 and summary["int_share"] == 0.25
    assert summary["hmma_share"] == 0 and summary["smem_share"] == 0
    assert summary["padding_share"] == 0.5 * 12 / 16  # 4 rows padded to 16
    assert summary["fma_floor"] == 4 * 128 / 32  # the scores' products
    # 320 instructions at 132 x 4 x 2 GHz take 0.303 ns; 500 bytes at 2 TB/s take 0.25 ns
    assert summary["vs_fp16"] == pytest.approx(320 / 1056 / 0.25)


NVDISASM = """
	//## File "/somewhere/rqlib/kernels/triton_attention.py", line 10
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
	//## File "/somewhere/rqlib/kernels/triton_attention.py", line 12
        /*0010*/                   FFMA R3, R4, R5, R3 ;
        /*0020*/                   FFMA R3, R4, R5, R3 ;
	//## File "/somewhere/rqlib/kernels/triton_common.py", line 30
        /*0030*/                   LOP3.LUT R6, R7, 0x7, RZ, 0xc0, !PT ;
        /*0040*/              @!P1 BRA `(.L_x_0) ;
        /*0050*/                   EXIT ;
"""


def test_an_nvdisasm_listing_gives_labels_and_source_lines():
    instructions = sass.parse_sass(NVDISASM)
    assert sass.loops(instructions) == [(0x10, 0x40)]  # the label .L_x_0 is address 0x10
    assert [i.source for i in instructions] == [
        "triton_attention.py:10",
        "triton_attention.py:12",
        "triton_attention.py:12",
        "triton_common.py:30",
        "triton_common.py:30",
        "triton_common.py:30",
    ]
    by_source = sass.tile_counts(instructions, trips=1, by="source")
    assert by_source == {"triton_attention.py:12": 2, "triton_common.py:30": 2}
