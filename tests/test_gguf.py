"""GGUF files as models: every MoE architecture Tandem reads, written as llama.cpp's converter writes them
(tests/ggufs.py), runs exactly as the checkpoint it came from; quantized tensors are read as their dequantized
values; split files open from any part; what cannot be read is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tandem.app.cli.main import main
from tandem.kernels.errors import CheckpointError, UnsupportedModelError
from tandem.kernels.quant import QuantizedMatrix
from tandem.runtime.accelerator import EmulatedAccelerator
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.dispatch import OffloadOptions, Strategy
from tandem.runtime.engine import Engine
from tandem.runtime.loader import load_model
from tandem.runtime.model import ModelRun, MoEModel
from tandem.runtime.sampling import SamplingParams
from tests.conftest import build_hf_checkpoint
from tests.ggufs import rewrite_gguf, write_gguf
from tests.test_dispatch import MULTI_TOKEN_FETCH

pytestmark = pytest.mark.isa  # F16 and float32 weights run on the kernels: again under every CPU feature mask

READ = ["mixtral", "mixtral-tied", "qwen3_moe", "qwen3_moe-dense-bias", "qwen2_moe-shared", "qwen2_moe-dense-noshared",
        "olmoe", "glm4_moe", "glm4_moe-grouped-qknorm", "glm4_moe-fullrope-nobias", "deepseek_v2", "deepseek_v2-dense2",
        "deepseek_v3", "gpt_oss", "dots1", "minimax_m2", "glm4_moe_lite",
        "ernie4_5_moe", "hunyuan_v1_moe", "granitemoe", "granitemoe-bias-tied", "granitemoeshared", "gemma4_text",
        "gemma4_text-vproj-bias", "gemma4_text-keqv-bias"]
IDS = torch.randint(0, 500, (1, 13), generator=torch.Generator().manual_seed(1))


def logits(model: Path) -> torch.Tensor:
    return load_model(model, dtype="fp32").model.forward(IDS, 0)


def generate(model: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["generate", "--model", str(model), "--prompt", "The quick brown fox", "--chat", "--max-new-tokens",
                 "8", "--dtype", "fp32", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("case", READ)
def test_a_gguf_file_runs_as_the_checkpoint_it_came_from(hf_checkpoints: dict[str, Path], tmp_path: Path, case: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    folder = hf_checkpoints[case]
    file = tmp_path / f"{case}.gguf"
    write_gguf(folder, file)
    assert torch.equal(logits(file), logits(folder))
    # the tokenizer and chat template come from the file's metadata: the same prompt, the same tokens
    ours, theirs = generate(file, capsys), generate(folder, capsys)
    assert ours["prompt_tokens"] == theirs["prompt_tokens"] and ours["tokens"] == theirs["tokens"]


@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_next-dense-bias", "qwen3_5_moe_text", "lfm2_moe",
                                  "granitemoehybrid"])
def test_hybrid_files_run_as_the_checkpoint_they_came_from(hf_checkpoints: dict[str, Path], tmp_path: Path,
                                                           case: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The hybrids as llama.cpp's converter writes them (tests/ggufs.py hybrid_tensor): Gated DeltaNet's tensors
    split and renamed, Qwen3.5's value heads reordered, norms stored plus one, A as -exp(A_log), LFM2's and Granite
    4.0-H's own names and kinds of layer per key/value heads. A read back through log(-A) may differ in its last bit:
    the logits within 1e-5, the tokens the same."""
    folder = hf_checkpoints[case]
    file = tmp_path / f"{case}.gguf"
    write_gguf(folder, file)
    assert (logits(file) - logits(folder)).abs().max().item() <= 1e-5
    ours, theirs = generate(file, capsys), generate(folder, capsys)
    assert ours["prompt_tokens"] == theirs["prompt_tokens"] and ours["tokens"] == theirs["tokens"]


def test_qwen3_next_blocks_pick_b_and_a_rows_as_floats_do(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Q8_0: ssm_ba's b and a rows picked apart as rows of blocks, as the kernels read them, give what the same
    file's dequantized values give."""
    folder = hf_checkpoints["qwen3_next"]
    held = write_gguf(folder, tmp_path / "q8.gguf", mix=dict.fromkeys(("ssm_ba", "attn_qkv", "attn_gate"), "Q8_0"))
    floats = tmp_path / "floats.gguf"
    write_gguf(folder, floats, given=held)  # (the blocks' values, as F32)
    assert (logits(tmp_path / "q8.gguf") - logits(floats)).abs().max().item() <= 1e-4


def test_qwen3_next_files_without_each_layers_kind_read_the_interval(tmp_path: Path) -> None:
    """A file without `attention.recurrent_layers` (older converters) has every fourth layer attend, as llama.cpp
    reads it."""
    from tests.conftest import build_hf_checkpoint

    folder = build_hf_checkpoint(tmp_path / "m", "qwen3_next", {
        "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    write_gguf(folder, tmp_path / "m.gguf", omit=("recurrent_layers",))
    assert (logits(tmp_path / "m.gguf") - logits(folder)).abs().max().item() <= 1e-5


def test_gated_attention_of_mixed_block_formats_runs_as_their_values(hf_checkpoints: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """attn_q, attn_k and attn_v in different block formats (as a Q4_K_M file mixes them): the gated q's rows split
    into queries and gates as blocks, giving what the same file's values as floats give."""
    folder = hf_checkpoints["qwen3_5_moe_text"]
    held = write_gguf(folder, tmp_path / "mix.gguf", mix={"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_0"})
    write_gguf(folder, tmp_path / "floats.gguf", given=held)
    assert (logits(tmp_path / "mix.gguf") - logits(tmp_path / "floats.gguf")).abs().max().item() <= 1e-4


@pytest.mark.parametrize("split_kv_b", [True, False])
def test_deepseek_files_with_yarn_and_either_kv_b_run_as_their_checkpoint(tmp_path: Path, split_kv_b: bool) -> None:
    """DeepSeek-V2 with q_lora, groups and YaRN, as llama.cpp writes it: kv_b_proj split into attn_k_b and attn_v_b
    (today's converter) or whole (older files). YaRN's mscale and mscale_all_dim equal, as the published models have
    them: a GGUF keeps only the one (llama.cpp computes with it alone)."""
    folder = build_hf_checkpoint(tmp_path / "hf", "deepseek_v2", {
        "q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
        "num_experts_per_tok": 3, "routed_scaling_factor": 1.7, "first_k_dense_replace": 1,
        "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}})
    write_gguf(folder, tmp_path / "m.gguf", split_kv_b=split_kv_b)
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert ("blk.0.attn_k_b.weight" in names) == split_kv_b and ("blk.0.attn_kv_b.weight" in names) != split_kv_b
    assert torch.equal(logits(tmp_path / "m.gguf"), logits(folder))


def test_glm_flash_files_run_as_their_checkpoint(tmp_path: Path) -> None:
    """GLM-4.7-Flash as llama.cpp writes it: its `deepseek2` architecture with sigmoid gating, read as the DeepSeek-V3
    family (the same computation), its multi-token-prediction layer counted in block_count and not run."""
    folder = build_hf_checkpoint(tmp_path / "hf", "glm4_moe_lite", {"num_hidden_layers": 3})
    write_gguf(folder, tmp_path / "m.gguf")
    layers = 3
    mtp = {f"blk.{layers}.nextn.eh_proj.weight": np.ones((64, 128), np.float32),
           f"blk.{layers}.attn_norm.weight": np.ones(64, np.float32)}
    rewrite_gguf(tmp_path / "m.gguf", tmp_path / "mtp.gguf", {
        "deepseek2.block_count": (layers + 1, gguf.GGUFValueType.UINT32),
        "deepseek2.nextn_predict_layers": (1, gguf.GGUFValueType.UINT32)}, mtp)
    for file in ("m.gguf", "mtp.gguf"):
        assert open_checkpoint(tmp_path / file).config.num_layers == layers
        assert torch.equal(logits(tmp_path / file), logits(folder))


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 16}])
def test_llama4_files_run_as_their_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              rope: dict | None) -> None:
    """Llama 4 as llama.cpp's converter writes it: the experts' gate_up split and every expert transposed, Llama 3's
    RoPE scaling as each pair's factor (rope_freqs), and what llama.cpp fixes for the architecture (chunks of 8192,
    every fourth layer global, the temperature's 8192 and 0.1, q/k norms below 128 experts) as the checkpoint sets
    it. The factors are the scaling's rounded to float32: within float32 rounding of the checkpoint, and the same
    tokens."""
    published = {"num_hidden_layers": 4, "no_rope_layer_interval": 4, "attention_chunk_size": 8192,
                 "floor_scale": 8192, "attn_scale": 0.1} | ({"rope_parameters": rope} if rope else {})
    folder = build_hf_checkpoint(tmp_path / "hf", "llama4_text", published)
    write_gguf(folder, tmp_path / "m.gguf")
    if rope is None:
        assert torch.equal(logits(tmp_path / "m.gguf"), logits(folder))
    else:
        want = logits(folder)
        torch.testing.assert_close(logits(tmp_path / "m.gguf"), want, rtol=0, atol=1e-5 * want.abs().max().item())
    ours, theirs = generate(tmp_path / "m.gguf", capsys), generate(folder, capsys)
    assert ours["tokens"] == theirs["tokens"]


@pytest.mark.parametrize("resident", [False, True])
def test_gemma4_experts_are_rows_of_one_gate_up_tensor_as_blocks(tmp_path: Path, resident: bool) -> None:
    """Gemma 4 as llama.cpp writes it keeps each layer's gate and up in one tensor (ffn_gate_up_exps [E, 2I, H],
    gate's rows first): as Q4_K_M blocks each expert's gate and up are its rows of it, read by the kernels as stored
    (views of the file, or of its RAM copy); the logits are those of an F32 file of the same values."""
    folder = build_hf_checkpoint(tmp_path / "hf", "gemma4_text", {
        "hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256, "head_dim": 64,
        "global_head_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 2})
    held = write_gguf(folder, tmp_path / "q.gguf", "Q4_K", mix={"ffn_down": "Q6_K"})
    write_gguf(folder, tmp_path / "f.gguf", "F32", given=held)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
    assert kinds["blk.0.ffn_gate_up_exps.weight"] == "Q4_K" and "blk.0.ffn_gate_exps.weight" not in kinds
    loaded = load_model(tmp_path / "q.gguf", dtype="fp32", resident=resident)
    experts = loaded.model.dispatcher.cpu_experts[0]
    assert {(e.kind, e.down.kind) for e in experts} == {("Q4_K", "Q6_K")}  # type: ignore[union-attr]
    want = logits(tmp_path / "f.gguf")
    torch.testing.assert_close(loaded.model.forward(IDS, 0), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_gemma4_files_tandem_cannot_run_are_refused_by_name(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A Gemma 4 file with per-layer input embeddings, shared keys and values, a head count per layer of the wrong
    length, layers of one kind with different heads, or RoPE factors other than the converter's (pairs that turn,
    then pairs that do not) is refused, saying what."""
    A = gguf.GGUFValueType.ARRAY
    U32 = gguf.GGUFValueType.UINT32
    write_gguf(hf_checkpoints["gemma4_text"], tmp_path / "g.gguf")
    cases = [({"gemma4.embedding_length_per_layer_input": (16, U32)}, {}, "per-layer input embeddings"),
             ({"gemma4.attention.shared_kv_layers": (1, U32)}, {}, "share earlier layers' keys"),
             ({"gemma4.attention.head_count_kv": ([2, 1, 1], A)}, {}, "one per layer"),
             ({"gemma4.attention.sliding_window_pattern": ([True, True], A)}, {}, "different shapes"),
             ({}, {"rope_freqs.weight": np.array([1.0, 2.0] + [1e30] * 14, dtype=np.float32)}, "rope_freqs")]
    for k, (meta, tensors, needle) in enumerate(cases):
        rewrite_gguf(tmp_path / "g.gguf", tmp_path / f"bad{k}.gguf", meta=meta, tensors=tensors)
        with pytest.raises(CheckpointError, match=needle):
            open_checkpoint(tmp_path / f"bad{k}.gguf")


def test_a_file_whose_routers_disagree_with_its_metadata_is_refused(hf_checkpoints: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    """A layer the metadata gives experts without its router (a damaged or edited file) is refused by name before
    anything reads it, in a family whose dense layers the metadata places (Llama 4's interleave step) as in one whose
    layers all have experts."""
    for case, layer in (("llama4_text", 1), ("mixtral", 0)):
        write_gguf(hf_checkpoints[case], tmp_path / f"{case}.gguf")
        rewrite_gguf(tmp_path / f"{case}.gguf", tmp_path / f"{case}-cut.gguf",
                     tensors={f"blk.{layer}.ffn_gate_inp.weight": None})
        with pytest.raises(CheckpointError, match=f"experts in layers .*{layer}.* but the file holds routers"):
            open_checkpoint(tmp_path / f"{case}-cut.gguf")


def test_pairwise_rope_reorders_blocks_as_it_reorders_floats(tmp_path: Path) -> None:
    """ERNIE's q and k rows, reordered at load for its pairwise RoPE (attention.halves_order): as GGUF blocks the
    kernels read, they give what the same values dequantized give through torch."""
    folder = build_hf_checkpoint(tmp_path / "hf", "ernie4_5_moe", {"hidden_size": 128, "num_attention_heads": 4,
                                                                  "num_key_value_heads": 2, "head_dim": 32,
                                                                  "moe_intermediate_size": 64})
    for name, mix in (("q8", None), ("mixed", {"attn_k": "Q4_0"})):  # q, k and v one matrix, or side by side
        write_gguf(folder, tmp_path / f"{name}.gguf", qtype="Q8_0", mix=mix)
        blocks = load_model(tmp_path / f"{name}.gguf", dtype="fp32").model
        floats = load_model(tmp_path / f"{name}.gguf", dtype="fp32", use_kernel=False).model
        assert isinstance(blocks.layers[0].attn.qkv, list if mix else QuantizedMatrix)
        assert isinstance(floats.layers[0].attn.qkv, torch.Tensor)
        assert torch.allclose(blocks.forward(IDS, 0), floats.forward(IDS, 0), atol=1e-4)


def test_gpt_oss_mxfp4_experts_run_on_the_kernels(tmp_path: Path) -> None:
    """gpt-oss with MXFP4 experts, as llama.cpp writes it (ffn_{gate,up,down}_exps and their biases): read as the
    published checkpoint stores its experts, they run on the kernels 4-bit; the same logits as an F32 file of their
    values (float32 rounding)."""
    from tandem.runtime.moe import MXFP4Expert

    folder = build_hf_checkpoint(tmp_path / "hf", "gpt_oss", {"intermediate_size": 64, "hidden_size": 64})
    held = write_gguf(folder, tmp_path / "q.gguf", "MXFP4")
    write_gguf(folder, tmp_path / "f.gguf", "F32", given=held)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
    assert kinds["blk.0.ffn_gate_exps.weight"] == kinds["blk.0.ffn_down_exps.weight"] == "MXFP4"
    loaded = load_model(tmp_path / "q.gguf", dtype="fp32")
    assert loaded.checkpoint.config.experts_mxfp4
    assert all(isinstance(e, MXFP4Expert) for e in loaded.model.layers[0].ffn.experts)  # type: ignore[union-attr]
    want = logits(tmp_path / "f.gguf")
    torch.testing.assert_close(loaded.model.forward(IDS, 0), want, rtol=0, atol=1e-5 * want.abs().max().item())


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-MoE whose rows are whole K-quant blocks (256 values)."""
    return build_hf_checkpoint(tmp_path_factory.mktemp("wide") / "hf", "qwen3_moe", {
        "hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2})


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "F16"])
@pytest.mark.parametrize("resident", [False, True])
def test_quantized_tensors_run_as_stored_and_match_their_dequantized_values(wide: Path, tmp_path: Path, qtype: str,
                                                                            resident: bool) -> None:
    """The same weights as an F32 file of their dequantized values: the block formats stay blocks, views of the file
    (experts, attention, lm_head), and run on the kernels' block paths, whose float32 sums over the same values are
    grouped differently: equal to float32 rounding, within 1e-5 of the logits' largest magnitude (the K formats'
    random scales make it 150-360 here; measured: at most 2.3e-6 of it). F16 experts run on the kernels' F16 path
    likewise.
    Resident, the experts are one RAM copy of the file's bytes; else the file's memory map itself."""
    held = write_gguf(wide, tmp_path / "q.gguf", qtype)
    write_gguf(wide, tmp_path / "f.gguf", "F32", given=held)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
    assert qtype in kinds  # the experts, attention and lm_head are stored so
    loaded = load_model(tmp_path / "q.gguf", dtype="fp32", resident=resident)
    got, want = loaded.model.forward(IDS, 0), logits(tmp_path / "f.gguf")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    if qtype == "F16":
        return
    model = loaded.model
    experts = next(iter(model.dispatcher.cpu_experts.values()))
    assert {e.kind for e in experts} == {qtype}  # the kernels read the blocks themselves
    attn = model.layers[0].attn
    assert isinstance(attn.o, QuantizedMatrix) and attn.o.kind == qtype
    assert isinstance(model.lm_head, QuantizedMatrix) and model.lm_head.kind == qtype
    mapped = loaded.checkpoint.shards[0].readers[0].data  # the file's memory map
    lo, hi = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    in_file = [lo <= m.data.data_ptr() < hi for e in experts for m in (e.gate, e.up, e.down)]  # type: ignore[union-attr]
    assert all(in_file) if not resident else not any(in_file)


def test_mixed_formats_run_as_stored(wide: Path, tmp_path: Path) -> None:
    """Q4_K_M's mix: Q4_K, with the experts' down matrices and attention's v in Q6_K. A layer's experts run with down
    in another format than gate and up; q, k and v side by side, each in its own."""
    held = write_gguf(wide, tmp_path / "q.gguf", "Q4_K", mix={"ffn_down": "Q6_K", "attn_v": "Q6_K"})
    write_gguf(wide, tmp_path / "f.gguf", "F32", given=held)
    loaded = load_model(tmp_path / "q.gguf", dtype="fp32")
    got, want = loaded.model.forward(IDS, 0), logits(tmp_path / "f.gguf")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    experts = next(iter(loaded.model.dispatcher.cpu_experts.values()))
    assert {(e.kind, e.down_kind) for e in experts} == {("Q4_K", "Q6_K")}
    assert [m.kind for m in loaded.model.layers[0].attn.qkv] == ["Q4_K", "Q4_K", "Q6_K"]  # type: ignore[union-attr]
    for tokens in (1, 3):  # one token (the four-row kernels) and several, against the dequantized experts
        x = torch.randn(tokens, 256)
        for e in experts[:2]:
            g, u, d = e.dense(torch.float64)
            ref = torch.nn.functional.linear(torch.nn.functional.silu(x.double() @ g.T) * (x.double() @ u.T), d)
            with torch.inference_mode():  # (the model's buffers were made so)
                y = e(x).double()
            torch.testing.assert_close(y, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("strategy", list(Strategy))
def test_the_accelerator_holds_experts_as_blocks(wide: Path, tmp_path: Path, strategy: Strategy) -> None:
    """Accelerator slots keep a Q4_K_M file's experts as its blocks (dequantized on use): 3.1 times the slots a bf16
    expert would get in the same memory (Q6_K down matrices; 3.6 with Q4_K alone); static, cached, fetched and
    CPU-served experts give the CPU-only logits and tokens."""
    write_gguf(wide, tmp_path / "q.gguf", "Q4_K", mix={"ffn_down": "Q6_K"})
    ckpt = open_checkpoint(tmp_path / "q.gguf")
    cfg = ckpt.config
    prompt = torch.randint(3, 500, (1, 5), generator=torch.Generator().manual_seed(5))

    def build(accel: EmulatedAccelerator | None, policy: OffloadOptions | None = None) -> Engine:
        return Engine(MoEModel.from_checkpoint(ckpt, ModelRun(torch.bfloat16, 64, 1), accel, policy), ())

    cpu = build(None)
    ref_logits = cpu.model.forward(prompt, 0)
    ref_tokens = list(cpu.generate(prompt[0].tolist(), SamplingParams(max_new_tokens=6)))
    budget = 12 << 20
    engine = build(EmulatedAccelerator(budget),
                   OffloadOptions(strategy, cache_ways=2, static=((0, 1),), cost=MULTI_TOKEN_FETCH))
    try:
        slot = engine.model.dispatcher.scratch
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        assert [t.dtype for t in slot.tensors()] == [torch.uint8] * 3
        slot_bytes = sum(t.numel() for t in slot.tensors())
        assert slot_bytes == (2 * i * h // 256 * 144 + h * i // 256 * 210)  # Q4_K gate and up, Q6_K down
        assert 3 * h * i * 2 / slot_bytes > 3.0  # bf16's bytes over these
        assert (engine.model.forward(prompt, 0) - ref_logits).abs().max().item() <= 0.02 * ref_logits.abs().max()
        tokens = list(engine.generate(prompt[0].tolist(), SamplingParams(max_new_tokens=6)))
        gpu, _, fetched = engine.model.dispatcher.request_stats().per_layer.sum(0)
    finally:
        engine.model.close()
    assert tokens == ref_tokens
    if strategy is not Strategy.CPU:
        assert gpu > 0


def test_a_split_model_opens_from_any_part_and_a_missing_part_is_named(mixtral_dir: Path, tmp_path: Path) -> None:
    write_gguf(mixtral_dir, tmp_path / "m.gguf", split_max_tensors=8)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 2
    assert torch.equal(logits(parts[1]), logits(mixtral_dir))
    parts[-1].unlink()
    with pytest.raises(CheckpointError, match=f"{parts[-1].name} is missing"):
        open_checkpoint(parts[0])


def test_files_tandem_cannot_read_are_refused_by_name(wide: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    write_gguf(wide, tmp_path / "q2.gguf", "Q2_K")
    with pytest.raises(UnsupportedModelError, match="stored as Q2_K, a GGUF type Tandem does not read yet"):
        open_checkpoint(tmp_path / "q2.gguf")
    for arch, experts, says in (("bert", 0, "architecture 'bert' is not one Tandem reads"),
                                ("llama", 0, "dense llama model")):
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_block_count(1)
        writer.add_expert_count(experts)
        writer.add_tensor("token_embd.weight", np.zeros((32, 8), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        capsys.readouterr()
        assert main(["generate", "--model", str(path), "--prompt", "hi"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and "Traceback" not in err


def test_experts_partly_blocks_and_partly_floats_are_refused_clearly(wide: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """gate and up as Q8_0 and down as F32 (a width that is no whole number of blocks, written as floats): the
    kernels take one or the other, and the CLI says which layer and what to do instead of failing later."""
    write_gguf(wide, tmp_path / "mixed.gguf", "Q8_0", mix={"ffn_down_exps": "F32"})
    with pytest.raises(UnsupportedModelError, match="layer 0's experts mix block formats and float tensors"):
        open_checkpoint(tmp_path / "mixed.gguf")
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "mixed.gguf"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "llama-quantize" in err and "Traceback" not in err


def test_the_memory_estimate_counts_blocks_as_stored(wide: Path, tmp_path: Path) -> None:
    """Q8_0 experts stay in the memory map, or (resident) take their file bytes in RAM; dense matrices count their
    blocks (34 bytes a 32 values), not float32 copies."""
    from tandem.kernels.experts import CpuOptions
    from tandem.runtime.memory import estimate_memory
    from tandem.runtime.weights import dense_tensors

    write_gguf(wide, tmp_path / "q.gguf", "Q8_0")
    write_gguf(wide, tmp_path / "f.gguf", "F32")
    ckpt = {kind: open_checkpoint(tmp_path / f"{kind}.gguf") for kind in ("q", "f")}
    ram = {(kind, resident): estimate_memory(ckpt[kind], torch.float32, 64, cpu=CpuOptions(resident=resident)).weights
           for kind in ("q", "f") for resident in (False, True)}
    cfg = ckpt["q"].config
    experts = cfg.num_moe_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 34 // 32
    assert ram["q", True] - ram["q", False] == experts
    blocks = [ckpt["q"].blocks(n) for n in dense_tensors(cfg, ckpt["q"].spec)]
    saved = sum(m.data.shape[0] * m.cols * 4 - m.nbytes for m in blocks if m is not None)
    assert saved > 0 and ram["f", False] - ram["q", False] == saved


def test_the_tuner_and_planner_count_blocks(wide: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's expert bytes are the file's blocks: in the same accelerator memory, a Q4_K_M file's plan
    holds about three times the experts of a bf16 one; the tuner measures experts of those formats."""
    from tandem.autotune.plan import ModelShape
    from tandem.kernels.experts import CpuExecutor

    write_gguf(wide, tmp_path / "q.gguf", "Q4_K", mix={"ffn_down": "Q6_K"})
    write_gguf(wide, tmp_path / "f.gguf", "F32")
    cfg = open_checkpoint(tmp_path / "q.gguf").config
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    shape = ModelShape.from_checkpoint(open_checkpoint(tmp_path / "q.gguf"))
    assert shape.expert_quant == "Q4_K/Q6_K" and shape.expert_bytes == 2 * h * i // 256 * 144 + h * i // 256 * 210
    assert ModelShape.from_checkpoint(open_checkpoint(tmp_path / "f.gguf")).expert_bytes == 3 * h * i * 2
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"cores": 8, "cpu_threads": {"8": {"expert_ms": 1.0, "per_token_ms": 0.5}},
                              "gpu": {"expert_ms": 0.05, "h2d_gbps": 25.0,
                                      "vram_bytes_for_experts": 4 * 3 * h * i * 2}}))  # 4 bf16 experts
    slots = {}
    for kind in ("q", "f"):
        assert main(["plan", "--hardware", str(hw), "--model", str(tmp_path / f"{kind}.gguf"), "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)["plan"]
        slots[kind] = plan["cache"]["indexes"] * plan["cache"]["ways"] + plan["static_experts"]
    assert slots["f"] <= 4 and slots["q"] >= 3 * slots["f"] > 0
    measured: list[tuple[str, str]] = []
    prepare = CpuExecutor.prepare_quantized
    monkeypatch.setattr(CpuExecutor, "prepare_quantized",
                        lambda self, *a, **k: measured.append((a[0].kind, a[2].kind)) or prepare(self, *a, **k))
    assert main(["autotune", "--model", str(tmp_path / "q.gguf"), "--quick", "--dtype", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted_tok_s"] > 0
    assert set(measured) == {("Q4_K", "Q6_K")}
    assert len(measured) > cfg.num_moe_layers * cfg.num_experts  # the model's, and the tuner's own
