"""How the cuda lane sizes a chunk's f16 scratch and asks for cuBLAS's workspace (`run/workspace`): within
`kernels.WORKSPACE_SHARE` of the weights and caches where a layer's largest product in at most
`kernels.SCRATCH_MOST_SLABS` slabs fits, else the whole product; pure arithmetic, no GPU."""

from __future__ import annotations

import pytest

from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.run import workspace
from fuselane.lanes.cuda.run.workspace import cublas_bytes, fit, operand_bytes, scratch_bounds, size

MIB = 2**20
# Qwen2.5-0.5B's matrices (one layer) and its vocabulary's tables
SMALL = {
    "token_embd.weight": (151936, 896),
    "output.weight": (151936, 896),
    "blk.0.attn_q.weight": (896, 896),
    "blk.0.attn_k.weight": (128, 896),
    "blk.0.ffn_gate.weight": (4864, 896),
    "blk.0.ffn_up.weight": (4864, 896),
    "blk.0.ffn_down.weight": (896, 4864),
    "blk.0.attn_norm.weight": (896,),
}
PAIR = 2 * 4864 * 896  # the 0.5B's gated pair, side by side: its largest product
WIDE = {"blk.0.ffn_gate.weight": (18944, 3584), "blk.0.ffn_down.weight": (3584, 18944)}  # a 7B's


def test_the_scratch_holds_a_layers_largest_product_at_most():
    # a layer's gated pair side by side, not the output's vocabulary rows (a chunk for every row's logits takes
    # those in slabs), and no more than `kernels.F16_SCRATCH_VALUES`; at least a pair's two rows of the widest
    assert scratch_bounds(SMALL) == (-(-PAIR // kernels.SCRATCH_MOST_SLABS), PAIR)
    assert scratch_bounds(WIDE)[1] == kernels.F16_SCRATCH_VALUES
    assert scratch_bounds(WIDE)[0] == kernels.F16_SCRATCH_VALUES  # past the cap in four slabs already
    assert scratch_bounds({"blk.0.attn_q.weight": (2, 4096)}) == (2 * 4096, 2 * 4096)
    shared = {"blk.0.attn_q.weight": (2048, 2048), "blk.0.ffn_gate_shexp.weight": (1408, 2048)}
    assert scratch_bounds(shared)[1] == 2 * 1408 * 2048  # a shared expert's pair, side by side
    assert scratch_bounds({"output.weight": (64, 32)})[1] == 64 * 32  # no layer: the matrices there are


@pytest.mark.parametrize(
    ("config", "mib"), [(None, 32), ("", 32), (":4096:1", 4), (":4096:8", 32), (":4096:2:16:8", 8.125), ("x", 32)]
)
def test_cublas_workspace_is_read_as_torch_reads_it(config, mib):
    assert cublas_bytes(config) == mib * MIB


def test_a_products_operands_by_hand():
    # 512 rows of the gate/up pair (k 896) with a scratch of the whole pair: the rounded activation, its scales
    # and the f16 product of both halves; the down (k 4,864) rounds a wider activation into fewer columns
    products = workspace.layer_products(SMALL)
    assert products == {896: PAIR, 4864: 896 * 4864}
    pair = 2 * 512 * 896 + 4 * 512 + 2 * 512 * (PAIR // 896)
    down = 2 * 512 * 4864 + 4 * 512 + 2 * 512 * 896
    assert operand_bytes(products, 512, PAIR) == max(pair, down) == pair
    assert operand_bytes(products, 512, 896 * 4864) == max(2 * 512 * 896 + 4 * 512 + 2 * 512 * 4864, down)


def test_the_scratch_is_the_most_that_fits_its_room():
    products = workspace.layer_products(SMALL)
    least, most = scratch_bounds(SMALL)
    for room in (12 * MIB, 16 * MIB, 24 * MIB):
        values = fit(SMALL, 512, room)
        assert values is not None and least <= values < most
        assert (
            2 * values + operand_bytes(products, 512, values)
            <= room
            < 2 * (values + 1) + operand_bytes(products, 512, values + 1)
        )
    assert fit(SMALL, 512, 64 * MIB) == most
    assert fit(SMALL, 512, 4 * MIB) is None  # not even the pair in four slabs


def test_a_large_model_keeps_the_whole_scratch_and_cublass_default():
    # a 7B's file and cache: the 64 MiB scratch and cuBLAS's 32 MiB fit its 5 %
    ws = size(WIDE, 512, 4_700_000_000, 60_000_000, None)
    assert ws.within and ws.cublas_config is None and ws.scratch_values == kernels.F16_SCRATCH_VALUES
    assert ws.cublas_bytes == kernels.CUBLAS_DEFAULT_WORKSPACE_BYTES


def _total(ws, held, dying=frozenset()):
    """What a chunk holds beyond the weights and caches under `ws`: the held bytes, cuBLAS's, the scratch and the
    largest product's operands."""
    operands = operand_bytes(workspace.layer_products(SMALL), ws.rows, ws.scratch_values, dying)
    return held + ws.cublas_bytes + 2 * ws.scratch_values + operands


def test_a_small_model_asks_for_the_lean_cublas_workspace_and_a_scratch_within_the_share():
    base, held = 1_100_000_000, 30_000_000
    ws = size(SMALL, 512, base, held, None)
    assert ws.cublas_config == kernels.CUBLAS_LEAN_WORKSPACE and ws.cublas_bytes == 4 * MIB
    assert ws.within and ws.scratch_values < PAIR and ws.rows == 512
    assert _total(ws, held) <= kernels.WORKSPACE_SHARE * base == ws.share_bytes


def test_no_cublas_workspace_where_only_that_takes_fewer_slabs():
    # 25 MB held: the lean 4 MiB leaves the pair two slabs, none leaves it whole
    base, held = 1_100_000_000, 25_000_000
    ws = size(SMALL, 512, base, held, None)
    assert ws.cublas_config == kernels.CUBLAS_NO_WORKSPACE and ws.cublas_bytes == 0
    assert ws.within and ws.scratch_values == PAIR and _total(ws, held) <= ws.share_bytes
    assert cublas_bytes(kernels.CUBLAS_NO_WORKSPACE) == 0


def test_where_the_share_cannot_hold_the_scratch_keeps_the_whole_product():
    # a 0.5B's file and cache leave ~25 MB: with 20 MB held, four slabs of the pair do not fit even with no
    # cuBLAS workspace, so the speed is kept (and the lean workspace) and the miss said
    ws = size(SMALL, 512, 493_000_000, 20_000_000, None, frozenset({4864}))
    assert not ws.within and ws.scratch_values == PAIR and ws.cublas_config == kernels.CUBLAS_LEAN_WORKSPACE
    assert not ws.rounds_in_place


def test_a_workspace_the_user_set_is_kept_and_counted():
    # the lane asks for nothing where the process says: 32 MiB leaves this share no room for four slabs
    ws = size(SMALL, 512, 1_100_000_000, 25_000_000, ":4096:8")
    assert ws.cublas_config is None and ws.cublas_bytes == 32 * MIB
    assert not ws.within and ws.scratch_values == PAIR
    lean = size(SMALL, 512, 1_100_000_000, 25_000_000, ":4096:1")
    assert lean.cublas_config is None and lean.within and lean.scratch_values < PAIR


def test_a_width_rounding_in_place_takes_no_copy():
    # the down (k 4,864) rounding its dying activation in its own bytes: its rows' scales and its product only
    products = workspace.layer_products(SMALL)
    down = 4 * 512 + 2 * 512 * 896
    pair = 2 * 512 * 896 + 4 * 512 + 2 * 512 * (PAIR // 896)
    assert operand_bytes(products, 512, PAIR, frozenset({4864})) == max(pair, down)
    assert operand_bytes(products, 512, 896 * 4864, frozenset({896, 4864})) == 4 * 512 + 2 * 512 * 4864


def test_a_short_scratch_rounds_dying_activations_in_place_where_that_takes_fewer_slabs():
    # the 0.5B's own figures (14 MB held): the copies leave the pair four slabs, rounding the down's activation
    # in place three; no cuBLAS workspace either way, as the lean one leaves no room for four
    base, held, dying = 493_000_000, 14_000_000, frozenset({4864})
    copies, rounded = size(SMALL, 512, base, held, None), size(SMALL, 512, base, held, None, dying)
    assert copies.within and not copies.rounds_in_place and -(-PAIR // copies.scratch_values) == 4
    assert rounded.within and rounded.rounds_in_place and -(-PAIR // rounded.scratch_values) == 3
    assert rounded.cublas_config == copies.cublas_config == kernels.CUBLAS_NO_WORKSPACE
    # that scratch fits beside the down's activation rounded in place, not beside its copy
    assert _total(rounded, held, dying) <= rounded.share_bytes < _total(rounded, held)
    # where the copies take as few slabs, they are kept: no second read of each row
    assert not size(SMALL, 512, 1_100_000_000, 39_800_000, None, dying).rounds_in_place
    # a large model's whole scratch fits with the copies
    assert not size(WIDE, 512, 4_700_000_000, 60_000_000, None, frozenset({18944})).rounds_in_place


def test_the_rows_a_chunk_is_sized_at():
    # the lane's chunk first, then fewer rows down to the least, each a power of two
    least = kernels.SCRATCH_LEAST_ROWS
    assert workspace.chunk_rows(least) == [least]
    assert workspace.chunk_rows(least + 3) == [least + 3, least]
    assert workspace.chunk_rows(least - 1) == [least - 1]
    assert workspace.chunk_rows(4 * least) == [4 * least, 2 * least, least]


def test_round_in_place_on_rounds_whatever_the_scratch():
    # the knob `round_in_place=on`: the dying widths round in place even where the copies hold the whole scratch
    ws = size(WIDE, 512, 4_700_000_000, 60_000_000, None, frozenset({18944}), always=True)
    assert ws.rounds_in_place and ws.within and ws.scratch_values == kernels.F16_SCRATCH_VALUES
    assert not size(WIDE, 512, 4_700_000_000, 60_000_000, None, frozenset(), always=True).rounds_in_place
