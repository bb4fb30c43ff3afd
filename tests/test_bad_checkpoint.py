"""A damaged or odd model folder ends in `error: <what and how to fix>` and exit status 2: config.json with wrong
types or impossible values, experts stored in mixed or unsupported dtypes, shard indexes that lead out of the folder,
unreadable tokenizer files and chat templates that would hang. Nothing crashes, hangs or reads outside the folder."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tandem.app.cli.main import main
from tandem.kernels.errors import CheckpointError
from tandem.runtime import chat_template
from tandem.runtime.safetensors_mmap import SafetensorsFile
from tandem.runtime.tokenizer import Tokenizer
from tests.conftest import copy_checkpoint, edit_config


def generate(capsys: pytest.CaptureFixture[str], folder: Path, *extra: str) -> tuple[int, str]:
    code = main(["generate", "--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2", "--no-profile",
                 *extra])
    return code, capsys.readouterr().err


def refused(capsys: pytest.CaptureFixture[str], folder: Path, *needles: str, extra: tuple[str, ...] = ()) -> str:
    code, err = generate(capsys, folder, *extra)
    assert code == 2, err
    assert err.splitlines()[-1].startswith("error: ") and "Traceback" not in err, err  # (after any progress lines)
    for needle in needles:
        assert needle in err, err
    return err


# -- config.json ------------------------------------------------------------------------------------------------------
BAD_CONFIGS: list[tuple[str, dict, str]] = [  # (case, changes, a word the error must hold)
    ("string eps", {"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
    ("zero heads", {"num_attention_heads": 0}, "num_attention_heads"),
    ("-1 layers", {"num_hidden_layers": -1}, "num_hidden_layers"),
    ("top-k 0", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ("NaN eps", {"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ("infinite rope theta", {"rope_theta": float("inf")}, "rope_theta"),
    ("NaN deep inside", {"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "rope_theta"),
    ("hidden size as a float", {"hidden_size": 64.0}, "hidden_size"),
    ("1e9 experts, a float", {"num_local_experts": 1e9}, "num_local_experts"),
    ("10**9 experts", {"num_local_experts": 10**9}, "num_local_experts"),
    ("4000 experts (within bounds, not in the files)", {"num_local_experts": 4000}, "does not match config.json"),
    ("top-k above the experts", {"num_experts_per_tok": 9}, "picks 9 experts"),
    ("heads not shared evenly", {"num_key_value_heads": 3}, "key/value heads"),
    ("a flag as a string", {"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ("eos as text", {"eos_token_id": "</s>"}, "eos_token_id"),
    ("negative bos", {"bos_token_id": -1}, "bos_token_id"),
    ("negative eps", {"rms_norm_eps": -1e-5}, "rms_norm_eps"),
    ("a boolean layer count", {"num_hidden_layers": True}, "num_hidden_layers"),
    ("huge vocabulary", {"vocab_size": 10**12}, "vocab_size"),
    ("context of zero", {"max_position_embeddings": 0}, "max_position_embeddings"),
]


MORE_CONFIGS: list[tuple[str, dict, str]] = [
    ("model_type a list", {"model_type": ["mixtral"]}, "not supported"),
    ("model_type an object", {"model_type": {"a": 1}}, "not supported"),
    ("rope_theta 10**400", {"rope_theta": 10**400}, "rope_theta"),
    ("rms_norm_eps 10**400", {"rms_norm_eps": 10**400}, "rms_norm_eps"),
    ("clip_qkv 1e308", {"clip_qkv": 1e308}, "clip_qkv"),
    ("a dense layer -1", {"mlp_only_layers": [-1]}, "mlp_only_layers"),
    ("a dense layer 10**30", {"mlp_only_layers": [10**30]}, "mlp_only_layers"),
    ("rope type a number", {"rope_scaling": {"type": 5}}, "rope_scaling"),
]


@pytest.mark.parametrize("case, changes, needle", BAD_CONFIGS + MORE_CONFIGS,
                         ids=[c[0] for c in BAD_CONFIGS + MORE_CONFIGS])
def test_bad_config_values_are_refused(mixtral_dir: Path, tmp_path: Path, capsys, case: str, changes: dict,
                                       needle: str) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    edit_config(folder, **changes)
    refused(capsys, folder, needle)


def _rope(factor: float) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}}


# glm4_moe's routing groups and partial rotary, against its tiny checkpoint (8 experts, top-2, head_dim 32)
GLM_CONFIGS: list[tuple[str, dict, str]] = [
    ("8 experts in 3 groups", {"n_group": 3}, "must be equal"),
    ("5 of 4 groups", {"n_group": 4, "topk_group": 5}, "topk_group 5"),
    ("groups of one expert", {"n_group": 8}, "two best"),
    ("top-3 from one group of 2", {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "top-k 3"),
    ("odd rotary dims", _rope(0.47), "even number"),
    ("no rotary dims", _rope(0.02), "partial_rotary_factor"),
    ("rotary factor above one", _rope(1.5), "partial_rotary_factor"),
    ("top-level rotary factor above one", {"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ("qk norm as a string", {"use_qk_norm": "yes"}, "use_qk_norm"),
    ("negative routed scaling", {"routed_scaling_factor": -1.0}, "routed_scaling_factor"),
    ("10**9 routed experts", {"n_routed_experts": 10**9}, "n_routed_experts"),
]


@pytest.mark.parametrize("case, changes, needle", GLM_CONFIGS, ids=[c[0] for c in GLM_CONFIGS])
def test_bad_glm4_moe_config_values_are_refused(hf_checkpoints: dict[str, Path], tmp_path: Path, capsys, case: str,
                                                changes: dict, needle: str) -> None:
    folder = copy_checkpoint(hf_checkpoints["glm4_moe"], tmp_path / "m")
    edit_config(folder, **changes)
    refused(capsys, folder, needle)


@pytest.mark.parametrize("changes, needle", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),  # it would run and give wrong tokens
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic' (config.json's rope_scaling)"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}},  # (Llama 3's now runs)
     "RoPE type 'linear' (config.json's rope_parameters)"),
], ids=["gelu", "dynamic rope_scaling", "linear rope_parameters"])
def test_what_the_decoder_does_not_compute_is_refused_by_name(mixtral_dir: Path, tmp_path: Path, capsys,
                                                              changes: dict, needle: str) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    edit_config(folder, **changes)
    refused(capsys, folder, needle)


def test_config_that_is_not_an_object(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / "config.json").write_text("[1, 2, 3]")
    refused(capsys, folder, "JSON object")


def test_plan_reads_a_bad_config_file_as_generate_does(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    config = tmp_path / "config.json"
    raw = json.loads((mixtral_dir / "config.json").read_text())
    config.write_text(json.dumps({**raw, "num_experts_per_tok": 99, "num_local_experts": 4}))
    hardware = tmp_path / "hw.json"
    hardware.write_text(json.dumps({"cores": 2, "cpu_bandwidth_gbps": 40, "cpu_gflops": 100}))
    code = main(["plan", "--hardware", str(hardware), "--model", str(config)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "picks 99 experts" in err, err


def test_null_values_take_the_familys_defaults(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    edit_config(folder, rms_norm_eps=None, sliding_window=None, head_dim=None)
    code, err = generate(capsys, folder)
    assert code == 0, err


# -- the weights' dtypes ----------------------------------------------------------------------------------------------
EXPERT = "model.layers.{layer}.block_sparse_moe.experts.{e}.{proj}.weight"  # Mixtral's names


def rewrite(folder: Path, change: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    """Re-save the folder's weights with `change(name, tensor)` applied to each."""
    shard = SafetensorsFile(folder / "model.safetensors")
    tensors = {n: change(n, shard.tensor(n).clone()) for n in shard.names()}
    del shard
    save_file(tensors, str(folder / "model.safetensors"))


def experts_of(match: Callable[[str], bool], dtype: torch.dtype) -> Callable[[str, torch.Tensor], torch.Tensor]:
    return lambda name, t: t.to(dtype) if ".experts." in name and match(name) else t


MIXED: list[tuple[str, Callable[[str, torch.Tensor], torch.Tensor]]] = [
    ("expert 0 float32, the rest bf16", experts_of(lambda n: ".experts.0." not in n, torch.bfloat16)),
    ("expert 0 bf16, the rest float32", experts_of(lambda n: ".experts.0." in n, torch.bfloat16)),
    ("one expert's gate bf16, its up and down float32", experts_of(
        lambda n: n == EXPERT.format(layer=1, e=2, proj="w1"), torch.bfloat16)),
    ("one layer fp16 beside bf16", lambda n, t: t.to(torch.float16 if ".layers.0.block_sparse_moe.experts.3." in n
                                                     else torch.bfloat16) if ".experts." in n else t),
]


@pytest.mark.parametrize("case, change", MIXED, ids=[m[0] for m in MIXED])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("resident", ["--resident", "--no-resident"])
def test_experts_of_mixed_dtypes_are_refused(hf_checkpoints: dict[str, Path], tmp_path: Path, capsys, case: str,
                                             change, dtype: str, resident: str) -> None:
    folder = copy_checkpoint(hf_checkpoints["mixtral"], tmp_path / "m")
    rewrite(folder, change)
    refused(capsys, folder, "more than one dtype", "save_pretrained", extra=("--dtype", dtype, resident))


@pytest.mark.parametrize("dtype, needle", [(torch.float64, "float64"), (torch.float8_e4m3fn, "8-bit float"),
                                           (torch.float8_e5m2, "8-bit float")])
def test_experts_in_an_unsupported_dtype_are_refused(mixtral_dir: Path, tmp_path: Path, capsys, dtype, needle) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    rewrite(folder, experts_of(lambda n: True, dtype))
    refused(capsys, folder, needle)


def test_experts_in_one_dtype_and_odd_dense_dtypes_still_run(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    # The control: uniform bf16 experts beside float64 and fp16 dense weights load and generate.
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    rewrite(folder, lambda n, t: t.to(torch.bfloat16) if ".experts." in n else
            t.to(torch.float64) if "norm" in n else t.to(torch.float16) if "self_attn" in n else t)
    code, err = generate(capsys, folder, "--dtype", "fp32")
    assert code == 0, err


# -- the shard index and the files it names ---------------------------------------------------------------------------
def write_index(folder: Path, value: object) -> None:
    names = SafetensorsFile(folder / "model.safetensors").names()
    index = {"weight_map": {n: (value if i == 0 else "model.safetensors") for i, n in enumerate(names)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("value", [7, None, ["model.safetensors"], "", "../other/model.safetensors",
                                   "sub/model.safetensors", ".."], ids=repr)
def test_index_naming_something_other_than_a_file_beside_it(mixtral_dir: Path, tmp_path: Path, capsys,
                                                             value: object) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    write_index(folder, value)
    refused(capsys, folder, "index may only name files beside it")


def test_index_naming_an_absolute_path_outside(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    other = copy_checkpoint(mixtral_dir, tmp_path / "other")
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    write_index(folder, str(other / "model.safetensors"))
    refused(capsys, folder, "index may only name files beside it")


def test_weights_file_that_is_a_folder(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    refused(capsys, folder, "model.safetensors", "folder")


def test_weights_file_that_links_to_itself(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    os.symlink("model.safetensors", folder / "model.safetensors")
    refused(capsys, folder, "model.safetensors")


# -- tokenizer files and chat templates -------------------------------------------------------------------------------
def test_tokenizer_config_that_is_not_utf8(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / "tokenizer_config.json").write_bytes(b'{"eos_token": "\xff\xfe"}')
    refused(capsys, folder, "tokenizer_config.json")


def test_tokenizer_config_that_is_not_an_object(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / "tokenizer_config.json").write_text('"just a string"')
    refused(capsys, folder, "tokenizer_config.json", "JSON object")


def test_chat_template_file_that_is_not_utf8_matters_only_with_chat(mixtral_dir: Path, tmp_path: Path,
                                                                    capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    code, err = generate(capsys, folder)
    assert code == 0, err
    refused(capsys, folder, "chat_template.jinja", extra=("--chat",))


RUNAWAY_TEMPLATES = [
    ("a range of 10**9", "{% for i in range(10**9) %}x{% endfor %}", "too big"),
    ("a text repeated 10**9 times", "{{ 'a' * 10**9 }}", "repeats"),
    ("repeated the other way round", "{{ 10**8 * 'ab' }}", "repeats"),
    ("a list repeated", "{{ ([1] * 10**9) | length }}", "repeats"),
    ("a huge power", "{{ 2 ** 100000000 }}", "power"),
    ("a tower of powers", "{{ (((10**60)**60)**60)**60 }}", "power"),
    # 100 KB a turn: the character bound stops it within ~170 turns, long before the time bound on any machine
    ("nested loops that print too much", "{% for i in range(99999) %}{% for j in range(99999) %}" + "x" * 100_000
     + "{% endfor %}{% endfor %}", "characters"),
    ("division by zero", "{{ 1 / 0 }}", "division"),
    ("an unknown filter", "{{ messages | shout }}", "shout"),
    ("deep recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "failed"),
]


@pytest.mark.parametrize("case, template, needle", RUNAWAY_TEMPLATES, ids=[t[0] for t in RUNAWAY_TEMPLATES])
def test_chat_templates_that_would_hang_or_crash_are_stopped(mixtral_dir: Path, case: str, template: str,
                                                             needle: str) -> None:
    tok = Tokenizer.from_folder(mixtral_dir)
    tok.chat_template = template
    with pytest.raises(CheckpointError, match="chat template") as err:
        tok.render_chat([{"role": "user", "content": "hi"}])
    assert needle in str(err.value)


def test_a_slow_template_is_stopped_in_time(mixtral_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "TEMPLATE_MAX_SECONDS", 0.2)
    tok = Tokenizer.from_folder(mixtral_dir)
    tok.chat_template = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}.{% endfor %}"
    with pytest.raises(CheckpointError, match="ran for more than"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_a_slow_template_through_the_command_line(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / "chat_template.jinja").write_text("{% for i in range(10**9) %}x{% endfor %}")
    refused(capsys, folder, "chat template", extra=("--chat",))


# -- generation_config.json, odd files in a metadata file's place -----------------------------------------------------
@pytest.mark.parametrize("eos", [["a"], 1e30, float("nan"), {"a": 1}, [[1]], True, -2], ids=repr)
def test_bad_eos_in_generation_config(mixtral_dir: Path, tmp_path: Path, capsys, eos: object) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    refused(capsys, folder, "generation_config.json", "eos_token_id")


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json"])
def test_json_nested_too_deeply(mixtral_dir: Path, tmp_path: Path, capsys, name: str) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / name).write_text(DEEP)
    refused(capsys, folder, name)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_metadata_file_that_is_not_a_regular_file(mixtral_dir: Path, tmp_path: Path, capsys, name: str,
                                                    kind: str) -> None:
    # a FIFO would block the read forever; a device would be read until the RAM runs out
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / name).unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(folder / name)
    else:
        os.symlink(kind, folder / name)
    refused(capsys, folder, name, "not a regular file")


def test_index_naming_a_file_with_an_overlong_name(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    write_index(folder, "x" * 5000)
    refused(capsys, folder, "index may only name files beside it")


# -- safetensors headers -----------------------------------------------------------------------------------------------
def rewrite_header(folder: Path, edit: Callable[[str], str]) -> None:
    """Replace the header of the folder's weights file with `edit(header JSON text)`, data unchanged."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = edit(data[8 : 8 + n].decode()).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n :])


def _first_entry(edit: Callable[[dict], None]) -> Callable[[str], str]:
    def run(text: str) -> str:
        header = json.loads(text)
        name = next(k for k in header if k != "__metadata__")
        edit(header[name])
        return json.dumps(header)
    return run


def _two_on_the_same_bytes(text: str) -> str:
    header = json.loads(text)
    a, b = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[:2]
    size = header[a]["data_offsets"][1] - header[a]["data_offsets"][0]
    if header[b]["data_offsets"][1] - header[b]["data_offsets"][0] == size:
        header[b]["data_offsets"] = header[a]["data_offsets"]
    else:  # another size: make b start inside a
        start = header[a]["data_offsets"][0] + 2
        header[b]["data_offsets"] = [start, start + header[b]["data_offsets"][1] - header[b]["data_offsets"][0]]
    return json.dumps(header)


def _name_twice(text: str) -> str:
    header = json.loads(text)
    name = next(k for k in header if k != "__metadata__")
    entry = json.dumps(header[name])
    return text[:-1] + f', "{name}": {entry}}}'


HEADERS: list[tuple[str, Callable[[str], str]]] = [
    ("an offset of 1e999", _first_entry(lambda e: e.update(data_offsets=[0, float("inf")]))),
    ("a dimension of 1e999", _first_entry(lambda e: e.update(shape=[float("inf"), 64]))),
    ("a dimension of 96.9", _first_entry(lambda e: e.update(shape=[96.9] + e["shape"][1:]))),
    ("a dimension that is true", _first_entry(lambda e: e.update(shape=[True] + e["shape"][1:]))),
    ("an unknown dtype", _first_entry(lambda e: e.update(dtype="F128"))),
    ("a name twice", _name_twice),
    ("two tensors on the same bytes", _two_on_the_same_bytes),
    ("nested too deeply", lambda text: "[" * 100_000 + "]" * 100_000),
]


@pytest.mark.parametrize("case, edit", HEADERS, ids=[h[0] for h in HEADERS])
def test_bad_safetensors_headers(mixtral_dir: Path, tmp_path: Path, capsys, case: str, edit) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    rewrite_header(folder, edit)
    refused(capsys, folder, "model.safetensors")


def test_names_that_are_no_model_say_what_they_are(mixtral_dir: Path, tmp_path: Path) -> None:
    """A FIFO or a device named like a model, a loop of links, a name too long for any file, and a config.json
    number of thousands of digits: each an error saying so, not a traceback or a hang."""
    from tandem.runtime.checkpoint import open_checkpoint

    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "zero.gguf").symlink_to("/dev/zero")
    for path, words in ((fifo, r"is a FIFO \(named pipe\), not a model folder"), (tmp_path / "a", "loop of links"),
                        (tmp_path / "zero.gguf", "is a device"), ("x:" + "a" * 300, "name is too long")):
        with pytest.raises(CheckpointError, match=words):
            open_checkpoint(path)
    big = copy_checkpoint(mixtral_dir, tmp_path / "big")
    text = (big / "config.json").read_text()
    (big / "config.json").write_text(text.replace('"hidden_size": ', '"hidden_size": ' + "9" * 5000 + ", \"x\": ", 1))
    with pytest.raises(CheckpointError, match="cannot read"):
        open_checkpoint(big)
