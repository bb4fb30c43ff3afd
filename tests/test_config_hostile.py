"""Hostile config.json values for RoPE and special tokens: each is refused by `parse_config` with a CheckpointError
naming the field (the command line: `error: ...`, exit status 2), never a Python traceback and never a silent run.

A RoPE parameter (`rope_parameters`, transformers 5, or `rope_scaling`, older configs) of the wrong type or range,
a variant without the keys it needs, LongRoPE factors that do not fit the head, and a special token id outside
[0, vocab_size) are what a damaged or carelessly edited config holds. What real configs hold (the tests' reference
cases, the published shapes, GGUF metadata as llama.cpp writes it) still parses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tandem.app.cli.main import main
from tandem.kernels.errors import CheckpointError
from tandem.runtime.families import families, parse_config
from tandem.runtime.gguf import config_of
from tandem.runtime.synth import tiny_config, write_test_model
from tests.conftest import CASES, copy_checkpoint, edit_config

YARN = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}
# qwen3_moe's tiny config has head_dim 32: 16 rotated pairs; phimoe's has head_dim 16: 8
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [1.5] * 16,
            "original_max_position_embeddings": 16}
PHI_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.5] * 8, "short_mscale": 1.1,
                "long_mscale": 1.2, "original_max_position_embeddings": 16}


def without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


# (case, family, changes to the tiny config, words the error must hold): the ones the hostile sweep found through
# `tandem generate`, each a traceback or a silent run before
SWEEP: list[tuple[str, str, dict[str, Any], tuple[str, ...]]] = [
    ("yarn factor a string", "qwen3_moe", {"rope_scaling": YARN | {"factor": "2"}}, ("rope_scaling.factor",)),
    ("yarn factor a list", "qwen3_moe", {"rope_scaling": YARN | {"factor": [2]}}, ("rope_scaling.factor",)),
    ("yarn factor negative", "qwen3_moe", {"rope_scaling": YARN | {"factor": -2.0}}, ("rope_scaling.factor",)),
    ("yarn original 0", "qwen3_moe", {"rope_scaling": YARN | {"original_max_position_embeddings": 0}},
     ("rope_scaling.original_max_position_embeddings",)),
    ("yarn original a string", "qwen3_moe", {"rope_scaling": YARN | {"original_max_position_embeddings": "256"}},
     ("rope_scaling.original_max_position_embeddings",)),
    ("yarn beta_fast a string", "qwen3_moe", {"rope_scaling": YARN | {"beta_fast": "32"}}, ("rope_scaling.beta_fast",)),
    ("yarn beta_slow a string", "qwen3_moe", {"rope_scaling": YARN | {"beta_slow": "1"}}, ("rope_scaling.beta_slow",)),
    ("longrope factors strings", "qwen3_moe", {"rope_scaling": LONGROPE | {"short_factor": ["1"] * 16}},
     ("rope_scaling.short_factor",)),
    ("longrope long factors strings", "qwen3_moe", {"rope_scaling": LONGROPE | {"long_factor": ["1"] * 16}},
     ("rope_scaling.long_factor",)),
    ("longrope short_factor too short", "qwen3_moe", {"rope_scaling": LONGROPE | {"short_factor": [1.0] * 3}},
     ("short_factor", "lists 3 numbers", "need 16")),
    ("longrope without short_factor", "qwen3_moe", {"rope_scaling": without(LONGROPE, "short_factor")},
     ("LongRoPE needs short_factor",)),
    ("phimoe longrope factors strings", "phimoe", {"rope_scaling": PHI_LONGROPE | {"short_factor": ["1"] * 8}},
     ("rope_scaling.short_factor",)),
    ("phimoe longrope short_factor too short", "phimoe", {"rope_scaling": PHI_LONGROPE | {"short_factor": [1.0] * 3}},
     ("short_factor", "8 numbers")),
    ("eos 99999", "qwen3_moe", {"eos_token_id": 99999}, ("eos_token_id 99999", "vocab_size 512")),
    ("eos = vocab_size", "qwen3_moe", {"eos_token_id": 512}, ("eos_token_id 512", "vocab_size 512")),
    ("bos 99999", "qwen3_moe", {"bos_token_id": 99999}, ("bos_token_id 99999",)),
]

# The rest of RoPE's parameters, in either dict, and the special tokens' other forms
MORE: list[tuple[str, str, dict[str, Any], tuple[str, ...]]] = [
    ("yarn factor in rope_parameters a string", "qwen3_moe",
     {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": "2"}}, ("rope_parameters.factor",)),
    ("yarn factor 0", "qwen3_moe", {"rope_scaling": YARN | {"factor": 0}}, ("rope_scaling.factor",)),
    ("yarn factor true", "qwen3_moe", {"rope_scaling": YARN | {"factor": True}}, ("rope_scaling.factor",)),
    ("yarn factor 1e300", "qwen3_moe", {"rope_scaling": YARN | {"factor": 1e300}}, ("rope_scaling.factor",)),
    ("yarn factor 10**400", "qwen3_moe", {"rope_scaling": YARN | {"factor": 10**400}}, ("rope_scaling.factor",)),
    ("yarn without factor", "qwen3_moe", {"rope_scaling": without(YARN, "factor")}, ("YaRN needs its factor",)),
    ("yarn factor null", "qwen3_moe", {"rope_scaling": YARN | {"factor": None}}, ("YaRN needs its factor",)),
    ("yarn original a float", "qwen3_moe", {"rope_scaling": YARN | {"original_max_position_embeddings": 256.0}},
     ("rope_scaling.original_max_position_embeddings",)),
    ("yarn beta_fast negative", "qwen3_moe", {"rope_scaling": YARN | {"beta_fast": -32}}, ("rope_scaling.beta_fast",)),
    ("yarn beta_fast below beta_slow", "qwen3_moe", {"rope_scaling": YARN | {"beta_fast": 1, "beta_slow": 32}},
     ("beta_fast (1) is below its beta_slow (32)",)),
    ("yarn mscale a string", "qwen3_moe", {"rope_scaling": YARN | {"mscale": "1", "mscale_all_dim": 1}},
     ("rope_scaling.mscale",)),
    ("yarn mscale_all_dim negative", "deepseek_v2", {"rope_scaling": YARN | {"mscale": 1, "mscale_all_dim": -1.5}},
     ("rope_scaling.mscale_all_dim",)),
    ("yarn attention_factor a string", "qwen3_moe", {"rope_scaling": YARN | {"attention_factor": "1"}},
     ("rope_scaling.attention_factor",)),
    ("yarn attention_factor 0", "qwen3_moe", {"rope_scaling": YARN | {"attention_factor": 0.0}},
     ("rope_scaling.attention_factor",)),
    ("yarn truncate a string", "qwen3_moe", {"rope_scaling": YARN | {"truncate": "no"}}, ("rope_scaling.truncate",)),
    ("rope_parameters theta a string", "qwen3_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
     ("rope_parameters.rope_theta",)),
    ("partial rotary a string", "glm4_moe",
     {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": "0.5"}},
     ("rope_parameters.partial_rotary_factor",)),
    ("longrope a factor 0", "qwen3_moe", {"rope_scaling": LONGROPE | {"long_factor": [1.0] * 15 + [0]}},
     ("rope_scaling.long_factor",)),
    ("longrope factors empty", "qwen3_moe", {"rope_scaling": LONGROPE | {"short_factor": []}},
     ("rope_scaling.short_factor",)),
    ("longrope factors nested", "qwen3_moe", {"rope_scaling": LONGROPE | {"short_factor": [[1.0]] * 16}},
     ("rope_scaling.short_factor",)),
    ("longrope factors an object", "qwen3_moe", {"rope_scaling": LONGROPE | {"short_factor": {"a": 1}}},
     ("rope_scaling.short_factor",)),
    ("longrope long_factor too long", "qwen3_moe", {"rope_scaling": LONGROPE | {"long_factor": [1.0] * 17}},
     ("long_factor", "lists 17 numbers")),
    ("su without long_factor", "qwen3_moe", {"rope_scaling": without(LONGROPE, "long_factor") | {"rope_type": "su"}},
     ("LongRoPE needs long_factor",)),
    ("longrope original 1", "qwen3_moe", {"rope_scaling": LONGROPE | {"original_max_position_embeddings": 1}},
     ("original_max_position_embeddings is 1",)),
    ("longrope mscale negative", "phimoe", {"rope_scaling": PHI_LONGROPE | {"long_mscale": -1.0}},
     ("rope_scaling.long_mscale",)),
    ("phimoe top-level original a string", "phimoe",
     {"rope_scaling": PHI_LONGROPE, "original_max_position_embeddings": "4096"}, ("original_max_position_embeddings",)),
    ("longrope factors in rope_parameters, wrong length", "deepseek_v2",  # MLA rotates qk_rope_head_dim 8: 4 pairs
     {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                          "long_factor": [1.0] * 4}}, ("short_factor", "need 4")),
    ("odd head dim", "qwen3_moe", {"head_dim": 33}, ("rotates 33 dims",)),
    ("odd MLA rotary dims", "deepseek_v2", {"qk_rope_head_dim": 3}, ("rotates 3 dims",)),
    ("an eos list with one beyond the vocabulary", "qwen3_moe", {"eos_token_id": [2, 512]}, ("eos_token_id 512",)),
    ("an eos of 10**30 in a list", "qwen3_moe", {"eos_token_id": [10**30]}, ("eos_token_id",)),
    ("bos = vocab_size", "qwen3_moe", {"bos_token_id": 512}, ("bos_token_id 512",)),
    ("eos beyond a GLM vocabulary", "glm4_moe", {"eos_token_id": [151329, 151336, 151338]}, ("eos_token_id 151329",)),
    # dots.llm1's variants it does not run, refused by name
    ("dots1 a MoE block every other layer", "dots1", {"moe_layer_freq": 2}, ("moe_layer_freq 2",)),
    ("dots1 groups too few for top-k", "dots1", {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
     ("cannot give top-k 3",)),
    ("dots1 layer_types of another model", "dots1", {"sliding_window": 4, "layer_types": ["sliding_attention"]},
     ("layer_types has 1 entries",)),
    # MiniMax-M2's
    ("minimax_m2 q/k norm per head", "minimax_m2", {"qk_norm_type": "per_head"}, ("qk_norm_type 'per_head'",)),
    ("minimax_m2 a shared expert", "minimax_m2", {"shared_intermediate_size": 64}, ("shared_intermediate_size 64",)),
    ("minimax_m2 softmax routing", "minimax_m2", {"scoring_func": "softmax"}, ("scoring_func 'softmax'",)),
    ("minimax_m2 odd rotary_dim", "minimax_m2", {"rotary_dim": 15}, ("rotary_dim is 15",)),
    # GLM-4.7-Flash's
    ("glm4_moe_lite mlp_layer_types too short", "glm4_moe_lite", {"mlp_layer_types": ["dense"]},
     ("mlp_layer_types must list",)),
    ("glm4_moe_lite an unknown layer type", "glm4_moe_lite", {"mlp_layer_types": ["dense", "moe"]},
     ("mlp_layer_types must list",)),
    ("glm4_moe_lite softmax routing", "glm4_moe_lite", {"scoring_func": "softmax"}, ("scoring_func 'softmax'",)),
    # ERNIE 4.5's
    ("ernie4_5_moe biases everywhere", "ernie4_5_moe", {"use_bias": True}, ("use_bias",)),
    # HunYuan's
    ("hunyuan_v1_moe top-k differing by layer", "hunyuan_v1_moe", {"moe_topk": [2, 3]}, ("moe_topk differing",)),
    ("hunyuan_v1_moe expert width per layer differing", "hunyuan_v1_moe", {"moe_intermediate_size": [48, 64]},
     ("differs between layers",)),
    ("hunyuan_v1_moe experts narrower than the shared one", "hunyuan_v1_moe", {"moe_intermediate_size": 32},
     ("moe_intermediate_size 32",)),
    ("hunyuan_v1_moe dynamic RoPE without alpha", "hunyuan_v1_moe",
     {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, ("no positive alpha",)),
    # Llama 4's
    ("llama4_text two experts a token", "llama4_text", {"num_experts_per_tok": 2}, ("num_experts_per_tok 2",)),
    ("llama4_text an expert layer past the last", "llama4_text", {"moe_layers": [1, 2]}, ("moe_layers must list",)),
    ("llama4_text no_rope_layers too short", "llama4_text", {"no_rope_layers": [1]}, ("no_rope_layers must be",)),
    ("llama3 RoPE without its ramp", "llama4_text",
     {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, ("low_freq_factor",)),
    ("llama3 RoPE ramp backwards", "llama4_text",
     {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 4.0,
                          "high_freq_factor": 1.0, "original_max_position_embeddings": 16}}, ("at or below",)),
    ("llama4_text no_rope_layer_interval 0", "llama4_text", {"no_rope_layer_interval": 0},
     ("no_rope_layer_interval",)),
    ("llama4_text floor_scale 0", "llama4_text", {"floor_scale": 0}, ("floor_scale",)),
    ("llama4_text a negative chunk", "llama4_text", {"attention_chunk_size": -4}, ("attention_chunk_size",)),
    ("frequency factors too few", "llama4_text",
     {"rope_parameters": {"rope_type": "frequency_factors", "rope_theta": 5e5, "factors": [1.0, 2.0]}},
     ("list 2 numbers", "need 8")),
    # Gemma 4's variants it does not run, refused by name; its layer kinds' RoPE and shapes checked
    ("gemma4_text per-layer input embeddings", "gemma4_text", {"hidden_size_per_layer_input": 16},
     ("per-layer input embeddings",)),
    ("gemma4_text shared keys and values", "gemma4_text", {"num_kv_shared_layers": 1}, ("num_kv_shared_layers",)),
    ("gemma4_text a dense model", "gemma4_text", {"enable_moe_block": False}, ("dense model",)),
    ("gemma4_text bidirectional", "gemma4_text", {"use_bidirectional_attention": "all"}, ("bidirectional",)),
    ("gemma4_text exact GELU", "gemma4_text", {"hidden_activation": "gelu"}, ("'gelu'",)),
    ("gemma4_text a sliding layer of its own shape", "gemma4_text", {"per_layer_config": {"0": {"head_dim": 32}}},
     ("different shapes",)),
    ("gemma4_text a global RoPE share past 1", "gemma4_text",
     {"rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 2.0,
                                             "rope_theta": 1e6}}}, ("full_attention.partial_rotary_factor",)),
    ("gemma4_text global heads that do not share", "gemma4_text", {"num_global_key_value_heads": 3},
     ("do not share 3",)),
]


@pytest.mark.parametrize("case, family, changes, needles", SWEEP + MORE, ids=[c[0] for c in SWEEP + MORE])
def test_hostile_rope_and_token_values_are_refused_by_name(case: str, family: str, changes: dict[str, Any],
                                                           needles: tuple[str, ...]) -> None:
    with pytest.raises(CheckpointError) as caught:
        parse_config(tiny_config(family, **changes), "config.json")
    for needle in needles:
        assert needle in str(caught.value), caught.value


# What real configs hold, or may: each parses
ACCEPTED: list[tuple[str, str, dict[str, Any]]] = [
    ("yarn with whole-number betas (DeepSeek)", "deepseek_v2",
     {"rope_scaling": YARN | {"beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    ("yarn mscales 0 (GGUF without a log multiplier)", "deepseek_v2",
     {"rope_scaling": YARN | {"mscale": 0.0, "mscale_all_dim": 0.0}}),
    ("yarn with nulls inside", "qwen3_moe", {"rope_scaling": YARN | {"attention_factor": None, "beta_fast": None}}),
    ("yarn factor a whole number", "qwen3_moe", {"rope_scaling": YARN | {"factor": 4}}),
    ("yarn in rope_scaling beside a plain rope_parameters", "qwen3_moe",
     {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": YARN}),
    ("longrope, attention_factor given", "qwen3_moe", {"rope_scaling": LONGROPE | {"attention_factor": 1.2}}),
    ("su (LongRoPE's old name)", "phimoe", {"rope_scaling": PHI_LONGROPE | {"rope_type": "su"}}),
    ("eos null", "qwen3_moe", {"eos_token_id": None}),
    ("eos an empty list", "qwen3_moe", {"eos_token_id": []}),
    ("eos the last token, bos the first", "qwen3_moe", {"eos_token_id": [2, 511], "bos_token_id": 0}),
    ("llama4_text no_rope_layers empty (the published configs: the default)", "llama4_text", {"no_rope_layers": []}),
    ("gemma4_text the global layers as transformers saves them (per_layer_config)", "gemma4_text",
     {"per_layer_config": {"1": {"head_dim": 32, "num_key_value_heads": 1}}}),
]


@pytest.mark.parametrize("case, family, changes", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_what_real_configs_hold_still_parses(case: str, family: str, changes: dict[str, Any]) -> None:
    parse_config(tiny_config(family, **changes), "config.json")


@pytest.mark.parametrize("case_id, family, overrides", CASES, ids=[c[0] for c in CASES])
def test_the_reference_cases_still_parse(case_id: str, family: str, overrides: dict[str, Any]) -> None:
    """The rope configs the reference tests run (YaRN, LongRoPE, DeepSeek's YaRN with mscale/mscale_all_dim)."""
    parse_config(tiny_config(family, **without(overrides, "quantization_config")), case_id)


def test_the_published_shapes_still_parse() -> None:
    for spec in families():
        for shape in spec.shapes:
            parse_config({"model_type": spec.model_type, **shape.config}, shape.name)


# -- GGUF metadata: runtime/gguf.py's config_of builds a raw config that goes through the same checks ---------------
def gpt_oss_meta(**changes: Any) -> dict[str, Any]:
    a = "gpt-oss"
    meta = {"general.architecture": a, f"{a}.attention.head_count": 4, f"{a}.attention.head_count_kv": 2,
            f"{a}.embedding_length": 64, f"{a}.block_count": 2, f"{a}.context_length": 512,
            f"{a}.attention.layer_norm_rms_epsilon": 1e-5, f"{a}.expert_used_count": 2, f"{a}.expert_count": 8,
            f"{a}.expert_feed_forward_length": 48, f"{a}.attention.sliding_window": 4, f"{a}.attention.key_length": 16,
            f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": 32.0,
            f"{a}.rope.scaling.original_context_length": 64, "tokenizer.ggml.eos_token_id": 2}
    return meta | {f"{a}.{k}" if not k.startswith("tokenizer") else k: v for k, v in changes.items()}


GGUF_TYPES = {f"blk.{i}.ffn_gate_inp.weight": "F32" for i in range(2)} | {"output.weight": "F32"}


def test_gguf_metadata_as_written_parses() -> None:
    parse_config(config_of(gpt_oss_meta(), GGUF_TYPES, 512), "m.gguf (its GGUF metadata)")


@pytest.mark.parametrize("changes, needle", [
    ({"tokenizer.ggml.eos_token_id": 512}, "eos_token_id 512"),
    ({"tokenizer.ggml.bos_token_id": 600}, "bos_token_id 600"),
    ({"rope.scaling.factor": 0.0}, "rope_scaling.factor"),
    ({"rope.scaling.factor": -4.0}, "rope_scaling.factor"),
    ({"rope.scaling.original_context_length": 0}, "rope_scaling.original_max_position_embeddings"),
    ({"rope.scaling.yarn_beta_fast": -1.0, "rope.scaling.yarn_beta_slow": 1.0}, "rope_scaling.beta_fast"),
], ids=["eos", "bos", "factor 0", "factor negative", "original 0", "beta_fast negative"])
def test_gguf_metadata_goes_through_the_same_checks(changes: dict[str, Any], needle: str) -> None:
    raw = config_of(gpt_oss_meta(**changes), GGUF_TYPES, 512)
    with pytest.raises(CheckpointError, match=needle.replace(".", r"\.")):
        parse_config(raw, "m.gguf (its GGUF metadata)")


# -- through the command line: `error: ...`, exit status 2 ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: write_test_model(root / family, tiny_config(family)) for family in ("qwen3_moe", "phimoe")}


@pytest.mark.parametrize("case, family, changes, needles", SWEEP, ids=[c[0] for c in SWEEP])
def test_the_command_line_says_what_is_wrong(tiny_models: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str], case: str, family: str,
                                             changes: dict[str, Any], needles: tuple[str, ...]) -> None:
    folder = copy_checkpoint(tiny_models[family], tmp_path / "m")
    edit_config(folder, **changes)
    code = main(["generate", "--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2", "--no-profile"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.splitlines()[-1].startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_rope_given_per_kind_of_layer_is_refused_by_name() -> None:
    """transformers 5 may give rope_parameters per kind of layer ({"full_attention": {...}, ...}); read as one flat
    set it would rotate every layer with the default tables, silently."""
    from tandem.kernels.errors import UnsupportedModelError
    from tandem.runtime.families import parse_config
    from tandem.runtime.synth import tiny_config

    raw = tiny_config("qwen3_moe") | {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                             "rope_theta": 1e6},
                                                          "sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 1e4}}}
    with pytest.raises(UnsupportedModelError, match="per kind of layer"):
        parse_config(raw, "config.json")


def test_gemma4_global_layers_read_alike_from_either_form() -> None:
    """The published configs name the global layers' head size and key/value heads (`global_head_dim`,
    `num_global_key_value_heads`); transformers saves them per layer (`per_layer_config`): the same model."""
    published = parse_config(tiny_config("gemma4_text"), "config.json")[1]
    saved = tiny_config("gemma4_text", per_layer_config={"1": {"head_dim": 32, "num_key_value_heads": 1}})
    del saved["global_head_dim"], saved["num_global_key_value_heads"]
    assert parse_config(saved, "config.json")[1] == published
    assert (published.head_size(0), published.kv_heads(0), published.head_size(1), published.kv_heads(1)) == \
        (16, 2, 32, 1)
