"""Weight-only quantization of expert matrices for the CPU kernels.

int8: symmetric, one float32 scale per output row. int4: symmetric, one bfloat16 scale per group of
`group` input values (the values are rounded against the stored scale; bf16 rather than float32 makes an
expert 6 % smaller at group 64 and one-token decode about as much faster, for a relative scale error of at
most 2^-9, far below int4's own); each group is stored in group/2 bytes whose low nibble holds element j and high
nibble element j + group/2 (values offset by 8), the layout the C kernel reads.

Row-major is the stored layout. With AMX, matrices are re-laid out once (`blocked_layout()`) for the kernels
that read them: rows in blocks of BLOCK_ROWS = 16, each block stored as 64-value chunks of its rows, one chunk
after another, in the order of a tile's second operand, where one 64-byte line holds a 4-value column (quad) of
every row. An int8 chunk (1 KiB) is [16 quads][16 rows][4 bytes]. An int4 chunk (512 bytes) is
[8 lines][16 rows][4 bytes], whose low nibbles are quad l of the chunk and high nibbles quad l + 8 (values 4l..4l+3
and 32+4l..32+4l+3): unpacking a line gives two lines of the int8 order. The one-token VNNI kernels multiply a line
by one broadcast quad of the token; the tiles load the lines as they are (int4: once unpacked). Scales: int8 keeps
one per row; int4's, per block and group, the block's 16 side by side. Widths must be multiples of 64 values.

MXFP4 (gpt-oss's experts, GGUF's MXFP4): blocks of 32 FP4 values (E2M1: sign, 2 exponent bits, 1 mantissa bit, so
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), each block with one E8M0 scale byte e (2^(e-127)). Stored as int4
with group 32: 16 bytes a block, low nibble value j and high nibble value j + 16 (GGUF's order; gpt-oss's
safetensors pair neighbours instead, and `mxfp4_from_pairs` reorders them), codes as they are (no offset); scales
one uint8 per block. The kernels and `dequantize` compute each value as GGUF's reference does: twice the E2M1
value (a small integer) times 2^(e-128), exactly.

Letters: B blocks, C 64-value chunks per row, n BLOCK_ROWS, G groups per row, L lines of a chunk, h nibble half.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from tandem.kernels.names import GROUPS

BLOCK_ROWS = 16  # rows per block of the layout the AMX machines use (BLOCK_ROWS in csrc/common.h)
MX_BLOCK = 32  # values per MXFP4 block
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0-7; codes 8-15 are their negatives
E2M1X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # twice each code's value, as GGUF (code 8: +0)


@cache
def constant(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A constant table (a dequantizer's) on `device`, made once per device and dtype: made from a list at each call,
    it is a copy from host memory that the host waits for, a synchronisation per matrix on an accelerator."""
    return torch.tensor(values, dtype=dtype).to(device)


@dataclass(frozen=True)
class QuantizedMatrix:
    kind: str  # "int8" | "int4" | "mxfp4" | a GGUF block format ("Q4_K", ...: kernels/blocks.py)
    data: torch.Tensor  # int8 [rows, cols] | uint8 [rows, cols / 2] | GGUF: uint8 [rows, bytes a row], as stored
    scales: torch.Tensor  # int8: float32 [rows] | int4: bfloat16 [rows, cols / group] | mxfp4: uint8 [rows, cols / 32]
    # | GGUF: empty (in the blocks)
    cols: int
    group: int = 0  # int4: values a group; MXFP4 and GGUF: values a block
    blocked: bool = False  # True: the AMX kernels' block layout of BLOCK_ROWS rows (see the module docstring)

    def blocked_layout(self) -> QuantizedMatrix:
        """This matrix in blocks of BLOCK_ROWS rows and 64-value chunks (see the module docstring)."""
        if self.blocked:
            return self
        if self.kind not in ("int8", "int4"):
            raise ValueError(f"{self.kind} matrices have no block layout: the AMX kernels do not read them")
        n, rows, cols = BLOCK_ROWS, self.data.shape[0], self.cols
        if rows % n or cols % 64:
            raise ValueError(f"the block layout needs rows in multiples of {n} and widths of 64 values ({self.kind})")
        if self.kind == "int8":
            data = self.data.reshape(rows // n, n, cols // 64, 16, 4).permute(0, 2, 3, 1, 4)  # [B, C, 16, n, 4]
        else:
            u = self._nibbles().reshape(rows // n, n, cols // 64, 2, 8, 4)  # [B, n, C, h, L, 4]
            u = u.permute(0, 2, 3, 4, 1, 5)  # [B, C, h, L, n, 4]
            data = u[:, :, 0] | (u[:, :, 1] << 4)  # [B, C, L, n, 4]
        return QuantizedMatrix(self.kind, data.reshape(self.data.shape).contiguous(), self._scales_by_block(True),
                               cols, self.group, blocked=True)

    def row_major(self) -> QuantizedMatrix:
        if not self.blocked:
            return self
        n, rows, cols = BLOCK_ROWS, self.data.shape[0], self.cols
        if self.kind == "int8":
            data = self.data.reshape(rows // n, cols // 64, 16, n, 4).permute(0, 3, 1, 2, 4)  # [B, n, C, 16, 4]
        else:
            d = self.data.reshape(rows // n, cols // 64, 8, n, 4)  # [B, C, L, n, 4]
            u = torch.stack([d & 15, d >> 4], dim=2)  # [B, C, h, L, n, 4]
            u = u.permute(0, 4, 1, 2, 3, 5).reshape(rows, cols // self.group, 2, self.group // 2)  # [rows, G, 2, g/2]
            data = u[:, :, 0] | (u[:, :, 1] << 4)  # [rows, G, g/2]
        return QuantizedMatrix(self.kind, data.reshape(self.data.shape).contiguous(), self._scales_by_block(False),
                               cols, self.group)

    def _nibbles(self) -> torch.Tensor:
        """Row-major int4 as one byte per value, q + 8: [rows, cols]."""
        rows = self.data.shape[0]
        packed = self.data.view(rows, -1, self.group // 2)  # [rows, G, g/2]
        return torch.cat([packed & 15, packed >> 4], dim=-1).reshape(rows, self.cols)

    def _scales_by_block(self, blocked: bool) -> torch.Tensor:
        """int4 scales [rows, G] <-> per block, per group, the block's rows side by side ([B, G, n])."""
        if self.kind != "int4":
            return self.scales
        rows, n, groups = self.scales.shape[0], BLOCK_ROWS, self.cols // self.group
        if blocked:
            return self.scales.reshape(rows // n, n, groups).transpose(1, 2).reshape(rows, groups).contiguous()
        return self.scales.reshape(rows // n, groups, n).transpose(1, 2).reshape(rows, groups).contiguous()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.blocked:
            return self.row_major().dequantize(dtype)
        if self.kind not in ("int8", "int4", "mxfp4"):  # GGUF blocks
            from tandem.kernels.blocks import dequantize

            return dequantize(self.data, self.kind).to(dtype)
        if self.kind == "int8":
            return (self.data.float() * self.scales[:, None]).to(dtype)
        rows = self.data.shape[0]
        if self.kind == "mxfp4":
            table = constant(E2M1X2, torch.float32, self.data.device)
            codes = table[self._nibbles().long()]  # [rows, cols]
            values = codes.view(rows, -1, MX_BLOCK) * e8m0_half(self.scales)[:, :, None]  # [rows, G, 32]
            return values.reshape(rows, self.cols).to(dtype)
        values = (self._nibbles().to(torch.int8) - 8).float().view(rows, -1, self.group)  # [rows, G, g]
        return (values * self.scales.float()[:, :, None]).reshape(rows, self.cols).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


def quantize_int8(w: torch.Tensor) -> QuantizedMatrix:
    """w [rows, cols] -> int8 with a per-row scale."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [rows]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedMatrix("int8", q.contiguous(), scales.contiguous(), w.shape[1])


def quantize_int4(w: torch.Tensor, group: int) -> QuantizedMatrix:
    """w [rows, cols] -> packed int4 with a scale per group of `group` columns (cols % group == 0)."""
    if group not in GROUPS:
        raise ValueError(f"int4 group size must be one of {GROUPS}")
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"int4 with group {group} needs a width divisible by it (got {cols})")
    g = w.float().reshape(rows, cols // group, group)  # [rows, groups, group]
    scales = (g.abs().amax(dim=-1).clamp(min=1e-12) / 7).to(torch.bfloat16)  # [rows, groups]
    q = (torch.round(g / scales.float()[..., None]).clamp(-8, 7) + 8).to(torch.uint8)  # [rows, groups, group]
    half = group // 2
    packed = q[..., :half] | (q[..., half:] << 4)  # [rows, groups, group/2]
    return QuantizedMatrix("int4", packed.reshape(rows, cols // 2).contiguous(), scales.contiguous(), cols, group)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """Half of each E8M0 scale, 2^(e-128), as float32, made from its bits (subnormal below e = 2) as GGUF does."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def quantize_mxfp4(w: torch.Tensor) -> QuantizedMatrix:
    """w [rows, cols] -> MXFP4 (cols % 32 == 0): each block's scale is 2^(floor(log2 amax) - 2), the OCP MX rule,
    which puts the largest value between 4 and 8 scale units (above 6 it saturates; the smallest scale that avoids
    that measured no better on Gaussian weights: 0.115 relative RMS error either way); values round to the nearest
    E2M1 value, ties away from zero."""
    rows, cols = w.shape
    if cols % MX_BLOCK:
        raise ValueError(f"MXFP4 needs a width divisible by {MX_BLOCK} (got {cols})")
    g = w.float().reshape(rows, cols // MX_BLOCK, MX_BLOCK)  # [rows, G, 32]
    amax = g.abs().amax(dim=-1)  # [rows, G]
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-126))), torch.tensor(-125.0)) - 2
    e = (exponent + 127).clamp(0, 254).to(torch.uint8)  # [rows, G]
    scaled = (g / (2 * e8m0_half(e))[..., None]).abs().contiguous()  # [rows, G, 32] magnitudes in scale units
    mids = torch.tensor([(a + b) / 2 for a, b in zip(E2M1, E2M1[1:], strict=False)])
    code = torch.bucketize(scaled, mids, right=True)  # 0-7: the nearest magnitude (a tie goes up)
    code = (code | ((g < 0) & (code > 0)).to(code.dtype) << 3).to(torch.uint8)  # [rows, G, 32]
    packed = code[..., :16] | (code[..., 16:] << 4)  # [rows, G, 16]
    return QuantizedMatrix("mxfp4", packed.reshape(rows, cols // 2).contiguous(), e.contiguous(), cols, MX_BLOCK)


def mxfp4_from_pairs(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedMatrix:
    """gpt-oss's stored MXFP4 (`*_blocks` [rows, G, 16] uint8 whose byte j holds value 2j in its low nibble and
    2j + 1 in its high one, `*_scales` [rows, G] uint8) as a QuantizedMatrix (low nibble j, high j + 16): the same
    4-bit codes and scales, reordered once."""
    rows, groups = scales.shape
    if blocks.shape != (rows, groups, 16) or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales {list(scales.shape)} "
                         f"({scales.dtype}) do not belong together: expected uint8 [rows, G, 16] and [rows, G]")
    return QuantizedMatrix("mxfp4", nibbles_from_pairs(blocks), scales.contiguous(), groups * MX_BLOCK, MX_BLOCK)


def nibbles_from_pairs(blocks: torch.Tensor) -> torch.Tensor:
    """Stored blocks [..., G, 16] (byte j: values 2j, 2j + 1) in the kernels' order (byte j: values j, j + 16), as
    one new tensor [..., G * 16]."""
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32] in order
    return (codes[..., :16] | (codes[..., 16:] << 4)).flatten(-2)  # [..., G * 16]


def mxfp4_to_pairs(q: QuantizedMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `mxfp4_from_pairs`: gpt-oss's stored (blocks [rows, G, 16], scales [rows, G]) of an MXFP4
    matrix (to write checkpoints as published)."""
    if q.kind != "mxfp4":
        raise ValueError(f"expected an MXFP4 matrix, not {q.kind}")
    rows, groups = q.scales.shape
    packed = q.data.view(rows, groups, 16)
    codes = torch.cat((packed & 15, packed >> 4), dim=-1)  # [rows, G, 32] in order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), q.scales
