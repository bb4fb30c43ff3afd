"""Shared fixtures: tiny random checkpoints built with transformers' `save_pretrained`, offline tokenizers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# OpenMP threads that wait at a barrier sleep instead of spinning, here and in every command a test starts: on a
# machine whose cores other jobs share, a spinning waiter burns the time slice its partner needs (the suite ran
# several times slower with a second run beside it). Read once, when torch loads OpenMP (the kernels share it):
# set before torch is imported. No test measures speed.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels.isa import masked_features, torch_isa_environment  # noqa: E402
from tandem.runtime.synth import tiny_config, write_tokenizer  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    # A run under TANDEM_CPU_FEATURES caps torch's kernels too, as the command line does (before torch's first op).
    for name, value in torch_isa_environment(masked_features()).items():
        os.environ.setdefault(name, value)
    # The suite is the CPU's: on a machine with a GPU, `--accelerator auto` (every command's default) would take it
    # and every expectation of a CPU-only run would be off. Only a run that selects the `cuda` tests (`pytest -m
    # cuda`) sees the GPU; hidden before torch first looks for one.
    if "cuda" not in (config.getoption("markexpr", "") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Each case: (id, family, overrides). Together they cover shared expert on/off, norm_topk_prob both
# ways, dense layers (decoder_sparse_step / mlp_only_layers), tied embeddings, biases and q/k clipping.
# gpt-oss's quantization_config as published
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("mixtral", "mixtral", {}),
    ("mixtral-tied", "mixtral", {"tie_word_embeddings": True, "num_experts_per_tok": 3}),
    ("qwen2_moe-shared", "qwen2_moe", {}),
    ("qwen2_moe-dense-noshared", "qwen2_moe", {"num_hidden_layers": 3, "decoder_sparse_step": 2,
                                               "shared_expert_intermediate_size": 0, "norm_topk_prob": True}),
    ("qwen3_moe", "qwen3_moe", {}),
    ("qwen3_moe-dense-bias", "qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": False,
                                          "attention_bias": True, "tie_word_embeddings": True}),
    ("olmoe", "olmoe", {}),
    ("olmoe-clip-norm", "olmoe", {"clip_qkv": 0.5, "norm_topk_prob": True}),
    # sliding windows shorter than the tests' prompts (13 tokens) and answers: every layer, or some (layer_types)
    ("mixtral-sliding", "mixtral", {"sliding_window": 4}),
    ("qwen3_moe-sliding", "qwen3_moe", {"use_sliding_window": True, "sliding_window": 5}),
    ("qwen2_moe-sliding", "qwen2_moe", {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 3,
                                        "max_window_layers": 2}),
    # PhiMoE: LayerNorm with biases, sparsemixer routing (router_jitter_noise its threshold), attention and lm_head
    # biases (the tiny config has both, as Phi-3.5-MoE), LongRoPE. The LongRoPE case's pretraining length (16) lies
    # past the logits test's 13-token prompt, so its decode crosses it (transformers then scales cos/sin by
    # long_mscale), and within the CLI test's 32 new tokens, so generation runs the whole sequence again there.
    ("phimoe", "phimoe", {}),
    ("phimoe-longrope-nobias", "phimoe", {
        "attention_bias": False, "lm_head_bias": False, "router_jitter_noise": 0.2,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0 + 0.15 * i for i in range(8)],  # head dim 16: 8 frequencies
                            "long_factor": [2.0 + 0.5 * i for i in range(8)],
                            "short_mscale": 1.1, "long_mscale": 1.4, "original_max_position_embeddings": 16}}),
    # DeepSeek-V2: plain q_proj, greedy, one dense layer / q_lora_rank, group-limited routing (topk_group < n_group),
    # YaRN (mscale != mscale_all_dim: both the cos/sin and the softmax scale), a routed scaling factor, all layers
    # MoE, norm_topk_prob set (transformers ignores it for V2)
    ("deepseek_v2", "deepseek_v2", {}),
    ("deepseek_v2-qlora-group-yarn", "deepseek_v2", {
        "q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
        "num_experts_per_tok": 3, "routed_scaling_factor": 1.7, "norm_topk_prob": True, "first_k_dense_replace": 0,
        "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}}),
    ("deepseek_v2-dense2", "deepseek_v2", {"num_hidden_layers": 3, "first_k_dense_replace": 2,
                                           "tie_word_embeddings": True}),
    # DeepSeek-V3: q_lora_rank, group-limited by the best two (topk_group < n_group), norm_topk_prob, a routed
    # scaling factor, a nonzero correction bias (every case) / plain q_proj, one group, no renormalisation, YaRN,
    # RoPE not interleaved, all layers MoE
    ("deepseek_v3", "deepseek_v3", {}),
    ("deepseek_v3-noq-yarn-nonorm", "deepseek_v3", {
        "q_lora_rank": None, "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.3,
        "rope_interleave": False, "first_k_dense_replace": 0,
        "rope_scaling": {"rope_type": "yarn", "factor": 6.0, "original_max_position_embeddings": 64, "beta_fast": 16,
                         "beta_slow": 2, "mscale": 0.9, "mscale_all_dim": 0.6}}),
    # glm4_moe: like GLM-4.5-Air (a dense first layer, one shared expert, q/k/v biases, half of each head rotated);
    # then every routing and attention knob turned: per-head q/k norm, 4 groups of which 2 compete, no
    # renormalisation, a routed scaling, two dense layers, two shared experts; then the whole head rotated.
    ("glm4_moe", "glm4_moe", {}),
    ("glm4_moe-grouped-qknorm", "glm4_moe", {
        "num_hidden_layers": 4, "use_qk_norm": True, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
        "norm_topk_prob": False, "routed_scaling_factor": 2.5, "first_k_dense_replace": 2, "n_shared_experts": 2,
        "partial_rotary_factor": 0.5}),
    ("glm4_moe-fullrope-nobias", "glm4_moe", {"partial_rotary_factor": 1.0, "attention_bias": False,
                                              "first_k_dense_replace": 0, "tie_word_embeddings": True}),
    # dots1: like dots.llm1 (Qwen3's per-head q/k norm, a dense first layer, two shared experts, normalised sigmoid
    # routing scaled by 2.5); then 4 groups of which 2 compete, no renormalisation, q/k/v/o biases, sliding layers
    # (layer_types) with a window shorter than the prompts, one shared expert, every layer MoE
    ("dots1", "dots1", {}),
    ("dots1-grouped-sliding-bias", "dots1", {
        "num_hidden_layers": 3, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "norm_topk_prob": False,
        "routed_scaling_factor": 1.7, "attention_bias": True, "sliding_window": 4, "n_shared_experts": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "first_k_dense_replace": 0}),
    # glm4_moe_lite: DeepSeek-V3's latent attention (q_lora_rank, interleaved RoPE) under GLM-4.5's routing, the first
    # layer dense; then groups (2 of 4 compete), no renormalisation, RoPE not interleaved, dense layers by
    # mlp_layer_types (the first and the third), two shared experts
    ("glm4_moe_lite", "glm4_moe_lite", {}),
    ("glm4_moe_lite-grouped-types", "glm4_moe_lite", {
        "num_hidden_layers": 4, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "norm_topk_prob": False,
        "rope_interleave": False, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "n_shared_experts": 2}),
    # ernie4_5_moe: RoPE over adjacent pairs, softmax routing with the moe_statics correction bias, two shared
    # experts, the first layer dense; then MoE every other layer up to the third of four (a dense one after the
    # range), one shared expert, top-3, tied embeddings
    ("ernie4_5_moe", "ernie4_5_moe", {}),
    ("ernie4_5_moe-interval-tied", "ernie4_5_moe", {
        "num_hidden_layers": 4, "moe_layer_start_index": 0, "moe_layer_end_index": 2, "moe_layer_interval": 2,
        "moe_num_shared_experts": 1, "moe_k": 3, "tie_word_embeddings": True}),
    # hunyuan_v1_moe: per-head q/k RMSNorm after RoPE, softmax top-k, a shared SwiGLU; then NTK-alpha RoPE, q/k/v/o
    # biases, top-3, tied embeddings
    ("hunyuan_v1_moe", "hunyuan_v1_moe", {}),
    ("hunyuan_v1_moe-alpha-bias", "hunyuan_v1_moe", {
        "num_hidden_layers": 3, "attention_bias": True, "moe_topk": 3, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "dynamic", "alpha": 50.0, "factor": 1.0, "rope_theta": 10000.0}}),
    # granitemoe: the muP multipliers as granite-3.1-3b-a800m has them, top-k logits then softmax, experts stored
    # stacked; then q/k/v/o biases, tied embeddings, top-3; granitemoeshared: a shared SwiGLU beside the experts
    ("granitemoe", "granitemoe", {}),
    ("granitemoe-bias-tied", "granitemoe", {"num_hidden_layers": 3, "attention_bias": True,
                                            "tie_word_embeddings": True, "num_experts_per_tok": 3}),
    ("granitemoeshared", "granitemoeshared", {}),
    # minimax_m2: q/k RMSNorm over all heads, half of each head rotated, sigmoid routing with a correction bias beside
    # the router (always renormalised); then the whole head rotated, top-3, tied embeddings
    ("minimax_m2", "minimax_m2", {}),
    ("minimax_m2-fullrope-tied", "minimax_m2", {"num_hidden_layers": 3, "rotary_dim": 32, "num_experts_per_tok": 3,
                                                "tie_word_embeddings": True}),
    # llama4_text: chunks of 4 with the second layer global (no RoPE, its queries' temperature rising every 4
    # positions), L2 q/k norms, pairwise RoPE, one expert a token taking its input scaled, a shared expert, the first
    # layer dense; then Llama 3's RoPE scaling, layers without RoPE and with experts listed, no q/k norm, no
    # temperature, q/k/v/o biases
    ("llama4_text", "llama4_text", {}),
    ("llama4_text-llama3-lists", "llama4_text", {
        "num_hidden_layers": 4, "no_rope_layers": [1, 0, 1, 1], "moe_layers": [0, 1, 3], "use_qk_norm": False,
        "attn_temperature_tuning": False, "attention_bias": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    # gemma4_text: a sliding layer (window 4, shorter than the prompts) then a global one with its own head size, one
    # key/value head, values from k_proj and proportional RoPE; GeGLU MLP and experts side by side, soft-capped
    # logits, tied embeddings, layer scalars; then v_proj in the global layers with the sliding layers' heads, q/k/v/o
    # biases, top-3, other RoPE on both kinds, no soft-cap, two global layers; then values from k_proj with its bias
    ("gemma4_text", "gemma4_text", {}),
    ("gemma4_text-vproj-bias", "gemma4_text", {
        "num_hidden_layers": 4, "attention_k_eq_v": False, "attention_bias": True, "top_k_experts": 3,
        "final_logit_softcapping": None, "sliding_window": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                               "rope_theta": 20000.0}}}),
    ("gemma4_text-keqv-bias", "gemma4_text", {"num_hidden_layers": 3, "attention_bias": True,
                                              "layer_types": ["full_attention", "sliding_attention",
                                                              "full_attention"]}),
    # gpt-oss: attention sinks (nonzero), q/k/v/o, router and expert biases, layer_types alternating (GptOssConfig's
    # default) with a window shorter than the prompts, YaRN as published (truncate false), alpha 1.702, a limit
    # no value reaches / 3 layers, other YaRN parameters (truncated), another alpha, a limit that clamps
    ("gpt_oss", "gpt_oss", {}),
    ("gpt_oss-yarn-clamp", "gpt_oss", {
        "num_hidden_layers": 3, "sliding_window": 3, "swiglu_alpha": 1.2, "swiglu_limit": 0.25,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 20000.0, "factor": 8.0, "beta_fast": 16.0,
                            "beta_slow": 2.0, "original_max_position_embeddings": 64, "truncate": True}}),
    # gpt-oss as published: MXFP4 experts (transformers dequantizes them on the CPU) / a limit that clamps and a
    # wider expert
    ("gpt_oss-mxfp4", "gpt_oss", {"intermediate_size": 64, "quantization_config": MXFP4}),
    ("gpt_oss-mxfp4-clamp", "gpt_oss", {"intermediate_size": 96, "num_hidden_layers": 3, "swiglu_limit": 0.25,
                                        "swiglu_alpha": 1.5, "quantization_config": MXFP4}),
    # qwen3_next: Gated DeltaNet (2 value heads per key head, a convolution of 4) then gated attention with a quarter
    # of each head rotated, zero-centred norms, a gated shared expert; then one value head per key head of another
    # size, a dense layer, attention first and between, q/k/v/o biases, a convolution of 2, tied embeddings
    ("qwen3_next", "qwen3_next", {}),
    ("qwen3_next-dense-bias", "qwen3_next", {
        "num_hidden_layers": 4, "mlp_only_layers": [2], "attention_bias": True, "linear_num_value_heads": 2,
        "linear_value_head_dim": 24, "linear_conv_kernel_dim": 2, "tie_word_embeddings": True,
        "layer_types": ["full_attention", "linear_attention", "full_attention", "linear_attention"]}),
    # qwen3_5_moe_text: Qwen3.5's projections (in_proj_qkv, _z, _b, _a) and every layer routed
    ("qwen3_5_moe_text", "qwen3_5_moe_text", {}),
    # lfm2_moe: a short convolution then attention with per-head q/k norms, the first layer dense, sigmoid routing
    # with an expert bias; then biases in the convolutions, a wider one, attention first, no dense layer, no expert
    # bias, a routed scaling, top-3, untied embeddings
    ("lfm2_moe", "lfm2_moe", {}),
    ("lfm2_moe-bias-scaled", "lfm2_moe", {
        "num_hidden_layers": 3, "conv_bias": True, "conv_L_cache": 4, "num_dense_layers": 0, "use_expert_bias": False,
        "routed_scaling_factor": 1.5, "num_experts_per_tok": 3, "tie_word_embeddings": False,
        "layer_types": ["full_attention", "conv", "conv"]}),
    # granitemoehybrid: Mamba-2 (2 groups of 4 heads, a state of 16, a convolution with its bias) then attention
    # without RoPE, a shared SwiGLU, the muP multipliers; then attention first with RoPE and q/k/v/o biases, one group,
    # in_proj and out_proj biases, no convolution bias, a state of 8, tied embeddings
    ("granitemoehybrid", "granitemoehybrid", {}),
    ("granitemoehybrid-rope-bias", "granitemoehybrid", {
        "num_hidden_layers": 3, "position_embedding_type": "rope", "attention_bias": True, "mamba_n_groups": 1,
        "mamba_proj_bias": True, "mamba_conv_bias": False, "mamba_d_state": 8, "tie_word_embeddings": True,
        "layer_types": ["attention", "mamba", "mamba"]}),
]


def build_hf_checkpoint(out: Path, family: str, overrides: dict[str, Any], seed: int = 0) -> Path:
    """Save a random transformers model (fp32) plus an offline-trained tokenizer into `out`. With a
    `quantization_config` of MXFP4 (gpt-oss), its experts are then stored as published: `*_blocks` and `*_scales`."""
    import transformers

    overrides = dict(overrides)
    quantization = overrides.pop("quantization_config", None)
    raw = tiny_config(family, **overrides)
    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger, non-zero weights everywhere: routers must not tie
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias: zeros when built, some negative here
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
            if name.endswith("layer_scalar"):  # Gemma 4's: ones when built
                b.copy_(0.5 + torch.rand_like(b))
    model.save_pretrained(out)
    write_tokenizer(out, raw["vocab_size"])
    if quantization is not None:
        store_experts_as_mxfp4(out, quantization)
    return out


def store_experts_as_mxfp4(folder: Path, quantization: dict[str, Any]) -> None:
    """gpt-oss's fused experts ([E, in, out] float) rewritten as published MXFP4: per expert, the transposed matrix
    ([out, in]) in blocks of 32 along `in`, and config.json's quantization_config saying so."""
    from safetensors.torch import load_file, save_file

    from tandem.kernels.quant import mxfp4_to_pairs, quantize_mxfp4

    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        fused = tensors.pop(name)  # [E, in, out]
        stored = [mxfp4_to_pairs(quantize_mxfp4(fused[e].t())) for e in range(fused.shape[0])]
        tensors[f"{name}_blocks"] = torch.stack([b for b, _ in stored])  # [E, out, in / 32, 16]
        tensors[f"{name}_scales"] = torch.stack([s for _, s in stored])  # [E, out, in / 32]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    edit_config(folder, quantization_config=quantization)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {case_id: build_hf_checkpoint(root / case_id, fam, ov) for case_id, fam, ov in CASES}


@pytest.fixture
def mixtral_dir(hf_checkpoints: dict[str, Path]) -> Path:
    return hf_checkpoints["mixtral"]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.fixture(autouse=True)
def tandem_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Saved state (profiles, later conversations) goes to a fresh folder per test, never the user's."""
    home = tmp_path_factory.mktemp("tandem-home")
    monkeypatch.setenv("TANDEM_HOME", str(home))
    # other apps' model stores (the picker, `tandem models`): an empty home, never the user's
    monkeypatch.setenv("HOME", str(home / "user"))
    monkeypatch.setenv("OLLAMA_MODELS", str(home / "user" / ".ollama" / "models"))  # (not the system service's)
    for name in ("HF_HOME", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture
def cpu_features(monkeypatch: pytest.MonkeyPatch):
    """`cpu_features("-amx,...")`: from here to the end of the test, this process plays the masked CPU (the kernel
    library is told again after the test)."""
    from tandem.kernels.library import library

    def play(mask: str) -> None:  # on top of the mask the run itself may have
        monkeypatch.setenv("TANDEM_CPU_FEATURES", ",".join(filter(None, (os.environ.get("TANDEM_CPU_FEATURES"), mask))))
        library.cache_clear()
        library()

    yield play
    monkeypatch.undo()
    library.cache_clear()
    library()

