"""`benchmarks/gemv_l1.py` reads Nsight Compute's metrics report: a report of two launches (the 7B's Q3_K gate/up
GLU as measured on an H200, and a second launch with other units) gives each launch's figures in bytes and
microseconds, and the L1 bytes a DRAM byte that RESULTS.md quotes."""

from __future__ import annotations

import pytest

from tests.benchmark_script import load_script

REPORT = """\
==PROF== Profiling "_q8_glu_q8_kernel": 0%....50%....100% - 7 passes
[606] python3.12@127.0.0.1
  _q8_glu_q8_kernel (4736, 1, 1)x(64, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    Section: Command line profiler metrics
    ---------------------------------------------------------------- ----------- ------------
    Metric Name                                                      Metric Unit Metric Value
    ---------------------------------------------------------------- ----------- ------------
    dram__bytes_read.sum                                                   Mbyte        58.39
    gpu__time_duration.sum                                                    us        37.57
    l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_active           %        67.72
    l1tex__data_pipe_lsu_wavefronts_mem_lg.sum                                        (!) n/a
    l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum                                 1,440,928
    l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum                        sector   16,135,552
    sm__warps_active.avg.pct_of_peak_sustained_active                          %        23.69
    smsp__inst_executed.sum                                                 inst   14,740,800
    ---------------------------------------------------------------- ----------- ------------
  _parts_kernel (512, 1, 1)x(256, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    dram__bytes_read.sum                                                   Kbyte       512.00
    gpu__time_duration.sum                                                    ns       900.00
    l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_active           %        10.00
    l1tex__data_pipe_lsu_wavefronts.sum                                                12,345
    l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum                                     1,000
    l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum                        sector       32,000
    sm__warps_active.avg.pct_of_peak_sustained_active                          %        50.00
    smsp__inst_executed.sum                                                 inst       99,000
"""


@pytest.fixture(scope="module")
def tool():
    return load_script("gemv_l1")


def test_each_launch_reads_its_metrics_in_bytes_and_microseconds(tool) -> None:
    glu, parts = tool.parse(REPORT)
    assert (glu.kernel, parts.kernel) == ("_q8_glu_q8_kernel", "_parts_kernel")
    assert glu.values == {
        "dram": 58.39e6, "time": 37.57, "pipe": 67.72, "requests": 1_440_928, "sectors": 16_135_552,
        "warps": 23.69, "instructions": 14_740_800,
    }  # fmt: skip
    assert parts.values["dram"] == 512e3 and parts.values["time"] == pytest.approx(0.9)
    assert parts.values["wavefronts"] == 12_345  # the measured report predates the metric: absent there


def test_the_l1_bytes_a_dram_byte(tool) -> None:
    glu, parts = tool.parse(REPORT)
    assert glu.l1_per_dram_byte == pytest.approx(16_135_552 * 32 / 58.39e6)  # 8.84: RESULTS.md's 8.8
    assert parts.l1_per_dram_byte == pytest.approx(2.0)
    lines = tool.table([glu, parts]).splitlines()
    assert len(lines) == 3 and lines[1].split()[:2] == ["_q8_glu_q8_kernel", "37.57"] and "8.8" in lines[1].split()
    assert "-" in lines[1].split() and "12,345" in lines[2].split()


def test_a_report_without_the_kernel_gives_no_launch(tool) -> None:
    assert tool.parse("==PROF== No kernels were profiled.\n") == []
