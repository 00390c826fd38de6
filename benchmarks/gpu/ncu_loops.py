"""Where a kernel's warps stall, loop by loop, from an Nsight Compute source-page export.

The H200 host has ``ncu`` (``/usr/local/cuda/bin``). Profile one launch of a kernel, then
export its SASS source view (per-instruction warp-stall samples) as CSV::

    ncu -k regex:_decode_kernel -s 1 -c 1 --set full -o /tmp/rep python <script that launches it>
    ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > src.csv
    python benchmarks/gpu/ncu_loops.py src.csv
    python benchmarks/gpu/ncu_loops.py src.csv --pipes   # executed instructions per pipe and opcode

Every backward branch closes a loop; for each innermost loop of at least ``--min``
instructions this prints its instruction count, the share of all stall samples taken inside
it, its top stall reasons, and the instructions with the most samples. The producer, softmax
and PV warpgroups of the decode kernel are told apart by their instruction mix (PRMT: the
byte-permute decode; HGMMA: tensor cores).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter


def read_source_csv(path: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of an ``ncu --page source --csv`` export (the first line names the kernel)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[start], [r for r in rows[start + 1:] if r and r[0].startswith("0x")]


def _num(cell: str) -> float:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(sass: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", sass.strip())
    return text.split()[0] if text else ""


def loops(rows: list[list[str]]) -> list[tuple[int, int]]:
    """(first, last) row index of every innermost loop: a branch back to an earlier address."""
    index = {int(r[0], 16): i for i, r in enumerate(rows)}
    found = set()
    for i, r in enumerate(rows):
        m = re.search(r"\bBRA\s+(0x[0-9a-f]+)", r[1])
        if m and int(m.group(1), 16) < int(r[0], 16) and int(m.group(1), 16) in index:
            found.add((index[int(m.group(1), 16)], i))
    # keep the innermost ones: a barrier's retry branch from out-of-line code at the end of
    # the kernel would otherwise make every loop look like it spans most of the kernel
    return sorted(a for a in found if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in found))


def report(header: list[str], rows: list[list[str]], min_instructions: int = 100, top: int = 6) -> str:
    col = {h: i for i, h in enumerate(header)}
    samples = col["Warp Stall Sampling (All Samples)"]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_num(r[samples]) for r in rows) or 1.0
    out = [f"{len(rows)} instructions, {total:.0f} stall samples"]
    for lo, hi in loops(rows):
        body = rows[lo:hi + 1]
        if len(body) < min_instructions:
            continue
        n = sum(_num(r[samples]) for r in body)
        ops = Counter(_opcode(r[1]) for r in body)
        kinds = [k for k, op in (("byte-permute decode", "PRMT"), ("wgmma", "HGMMA"))
                 if any(o.startswith(op) for o in ops)]
        why = Counter({h[len("stall_"):]: sum(_num(r[col[h]]) for r in body) for h in reasons})
        out.append(f"\nloop {rows[lo][0]}..{rows[hi][0]}: {len(body)} instructions"
                   f"{' (' + ', '.join(kinds) + ')' if kinds else ''}, {n / total:.1%} of samples")
        out.append("  stalls: " + ", ".join(f"{k} {v / max(n, 1):.0%}" for k, v in why.most_common(top) if v))
        for r in sorted(body, key=lambda r: -_num(r[samples]))[:3]:
            out.append(f"  {_num(r[samples]):6.0f}  {r[1].strip()[:70]}")
    return "\n".join(out)


# Opcodes that issue to the integer ALU pipe on sm_80-sm_90 (64 lanes per SM and clock: one warp
# instruction every second cycle per scheduler), and to the FMA pipe: fp32 at full rate, integer
# multiply-adds on its heavy half only (half rate).
ALU_OPS = frozenset({"PRMT", "LOP3", "PLOP3", "FMNMX", "IMNMX", "VIMNMX", "SHF", "LEA", "ISETP", "FSETP",
                     "SEL", "FSEL", "IADD3", "VIADD", "VIADDMNMX", "BMSK", "FLO", "IABS"})
FMA_OPS = frozenset({"FFMA", "FMUL", "FADD"})
FMA_HALF_OPS = frozenset({"IMAD", "IMUL"})


def pipe_counts(header: list[str], rows: list[list[str]]) -> dict[str, float]:
    """Executed warp instructions per opcode (``"op:PRMT"``...) and per pipe: ``total``, ``alu``,
    ``fma`` (``fma_half`` of them at half rate), ``uniform`` (the U* instructions). Run 12
    found the dense indexer bound by issue and by the half-rate ALU pipe at once, so a change
    that moves work from the uniform datapath onto the ALU can run slower with fewer
    instructions."""
    executed = header.index("Instructions Executed")
    out: Counter = Counter()
    for r in rows:
        n = _num(r[executed])
        op = _opcode(r[1]).split(".")[0]
        out["op:" + op] += n
        out["total"] += n
        if op in ALU_OPS:
            out["alu"] += n
        elif op in FMA_OPS or op in FMA_HALF_OPS:
            out["fma"] += n
            out["fma_half"] += n if op in FMA_HALF_OPS else 0
        elif op.startswith("U"):
            out["uniform"] += n
    return dict(out)


def pipe_report(counts: dict[str, float], schedulers: int = 132 * 4, top: int = 16) -> str:
    """``pipe_counts`` as text: per pipe, millions of warp instructions and the cycles each
    scheduler needs for them (the half-rate ones twice), then the busiest opcodes."""
    cycles = {"total": counts.get("total", 0.0), "alu": 2 * counts.get("alu", 0.0),
              "fma": counts.get("fma", 0.0) + counts.get("fma_half", 0.0),
              "uniform": counts.get("uniform", 0.0)}
    lines = [f"{'':10s} {'M instr':>9s} {'k cycles/scheduler':>19s}"]
    for name, c in cycles.items():
        lines.append(f"{name:10s} {counts.get(name, 0.0) / 1e6:9.2f} {c / schedulers / 1e3:19.1f}")
    ops = sorted(((k[3:], v) for k, v in counts.items() if k.startswith("op:")), key=lambda kv: -kv[1])
    lines += [f"  {op:12s} {v / 1e6:7.2f}" for op, v in ops[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass export")
    ap.add_argument("--min", type=int, default=100, help="smallest loop to list (instructions)")
    ap.add_argument("--pipes", action="store_true", help="executed instructions per pipe and opcode instead")
    args = ap.parse_args(argv)
    header, rows = read_source_csv(args.csv)
    print(pipe_report(pipe_counts(header, rows)) if args.pipes else report(header, rows, args.min))
    return 0


if __name__ == "__main__":
    sys.exit(main())
