"""DeepSeek-V2/V3 pieces against transformers' own, one knob at a time (the whole models are in
test_reference_parity.py): the routers, YaRN's tables, latent attention's two paths, the latent cache under beams and
batches, and the bench shapes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tandem.autotune.bench.models import bench_config
from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.config import clean_raw
from tandem.runtime.engine import Engine
from tandem.runtime.families import parse_config
from tandem.runtime.loader import load_model
from tandem.runtime.memory import estimate_memory
from tandem.runtime.mla import LatentCache, attend, load_mla
from tandem.runtime.model import ModelRun, MoEModel, rms_norm
from tandem.runtime.moe import RoutingRule, route
from tandem.runtime.rope import rope_tables
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.synth import tiny_config, write_test_model
from tests.test_engine import reference_beam_search


def _hf_config(family: str, **overrides):
    import transformers

    return transformers.AutoConfig.for_model(**tiny_config(family, **overrides))


@pytest.mark.parametrize("family, overrides", [
    ("deepseek_v2", {}),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
                     "routed_scaling_factor": 2.0}),
    ("deepseek_v3", {}),
    ("deepseek_v3", {"n_group": 4, "topk_group": 3, "num_experts_per_tok": 3, "norm_topk_prob": False}),
])
def test_routing_matches_transformers_routers(family: str, overrides: dict) -> None:
    """Including a correction bias that makes kept experts' choice scores negative: the experts outside the kept
    groups must still lose (masked with -inf, as transformers does, not 0)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = _hf_config(family, **overrides)
    ours = parse_config(clean_raw(config.to_dict(), "test"), "test")[1]
    router = (DeepseekV2TopkRouter if family == "deepseek_v2" else DeepseekV3TopkRouter)(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    correction = None
    if family == "deepseek_v3":
        correction = -1.5 * torch.rand(ours.num_experts, generator=gen)  # every choice score below 0 for some
        router.e_score_correction_bias.copy_(correction)
    x = torch.randn(64, ours.hidden_size, generator=gen)
    _, want_w, want_ids = router(x)
    rule = RoutingRule(ours.top_k, ours.norm_topk_prob, ours.scoring, ours.n_group, ours.topk_group,  # type: ignore[arg-type]
                       ours.group_score, ours.routed_scaling_factor)  # type: ignore[arg-type]
    got_w, got_ids = route(x @ router.weight.T, rule, correction)
    order, got_order = want_ids.sort(-1), got_ids.sort(-1)
    assert torch.equal(order.values, got_order.values)
    assert torch.allclose(want_w.gather(-1, order.indices), got_w.gather(-1, got_order.indices), atol=1e-6)


@pytest.mark.parametrize("params", [
    {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
     "mscale_all_dim": 0.707},
    {"factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8},
    {"factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 1.3},
    {"factor": 2.0},
])
def test_yarn_tables_match_transformers(params: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = tiny_config("deepseek_v3", max_position_embeddings=512, qk_rope_head_dim=16,
                      rope_scaling={"rope_type": "yarn", **params})
    config = _hf_config("deepseek_v3", max_position_embeddings=512, qk_rope_head_dim=16,
                        rope_scaling={"rope_type": "yarn", **params})
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = parse_config(raw, "test")[1]
    cos, sin = rope_tables(ours, 300, torch.float32)
    angles = torch.arange(300, dtype=torch.float)[:, None] * inv_freq[None, :]  # [300, R/2]
    emb = torch.cat((angles, angles), -1)  # [300, R]
    assert torch.allclose(cos, emb.cos() * attention, atol=1e-6)
    assert torch.allclose(sin, emb.sin() * attention, atol=1e-6)


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_model(tmp_path_factory.mktemp("dsk") / "v2", tiny_config("deepseek_v2", q_lora_rank=24), seed=5)


@pytest.mark.parametrize("start, tokens", [(0, 11), (7, 5), (9, 1)])
def test_absorbed_and_expanded_attention_agree(v2_dir: Path, start: int, tokens: int) -> None:
    ckpt = open_checkpoint(v2_dir)
    cfg = ckpt.config
    weights = load_mla(cfg, "model.layers.1.self_attn", lambda name: ckpt.tensor(name).float())
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randn(1, start, cfg.hidden_size, generator=gen) if start else None
    x = torch.randn(1, tokens, cfg.hidden_size, generator=gen)
    cos, sin = rope_tables(cfg, 32, torch.float32)
    out = {}
    for absorb in (False, True):
        cache = LatentCache(cfg, 1, 32, torch.float32)
        if prefix is not None:
            attend(cfg, weights, cache, 1, prefix, 0, cos[:start], sin[:start], _linear, rms_norm, absorb)
        out[absorb] = attend(cfg, weights, cache, 1, x, start, cos[start:start + tokens], sin[start:start + tokens],
                             _linear, rms_norm, absorb)
    assert torch.allclose(out[False], out[True], atol=1e-5)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    y = torch.nn.functional.linear(x, w, b)
    return y if out_dtype is None else y.to(out_dtype)


@pytest.mark.parametrize("eos", [set(), {7, 11, 23}])
def test_beam_search_moves_latent_rows(v2_dir: Path, eos: set[int]) -> None:
    loaded = load_model(v2_dir, dtype="fp32", context=64, batch=4)
    assert isinstance(loaded.model.cache, LatentCache)
    prompt = [3, 14, 15, 92]
    got = list(Engine(loaded.model, eos).generate(prompt, SamplingParams(max_new_tokens=8, beams=4)))
    assert got == reference_beam_search(loaded.engine, prompt, 4, 8, eos)
    assert loaded.model.with_batch(3).cache is loaded.model.cache  # rows it holds already: shared
    wide = loaded.model.with_batch(6)
    assert isinstance(wide.cache, LatentCache) and wide.cache.latent.shape[1] == 6


def test_latent_cache_bytes_and_memory_estimate(v2_dir: Path) -> None:
    """The saving the mla.py docstring states, from the real shapes; the RAM estimate counts the latent cache."""
    for shape, heads in (("deepseek-v2-lite", 16), ("moonlight-16b-a3b", 16)):
        cfg = parse_config(bench_config(shape), shape)[1]
        per_token = LatentCache.nbytes(cfg, 1, 1, torch.bfloat16) // cfg.num_layers
        full = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 2
        assert (per_token, full) == (1152, 10240)
    ckpt = open_checkpoint(v2_dir)
    cfg = ckpt.config
    assert estimate_memory(ckpt, torch.float32, 100).kv_cache == cfg.num_layers * 100 * (32 + 8) * 4


def test_bench_shapes_parse_as_published() -> None:
    v2 = parse_config(bench_config("deepseek-v2-lite"), "v2")[1]
    assert (v2.hidden_size, v2.num_layers, v2.num_experts, v2.top_k, v2.moe_intermediate_size,
            v2.dense_intermediate_size, v2.shared_expert_intermediate_size) == (2048, 27, 64, 6, 1408, 10944, 2816)
    assert (v2.kv_lora_rank, v2.q_lora_rank, v2.qk_rope_head_dim, v2.qk_nope_head_dim, v2.v_head_dim) == \
        (512, 0, 64, 128, 128)
    assert v2.sparse_layers == (False,) + (True,) * 26 and v2.rope_type == "yarn" and v2.vocab_size == 102400
    v3 = parse_config(bench_config("moonlight"), "v3")[1]
    assert (v3.scoring, v3.n_group, v3.topk_group, v3.router_correction, v3.routed_scaling_factor, v3.top_k) == \
        ("sigmoid", 1, 1, True, 2.446, 6)
    assert math.isclose(v3.rope_theta, 50000.0) and v3.q_lora_rank == 0


@pytest.mark.parametrize("family, changes, needle", [
    ("deepseek_v2", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
     "top-k 3"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "sigmoid"),
    ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
    ("deepseek_v3", {"n_group": 8, "topk_group": 4}, "two best"),
])
def test_configs_transformers_would_run_differently_are_refused(family: str, changes: dict, needle: str) -> None:
    with pytest.raises(UnsupportedModelError, match=needle):
        parse_config(tiny_config(family, **changes), "test")


def test_model_keeps_the_correction_bias_in_float32(tmp_path: Path) -> None:
    folder = write_test_model(tmp_path / "v3", tiny_config("deepseek_v3"), dtype=torch.bfloat16)
    model = MoEModel.from_checkpoint(open_checkpoint(folder), ModelRun(torch.bfloat16, 32))
    block = model.layers[1].ffn
    assert block.correction is not None and block.correction.dtype == torch.float32  # type: ignore[union-attr]
    assert block.rule.scoring == "sigmoid" and block.rule.group_score == "top2"  # type: ignore[union-attr]


@pytest.mark.parametrize("key, value", [("kv_lora_rank", 0), ("routed_scaling_factor", -1.0), ("n_group", 0),
                                        ("rope_interleave", "yes"), ("qk_rope_head_dim", 1)])
def test_bad_deepseek_values_are_refused_by_name(key: str, value: object) -> None:
    from tandem.kernels.errors import CheckpointError

    with pytest.raises(CheckpointError, match=key):
        parse_config(tiny_config("deepseek_v3", **{key: value}), "test")
