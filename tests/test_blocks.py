"""GGUF's block formats dequantize bit for bit as the `gguf` package's reference does, over random blocks whose f16
fields include subnormals, infinities, NaNs and both zeros, and every E8M0 scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.kernels.blocks import FORMATS, block_matrix, dequantize
from tandem.kernels.dense import lookup_rows

EDGE_F16 = [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x3C00]  # 0, -0, subnormals,
# the smallest normal, the largest, +-inf, NaN, 1


def random_blocks(nbytes: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), generator=g, dtype=torch.uint8)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN matching any NaN (their payloads are the platform's)."""
    both_nan = torch.isnan(got) & torch.isnan(want)
    return bool(((got.view(torch.int32) == want.view(torch.int32)) | both_nan).all())


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_dequantizes_as_the_gguf_reference(name: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference

    fmt = FORMATS[name]
    blocks = random_blocks(fmt.nbytes, 600, seed=len(name))
    f16_at = {"Q6_K": [208]}.get(name, [0, 2] if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])
    if name != "MXFP4":  # the edge values in every f16 field of the first blocks
        for i, bits in enumerate(EDGE_F16):
            for at in f16_at:
                blocks[i, at : at + 2] = torch.tensor([bits & 255, bits >> 8], dtype=torch.uint8)
    else:
        blocks[:256, 0] = torch.arange(256, dtype=torch.uint8)  # every scale
    rows = blocks.reshape(6, -1)  # 6 rows of 100 blocks
    with np.errstate(all="ignore"):  # the edge values make infinities and NaNs, on purpose
        want = torch.from_numpy(reference(rows.numpy(), GGMLQuantizationType[name]).astype(np.float32))
    got = dequantize(rows, name)
    assert got.shape == want.shape == (6, 100 * fmt.values) and got.dtype == torch.float32
    assert same_bits(got, want)
    assert torch.isfinite(got).float().mean() > 0.5  # mostly ordinary numbers: the test compares values
    # a quantized embedding's lookup (the kernel's unpacking where it is built), rows in any order, some twice
    ids = torch.tensor([[5, 0, 3], [3, 1, 4]])
    looked_up = lookup_rows(block_matrix(rows, name), ids)
    assert looked_up.shape == (2, 3, 100 * fmt.values) and same_bits(looked_up, want[ids])
    with pytest.raises(ValueError, match="from 0 to 5"):
        lookup_rows(block_matrix(rows, name), torch.tensor([2, 6]))


def test_a_row_of_part_of_a_block_is_refused() -> None:
    with pytest.raises(ValueError, match="whole blocks of 34 bytes"):
        dequantize(torch.zeros(2, 40, dtype=torch.uint8), "Q8_0")
