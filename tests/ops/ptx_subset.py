"""A tiny interpreter for the straight-line PTX that our kernels inline (``inline_asm``).

It runs the exact instruction strings of ``ops/triton`` on the CPU, vectorised over torch
int64 tensors holding bit patterns, so CI checks the kernels' bit tricks against the format
references without a GPU. Only the instructions those strings use are implemented, with the
PTX ISA's semantics: 32-bit logic and shifts, ``mul.lo`` / ``mad.lo`` on u32, ``prmt`` (default mode, sign-replicate bit),
``mov`` packing / unpacking, ``cvt`` between e4m3x2 / f16 / f32 / bf16, ``mul.rn`` on f32,
f16x2 and bf16x2, and for warp-level strings (the last dimension of the inputs is the 32
lanes of a warp) ``%laneid``, ``setp.ne`` / ``selp``, ``shfl.sync.bfly`` and predicated
``st.global.v4.b32`` (recorded, not performed). Anything else raises, so a new instruction
cannot pass untested.
"""

from __future__ import annotations

import re

import torch

_M32 = 0xFFFFFFFF


def _to_bits(v: torch.Tensor) -> torch.Tensor:
    if v.dtype == torch.float32:
        return v.view(torch.int32).to(torch.int64) & _M32
    return v.view(torch.int16).to(torch.int64) & 0xFFFF


def _f32(x: torch.Tensor) -> torch.Tensor:
    return ((x & _M32) - ((x & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


def _h(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Low 16 bits as ``dtype`` (float16 / bfloat16)."""
    return ((x & 0xFFFF) - ((x & 0x8000) << 1)).to(torch.int16).view(dtype)


def _prmt(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    stack = torch.stack(src, dim=-1)
    out = torch.zeros_like(a)
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = torch.gather(stack, -1, (sel & 7).unsqueeze(-1)).squeeze(-1)
        byte = torch.where((sel & 8) != 0, torch.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out = out | (byte << (8 * i))
    return out


def _e4m3x2_to_f16x2(x: torch.Tensor) -> torch.Tensor:
    lo = (x & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
    hi = ((x >> 8) & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
    return _to_bits(lo) | (_to_bits(hi) << 16)


def _mul_x2(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per 16-bit half: the exact fp32 product of two 16-bit floats, rounded once."""
    out = []
    for sh in (0, 16):
        p = _h(a >> sh, dtype).float() * _h(b >> sh, dtype).float()
        out.append(_to_bits(p.to(dtype)) << sh)
    return out[0] | out[1]


def run_ptx(ptx: str, outputs: int, inputs: list[torch.Tensor],
            stores: list | None = None) -> list[torch.Tensor]:
    """Run ``ptx`` with ``$0 .. $(outputs - 1)`` as outputs and the following ``$n`` bound to
    ``inputs`` (int64 bit patterns, broadcastable). Returns the outputs' bit patterns.
    Global stores are appended to ``stores`` as ``(address, values [..., 4], predicate)``;
    warp-level instructions treat the last dimension as the lanes."""
    shape = torch.broadcast_shapes(*(x.shape for x in inputs))
    regs: dict[str, torch.Tensor] = {f"${outputs + i}": x.expand(shape).to(torch.int64)
                                     for i, x in enumerate(inputs)}

    def lanes() -> torch.Tensor:
        if shape[-1] != 32:
            raise ValueError(f"warp-level PTX needs 32 lanes in the last dimension, got {shape}")
        return torch.arange(32, dtype=torch.int64).expand(shape)

    def val(tok: str) -> torch.Tensor:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok == "%laneid":
            return lanes()
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok):
            return torch.full(shape, int(tok, 0), dtype=torch.int64)
        raise KeyError(f"unknown operand {tok!r}")

    body = ptx.strip().lstrip("{").rstrip("}")
    for stmt in body.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        guard = None
        if stmt.startswith("@"):
            g, _, stmt = stmt.partition(" ")
            guard = g[1:]
            stmt = stmt.strip()
        op, _, rest = stmt.partition(" ")
        if guard is not None and op != "st.global.v4.b32":
            raise NotImplementedError(f"predicated {op!r} is not in the interpreter's subset")
        if op == "st.global.v4.b32":
            addr, vals = [o.strip() for o in re.findall(r"\[[^]]*\]|\{[^}]*\}", rest)]
            data = torch.stack([val(t) for t in vals.strip("{}").split(",")], dim=-1)
            pred = regs[guard] != 0 if guard is not None else torch.ones(shape, dtype=torch.bool)
            if stores is None:
                raise ValueError("the PTX stores to global memory: pass a ``stores`` list")
            stores.append((val(addr.strip("[]")), data, pred))
            continue
        # operands: split on commas outside braces
        ops = [o.strip() for o in re.findall(r"\{[^}]*\}|[^,]+", rest)]
        dst = ops[0]
        args = ops[1:]
        if op == "mov.b32" and dst.startswith("{"):  # unpack a 32-bit register into halves
            lo, hi = [t.strip() for t in dst.strip("{}").split(",")]
            x = val(args[0])
            regs[lo], regs[hi] = x & 0xFFFF, (x >> 16) & 0xFFFF
            continue
        if op == "mov.b32" and args[0].startswith("{"):  # pack two halves
            lo, hi = [val(t) for t in args[0].strip("{}").split(",")]
            regs[dst] = (lo & 0xFFFF) | ((hi & 0xFFFF) << 16)
            continue
        x = [val(a) for a in args]
        if op in ("mov.b32", "mov.u32"):
            r = x[0] & _M32
        elif op in ("setp.ne.u32", "setp.ne.s32"):
            r = ((x[0] & _M32) != (x[1] & _M32)).to(torch.int64)
        elif op == "selp.b32":
            r = torch.where(x[2] != 0, x[0], x[1]) & _M32
        elif op == "shfl.sync.bfly.b32":  # d, a, lane mask, clamp 0x1f, all 32 lanes taking part
            if int(x[2].flatten()[0]) != 0x1F or int(x[3].flatten()[0]) != _M32:
                raise NotImplementedError("shfl.sync.bfly: only the full-warp form is in the subset")
            src = lanes() ^ x[1]
            r = torch.gather(x[0], -1, src)
        elif op == "and.b32":
            r = x[0] & x[1] & _M32
        elif op == "or.b32":
            r = (x[0] | x[1]) & _M32
        elif op == "shl.b32":
            r = (x[0] << x[1]) & _M32
        elif op == "shr.b32":
            r = (x[0] & _M32) >> x[1]
        elif op == "mul.lo.u32":
            r = ((x[0] & _M32) * (x[1] & _M32)) & _M32
        elif op == "mad.lo.u32":
            r = ((x[0] & _M32) * (x[1] & _M32) + (x[2] & _M32)) & _M32
        elif op == "prmt.b32":
            r = _prmt(x[0], x[1], x[2])
        elif op == "cvt.rn.f16x2.e4m3x2":
            r = _e4m3x2_to_f16x2(x[0])
        elif op == "cvt.f32.f16":
            r = _to_bits(_h(x[0], torch.float16).float())
        elif op == "cvt.rn.bf16.f32":
            r = _to_bits(_f32(x[0]).to(torch.bfloat16))
        elif op == "cvt.rn.bf16x2.f32":  # d = {hi: a, lo: b}
            r = _to_bits(_f32(x[1]).to(torch.bfloat16)) | (_to_bits(_f32(x[0]).to(torch.bfloat16)) << 16)
        elif op == "mul.rn.f32":
            r = _to_bits(_f32(x[0]) * _f32(x[1]))
        elif op == "mul.rn.f16x2":
            r = _mul_x2(x[0], x[1], torch.float16)
        elif op == "mul.rn.bf16x2":
            r = _mul_x2(x[0], x[1], torch.bfloat16)
        else:
            raise NotImplementedError(f"PTX instruction {op!r} is not in the interpreter's subset")
        regs[dst] = r
    return [regs[f"${i}"] for i in range(outputs)]
