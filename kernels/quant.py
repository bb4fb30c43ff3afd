"""Weight-only quantization of expert matrices for the CPU kernels.

int8: symmetric, one float32 scale per output row. int4: symmetric, one float32 scale per group of
`group` input values; each group is stored in group/2 bytes whose low nibble holds element j and high
nibble element j + group/2 (values offset by 8), the layout the C kernel reads.

Row-major is the stored layout. With AMX, int4 matrices are re-laid out once (`blocked_layout()`) for the two
kernels that read them: rows in blocks of BLOCK_ROWS, each block stored as 64-byte pieces of its rows' bytes,
BLOCK_ROWS rows x 64 bytes after one another (scales likewise: per block, per group, the block's scales side by
side). The one-token kernel then reads one sequential stream, a row's 64 bytes at a time, and the tile kernel
(32 rows, one group at a time) reads two. Both need widths that are multiples of 128 values.
Letters: B row blocks (rows / 8), P 64-byte pieces per row, G groups per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUPS = (32, 64, 128)
BLOCK_ROWS = 16  # rows per block of the int4 layout the AMX machines use (INT4_BLOCK_ROWS in csrc/expert.c)


@dataclass(frozen=True)
class QuantizedMatrix:
    kind: str  # "int8" | "int4"
    data: torch.Tensor  # int8 [rows, cols] | uint8 [rows, cols / 2]
    scales: torch.Tensor  # float32 [rows] | [rows, cols / group]
    cols: int
    group: int = 0
    blocked: bool = False  # True: the AMX kernel's 32-row block layout (see the module docstring)

    def blocked_layout(self) -> QuantizedMatrix:
        """This int4 matrix in row blocks of 64-byte pieces (rows a multiple of BLOCK_ROWS, columns of 128)."""
        if self.blocked:
            return self
        n = BLOCK_ROWS
        if self.kind != "int4" or self.data.shape[0] % n or self.cols % 128:
            raise ValueError(f"the block layout is for int4 matrices with rows a multiple of {n} and columns of 128")
        rows, width = self.data.shape  # width: bytes per row
        groups = self.cols // self.group
        data = self.data.reshape(rows // n, n, width // 64, 64).transpose(1, 2)  # [B, P, n, 64]
        scales = self.scales.reshape(rows // n, n, groups).transpose(1, 2)  # [B, G, n]
        return QuantizedMatrix(self.kind, data.reshape(rows, width).contiguous(),
                               scales.reshape(rows, groups).contiguous(), self.cols, self.group, blocked=True)

    def row_major(self) -> QuantizedMatrix:
        if not self.blocked:
            return self
        rows, width = self.data.shape
        groups, n = self.cols // self.group, BLOCK_ROWS
        data = self.data.reshape(rows // n, width // 64, n, 64).transpose(1, 2)  # [B, n, P, 64]
        scales = self.scales.reshape(rows // n, groups, n).transpose(1, 2)  # [B, n, G]
        return QuantizedMatrix(self.kind, data.reshape(rows, width).contiguous(),
                               scales.reshape(rows, groups).contiguous(), self.cols, self.group)

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
        return (values * self.scales[:, :, None]).reshape(rows, self.cols).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4


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
    scales = g.abs().amax(dim=-1).clamp(min=1e-12) / 7  # [rows, groups]
    q = (torch.round(g / scales[..., None]).clamp(-8, 7) + 8).to(torch.uint8)  # [rows, groups, group]
    half = group // 2
    packed = q[..., :half] | (q[..., half:] << 4)  # [rows, groups, group/2]
    return QuantizedMatrix("int4", packed.reshape(rows, cols // 2).contiguous(), scales.contiguous(), cols, group)
