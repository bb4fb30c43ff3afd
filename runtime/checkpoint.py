"""Open a local Hugging Face model folder: config, safetensors shards (memory-mapped), validation.

Opening reads `config.json`, the shard index and each shard's header — never tensor data — and checks
that every tensor the architecture needs is present with the right shape, so a broken download is
reported up front with a fix, not as a crash mid-generation.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tandem.kernels.choice import WEIGHT_DTYPES
from tandem.kernels.errors import CheckpointError, UnsupportedModelError
from tandem.kernels.quant import QuantizedMatrix
from tandem.runtime.config import ModelConfig, token_ids
from tandem.runtime.families import FamilySpec, parse_config, supported_model_types, text_model, usual_name
from tandem.runtime.paths import file_kind, read_bounded
from tandem.runtime.safetensors_mmap import SafetensorsFile
from tandem.runtime.weights import dense_tensors, expert_tensors, layer_expert_names, stacked_expert_names

INDEX = "model.safetensors.index.json"
RAM_ALIGN = 64  # bytes: tensors read into RAM start on a cache line (in the files they often do not)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclass
class Checkpoint:
    path: Path
    raw_config: dict[str, Any]
    config: ModelConfig
    spec: FamilySpec
    shards: list[SafetensorsFile]
    where: dict[str, SafetensorsFile]  # tensor name -> the shard holding it

    def identity(self) -> list[Any]:
        """What a cache made from these weights is keyed by (the quantized experts, kept prefixes): the resolved
        path and each weight file's name, size and modification time, so that a changed checkpoint gets new ones."""
        files = sorted(self.path.rglob("*.safetensors")) if self.path.is_dir() else [self.path]
        return [str(self.path.resolve()), [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]]

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy, memory-mapped view of one tensor, in its on-disk dtype."""
        return self.where[name].tensor(name)

    def read_into_ram(self, names: list[str]) -> list[torch.Tensor]:
        """Copies of these tensors in RAM (on-disk dtype), each starting on a cache line of one shared buffer."""
        infos = [self.where[n].infos[n] for n in names]
        buffer, offsets = one_buffer([info.nbytes for info in infos])
        view = memoryview(buffer.numpy())
        out = []
        for name, info, at in zip(names, infos, offsets, strict=True):
            self.where[name].read_into(name, view[at : at + info.nbytes])
            out.append(buffer[at : at + info.nbytes].view(info.dtype).view(info.shape))
        return out

    def blocks(self, name: str) -> QuantizedMatrix | None:
        """A GGUF matrix in a block format as the file stores it (a view), for the kernels to read as it is; None for
        any other tensor (`tensor` gives it, dequantized)."""
        shard = self.where[name]
        return shard.blocks(name) if hasattr(shard, "blocks") else None

    @property
    def expert_blocks(self) -> bool:
        """Whether this is a GGUF file whose routed experts are in a block format (kept so, as the file has them)."""
        return self.expert_block_kind is not None

    @property
    def expert_block_kind(self) -> str | None:
        """The block format of a GGUF file's routed experts (their first matrix's), or None."""
        first = next((n for n in self.where if ".experts." in n), None)
        blocks = self.blocks(first) if first is not None else None
        return blocks.kind if blocks is not None else None

    def dtype(self, name: str) -> torch.dtype:
        return self.where[name].infos[name].dtype

    @property
    def file_bytes(self) -> int:
        return sum(s.path.stat().st_size for s in self.shards)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from config.json and generation_config.json (either may list several)."""
        ids = list(self.config.eos_token_ids)
        gen_path = self.path / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.exists() else {}
        extra = gen.get("eos_token_id")
        if extra is not None and not (_token_id(extra) or isinstance(extra, list) and all(map(_token_id, extra))):
            raise CheckpointError(f"{gen_path}: eos_token_id is {extra!r}, but it must be a token id or a list of "
                                  "them; fix the file or remove it")
        ids += [i for i in token_ids(extra) if i not in ids]
        return tuple(ids)


def one_buffer(sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
    """One uint8 buffer for pieces of these byte sizes, each starting on a cache line (RAM_ALIGN), and their offsets."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // RAM_ALIGN) * RAM_ALIGN
    return torch.empty(total, dtype=torch.uint8), offsets


def open_checkpoint(path: str | Path) -> Checkpoint:
    from tandem.runtime.gguf import is_gguf

    folder = Path(path).expanduser()
    try:
        kind = os.stat(folder).st_mode
    except OSError as e:
        kind = None
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{folder} is a loop of links; point to the model itself") from None
        if e.errno == errno.ENAMETOOLONG:
            raise CheckpointError(f"{str(folder)[:80]}…: the name is too long for a file, a folder or an Ollama "
                                  "model") from None
    if kind is not None and not (stat.S_ISDIR(kind) or stat.S_ISREG(kind)):
        raise CheckpointError(f"{folder} is {file_kind(kind)}, not a model folder or a .gguf file")
    if kind is None:
        from tandem.runtime.discover import OLLAMA_NAME, resolve_ollama_name

        blob = resolve_ollama_name(str(path)) if OLLAMA_NAME.match(str(path)) else None
        if blob is not None:  # an Ollama model's name: its GGUF blob
            return _open_gguf(blob)
        raise CheckpointError(f"model folder {folder} does not exist; pass a folder with config.json and "
                              "*.safetensors, a .gguf file or the name of an Ollama model (`tandem models` lists "
                              "those it finds)")
    if folder.is_file() and (folder.suffix == ".gguf" or is_gguf(folder)):
        return _open_gguf(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is a file; pass the model folder that contains it, or a .gguf file")
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(
            f"{folder} has no config.json, so it is not a Hugging Face model folder; "
            "point to the folder holding config.json and the *.safetensors files"
        )
    raw = _read_json(config_path)
    # Code shipped in the folder (auto_map, trust_remote_code) is never imported or run. As transformers does without
    # trust_remote_code, a model_type that Tandem runs is read as that family and auto_map is ignored (Phi-3.5-MoE
    # and DeepSeek-V2-Lite ship one beside their native classes); any other model_type is refused by name.
    if ("auto_map" in raw or raw.get("trust_remote_code")) and raw.get("model_type") not in supported_model_types():
        raise UnsupportedModelError(
            f"{config_path}: model_type {raw.get('model_type')!r} is not a family Tandem runs, and the model's own "
            f"code in the folder (auto_map / trust_remote_code) is never run; Tandem runs: "
            f"{', '.join(supported_model_types())}"
        )
    inside = text_model(raw)  # a whole model (Gemma 4's, with its towers): its text model
    if inside is not None:
        raw = inside[0]
    spec, config = parse_config(raw, str(config_path))
    shards, where = _open_shards(folder, inside[1] if inside is not None else None, spec)
    ckpt = Checkpoint(folder, raw, config, stored_layout(spec, config, where), shards, where)
    _validate(ckpt)
    return ckpt


STACKED = ("experts.gate_up_proj", "experts.down_proj")  # transformers 5's own layout of a layer's SwiGLU experts


def stored_layout(spec: FamilySpec, config: ModelConfig, where: dict[str, Any]) -> FamilySpec:
    """The family's names as the files store its experts: a family whose checkpoints hold each expert's tensors,
    saved instead as transformers 5 holds them (a layer's gate and up rows in one tensor [E, 2I, H], down in another
    [E, H, I]: Qwen3.5's whole-model folders), is read as stored so."""
    if spec.stacked_experts or spec.fused_experts or not any(config.sparse_layers):
        return spec
    first = config.sparse_layers.index(True)
    stacked = replace(spec, stacked_experts=STACKED)
    return stacked if stacked_expert_names(stacked, first)[0] in where else spec


def _open_gguf(path: Path) -> Checkpoint:
    """A GGUF model (runtime/gguf.py): its metadata as config.json, its tensors under Hugging Face names."""
    from tandem.runtime import gguf

    file = gguf.GGUFFile(path)
    embed = file.tensors.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{path} has no token_embd.weight: it is not a language model's GGUF file")
    types = {n: t.tensor_type.name for n, t in file.tensors.items()}
    raw = gguf.config_of(file.meta, types, int(embed.shape[1]))
    spec, config = parse_config(gguf.with_frequency_factors(raw, file), f"{path} (its GGUF metadata)")
    gguf.routers_agree(config, types, str(path))
    # llama.cpp stores every layer's experts as three stacked tensors, each expert's rows of them read on their
    # own (views of blocks), and a shared expert's gate, up and down apart: named so, whatever the family's own
    # checkpoints stack
    reader = gguf.reader_of(file.meta)  # (the architecture's layout and names, whichever family parses it)
    spec = replace(spec, stacked_experts=None, stacked_by_input=False, stacked_mlp=None, **reader.spec)
    shared = f"{spec.moe_prefix}.{spec.shared_expert}" if spec.shared_in_block and spec.moe_prefix else \
        spec.shared_expert
    shapes = dense_tensors(config, spec) | expert_tensors(config, spec)
    llama = (config.num_heads, config.num_kv_heads) if reader.rope_permuted else None
    special = reader.sources(config) if reader.sources is not None else None
    file.name(gguf.sources(list(shapes), spec.moe_prefix, spec.router, spec.expert_proj, shared,
                           spec.shared_expert_gate, llama, spec.correction_name, spec.dense_mlp, reader.tensors,
                           special), shapes)
    ckpt = Checkpoint(path, raw, config, spec, [file], dict.fromkeys(file.names(), file))  # type: ignore[list-item]
    _validate(ckpt)
    return ckpt


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


JSON_MOST = 64 << 20  # bytes: far above any config or index (a 1T-parameter model's index is a few MB)


def read_small_file(path: Path, most: int = JSON_MOST) -> bytes:
    """A metadata file's bytes: a regular file (a FIFO would block, a device never end) of at most `most` bytes.
    Raises CheckpointError saying which."""
    try:
        return read_bounded(path, most)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}; replace it with the model's own file") from None


def _read_json(path: Path) -> dict[str, Any]:
    raw = read_small_file(path)
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # not UTF-8, not JSON, or a whole number of thousands of digits
        raise CheckpointError(f"cannot read {path}: {e}; re-download or fix the file") from None
    except RecursionError:
        raise CheckpointError(f"cannot read {path}: it is nested too deeply; re-download or fix the file") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object; re-download or fix the file")
    return data


def _open_shards(folder: Path, text_prefix: str | None = None, spec: FamilySpec | None = None
                 ) -> tuple[list[SafetensorsFile], dict[str, SafetensorsFile]]:
    """The folder's shards and where each tensor is; `text_prefix`: a whole model's text model is read, its tensors
    named as in a folder of its own (`model.` for the prefix; the towers' left out); `spec`: the tensors named as
    Tandem names them (`FamilySpec.renames`)."""
    shards = [SafetensorsFile(f) for f in shard_paths(folder)]
    where: dict[str, SafetensorsFile] = {}
    for shard in shards:
        if text_prefix is not None:
            shard.infos = {("model." + n.removeprefix(text_prefix) if n.startswith(text_prefix) else n): info
                           for n, info in shard.infos.items() if n.startswith(text_prefix) or n == "lm_head.weight"}
        if spec is not None and spec.renames:
            shard.infos = {usual_name(spec, n): info for n, info in shard.infos.items()}
        for name in shard.names():
            where[name] = shard
    return shards, where


def shard_paths(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: those its index names (each beside it, each there), else every
    `*.safetensors`; CheckpointError saying what is missing or wrong."""
    index_path = folder / INDEX
    if index_path.exists():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no weight_map; re-download the checkpoint")
        names = sorted({_shard_name(index_path, v) for v in weight_map.values()})
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{index_path.name} names shard(s) that are missing from {folder}: {', '.join(missing[:3])}"
                f"{' …' if len(missing) > 3 else ''}; the download is incomplete — fetch the missing files"
            )
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if any(f.is_dir() for f in files):
            raise CheckpointError(f"{next(f for f in files if f.is_dir())} is a folder, not a weights file; "
                                  "re-download the checkpoint")
    if not files:
        pickles = [p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES]
        if pickles:
            raise CheckpointError(
                f"{folder} holds only pickle weights ({', '.join(sorted(pickles)[:3])}); Tandem never unpickles "
                "(it can run arbitrary code). Convert them to safetensors, e.g. load with transformers and "
                "save_pretrained(..., safe_serialization=True)"
            )
        raise CheckpointError(f"{folder} has no *.safetensors weights; download the model's safetensors files")
    return files


def _shard_name(index_path: Path, value: object) -> str:
    """A shard named by the index: a plain file name inside the model folder (never a path that leads out of it)."""
    if (not isinstance(value, str) or not value or Path(value).name != value or value in (".", "..")
            or len(value.encode()) > 255):
        raise CheckpointError(f"{index_path} names the shard {value!r}; an index may only name files beside it, as "
                              "'model-00001-of-00002.safetensors'; re-download the checkpoint")
    return value


def _validate(ckpt: Checkpoint) -> None:
    cfg = ckpt.config
    # expert tensors of one MoE layer: fused (gpt-oss: 6 as MXFP4, else 4) or 3 per expert
    per_layer = (6 if cfg.experts_mxfp4 else 4) if ckpt.spec.fused_experts else 2 if ckpt.spec.stacked_experts \
        else 3 * cfg.num_experts
    wanted = per_layer * cfg.num_moe_layers
    if wanted > len(ckpt.where):  # before listing them: a config that claims a billion experts is caught here
        last = max(i for i, sparse in enumerate(cfg.sparse_layers) if sparse)
        example = layer_expert_names(cfg, ckpt.spec, last)[-1]
        raise CheckpointError(
            f"{ckpt.path} lacks tensors that its config requires, e.g. {example}: config.json describes "
            f"{cfg.num_moe_layers} layers of {cfg.num_experts} experts ({wanted} expert tensors), but the weights hold "
            f"{len(ckpt.where)} tensors in all; the checkpoint is incomplete or does not match config.json"
        )
    expected = dense_tensors(ckpt.config, ckpt.spec) | expert_tensors(ckpt.config, ckpt.spec)
    missing = [n for n in expected if n not in ckpt.where]
    mxfp4 = [n for n in missing if f"{n}_blocks" in ckpt.where]
    if mxfp4:  # MXFP4 tensors, but config.json does not say so (as published, it does)
        raise UnsupportedModelError(
            f"{ckpt.path} stores its experts as MXFP4 ({mxfp4[0]}_blocks and _scales), but config.json has no "
            '"quantization_config": {"quant_method": "mxfp4"} to say so; restore the published config.json'
        )
    if missing:
        raise CheckpointError(
            f"{ckpt.path} lacks {len(missing)} tensor(s) that its config requires, e.g. {missing[0]}; "
            "the checkpoint is incomplete or does not match config.json"
        )
    for name, shape in expected.items():
        info = ckpt.where[name].infos[name]
        if info.shape != shape:
            raise CheckpointError(
                f"tensor {name} has shape {list(info.shape)} but config.json implies {list(shape)}; "
                "the weights and config.json do not belong together"
            )
        packed = name.endswith(("_blocks", "_scales"))  # MXFP4's codes and scales: bytes
        if packed and info.dtype != torch.uint8:
            raise CheckpointError(f"tensor {name} has dtype {info.dtype}; MXFP4 blocks and scales are uint8")
        if not packed and not info.dtype.is_floating_point:
            raise CheckpointError(f"tensor {name} has dtype {info.dtype}; expected floating-point weights")
    _validate_expert_dtypes(ckpt)


def _validate_expert_dtypes(ckpt: Checkpoint) -> None:
    """A layer's routed experts run as one kind (one kernel call takes them all), in a dtype the kernels take."""
    cfg = ckpt.config
    if cfg.experts_mxfp4:  # bytes (checked above) beside float biases, whatever their dtype
        return
    for layer in range(cfg.num_layers):
        if not cfg.sparse_layers[layer]:
            continue
        seen: dict[torch.dtype, str] = {}
        for name in layer_expert_names(cfg, ckpt.spec, layer):
            seen.setdefault(ckpt.dtype(name), name)
        if len(seen) > 1:
            kinds = ", ".join(f"{str(d).removeprefix('torch.')} ({n})" for d, n in seen.items())
            raise CheckpointError(
                f"layer {layer}'s experts are stored in more than one dtype: {kinds}; Tandem runs a layer's experts "
                "together and needs them in one. Re-save the checkpoint in one dtype, e.g. with transformers: "
                "model.to(torch.bfloat16).save_pretrained(folder)"
            )
        (dtype,) = seen
        if dtype not in WEIGHT_DTYPES:  # what the kernels read as stored
            fp8 = " (8-bit float checkpoints with their scale tensors are not supported yet: use the bf16 release)" \
                if dtype.itemsize == 1 else ""
            raise CheckpointError(
                f"layer {layer}'s experts are stored as {str(dtype).removeprefix('torch.')}; Tandem runs experts "
                f"stored as float32, bf16 or fp16{fp8}. Convert the checkpoint, e.g. with transformers: "
                "model.to(torch.bfloat16).save_pretrained(folder)"
            )
