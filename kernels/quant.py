"""Weight-only quantization of expert matrices for the CPU kernels.

int8: symmetric, one float32 scale per output row. int4: symmetric, one bfloat16 scale per group of
`group` input values (the values are rounded against the stored scale; bf16 rather than float32 makes an
expert 6 % smaller at group 64 and one-token decode about as much faster, for a relative scale error of at
most 2^-9, far below int4's own); each group is stored in group/2 bytes whose low nibble holds element j and high
nibble element j + group/2 (values offset by 8), the layout the C kernel reads.

Row-major is the stored layout. With AMX, matrices are re-laid out once (`blocked_layout()`) for the kernels
that read them: rows in blocks of BLOCK_ROWS, each block stored as 64-byte pieces of its rows' bytes, BLOCK_ROWS
rows x 64 bytes after one another (int4 scales likewise: per block, per group, the block's scales side by side;
int8 keeps one scale per row). An int8 piece (16 rows x 64 values, 1 KiB) is stored by 4-value column:
[16 quads][16 rows][4 bytes], the layout of a tile's second operand, where one 64-byte line holds a quad of every
row (the one-token VNNI kernel multiplies it by one broadcast quad of the token). The one-token int4 kernel reads
one sequential stream, and the int4 tile kernel (32 rows, one group at a time) two. Widths must be multiples of
64 values (int8) or 128 (int4).

Letters: B blocks, P 64-byte pieces per row, n BLOCK_ROWS, G groups per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUPS = (32, 64, 128)
BLOCK_ROWS = 16  # rows per block of the layout the AMX machines use (INT4_BLOCK_ROWS in csrc/expert.c)


@dataclass(frozen=True)
class QuantizedMatrix:
    kind: str  # "int8" | "int4"
    data: torch.Tensor  # int8 [rows, cols] | uint8 [rows, cols / 2]
    scales: torch.Tensor  # int8: float32 [rows] | int4: bfloat16 [rows, cols / group]
    cols: int
    group: int = 0
    blocked: bool = False  # True: the AMX kernels' block layout of BLOCK_ROWS rows (see the module docstring)

    def blocked_layout(self) -> QuantizedMatrix:
        """This matrix in row blocks of 64-byte pieces (rows a multiple of BLOCK_ROWS; row bytes of 64)."""
        if self.blocked:
            return self
        n = BLOCK_ROWS
        rows, width = self.data.shape  # width: bytes per row
        if rows % n or width % 64 or (self.kind == "int4" and self.cols % 128):
            raise ValueError(f"the block layout needs rows in multiples of {n} and 64-byte rows ({self.kind})")
        data = self.data.reshape(rows // n, n, width // 64, 64).transpose(1, 2)  # [B, P, n, 64]
        if self.kind == "int8":
            data = data.reshape(rows // n, width // 64, n, 16, 4).transpose(2, 3)  # [B, P, 16, n, 4]
        scales = self.scales
        if self.kind == "int4":
            groups = self.cols // self.group
            scales = scales.reshape(rows // n, n, groups).transpose(1, 2).reshape(rows, groups)  # [B, G, n]
        return QuantizedMatrix(self.kind, data.reshape(rows, width).contiguous(), scales.contiguous(), self.cols,
                               self.group, blocked=True)

    def row_major(self) -> QuantizedMatrix:
        if not self.blocked:
            return self
        rows, width = self.data.shape
        n = BLOCK_ROWS
        data = self.data
        if self.kind == "int8":
            data = data.reshape(rows // n, width // 64, 16, n, 4).transpose(2, 3)  # [B, P, n, 16, 4]
        data = data.reshape(rows // n, width // 64, n, 64).transpose(1, 2)  # [B, n, P, 64]
        scales = self.scales
        if self.kind == "int4":
            groups = self.cols // self.group
            scales = scales.reshape(rows // n, groups, n).transpose(1, 2).reshape(rows, groups)  # [B, n, G]
        return QuantizedMatrix(self.kind, data.reshape(rows, width).contiguous(), scales.contiguous(), self.cols,
                               self.group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.blocked:
            return self.row_major().dequantize(dtype)
        if self.kind == "int8":
            return (self.data.float() * self.scales[:, None]).to(dtype)
        rows, half = self.data.shape[0], self.group // 2
        packed = self.data.view(rows, -1, half)  # [rows, groups, group/2]
        lo = (packed & 15).to(torch.int8) - 8
        hi = (packed >> 4).to(torch.int8) - 8
        values = torch.cat([lo, hi], dim=-1).float()  # [rows, groups, group]
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
