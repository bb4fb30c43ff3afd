"""Reading a GGUF file's metadata into a family's config.json: typed, bounded reads of its keys (an integer is not a
float or a boolean; a number is finite and of sane size; a field's bound is config.py's), each refusal a
CheckpointError naming the key, and the keys every llama.cpp architecture writes alike (`common_config`). A family
that reads GGUF files (`FamilySpec.gguf`) builds its config from these.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.kernels.errors import CheckpointError
from tandem.runtime.config import WHOLE
from tandem.runtime.gguf_header import GGUFArray

Meta = dict[str, Any]  # a file's metadata, with plain Python values (arrays as GGUFArray: item type, length)

MISSING = object()  # no default: the key is required
FLOAT_MOST = 1e30  # a real number in a model's metadata (eps, rope base, scales) is far below this


def bad(key: str, value: Any, want: str) -> CheckpointError:
    shown = f"an array of {value.count} items" if isinstance(value, GGUFArray) else \
        f"{type(value).__name__} {value!r}"[:120]
    return CheckpointError(f"the GGUF file's {key} is {shown}, but it must be {want}; the file is damaged or was not "
                           "written by llama.cpp's converter: re-download or convert it again")


def read_int(meta: Meta, key: str, default: Any = MISSING, bound: str = "") -> int:
    """An integer key (not a float or boolean, which `int()` would truncate), within config.py's bound for the
    config.json field `bound` (else 0 to 2^31) when given."""
    value = meta.get(key, default)
    if value is MISSING:
        raise CheckpointError(f"the GGUF file has no {key}; it is incomplete or not a model file")
    lo, hi = WHOLE.get(bound, (0, (1 << 31) - 1))
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, value, "an integer")
    if not lo <= value <= hi:
        raise bad(key, value, f"a whole number from {lo} to {hi}")
    return value


def read_float(meta: Meta, key: str, default: Any = MISSING) -> float:
    """A real number key (an integer type too), finite and of sane size."""
    value = meta.get(key, default)
    if value is MISSING:
        raise CheckpointError(f"the GGUF file has no {key}; it is incomplete or not a model file")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(key, value, "a number")
    if not math.isfinite(value) or abs(value) >= FLOAT_MOST:
        raise bad(key, value, "a finite number")
    return float(value)


def read_flag(meta: Meta, key: str, default: bool) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise bad(key, value, "a boolean")
    return value


def per_layer(meta: Meta, key: str, layers: int, kind: type, bound: str = "") -> list[Any]:
    """A key llama.cpp writes once, or once per layer (an array of `layers` items): the value of each layer, each
    an int (within `bound`'s range, as `read_int`) or a bool."""
    value = meta.get(key, MISSING)
    if value is MISSING:
        raise CheckpointError(f"the GGUF file has no {key}; it is incomplete or not a model file")
    if not isinstance(value, GGUFArray):
        return [read_int(meta, key, bound=bound) if kind is int else read_flag(meta, key, False)] * layers
    if value.count != layers or value.values is None:
        raise bad(key, value, f"one value or one per layer ({layers})")
    items = list(value.values)
    if kind is bool:
        if value.item_type != 7:
            raise bad(key, value, "booleans, one per layer")
        return items
    lo, hi = WHOLE.get(bound, (0, (1 << 31) - 1))
    if any(isinstance(v, float) or not lo <= v <= hi for v in items):
        raise bad(key, value, f"whole numbers from {lo} to {hi}, one per layer")
    return items


def read_text(meta: Meta, key: str) -> str | None:
    value = meta.get(key)
    if value is not None and not isinstance(value, str):
        raise bad(key, value, "a string")
    return value


def common_config(meta: Meta, arch: str, vocab: int) -> dict[str, Any]:
    a = arch
    heads = read_int(meta, f"{a}.attention.head_count", bound="num_attention_heads")
    hidden = read_int(meta, f"{a}.embedding_length", bound="hidden_size")
    out = {
        "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": read_int(meta, f"{a}.block_count", bound="num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": read_int(meta, f"{a}.attention.head_count_kv", heads, "num_key_value_heads"),
        "max_position_embeddings": read_int(meta, f"{a}.context_length", bound="max_position_embeddings"),
        "rms_norm_eps": read_float(meta, f"{a}.attention.layer_norm_rms_epsilon"),
        "rope_theta": read_float(meta, f"{a}.rope.freq_base", 10000.0),
        "num_experts_per_tok": read_int(meta, f"{a}.expert_used_count", bound="num_experts_per_tok"),
        "hidden_act": "silu", "tie_word_embeddings": False,
    }
    if f"{a}.attention.key_length" in meta:
        out["head_dim"] = read_int(meta, f"{a}.attention.key_length", bound="head_dim")
    if "tokenizer.ggml.bos_token_id" in meta:
        out["bos_token_id"] = read_int(meta, "tokenizer.ggml.bos_token_id", bound="bos_token_id")
    if "tokenizer.ggml.eos_token_id" in meta:
        out["eos_token_id"] = read_int(meta, "tokenizer.ggml.eos_token_id", bound="bos_token_id")
    return out
