"""Where a Hugging Face tensor lies in a GGUF file (`Source`): what a family's file says of its tensors
(`GGUFArch.sources`) and runtime/gguf.py reads. Apart from the reader so that a family's file, which every command's
flags list (`--shape`, the families' names), imports no torch: `tandem --help` starts in a fraction of a second, and
the environment the command line sets for torch's OpenMP runtime is there before torch loads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """Where a Hugging Face tensor lies in the GGUF: its tensor, the expert's index in a stacked one (or None),
    whether its rows are llama.cpp's RoPE order (q or k of a `llama` model: `heads` to undo it with), and for
    DeepSeek's kv_b_proj, whether it was split into attn_k_b (each head's k rows, transposed) and attn_v_b."""

    name: str
    expert: int | None = None
    heads: int = 0
    kv_b: str | None = None  # DeepSeek's kv_b_proj split by llama.cpp: `name` is attn_k_b, this attn_v_b
    fused: str | None = None  # gpt-oss's fused experts made from the layer's three (see GGUFFile.tensor)
    rows: tuple[int, int] | None = None  # these rows of the expert's matrix: gate's or up's of ffn_gate_up_exps
    pick: tuple[int, ...] | None = None  # these rows of the tensor, in this order (Qwen3-Next's b and a of ssm_ba)
    value: str | None = None  # what the converter did to the values, undone: "less_one" (zero-centred norms stored
    # plus one), "log_neg" (Mamba's and Gated DeltaNet's A stored as -exp(A_log))
