"""Weight-only quantization of expert matrices for the CPU kernels.

int8: symmetric, one float32 scale per output row. int4: symmetric, one float32 scale per group of
`group` input values; each group is stored in group/2 bytes whose low nibble holds element j and high
nibble element j + group/2 (values offset by 8), the layout the C kernel reads.

Row-major is the stored layout. The AMX kernel turns int4 into bf16 32 rows at a time, one group each, and 32
rows read side by side in such short pieces defeat the hardware prefetchers, so for it an int4 matrix is
re-laid out in blocks (`blocked_layout()`): each block of 32 rows is stored group by group, 32 rows x one
group's bytes (and the group's 32 scales side by side), so the kernel reads one sequential stream.
Letters: B row blocks (rows / 32), P groups per row, S bytes per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class QuantizedMatrix:
    kind: str  # "int8" | "int4"
    data: torch.Tensor  # int8 [rows, cols] | uint8 [rows, cols / 2]
    scales: torch.Tensor  # float32 [rows] | [rows, cols / group]
    cols: int
    group: int = 0
    blocked: bool = False  # True: the AMX kernel's 32-row block layout (see the module docstring)

    def blocked_layout(self) -> QuantizedMatrix:
        """This int4 matrix in 32-row blocks (its row count must be a multiple of 32)."""
        if self.blocked:
            return self
        if self.kind != "int4" or self.data.shape[0] % 32:
            raise ValueError("the block layout is for int4 matrices with a multiple of 32 rows")
        rows, width = self.data.shape  # width: bytes per row
        groups = self.cols // self.group
        data = self.data.reshape(rows // 32, 32, groups, width // groups).transpose(1, 2)  # [B, P, 32, S]
        scales = self.scales.reshape(rows // 32, 32, groups).transpose(1, 2)  # [B, P, 32]
        return QuantizedMatrix(self.kind, data.reshape(rows, width).contiguous(),
                               scales.reshape(rows, groups).contiguous(), self.cols, self.group, blocked=True)

    def row_major(self) -> QuantizedMatrix:
        if not self.blocked:
            return self
        rows, width = self.data.shape
        groups = self.cols // self.group
        data = self.data.reshape(rows // 32, groups, 32, width // groups).transpose(1, 2)  # [B, 32, P, S]
        scales = self.scales.reshape(rows // 32, groups, 32).transpose(1, 2)  # [B, 32, P]
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
