"""`tandem bench quant`: int8/int4/MXFP4 and GGUF's Q8_0/Q4_K CPU experts against unquantized ones: the logits'
drift, their KL divergence and greedy (top-1) agreement."""

from __future__ import annotations

from itertools import chain, repeat
from pathlib import Path
from typing import Any

import torch

from tandem.autotune.bench.inputs import teacher_forced
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.engine import Engine
from tandem.runtime.loader import load_model
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.synth import ASSETS


def bench_quant(model_dir: str, new_tokens: int = 64, prompt_tokens: int = 16, group: int = 64,
                files: list[str] | None = None) -> dict[str, Any]:
    """Quality of int8/int4/MXFP4 CPU experts against the unquantized model (same dtype), teacher-forced:
    the unquantized greedy continuation is fed to every variant one token at a time (the decode path),
    and at each step the logits are compared and the greedy choices checked for agreement. MXFP4 where the widths
    are whole blocks of 32 (Q4_K: 256). `files`: GGUF files of the same model (another quantizer's), compared too
    under their names."""
    variants: dict[str, dict[str, Any]] = {"none": {}, "int8": {"quant": "int8"},
                                           "int4": {"quant": "int4", "quant_group": group}}
    cfg = open_checkpoint(model_dir).config
    for name, block in (("mxfp4", 32), ("q8_0", 32), ("q4_k", 256)):  # where the widths are whole blocks
        if cfg.hidden_size % block == 0 and cfg.moe_intermediate_size % block == 0:
            variants[name] = {"quant": name}
    models = {name: load_model(model_dir, **settings) for name, settings in variants.items()}
    for file in files or []:
        models[f"gguf:{Path(file).name}"] = load_model(file, dtype=str(models["none"].options.dtype))
        variants[f"gguf:{Path(file).name}"] = {}
    base = models["none"]
    text = (ASSETS / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    prompt = base.tokenizer.encode(text)[:prompt_tokens]
    tokens = list(Engine(base.model, ()).generate(prompt, SamplingParams(max_new_tokens=new_tokens)))
    sequence = prompt + tokens[:-1]  # the prompt, then each step's token: logits for every new token
    logits = {name: torch.cat(list(teacher_forced(loaded.model, sequence, chain([len(prompt)], repeat(1)))))
              [len(prompt) - 1 :] for name, loaded in models.items()}  # [steps, V]
    ref = logits["none"]
    result: dict[str, Any] = {"model": str(model_dir), "dtype": str(base.model.dtype).removeprefix("torch."),
                              "steps": len(ref), "int4_group": group, "variants": {}}
    for name in [v for v in variants if v != "none"]:
        got = logits[name]
        drift = (got - ref).abs()
        result["variants"][name] = {
            "max_abs_logit_drift": round(drift.max().item(), 4),
            "mean_abs_logit_drift": round(drift.mean().item(), 4),
            "relative_drift": round((drift.norm() / ref.norm()).item(), 4),
            "greedy_agreement": round((got.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
            # KL(unquantized || quantized) per step, in nats, averaged (llama.cpp's perplexity --kl-divergence)
            "kl_divergence": round(torch.nn.functional.kl_div(
                torch.log_softmax(got.float(), -1), torch.log_softmax(ref.float(), -1), log_target=True,
                reduction="batchmean").item(), 6),
        }
    return result
