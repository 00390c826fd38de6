"""``benchmarks/gpu/ncu_loops.py`` on a small hand-written ncu source-page export (runs on the CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_math", "stall_wait"]
# a 4-instruction loop (0x10..0x40) between a prologue and an exit; executed counts with commas
# as ncu writes them, predicated and dotted opcodes
SASS = [
    ("0x00", "ULDC UR4, c[0x0][0x0]", "0", "10", "0", "0"),
    ("0x10", "PRMT R1, R2, 0x5140, R3", "7", "1,000", "5", "2"),
    ("0x20", "@P0 IMAD.SHL.U32 R4, R1, 0x2, RZ", "1", "1,000", "0", "1"),
    ("0x30", "FFMA R5, |R4|, R6, R5", "2", "1,000", "0", "2"),
    ("0x40", "@!P1 BRA 0x10", "0", "1,000", "0", "0"),
    ("0x50", "EXIT", "0", "10", "0", "0"),
]


def _module():
    spec = importlib.util.spec_from_file_location("ncu_loops", ROOT / "benchmarks" / "gpu" / "ncu_loops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _export(tmp_path: Path) -> Path:
    path = tmp_path / "src.csv"
    lines = ['"Kernel Name","_index_scores_gluon_kernel"', ",".join(f'"{h}"' for h in HEADER)]
    lines += [",".join(f'"{c}"' for c in row) for row in SASS]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_pipe_counts_classify_opcodes(tmp_path):
    m = _module()
    header, rows = m.read_source_csv(str(_export(tmp_path)))
    c = m.pipe_counts(header, rows)
    assert c["total"] == 4020
    assert c["alu"] == 1000                  # PRMT
    assert c["fma"] == 2000 and c["fma_half"] == 1000  # FFMA full rate, IMAD half rate
    assert c["uniform"] == 10                # ULDC
    assert c["op:BRA"] == 1000 and c["op:IMAD"] == 1000
    text = m.pipe_report(c, schedulers=1)
    # ALU: 1000 instructions at half rate -> 2.0 k cycles; FMA: 1000 + 2 * 1000 -> 3.0 k
    assert "alu             0.00                 2.0" in text
    assert "fma             0.00                 3.0" in text


def test_loop_report_finds_the_loop_and_its_stalls(tmp_path):
    m = _module()
    header, rows = m.read_source_csv(str(_export(tmp_path)))
    assert m.loops(rows) == [(1, 4)]
    text = m.report(header, rows, min_instructions=2)
    assert "loop 0x10..0x40: 4 instructions (byte-permute decode), 100.0% of samples" in text
    assert "stalls: wait 50%, math 50%" in text or "stalls: math 50%, wait 50%" in text
