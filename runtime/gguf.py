"""GGUF files (llama.cpp, Ollama, LM Studio) read as Tandem checkpoints: the architecture and metadata as a family's
config, every tensor under its Hugging Face name, the tokenizer and chat template from the file's own metadata.

`open_gguf` gives a `Checkpoint` whose one shard is the file (or the files of a split model): F32, F16 and BF16
tensors are zero-copy views of the memory-mapped file; the quantized block formats of `kernels/blocks.py` are
dequantized to float32 when a tensor is asked for, exactly as the gguf package's reference does. Experts are
stored stacked ([E, I, H] per layer); each expert's name reads its rows.

Each family's file says which `general.architecture` it reads and how its metadata becomes the family's config
(`FamilySpec.gguf`, with runtime/gguf_meta.py's typed reads): `llama` with experts is Mixtral's, `deepseek2` is
DeepSeek-V2's or, with sigmoid gating, V3's. This module is the format alone. llama.cpp's converter reorders the q
and k rows of `llama` models for its RoPE layout (`GGUFArch.rope_permuted`); they are put back in Hugging Face's
order here.

Letters: E experts, I expert width, H hidden size.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem.kernels.blocks import FORMATS, block_matrix, dequantize
from tandem.kernels.errors import CheckpointError, UnsupportedModelError
from tandem.kernels.quant import QuantizedMatrix
from tandem.runtime.config import ModelConfig
from tandem.runtime.gguf_header import GGUFArray, TensorEntry, open_regular, read_header
from tandem.runtime.gguf_meta import Meta, read_float, read_text
from tandem.runtime.gguf_source import Source
from tandem.runtime.safetensors_mmap import TensorInfo

if TYPE_CHECKING:
    from tandem.runtime.families import GGUFArch

FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# the types the gguf package's reader views in their own dtype (the others as uint8 rows of blocks)
VIEWED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}
# the tokenizer's large arrays: in `GGUFFile.meta` as their length only (the tokenizer reads them itself)
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.scores")
GGUF_MAGIC = b"GGUF"  # a GGUF file's first bytes
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_gguf(path: Path) -> bool:
    """A regular file that starts as GGUF files do, whatever its name (Ollama's blobs have no suffix)."""
    try:
        fd = open_regular(path)  # (a FIFO would block the read: refused, never waited for)
    except CheckpointError:
        return False
    try:
        return os.pread(fd, 4, 0) == GGUF_MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


def gguf_files(path: Path) -> list[Path]:
    """The file, or every part of a split model (`name-00001-of-000NN.gguf`, given any part): missing parts are an
    error naming them."""
    found = SPLIT.match(path.name)
    if not found:
        return [path]
    count, part = int(found["count"]), int(found["part"])
    if not 1 <= part <= count:
        raise CheckpointError(f"{path.name} names part {part} of {count}: not a split model's part (they are named "
                              "NAME-00001-of-000NN.gguf, from 1); rename it, or download it again")
    parts = [path.with_name(f"{found['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path.name} is part of a model split in {count} files, and {', '.join(missing[:3])} "
                              f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}; download every part")
    return parts


class GGUFFile:
    """The tensors of a GGUF model (one file or a split one) under Hugging Face names, with the `SafetensorsFile`
    interface the checkpoint uses: `infos`, `tensor`, `read_into`, `path`. `name` gives them their names."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files = gguf_files(path)
        self.readers = [_reader(p) for p in self.files]
        self.tensors: dict[str, GGUFTensor] = {}
        for reader in self.readers:
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise CheckpointError(f"{path.name}: tensor {t.name} is in more than one part of the split model; "
                                          "re-download every part")
                self.tensors[t.name] = t
        self.meta: Meta = dict(self.readers[0].header.meta)  # arrays as GGUFArray (item type, length) only
        self.sources: dict[str, Source] = {}
        self.infos: dict[str, TensorInfo] = {}

    def name(self, names: dict[str, Source], shapes: dict[str, tuple[int, ...]]) -> None:
        """Give the tensors their Hugging Face names (those found), in the shapes a checkpoint of them holds."""
        path = self.path
        for hf, src in names.items():
            k_b, v_b = src.name.replace("attn_kv_b", "attn_k_b"), src.name.replace("attn_kv_b", "attn_v_b")
            if src.name.endswith("attn_kv_b.weight") and src.name not in self.tensors and k_b in self.tensors:
                names[hf] = Source(k_b, kv_b=v_b)  # llama.cpp's newer files split DeepSeek's kv_b into k_b and v_b
            post = src.name.replace("ffn_norm", "post_attention_norm")
            if src.name.endswith("ffn_norm.weight") and src.name not in self.tensors and post in self.tensors:
                names[hf] = Source(post)  # gpt-oss's name for the norm before the MLP
            fused = re.sub(r"ffn_(gate|up)_exps", "ffn_gate_up_exps", src.name)
            if fused != src.name and src.name not in self.tensors and fused in self.tensors and hf in shapes:
                width = shapes[hf][0]  # gate and up in one tensor [E, 2I, H], gate's rows first (Gemma 4's)
                at = 0 if "ffn_gate_exps" in src.name else width
                names[hf] = Source(fused, expert=src.expert, rows=(at, at + width))
        found = {hf: src for hf, src in names.items() if src.name in self.tensors}
        self._check_shapes(found, shapes)
        # the experts run as one dtype (a layer's in one kernel call): their own when the file keeps them all in one
        # float type, else float32 (a quantized file keeps some in F16, e.g. rows that are not whole blocks)
        expert_kinds = {self.tensors[s.name].tensor_type.name for s in found.values() if s.expert is not None}
        experts = FLOATS[next(iter(expert_kinds))] if len(expert_kinds) == 1 and expert_kinds <= set(FLOATS) \
            else torch.float32
        for hf, src in found.items():
            t = self.tensors[src.name]
            kind = t.tensor_type.name
            if src.fused is not None:  # gpt-oss's fused experts, in the shapes the family reads
                shape = shapes[hf]
                dtype = torch.uint8 if src.fused.endswith(("_blocks", "_scales")) else \
                    FLOATS.get(kind, torch.float32) if src.fused in ("gate_up", "down") else torch.float32
                self.sources[hf] = src
                self.infos[hf] = TensorInfo(dtype, shape, 0, math.prod(shape) * dtype.itemsize)
                continue
            if src.kv_b is not None:  # k_b [heads, rank, nope] and v_b [heads, v, rank] -> [heads * (nope + v), rank]
                v = self.tensors[src.kv_b]  # (GGML lists dimensions innermost first)
                heads, rank, nope = int(t.shape[2]), int(t.shape[1]), int(t.shape[0])
                shape = (heads * (nope + int(v.shape[1])), rank)
                self.sources[hf] = src
                self.infos[hf] = TensorInfo(torch.float32, shape, 0, math.prod(shape) * 4)
                continue
            if kind not in FLOATS and kind not in FORMATS:
                raise UnsupportedModelError(
                    f"{path.name}: tensor {src.name} is stored as {kind}, a GGUF type Tandem does not read yet "
                    f"(it reads {', '.join([*FLOATS, *FORMATS])}); use a file quantized as Q4_K_M, Q5_K_M, Q6_K or "
                    "Q8_0")
            dtype = experts if src.expert is not None else FLOATS.get(kind, torch.float32)  # blocks: float32
            shape = shapes.get(hf, self._hf_shape(t, src))
            self.sources[hf] = src
            self.infos[hf] = TensorInfo(dtype, shape, 0, math.prod(shape) * dtype.itemsize)

    def _check_shapes(self, found: dict[str, Source], shapes: dict[str, tuple[int, ...]]) -> None:
        """Each stacked expert tensor holds exactly the experts the metadata counts, and each tensor as many values
        as the shape the model reads it in (llama.cpp refuses a file whose tensors disagree with its metadata)."""
        experts: dict[str, int] = {}
        for src in found.values():
            if src.expert is not None:
                experts[src.name] = max(experts.get(src.name, 0), src.expert + 1)
        for name, count in experts.items():
            held = self.tensors[name].shape[-1]  # (GGML lists the experts' dimension last)
            if held != count or len(self.tensors[name].shape) != 3:
                raise CheckpointError(f"{self.path.name}: the metadata counts {count} experts (expert_count), but "
                                      f"tensor {name} has shape {list(self.tensors[name].shape)}; the file is "
                                      "damaged or inconsistent: re-download it")
        for hf, src in found.items():
            if src.fused is not None or src.kv_b is not None or hf not in shapes:
                continue
            dims = self.tensors[src.name].shape
            held = math.prod(dims[:-1] if src.expert is not None else dims)
            if src.rows is not None:  # (part of the expert's rows: dims[-2] counts them all)
                held = held // dims[-2] * (src.rows[1] - src.rows[0])
            if src.pick is not None:  # (some of the tensor's rows: dims[-1] counts them all)
                held = held // dims[-1] * len(src.pick)
            if held != math.prod(shapes[hf]):
                raise CheckpointError(f"{self.path.name}: tensor {src.name} has shape {list(dims)}, but the model's "
                                      f"metadata makes it {list(reversed(shapes[hf]))}; the file is damaged or "
                                      "inconsistent: re-download it")

    @staticmethod
    def _hf_shape(t: Any, src: Source) -> tuple[int, ...]:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGML lists the innermost dimension first
        return shape[1:] if src.expert is not None else shape

    def names(self) -> list[str]:
        return list(self.infos)

    def mapped(self, name: str) -> bool:
        """Whether `tensor(name)` is a view of the file (a float type kept as it is) rather than a new copy."""
        src = self.sources[name]
        if src.kv_b is not None or src.fused is not None:
            return False
        kind = self.tensors[src.name].tensor_type.name
        return kind in FLOATS and FLOATS[kind] == self.infos[name].dtype and not src.heads and src.pick is None \
            and src.value is None

    def tensor(self, name: str) -> torch.Tensor:
        src, info = self.sources[name], self.infos[name]
        if src.fused is not None:
            return self._fused(src).to(info.dtype)
        if src.kv_b is not None:
            k_b, v_b = self._values(src.name), self._values(src.kv_b)  # [heads, rank, nope], [heads, v, rank]
            kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [heads, nope + v, rank]
            return kv_b.reshape(-1, k_b.shape[1]).to(info.dtype)  # [heads * (nope + v), rank]
        t = self.tensors[src.name]
        rows = t.data if src.expert is None else t.data[src.expert]  # numpy views of the memory map
        if src.rows is not None:
            rows = rows[src.rows[0] : src.rows[1]]
        if src.pick is not None:
            rows = rows[list(src.pick)]
        w = _decoded(rows, t.tensor_type.name).reshape(info.shape)
        if src.value == "less_one":
            w = w.float() - 1.0
        elif src.value == "log_neg":
            w = torch.log(-w.float())
        w = w.to(info.dtype)
        if src.heads:
            w = unpermute(w, src.heads)
        return w

    def blocks(self, name: str) -> QuantizedMatrix | None:
        """A 2-D tensor in a block format, as stored: its rows of blocks (a view of the file; q and k rows of a llama
        model reordered, a copy), for the kernels to read as they are. None for the float types."""
        src = self.sources[name]
        t = self.tensors[src.name]
        kind = t.tensor_type.name
        if kind not in FORMATS or len(self.infos[name].shape) != 2 or src.kv_b is not None or src.fused is not None \
                or src.value is not None:
            return None
        rows = t.data if src.expert is None else t.data[src.expert]  # numpy uint8 [rows, bytes a row] of the map
        if src.rows is not None:
            rows = rows[src.rows[0] : src.rows[1]]
        if src.pick is not None:
            rows = rows[list(src.pick)]
        raw = torch.from_numpy(rows).view(torch.uint8)
        raw = raw.reshape(self.infos[name].shape[0], -1)
        if src.heads:
            raw = unpermute(raw, src.heads).contiguous()
        return block_matrix(raw, kind)

    def _fused(self, src: Source) -> torch.Tensor:
        """gpt-oss's experts as its checkpoints store them, from llama.cpp's ffn_{gate,up,down}_exps (and biases):
        gate_up [E, H, 2I] (and its bias [E, 2I]) with gate and up interleaved, down [E, I, H]; MXFP4 as published,
        `*_blocks` [E, rows, blocks, 16] (byte j: values 2j, 2j + 1) and `*_scales` [E, rows, blocks]."""
        blk = src.name.removesuffix(".ffn_gate_exps.weight")
        part = src.fused
        if part == "gate_up_bias":
            return _interleave(self._values(f"{blk}.ffn_gate_exps.bias"), self._values(f"{blk}.ffn_up_exps.bias"))
        if part in ("gate_up", "down"):
            if part == "down":
                return self._values(f"{blk}.ffn_down_exps.weight").transpose(1, 2)  # [E, I, H]
            gate, up = (self._values(f"{blk}.ffn_{p}_exps.weight") for p in ("gate", "up"))  # [E, I, H] each
            return _interleave(gate, up).transpose(1, 2)  # [E, H, 2I]
        which, field = part.rsplit("_", 1)  # ("gate_up" | "down", "blocks" | "scales")
        if which == "down":
            return _published_mxfp4(self._raw(f"{blk}.ffn_down_exps.weight"), field)
        gate, up = (_published_mxfp4(self._raw(f"{blk}.ffn_{p}_exps.weight"), field) for p in ("gate", "up"))
        return _interleave(gate, up)

    def _raw(self, gguf_name: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.tensors[gguf_name].data))

    def _values(self, gguf_name: str) -> torch.Tensor:
        """A whole GGUF tensor as float32, in its Hugging Face dimension order (dequantized if in blocks)."""
        t = self.tensors[gguf_name]
        return _decoded(t.data, t.tensor_type.name).float().reshape(tuple(int(d) for d in reversed(t.shape)))

    def read_into(self, name: str, out: memoryview) -> None:
        w = self.tensor(name).contiguous()
        out[: self.infos[name].nbytes] = memoryview(w.view(torch.uint8).numpy()).cast("B")


def _decoded(rows: np.ndarray, kind: str) -> torch.Tensor:
    """A tensor's stored bytes (a numpy view of the map) as values: a float type viewed as it is, blocks dequantized
    to float32 (flat rows; the caller shapes them)."""
    raw = torch.from_numpy(np.ascontiguousarray(rows))
    return raw.view(FLOATS[kind]) if kind in FLOATS else dequantize(raw, kind)


def _interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[E, n, ...] and [E, n, ...] -> [E, 2n, ...]: a's rows even, b's odd (gpt-oss's gate and up)."""
    return torch.stack((a, b), dim=2).flatten(1, 2)


def _published_mxfp4(raw: torch.Tensor, field: str) -> torch.Tensor:
    """GGUF MXFP4 rows [E, rows, blocks * 17] (an E8M0 byte, then 16 bytes whose low nibbles are values 0-15 and
    high ones 16-31) -> gpt-oss's `blocks` [E, rows, blocks, 16] (byte j: values 2j, 2j + 1) or `scales`."""
    blocks = raw.reshape(*raw.shape[:-1], -1, 17)  # [E, rows, G, 17]
    if field == "scales":
        return blocks[..., 0].contiguous()
    codes = torch.cat((blocks[..., 1:] & 15, blocks[..., 1:] >> 4), dim=-1)  # [E, rows, G, 32] in order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows for its RoPE layout (back to Hugging Face's): per head, the rows
    alternate between the two halves there."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor of the file, as the gguf package's reader gives it: `shape` innermost first, `data` a numpy view of
    the map (its own dtype for the float and integer types, else uint8 rows of blocks)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int
    data: np.ndarray


class MappedGGUF:
    """One GGUF file, checked (runtime/gguf_header.py) and memory-mapped copy-on-write (writable views, as
    safetensors_mmap maps): `header`, `data` (the whole map as uint8), `tensors`."""

    def __init__(self, path: Path) -> None:
        self.header, self._map = read_header(path, copy_on_write=True)
        self.data = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [_tensor(self.data, t) for t in self.header.tensors]


def _tensor(data: np.ndarray, entry: TensorEntry) -> GGUFTensor:
    import gguf

    kind = gguf.GGMLQuantizationType(entry.type_id)
    dims = tuple(reversed(entry.dims))
    raw = data[entry.offset : entry.offset + entry.nbytes]
    if kind.name in VIEWED:
        values = raw.view(VIEWED[kind.name]).reshape(dims)
    else:  # rows of blocks: [..., bytes a row]
        block, size = gguf.GGML_QUANT_SIZES[kind]
        values = raw.reshape(*dims[:-1], dims[-1] // block * size)
    return GGUFTensor(entry.name, kind, entry.dims, entry.nbytes, entry.offset, values)


def _reader(path: Path) -> MappedGGUF:
    return MappedGGUF(path)


def with_frequency_factors(raw: dict[str, Any], file: GGUFFile) -> dict[str, Any]:
    """The config with the file's RoPE frequency factors (`rope_freqs.weight`: each rotated pair's divisor, as
    llama.cpp's converter writes Llama 3's scaling), where it has them, as RoPE "frequency_factors"."""
    found = file.tensors.get("rope_freqs.weight")
    if found is None:
        return raw
    if found.tensor_type.name != "F32" or found.data.ndim != 1:
        raise CheckpointError(f"{file.path.name}: rope_freqs.weight must be one row of F32 factors, not "
                              f"{found.tensor_type.name} {list(found.data.shape)}; the file is damaged: re-download it")
    own = reader_of(file.meta).frequencies
    if own is not None:  # the architecture reads them its own way (Gemma 4: its global layers' RoPE)
        return own(raw, [float(f) for f in found.data])
    given = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if given.get("rope_type", given.get("type", "default")) != "default":
        raise UnsupportedModelError(f"{file.path.name} scales its RoPE twice (rope_freqs.weight beside a "
                                    f"{given.get('rope_type', given.get('type'))} scaling in its metadata); Tandem "
                                    "runs one of them, not both")
    return raw | {"rope_parameters": {"rope_type": "frequency_factors", "rope_theta": raw["rope_theta"],
                                      "factors": [float(f) for f in found.data]}}


def reader_of(meta: Meta) -> GGUFArch:
    """How the file's architecture (`general.architecture`) is read: its family's `GGUFArch` (a file may then parse
    as a sibling family, as Granite's with a shared expert does). Unknown: UnsupportedModelError naming those read."""
    from tandem.runtime.families import gguf_architectures

    arch = read_text(meta, "general.architecture")
    readers = gguf_architectures()
    if arch not in readers:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not one Tandem reads yet; it reads {', '.join(readers)}")
    return readers[arch].gguf  # type: ignore[return-value]


def config_of(meta: Meta, types: dict[str, str], vocab: int) -> dict[str, Any]:
    """The config.json a Hugging Face folder of this model would hold: its family's reading of the metadata
    (`FamilySpec.gguf`). What the metadata does not say, the tensors (their names and types) do: which layers are
    dense (no router) where the family's config lists them (`mlp_only_layers`), attention biases, q/k norms, a tied
    lm_head. (Every family's layers are checked against the routers the file holds once parsed: `routers_agree`.)"""
    tensors = set(types)
    reader = reader_of(meta)
    arch = reader.name
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, GGUFArray) and tokens.count != vocab:  # llama.cpp refuses an embedding of other rows
        raise CheckpointError(f"the GGUF file's token embedding has {vocab} rows but its vocabulary "
                              f"(tokenizer.ggml.tokens) {tokens.count} tokens; the file is damaged: re-download it")
    raw = reader.config(meta, vocab, types)
    # every layer needs its own tensors: a layer count past them is refused before anything loops over it
    present = {name.split(".", 2)[1] for name in tensors if name.startswith("blk.")}
    missing = [i for i in range(min(raw["num_hidden_layers"], len(present) + 1)) if str(i) not in present]
    if missing:
        raise CheckpointError(f"the GGUF file's {arch}.block_count says {raw['num_hidden_layers']} layers, but it "
                              f"holds no tensors for layer {missing[0]}; the file is damaged or incomplete: "
                              "re-download it")
    dense = [i for i in range(raw["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if "first_k_dense_replace" in raw:  # the dense layers come first (GLM)
        if dense != list(range(raw["first_k_dense_replace"])):
            raise CheckpointError(f"this {arch} file says its first {raw['first_k_dense_replace']} layers are dense, "
                                  f"but layers {dense[:3]} have no router; the file is inconsistent")
    elif "mlp_only_layers" in raw:
        raw["mlp_only_layers"] = dense
    for i in range(raw["num_hidden_layers"]):  # the kernels take experts as blocks throughout, or as floats
        kinds = {types[n] for n in (f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up", "gate_up", "down"))
                 if n in types}
        if kinds & set(FORMATS) and kinds - set(FORMATS):
            raise UnsupportedModelError(
                f"layer {i}'s experts mix block formats and float tensors ({', '.join(sorted(kinds))}); Tandem runs "
                "experts stored as blocks throughout or as floats throughout: quantize the file again "
                "(llama-quantize) or use an F16 or BF16 file")
    raw["attention_bias"] = "blk.0.attn_q.bias" in tensors
    raw.setdefault("use_qk_norm", "blk.0.attn_q_norm.weight" in tensors)  # (Llama 4's have no weights: its reader says)
    raw["tie_word_embeddings"] = "output.weight" not in tensors
    if f"{arch}.attention.clamp_kqv" in meta:
        raw["clip_qkv"] = read_float(meta, f"{arch}.attention.clamp_kqv")
    return raw


def routers_agree(config: ModelConfig, types: dict[str, str], where: str) -> None:
    """The layers the parsed config gives experts are those whose router the file holds: a file whose metadata says
    otherwise (edited, or cut short) is refused before a layer reads a tensor it lacks."""
    routed = [i for i in range(config.num_layers) if f"blk.{i}.ffn_gate_inp.weight" in types]
    want = [i for i, sparse in enumerate(config.sparse_layers) if sparse]
    if routed != want:
        raise CheckpointError(f"{where}: its metadata puts experts in layers {want[:6]} but the file holds routers in "
                              f"layers {routed[:6]}; the file is inconsistent: re-download it")


# ---- Hugging Face tensor names -> GGUF tensors ------------------------------------------------------------------
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_DIRECT = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_IN_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
             "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "self_attn.query_layernorm.weight": "attn_q_norm.weight",  # (HunYuan's names)
             "self_attn.key_layernorm.weight": "attn_k_norm.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
             # DeepSeek's multi-head latent attention
             "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
             "self_attn.q_b_proj.weight": "attn_q_b.weight",
             "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
             "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
             "self_attn.kv_b_proj.weight": "attn_kv_b.weight"}


def sources(names: list[str], moe_prefix: str, router: str, expert_proj: tuple[str, str, str], shared: str | None,
            shared_gate: str | None, llama_heads: tuple[int, int] | None,
            correction: str | None = None, dense_mlp: str = "mlp", own: dict[str, str] | None = None,
            special: dict[str, Source] | None = None) -> dict[str, Source]:
    """Each Hugging Face tensor name's GGUF source. `llama_heads`: (query, key/value) heads whose q/k rows are in
    llama.cpp's RoPE order; `shared`: the shared expert's SwiGLU within a layer (in the MoE block, or beside it:
    Granite's); `correction`: the router's correction bias inside the MoE block (FamilySpec.correction_name; None:
    under the router); `dense_mlp`: a dense layer's SwiGLU (FamilySpec.dense_mlp); `own`: the architecture's own
    names inside a layer (GGUFArch.tensors), before every other; `special`: sources the architecture gives whole
    (GGUFArch.sources: a name inside a layer, or a whole name; the GGUF name inside `blk.N.` or whole). An empty
    `moe_prefix`: the MoE block's tensors lie in the layer itself."""
    correction = correction or f"{router}.e_score_correction_bias"
    dense = {f"{dense_mlp}.{k}_proj.weight": f"ffn_{k}.weight" for k in ("gate", "up", "down")}
    block = f"{moe_prefix}." if moe_prefix else ""
    experts = re.compile(rf"^{re.escape(block)}experts\.(\d+)\.({'|'.join(expert_proj)})\.weight$")
    kinds = dict(zip(expert_proj, ("gate", "up", "down"), strict=True))
    out: dict[str, Source] = {}
    special = special or {}
    for name in names:
        if name in special:
            out[name] = special[name]
            continue
        if name in _DIRECT:
            out[name] = Source(_DIRECT[name])
            continue
        layer = _LAYER.match(name)
        if layer is None:
            continue
        blk, rest = f"blk.{layer[1]}", layer[2]
        if rest in special:
            out[name] = replace(special[rest], name=f"{blk}.{special[rest].name}")
        elif own and rest in own:
            out[name] = Source(f"{blk}.{own[rest]}")
        elif rest in _IN_LAYER:
            heads = 0
            if llama_heads and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_proj.bias",
                                        "self_attn.k_proj.bias"):  # (the converter permutes the biases alike)
                heads = llama_heads[0] if rest.startswith("self_attn.q") else llama_heads[1]
            out[name] = Source(f"{blk}.{_IN_LAYER[rest]}", heads=heads)
        elif rest in dense:
            out[name] = Source(f"{blk}.{dense[rest]}")
        elif rest == f"{block}{router}.weight":
            out[name] = Source(f"{blk}.ffn_gate_inp.weight")
        elif rest == f"{block}{correction}":
            out[name] = Source(f"{blk}.exp_probs_b.bias")
        elif rest == f"{block}{router}.bias":
            out[name] = Source(f"{blk}.ffn_gate_inp.bias")
        elif rest == "self_attn.sinks":
            out[name] = Source(f"{blk}.attn_sinks.weight")
        elif rest == f"{block}experts.down_proj_bias":
            out[name] = Source(f"{blk}.ffn_down_exps.bias")
        elif rest.startswith(f"{block}experts.") and rest.count(".") == block.count(".") + 1:  # gpt-oss's fused
            # experts
            out[name] = Source(f"{blk}.ffn_gate_exps.weight", fused=rest.rsplit(".", 1)[1].removesuffix("_proj")
                               .replace("_proj_", "_"))
        elif (found := experts.match(rest)) is not None:
            out[name] = Source(f"{blk}.ffn_{kinds[found[2]]}_exps.weight", expert=int(found[1]))
        elif shared and rest.startswith(f"{shared}.") and rest.endswith("_proj.weight"):
            kind = rest.removeprefix(f"{shared}.").removesuffix("_proj.weight")
            out[name] = Source(f"{blk}.ffn_{kind}_shexp.weight")
        elif shared_gate and rest == f"{block}{shared_gate}.weight":
            out[name] = Source(f"{blk}.ffn_gate_inp_shexp.weight")
    return out
