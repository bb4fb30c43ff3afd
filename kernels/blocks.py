"""GGUF's block formats (ggml's quantization types): each type's block layout and its exact dequantization.

A quantized row is a run of blocks, each `values` numbers in `nbytes` bytes. Dequantizing reproduces the `gguf`
package's reference (`gguf.quants`) bit for bit: the same float32 operations in the same order (a scale made once
per block or sub-block, then one product per value, then the offset), so a GGUF model's weights read here are
the weights llama.cpp's converter meant. f16 fields are read as stored (subnormals, infinities and NaNs included).

Layouts (ggml-common.h), per block; d, m, dmin are f16, "nibbles" are bytes whose low halves hold the first values
of a group and high halves the rest:
- Q8_0 (32): d, int8 q[32]. v = q * d.
- Q4_0 (32): d, nibbles[16] (values j and j + 16). v = d * (q - 8).
- Q4_1 (32): d, m, nibbles[16]. v = d * q + m.
- Q5_0 (32): d, qh (32 high bits, value j's in bit j), nibbles[16]. v = d * (q - 16).
- Q5_1 (32): d, m, qh, nibbles[16]. v = d * q + m.
- Q4_K (256): d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, nibbles[128] (bytes 32i..32i+31:
  sub-blocks 2i low, 2i + 1 high). v = (d * scale) * q - (dmin * min).
- Q5_K (256): as Q4_K, then qh[32] (bit i of byte l: sub-block i's value l's fifth bit) before the nibbles.
- Q6_K (256): ql[128] (per half of 128 values: bytes 0-63 low then high nibbles), qh[64] (per half, 2 bits of 4
  values a byte), int8 scales[16] (one per 16 values), d last. v = (d * scale) * (q - 32).
- MXFP4 (32): an E8M0 scale byte e, nibbles[16] of E2M1 codes: v = E2M1x2[code] * 2^(e - 128) (kernels/quant.py).

Letters: n blocks, S sub-blocks of a super-block, V values a block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.kernels.quant import E2M1X2, QuantizedMatrix, constant, e8m0_half

Dequantizer = Callable[[torch.Tensor], torch.Tensor]  # blocks [n, nbytes] uint8 -> values [n, V] float32


@dataclass(frozen=True)
class BlockFormat:
    name: str  # as GGUF names the type (gguf.GGMLQuantizationType)
    values: int  # per block
    nbytes: int  # per block
    dequantize_blocks: Dequantizer


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 field at byte `at` of each block, as float32 [n, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2k]: the k low halves, then the k high halves."""
    return torch.cat((packed & 15, packed >> 4), dim=-1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bits 0..count-1 of each little-endian 32-bit word qh [n, 4] bytes -> [n, count] of 0/1 (uint8)."""
    word = qh.contiguous().view(torch.int32)  # [n, 1]
    return ((word >> torch.arange(count, dtype=torch.int32, device=qh.device)) & 1).to(torch.uint8)  # [n, count]


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _five_bits(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """Q5_0/Q5_1's 5-bit values [n, 32] (uint8): the nibbles after the 4 qh bytes, with value j's bit j of qh."""
    return _nibbles(b[:, qh_at + 4 :]) | (_high_bits(b[:, qh_at : qh_at + 4], 32) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_five_bits(b, 2).to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _five_bits(b, 4).float() + _f16(b, 2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins [n, 8]: sub-blocks 0-3 in the low 6 bits of
    bytes 0-3 (scales) and 4-7 (mins); 4-7 in the halves of bytes 8-11, with their top two bits in the top bits of
    bytes 0-3 (scales) and 4-7 (mins)."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]  # [n, 4] each
    scales = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)  # [n, 8]
    mins = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)  # [n, 8]
    return scales, mins


def _k_quant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(d * scale) * q - (dmin * min) per sub-block, for q [n, S, 32] of Q4_K/Q5_K."""
    n = b.shape[0]
    scales, mins = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * scales.float()).view(n, 8, 1)  # [n, S, 1]
    dm = (_f16(b, 2) * mins.float()).view(n, 8, 1)  # [n, S, 1]
    return (d * q.float() - dm).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).view(n, 8, 32)  # [n, 4, 64] -> sub-blocks 2i (low), 2i + 1 (high)
    return _k_quant(b, q)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = _nibbles(b[:, 48:].reshape(n, 4, 32)).view(n, 8, 32)  # [n, S, 32]
    qh = b[:, 16:48].reshape(n, 1, 32)  # [n, 1, 32]: bit i is sub-block i's
    high = (qh >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1  # [n, S, 32]
    return _k_quant(b, low | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = _nibbles(b[:, :128].reshape(n, 2, 64)).view(n, 2, 4, 32)  # [n, half, 4, 32]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)  # [n, half, 1, 32]
    shifts = constant((0, 2, 4, 6), torch.uint8, b.device).view(1, 1, 4, 1)
    high = (qh >> shifts) & 3  # [n, half, 4, 32]
    q = ((ql | (high << 4)).to(torch.int8) - 32).view(n, 16, 16).float()  # [n, 16 groups of 16]
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).view(n, 16, 1)  # [n, 16, 1]
    return (d * q).reshape(n, 256)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    table = constant(E2M1X2, torch.float32, b.device)
    return e8m0_half(b[:, :1]) * table[_nibbles(b[:, 1:]).long()]


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q8_0", 32, 34, _q8_0),
    BlockFormat("Q4_0", 32, 18, _q4_0),
    BlockFormat("Q4_1", 32, 20, _q4_1),
    BlockFormat("Q5_0", 32, 22, _q5_0),
    BlockFormat("Q5_1", 32, 24, _q5_1),
    BlockFormat("Q4_K", 256, 144, _q4_k),
    BlockFormat("Q5_K", 256, 176, _q5_k),
    BlockFormat("Q6_K", 256, 210, _q6_k),
    BlockFormat("MXFP4", 32, 17, _mxfp4),
)}


def block_matrix(raw: torch.Tensor, fmt: str) -> QuantizedMatrix:
    """Rows of blocks as stored, raw [rows, k * nbytes] uint8 (a view: nothing is copied), as the kernels' matrix of
    that format."""
    f = FORMATS[fmt]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[-1] % f.nbytes:
        raise ValueError(f"{f.name} rows are whole blocks of {f.nbytes} bytes (uint8 [rows, bytes]), not {raw.dtype} "
                         f"{list(raw.shape)}")
    return QuantizedMatrix(f.name, raw, torch.empty(0, dtype=torch.uint8), raw.shape[1] // f.nbytes * f.values,
                           f.values)


def dequantize(raw: torch.Tensor, fmt: str | BlockFormat) -> torch.Tensor:
    """Rows of blocks, raw [..., k * nbytes] uint8 -> float32 [..., k * values]."""
    f = FORMATS[fmt] if isinstance(fmt, str) else fmt
    if raw.dtype != torch.uint8 or raw.dim() == 0 or raw.shape[-1] % f.nbytes:
        raise ValueError(f"{f.name} rows are whole blocks of {f.nbytes} bytes (uint8), not {raw.dtype} "
                         f"{list(raw.shape)}")
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, f.nbytes)  # [n, nbytes]
    return f.dequantize_blocks(blocks).reshape(*lead, raw.shape[-1] // f.nbytes * f.values)


# ---- quantizing (Tandem's --quant q8_0 / q4_k) -------------------------------------------------------------------
QUANTIZABLE = ("Q8_0", "Q4_K")


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (C's roundf, as ggml quantizes)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [n] -> its f16 bits as bytes [n, 2] (little-endian)."""
    return v.to(torch.float16).contiguous().view(torch.uint8).view(-1, 2)


def _quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """[n, 32] -> [n, 34]: d = max|x| / 127 (f16), q = round(x / d) computed with the float32 d, as ggml does."""
    d = x.abs().amax(dim=1, keepdim=True) / 127  # [n, 1]
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _round_away(x * inv).to(torch.int8)  # [n, 32]
    return torch.cat((_f16_bytes(d[:, 0]), q.view(torch.uint8)), dim=1)


def _quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """[n, 256] -> [n, 144]: each sub-block of 32 gets the scale and offset of its range (the offset from its minimum
    clipped at 0, so a min >= 0 is 0), both quantized to 6 bits against the superblock's f16 d and dmin; then each
    value to 4 bits against them. (llama.cpp refines each sub-block's scale by a search; this takes the range.)"""
    n = x.shape[0]
    sub = x.view(n, 8, 32)  # [n, S, 32]
    low = sub.amin(dim=-1).clamp(max=0)  # [n, S]
    scale = (sub.amax(dim=-1) - low) / 15  # [n, S]
    offset = -low  # [n, S] >= 0
    d = (scale.amax(dim=-1) / 63).to(torch.float16).float()  # [n]
    dmin = (offset.amax(dim=-1) / 63).to(torch.float16).float()  # [n]
    sc = torch.where(d[:, None] > 0, _round_away(scale / d[:, None].clamp(min=1e-30)), 0).clamp(0, 63)  # [n, S]
    mn = torch.where(dmin[:, None] > 0, _round_away(offset / dmin[:, None].clamp(min=1e-30)), 0).clamp(0, 63)
    ds, dm = d[:, None] * sc, dmin[:, None] * mn  # [n, S]: what dequantizing gives each sub-block
    q = torch.where(ds[..., None] > 0, _round_away((sub + dm[..., None]) / ds[..., None].clamp(min=1e-30)), 0)
    q = q.clamp(0, 15).to(torch.uint8)  # [n, S, 32]
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    packed = torch.cat((sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)), dim=1)  # [n, 12]
    pairs = q.view(n, 4, 2, 32)  # [n, 4, 2, 32]: sub-blocks 2j (low nibbles) and 2j + 1 (high)
    nibbles = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)  # [n, 128]
    return torch.cat((_f16_bytes(d), _f16_bytes(dmin), packed, nibbles), dim=1)


def quantize(w: torch.Tensor, fmt: str) -> QuantizedMatrix:
    """w [rows, cols] (cols whole blocks) -> its blocks in `fmt` (QUANTIZABLE), as the kernels' matrix."""
    f = FORMATS[fmt]
    rows, cols = w.shape
    if fmt not in QUANTIZABLE or cols % f.values:
        raise ValueError(f"cannot quantize a [{rows}, {cols}] matrix to {fmt}: Tandem quantizes to "
                         f"{', '.join(QUANTIZABLE)}, rows of whole blocks ({f.values} values)")
    blocks = w.float().reshape(-1, f.values)  # [rows * blocks, V]
    raw = _quantize_q8_0(blocks) if fmt == "Q8_0" else _quantize_q4_k(blocks)
    return block_matrix(raw.reshape(rows, -1).contiguous(), fmt)
