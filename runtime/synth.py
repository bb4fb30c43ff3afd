"""Random-weight checkpoints in real Hugging Face layout, written tensor by tensor.

For trying the app without downloading a model and for tests and benchmarks that need a checkpoint of
a given shape. Names and shapes come from the family spec (`runtime.weights`), the same source the
loader validates against. A byte-level BPE tokenizer is trained offline on bundled text.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.runtime.families import family_for, stored_name
from tandem.runtime.weights import dense_tensors, expert_tensors, router_name

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# What every family's tiny test config shares; each family's own keys are in its FamilySpec (`tiny`).
_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "eos_token_id": 2, "bos_token_id": None, "rope_theta": 10000.0,
}


def tiny_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """A small but complete config.json for a family (experts, heads, GQA all exercised)."""
    spec = family_for(model_type)  # raises with the supported list
    return {"model_type": model_type, **_TINY_COMMON, **spec.tiny, **overrides}


def train_tokenizer(vocab_size: int, corpus: Path | None = None) -> Tokenizer:
    """A byte-level BPE trained on the bundled corpus in well under a second; ids 0-2 are special."""
    text = (corpus or ASSETS / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    return tok


def write_tokenizer(out: Path, vocab_size: int) -> None:
    train_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>", "chat_template": CHATML,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")


def write_test_model(
    out: str | Path,
    config: dict[str, Any],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shard_bytes: int = 2 * 1024**3,
    std: float = 0.08,
    routing_skew: float = 0.0,
    router_scale: float = 1.0,
) -> Path:
    """Write config.json, random weights (sharded, with an index when >1 shard) and a tokenizer.

    Built in a temporary sibling folder and renamed into place, so a crash never leaves a half model.
    Shards are generated and written one at a time, so the model is never whole in memory.
    `routing_skew` > 0 makes routing behave more like a trained model's: every token's embedding shares a
    common direction and each router favours its experts along it with Zipf-like strengths, so some experts
    are popular and consecutive tokens reuse experts more often (0: plain random routing); `router_scale`
    multiplies the routers' random part, making routing depend more on the token (less reuse).
    """
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        spec = family_for(config["model_type"])
        cfg = spec.parse(config)
        (tmp / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        gen = torch.Generator().manual_seed(seed)
        shapes = {stored_name(spec, n): s for n, s in (dense_tensors(cfg, spec) | expert_tensors(cfg, spec)).items()}
        common = torch.randn(cfg.hidden_size, generator=gen)
        routers = frozenset(stored_name(spec, router_name(spec, i)) for i in range(cfg.num_layers)
                            if cfg.sparse_layers[i])
        skew = Skew(common / common.norm(), routing_skew, router_scale, routers) \
            if routing_skew or router_scale != 1.0 else None
        # zero-centred norms (Qwen3-Next's: they multiply by 1 + weight) stored near 0, so that they multiply by about
        # one as trained ones do, not two
        centred = {n for n in shapes if cfg.norm_offset and (n.endswith(ZERO_CENTRED) or n == "model.norm.weight")}
        _write_shards(tmp, shapes, gen, dtype, shard_bytes, std, skew, frozenset(centred), 1.0 - cfg.norm_offset)
        write_tokenizer(tmp, min(cfg.vocab_size, 2048))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


class Skew(NamedTuple):
    """Trained-like routing (write_test_model's `routing_skew`, `router_scale`)."""

    common: torch.Tensor  # [H] the direction every token's embedding carries, unit length
    strength: float  # routing_skew
    scale: float  # router_scale
    routers: frozenset[str]  # the routers' tensor names


# MXFP4 (gpt-oss as published): random codes have an RMS of 2.93 (E2M1's values, equally likely), so a scale of
# std / 2.93 gives weights of about `std`; E8M0 keeps the nearest power of two, varied by one either way per block
E2M1_RMS = 2.93


def _packed(name: str) -> bool:
    """An MXFP4 tensor of codes or scales (bytes), not a float one."""
    return name.endswith(("_blocks", "_scales"))


ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")


def _random(shape: tuple[int, ...], name: str, gen: torch.Generator, dtype: torch.dtype, std: float,
            skew: Skew | None = None, centre: float = 1.0) -> torch.Tensor:
    if name.endswith("_blocks"):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if name.endswith("_scales"):
        e = 127 + round(math.log2(std / E2M1_RMS))
        return torch.randint(e - 1, e + 2, shape, generator=gen, dtype=torch.uint8)
    if "norm" in name or name.endswith(("layer_scalar", ".scale", "per_expert_scale")):  # RMSNorm weights and
        # Gemma's scales near one, as after training
        return (centre + 0.1 * torch.randn(shape, generator=gen)).to(dtype)
    w = torch.randn(shape, generator=gen) * std
    if skew is not None:
        common, strength, scale, routers = skew
        if name == "model.embed_tokens.weight":  # every token carries the common direction
            w += common * std * shape[1] ** 0.5 * strength
        elif name in routers and shape[0] > 1:  # a router: Zipf-like preference along it
            w *= scale
            popularity = 1.0 / torch.arange(1, shape[0] + 1) ** 0.8
            popularity = popularity[torch.randperm(shape[0], generator=gen)]
            w += popularity[:, None] * common[None, :] * std * shape[1] ** 0.5 * strength
    return w.to(dtype)


def _write_shards(
    out: Path, shapes: dict[str, tuple[int, ...]], gen: torch.Generator, dtype: torch.dtype, limit: int, std: float,
    skew: Skew | None = None, centred: frozenset[str] = frozenset(), centre: float = 1.0,
) -> None:
    item = torch.empty((), dtype=dtype).element_size()

    def nbytes_of(name: str) -> int:
        return math.prod(shapes[name]) * (1 if _packed(name) else item)

    groups: list[list[str]] = [[]]
    size = 0
    for name in shapes:
        nbytes = nbytes_of(name)
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, names in enumerate(groups):
        file = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: _random(shapes[n], n, gen, dtype, std, skew, centre if n in centred else 1.0) for n in names}
        try:
            save_file(tensors, str(out / file), metadata={"format": "pt"})
        except SafetensorError as e:  # safetensors reports a failed write (a full disk) as its own error
            raise OSError(f"{out / file}: {e}") from None
        del tensors
        weight_map |= dict.fromkeys(names, file)
    if len(groups) > 1:
        total = sum(nbytes_of(name) for name in shapes)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1), encoding="utf-8")
