"""`fuselane explain --lane cuda --form prefill` says how a chunk's workspace holds the share: the rows a prompt
runs in, the scratch, cuBLAS's workspace (`lanes/cuda/explain_workspace`), worked out on the host as the lane does
when it loads (tests/cuda_kernels/test_chunk_rows.py holds the two to the same figures on a written file)."""

from __future__ import annotations

import json

import pytest

from fuselane import cli
from fuselane.explain import prefill_workspace
from fuselane.lanes.cuda.plan import kernels


@pytest.fixture(autouse=True)
def _no_cublas_config(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)


def test_a_small_low_bit_file_runs_its_prompts_in_fewer_rows():
    ws = prefill_workspace("synth:qwen2.5-0.5b:q2_k")
    assert ws["rows"] == kernels.SCRATCH_LEAST_ROWS and ws["within"]
    assert ws["held_bytes"] + ws["cublas_bytes"] + ws["scratch_bytes"] <= ws["share_bytes"]


def test_a_small_q4_k_m_keeps_512_rows_with_its_pair_in_slabs_and_a_large_model_its_whole_scratch():
    small = prefill_workspace("synth:qwen2.5-0.5b:q4_k_m")
    assert small["rows"] == kernels.SCRATCH_CHUNK_ROWS and small["within"]
    assert 1 < small["slabs"] <= kernels.SCRATCH_MOST_SLABS and small["cublas_config"] is not None
    large = prefill_workspace("synth:qwen2.5-7b:q4_k_m")
    assert large["rows"] == kernels.SCRATCH_CHUNK_ROWS and large["within"] and large["cublas_config"] is None
    assert large["scratch_bytes"] == 2 * kernels.F16_SCRATCH_VALUES


def test_the_knob_sets_the_rows_and_other_prefills_keep_no_workspace():
    assert prefill_workspace("synth:qwen2.5-0.5b:q2_k", knobs=["chunk_rows=512"])["rows"] == 512
    assert not prefill_workspace("synth:qwen2.5-0.5b:q2_k", knobs=["chunk_rows=512"])["within"]
    assert prefill_workspace("synth:qwen2.5-0.5b:q2_k", knobs=["prefill=f16-copy"]) is None
    assert prefill_workspace("synth:qwen2.5-0.5b:q2_k", knobs=["batch=on"]) is None
    # a mixture's attention products take the scratch too, its chunks at the routing's own rows
    mixture = prefill_workspace("synth:qwen3-30b-a3b")
    assert mixture["rows"] == kernels.MOE_CHUNK_ROWS and mixture["within"]


def test_explain_prints_and_writes_it(capsys):
    cli.main(["explain", "synth:qwen2.5-0.5b:q2_k", "--lane", "cuda", "--form", "prefill"])
    text = capsys.readouterr().out
    assert "prompts in chunks of 256 rows" in text and "share of the weights and caches (5 %): held" in text
    cli.main(["explain", "synth:qwen2.5-0.5b:q2_k", "--lane", "cuda", "--form", "prefill", "--json"])
    assert json.loads(capsys.readouterr().out)["workspace"]["rows"] == 256
    cli.main(["explain", "synth:qwen2.5-0.5b:q2_k", "--lane", "cuda", "--json"])  # a decode step keeps none
    assert "workspace" not in json.loads(capsys.readouterr().out)


def test_the_workspace_is_sized_at_the_context_asked():
    # the share grows with the cache: at 32k rows the 0.5B's Q2_K file keeps 512-row chunks and its Q4_K_M the
    # whole pair; at bench's 641 rows fewer slabs than at the default 4,096 would not hold
    default = prefill_workspace("synth:qwen2.5-0.5b:q2_k")
    long = prefill_workspace("synth:qwen2.5-0.5b:q2_k", ctx=32768)
    assert default["ctx"] == 4096 and long["ctx"] == 32768 and long["share_bytes"] > default["share_bytes"]
    assert default["rows"] == kernels.SCRATCH_LEAST_ROWS and long["rows"] == kernels.SCRATCH_CHUNK_ROWS
    slabs = {ctx: prefill_workspace("synth:qwen2.5-0.5b:q4_k_m", ctx=ctx) for ctx in (641, 4096, 32768)}
    assert all(ws["within"] for ws in slabs.values())
    assert slabs[641]["slabs"] > slabs[4096]["slabs"] > slabs[32768]["slabs"]


def test_explain_takes_a_context(capsys):
    cli.main(["explain", "synth:qwen2.5-0.5b:q2_k", "--lane", "cuda", "--form", "prefill", "--ctx", "100", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["rows"] == 100 and data["workspace"]["ctx"] == 100 and data["workspace"]["rows"] == 100
    for args, said in (
        (["--rows", "200"], "a prefill chunk of 200 rows does not fit a context of 100"),
        (["--rows", "8", "--ctx", "40000"], "must be 1 to 32,768 tokens"),
    ):
        ctx = [] if "--ctx" in args else ["--ctx", "100"]
        rc = cli.main(["explain", "synth:qwen2.5-0.5b:q2_k", "--lane", "cuda", "--form", "prefill", *ctx, *args])
        out, err = capsys.readouterr()
        assert rc == 1 and out == "" and said in err and len(err.strip().splitlines()) == 1


def test_the_stored_layouts_bytes_are_held_in_the_share_and_said():
    # a Q2_K recipe's down and attention output are Q3_K, whose blocks the lane keeps in 112 bytes: the 1.8 % is
    # held within the share, and `explain` says how much and which layouts add it; a Q4_K_M 0.5B (no Q3_K) has only
    # its Q6_K rows' padding to 16 bytes: its ffn_down in Q6_K, 896 rows of 4,864 values (19 blocks, 3,990 bytes in
    # 4,000)
    from fuselane.gguf.formats import LAYOUTS, Format
    from fuselane.lanes.cuda.explain_workspace import render_workspace

    ws = prefill_workspace("synth:qwen2.5-1.5b:q2_k")
    down = 28 * 1536 * 8960 // 256 * LAYOUTS[Format.Q3_K].nbytes  # the 1.5B's 28 ffn_down in Q3_K
    assert down * 2 / 110 < ws["stored_surplus_bytes"] < down * 2 / 110 * 1.5  # and the attention outputs
    assert ws["held_bytes"] >= ws["stored_surplus_bytes"] and ws["within"]
    assert ws["stored_formats"] == ["Q3_K", "Q6_K"]  # the layouts that add bytes (not its Q2_K, Q4_K, Q8_0)
    line = next(line for line in render_workspace(ws) if "stored 16-byte aligned" in line)
    assert "Q3_K's 110 bytes in 112" in line and "Q8_0" not in line and "Q2_K" not in line
    from fuselane.gguf.synth import SHAPES, tensor_formats

    formats = tensor_formats(SHAPES["qwen2.5-0.5b"], "q4_k_m")
    q6_k_downs = sum(1 for name, f in formats.items() if name.endswith("ffn_down.weight") and f is Format.Q6_K)
    assert q6_k_downs and all(f is not Format.Q6_K for n, f in formats.items() if not n.endswith("ffn_down.weight"))
    assert prefill_workspace("synth:qwen2.5-0.5b:q4_k_m")["stored_surplus_bytes"] == q6_k_downs * 896 * 10
