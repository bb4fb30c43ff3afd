"""Finding the models a user already has: folders they name, the Hugging Face cache (safetensors folders and GGUF
files), LM Studio's models folder, and Ollama's store (manifests naming GGUF blobs, listed under Ollama's own names,
e.g. `qwen3:30b-a3b`). Reading is cheap: config.json, or a GGUF file's header (metadata and tensor table, through
its memory map), never the weights.

Where each app keeps its models (`Stores.default`): Hugging Face in `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`; LM Studio in `~/.lmstudio/models` (or the folder its settings name as
`downloadsFolder`) and, in older versions, `~/.cache/lm-studio/models`, as `publisher/model/file.gguf`; Ollama in
`$OLLAMA_MODELS`, else `~/.ollama/models` and the Linux service's `/usr/share/ollama/.ollama/models`, as
`manifests/<registry>/<namespace>/<model>/<tag>` (JSON whose layer of media type
`application/vnd.ollama.image.model` names the GGUF blob `blobs/sha256-<hex>`).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.kernels.errors import CheckpointError, TandemError, UnsupportedModelError
from tandem.runtime.checkpoint import shard_paths
from tandem.runtime.families import family_for, gguf_architectures, parse_config, text_model
from tandem.runtime.gguf import SPLIT, config_of, gguf_files, is_gguf
from tandem.runtime.gguf_header import GGUFHeader, TensorEntry, header_of
from tandem.runtime.paths import read_bounded, read_json
from tandem.runtime.safetensors_mmap import read_header
from tandem.runtime.weights import dense_tensors, expert_tensors

OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"
MANIFEST_MOST = 1 << 20  # bytes: an Ollama manifest is a few hundred
CONFIG_MOST = 64 << 20  # bytes: a config.json is a few kilobytes
OLLAMA_DIGEST = re.compile(r"sha256[:-][0-9a-f]{64}")  # a content address; nothing else names a blob
OLLAMA_NAME = re.compile(r"^[\w.-]+(/[\w.-]+){0,2}(:[\w.-]+)?$")  # model[:tag], namespace/model[:tag], ...
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class ModelEntry:
    path: str | None  # None: the built-in model
    name: str
    family: str  # the family Tandem runs it as, or the file's own architecture when it runs none
    params: int
    experts: int
    size_bytes: int
    source: str  # "built-in", "folder", "HF cache", "LM Studio", "Ollama"
    quant: str = ""  # "bf16", "Q4_K_M", "MXFP4", ...
    runs: bool = True  # whether Tandem runs this model (a mixture of experts of a family it knows)
    problem: str | None = None  # why a damaged file cannot run (listed so that one bad file hides no other model)

    def fits(self, ram: int) -> bool:
        """Whether the weights fit in RAM (memory-mapped experts stream from disk otherwise)."""
        return self.size_bytes <= ram

    def fits_vram(self, vram: int | None) -> str:
        """All of it on the GPU, part of it (the rest on the CPU), or no GPU."""
        if not vram:
            return "no GPU"
        return "all" if self.size_bytes <= vram * 0.9 else f"{min(99, int(100 * vram * 0.9 / self.size_bytes))}%"


@dataclass(frozen=True)
class Stores:
    """Where other apps keep models (see the module docstring)."""

    hf_hub: Path | None = None
    lmstudio: list[Path] = field(default_factory=list)
    ollama: list[Path] = field(default_factory=list)

    @classmethod
    def default(cls, home: Path | None = None, env: dict[str, str] | None = None) -> Stores:
        home = Path.home() if home is None else home
        env = dict(os.environ) if env is None else env
        hub = Path(env["HF_HUB_CACHE"]) if env.get("HF_HUB_CACHE") else \
            Path(env["HF_HOME"]) / "hub" if env.get("HF_HOME") else home / ".cache" / "huggingface" / "hub"
        lms = [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]
        folder = _folder_setting(_json(home / ".lmstudio" / "settings.json").get("downloadsFolder"))
        if folder is not None:
            lms.insert(0, folder)
        ollama = [Path(env["OLLAMA_MODELS"])] if env.get("OLLAMA_MODELS") else \
            [home / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
        return cls(hub, list(dict.fromkeys(lms)), ollama)


def _folder_setting(value: object) -> Path | None:
    """A folder another app's settings name, if it can be one: a non-empty absolute path (after `~`) of a sane
    length without NUL; None otherwise (a damaged setting leaves that app's default folders)."""
    if not isinstance(value, str) or not value or "\0" in value or len(value) > 4096:
        return None
    try:
        folder = Path(value).expanduser()
    except (RuntimeError, KeyError):  # `~user` of no such user, or no home to expand
        return None
    return folder if folder.is_absolute() else None


def _json(path: Path, most: int = MANIFEST_MOST) -> dict[str, Any]:
    """A small JSON object from a file, or {} when it is missing, not a regular file, too large, nested too deeply
    or not one (read through `read_bounded`: a FIFO is never waited for)."""
    try:
        value = json.loads(read_bounded(path, most).decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # ValueError: not UTF-8 or not JSON; RecursionError: nesting
        return {}
    return value if isinstance(value, dict) else {}


def describe_folder(folder: Path, source: str, name: str | None = None) -> ModelEntry | None:
    """A Hugging Face model folder -> its entry. A folder without config.json, or whose config names a family Tandem
    does not know, -> None (most folders are not models, and the Hugging Face cache holds models of every kind). One
    whose config.json is damaged, whose config a known family refuses, or that holds no weights is listed, not run,
    with why (`problem`): one bad download hides no other model, and the user sees what is wrong with it."""
    config = folder / "config.json"
    shown = name or folder.name
    try:
        raw = read_json(config, CONFIG_MOST)
    except FileNotFoundError:  # (a dangling link too: an unfinished download's cache entry)
        return None
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON, or nested too deeply
        return damaged(folder, shown, source, f"{config} cannot be read as JSON ({e}); re-download the model")
    if not isinstance(raw, dict):
        return damaged(folder, shown, source, f"{config} does not hold a JSON object; re-download the model")
    whole = raw
    try:
        inside = text_model(raw)  # a whole model (Gemma 4's, with its towers): its text model
        raw = inside[0] if inside is not None else raw
        family_for(raw.get("model_type"))
    except UnsupportedModelError:
        return None
    except CheckpointError as e:
        return damaged(folder, shown, source, str(e))
    try:
        spec, cfg = parse_config(raw, str(config))
    except TandemError as e:  # CheckpointError: a field is wrong; UnsupportedModelError: a variant not run
        return damaged(folder, shown, source, str(e), family="damaged" if _damage(e) else "unsupported")
    shapes = dense_tensors(cfg, spec) | expert_tensors(cfg, spec)
    try:  # the shards the folder's index names (beside it), each one's header checked against its size
        files = shard_paths(folder)
        for shard in files:
            read_header(shard)
        size = sum(p.stat().st_size for p in files)
    except CheckpointError as e:
        return damaged(folder, shown, source, str(e))
    except OSError as e:  # a dangling link or a file gone meanwhile
        return damaged(folder, shown, source, f"{folder}: a weights file cannot be read ({e}); re-download the model")
    qc = raw.get("quantization_config") or whole.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or whole.get("torch_dtype") or whole.get("dtype") or "") \
        or _stored_dtype(folder)
    quant = str(method).upper() if method else SHORT_DTYPES.get(dtype, dtype)
    return ModelEntry(str(folder), shown, spec.display_name, sum(math.prod(s) for s in shapes.values()),
                      cfg.num_experts, size, source, quant)


def damaged(path: Path, name: str, source: str, problem: str, size: int = 0, family: str = "damaged") -> ModelEntry:
    """The entry of a model that is listed but cannot run: `problem` says why, naming `path` where it does not."""
    problem = problem if str(path) in problem else f"{path}: {problem}"
    return ModelEntry(str(path), name, family, 0, 0, size, source, runs=False, problem=problem)


def _damage(e: TandemError) -> bool:
    """Whether `e` says a file is damaged (rather than of a kind Tandem does not run)."""
    return isinstance(e, CheckpointError) and not isinstance(e, UnsupportedModelError)


def _stored_dtype(folder: Path) -> str:
    """The dtype of the largest tensor of a folder's first shard, from its header ("" when unreadable)."""
    shard = next(iter(sorted(folder.glob("*.safetensors"))), None)
    try:
        infos = read_header(shard) if shard is not None else {}
    except (OSError, CheckpointError):
        return ""
    if not infos:
        return ""
    biggest = max(infos.values(), key=lambda i: i.nbytes)
    return str(biggest.dtype).removeprefix("torch.")


def describe_gguf(path: Path, source: str, name: str | None = None) -> ModelEntry | None:
    """A GGUF file (a whole model, or the first part of a split one) -> its entry; anything that is not a regular
    file -> None (a FIFO is never opened for reading). Files of an architecture Tandem does not run are listed too
    (`runs` False), and so are damaged ones (`problem` says why), so that the user sees why."""
    split = SPLIT.match(path.name)
    if not _regular(path):
        return None
    if split and int(split["part"]) != 1:  # listed through its first part; without one, as damaged
        first = path.with_name(f"{split['stem']}-00001-of-{split['count']}.gguf")
        if _regular(first) and int(split["part"]) <= int(split["count"]):
            return None
    shown = name or _gguf_name(path)
    try:
        files = gguf_files(path)
        headers = [header_of(part) for part in files]
        return _gguf_entry(path, shown, source, files, headers)
    except TandemError as e:  # CheckpointError: the file is damaged; UnsupportedModelError: it cannot run
        return damaged(path, shown, source, str(e), _size(path), "damaged" if _damage(e) else "unsupported")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _regular(path: Path) -> bool:
    """A regular file (links followed; a loop of links, a FIFO or a device is not)."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def _gguf_entry(path: Path, name: str, source: str, files: list[Path], headers: list[GGUFHeader]) -> ModelEntry:
    """A checked GGUF header -> its entry; metadata of the wrong type, or that does not describe a model that
    runs, raise CheckpointError (so the entry says why)."""
    meta = headers[0].meta
    arch = meta.get("general.architecture", "")
    if not isinstance(arch, str):
        raise CheckpointError(f"{path}: general.architecture is not a string; the file is damaged: re-download it")
    experts = meta.get(f"{arch}.expert_count", 0)
    if isinstance(experts, bool) or not isinstance(experts, int):
        raise CheckpointError(f"{path}: {arch}.expert_count is not an integer; the file is damaged: re-download it")
    tensors = [t for h in headers for t in h.tensors]
    runs = arch in gguf_architectures() and experts > 0
    family = arch or "unknown"
    if runs:  # what loading would refuse in the metadata, said now
        embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
        if embed is None or len(embed.dims) != 2:
            raise CheckpointError(f"{path} has no 2-D token_embd.weight: it is not a language model's GGUF file")
        kinds = _type_names()
        raw = config_of(meta, {t.name: kinds.get(t.type_id, "") for t in tensors}, embed.dims[1])
        family = parse_config(raw, f"{path} (its GGUF metadata)")[0].display_name
    return ModelEntry(str(path), name, family, sum(math.prod(t.dims) for t in tensors), experts,
                      sum(h.size for h in headers), source, _file_type(meta.get("general.file_type"), tensors), runs)


def _type_names() -> dict[int, str]:
    """GGML type id -> its name (Q4_K, F16, ...)."""
    import gguf

    return {int(k): k.name for k in gguf.GGMLQuantizationType}


def _gguf_name(path: Path) -> str:
    """A file's name without `.gguf` (and without `-00001-of-000NN` for a split model)."""
    found = SPLIT.match(path.name)
    return found["stem"] if found else path.stem


def _file_type(ftype: object, tensors: list[TensorEntry]) -> str:
    """The file's quantization as llama.cpp names it (Q4_K_M), else its experts' tensor type."""
    import gguf

    if isinstance(ftype, int) and not isinstance(ftype, bool):
        try:
            return gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_").replace("ALL_", "")
        except ValueError:
            pass
    kinds = [_type_names().get(t.type_id, "") for t in tensors if "exps" in t.name]
    return kinds[0] if kinds else ""


def _is_dir(path: Path) -> bool:
    """Whether `path` is a folder (one that cannot even be looked at, a name too long say, is none)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def _folders(root: Path) -> Iterator[Path]:
    """root and its subfolders, one level down (a folder of model folders); an unreadable folder holds none."""
    if _is_dir(root):
        yield root
        try:
            subs = sorted(root.iterdir())
        except OSError:
            return
        for sub in subs:
            if _is_dir(sub):
                yield sub


def _ggufs(root: Path, depth: int) -> list[Path]:
    """*.gguf files up to `depth` folders below root (an unreadable folder holds none)."""
    found: list[Path] = []
    if not _is_dir(root):
        return found
    for level in range(depth + 1):
        try:
            found += sorted(root.glob("/".join(["*"] * level + ["*.gguf"])))
        except OSError:
            continue
    return found


@dataclass(frozen=True)
class OllamaModel:
    """One manifest of an Ollama store: its name, and the GGUF blob it names, or (`blob` None) why it names none that
    can be read."""

    name: str
    manifest: Path
    blob: Path | None
    problem: str | None = None


def ollama_models(root: Path) -> list[OllamaModel]:
    """Every manifest of an Ollama store, named as Ollama does: `model:tag` for the default registry's `library`
    namespace, `namespace/model:tag` for others there, `registry/namespace/model:tag` elsewhere. A damaged manifest
    is kept with why (listed, so that the user sees it); a blob is only ever looked for inside the store."""
    out: list[OllamaModel] = []
    manifests = root / "manifests"
    if not manifests.is_dir():
        return out
    store = root.resolve()
    for path in sorted(manifests.glob("*/*/*/*")):
        if not path.is_file():
            continue
        registry, namespace, model, tag = path.relative_to(manifests).parts
        name = f"{model}:{tag}"
        if namespace != "library" or registry != OLLAMA_REGISTRY:
            name = f"{namespace}/{name}"
        if registry != OLLAMA_REGISTRY:
            name = f"{registry}/{name}"
        blob, problem = _ollama_blob(root, path) if _inside(path, store) else \
            (None, f"its manifest {path} is a link that leads outside the store (not read)")
        out.append(OllamaModel(name, path, blob, None if blob else f"{problem}; `ollama pull {name}` fetches it "
                                                                      "again"))
    return out


def _ollama_blob(root: Path, manifest: Path) -> tuple[Path | None, str]:
    """The model blob a manifest's layers name, if it is a regular file inside the store's blobs folder: the digest
    must be `sha256:<64 hex>` (a `../` in it, or a link in blobs/, leads nowhere outside the store); else None and
    what is wrong."""
    try:
        raw = read_json(manifest, MANIFEST_MOST)
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON, or nested too deeply
        return None, f"its manifest {manifest} cannot be read as JSON ({e})"
    layers = raw.get("layers") if isinstance(raw, dict) else None
    if not isinstance(layers, list):
        return None, f"its manifest {manifest} has no list of layers"
    digest = next((layer.get("digest") for layer in layers if isinstance(layer, dict)
                   and layer.get("mediaType") == OLLAMA_MODEL), None)
    if digest is None:
        return None, f"its manifest {manifest} names no model layer ({OLLAMA_MODEL})"
    if not isinstance(digest, str) or not OLLAMA_DIGEST.fullmatch(digest):
        return None, f"its manifest {manifest} names the model blob {_short(digest)}, not sha256:<64 hex digits>"
    blob = root / "blobs" / f"sha256-{digest[7:]}"
    try:  # inside the store's own blobs folder (not through a link in it, nor a blobs folder that is a link)
        inside = blob.resolve(strict=True).is_relative_to(root.resolve(strict=True) / "blobs")
    except (OSError, RuntimeError):  # missing, or a loop of links
        return None, f"its model blob {blob} is missing (an unfinished pull, or a pruned store)"
    if not inside:
        return None, f"its model blob {blob} is a link that leads outside the store (not followed)"
    return (blob, "") if _regular(blob) else (None, f"its model blob {blob} is not a regular file")


def _inside(path: Path, folder: Path) -> bool:
    """Whether `path`, links followed, is inside `folder` (itself resolved)."""
    try:
        return path.resolve(strict=True).is_relative_to(folder)
    except (OSError, RuntimeError):
        return False


def _short(value: object, most: int = 80) -> str:
    """repr(value), cut to `most` characters (a hostile manifest's string may be a megabyte long)."""
    text = repr(value)
    return text if len(text) <= most else text[:most] + "…"


def resolve_ollama_name(name: str, stores: Stores | None = None) -> Path | None:
    """The GGUF blob of an Ollama model name (`qwen3:30b-a3b`, `qwen3` for `:latest`); None when no store has it;
    CheckpointError saying why when its manifest is damaged."""
    stores = stores or Stores.default()
    wanted = name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"
    for root in stores.ollama:
        for found in ollama_models(root):
            if found.name == wanted:
                if found.blob is None:
                    raise CheckpointError(f"Ollama model {wanted}: {found.problem}")
                return found.blob
    return None


def discover(folders: list[Path], builtin: Path | None = None, stores: Stores | None = None) -> list[ModelEntry]:
    """Every model found: the built-in one first, then the named folders, the Hugging Face cache, LM Studio's
    folders and Ollama's store."""
    stores = stores or Stores.default()
    entries: list[ModelEntry] = []
    if builtin is not None:
        e = describe_folder(builtin, "built-in") if builtin.exists() else None
        entries.append(ModelEntry(None, "built-in: SmolLM2-135M ×8 experts", "Mixtral", e.params if e else 0,
                                  8, e.size_bytes if e else 0, "built-in", e.quant if e else "bf16"))
    for root in folders:
        for sub in _folders(root):
            if e := describe_folder(sub, "folder"):
                entries.append(e)
        for path in _ggufs(root, 2):
            if e := describe_gguf(path, "folder"):
                entries.append(e)
    hub = stores.hf_hub
    if hub is not None and hub.is_dir():
        for snap in sorted(hub.glob("models--*/snapshots/*")):
            repo = snap.parent.parent.name.removeprefix("models--").replace("--", "/")
            if e := describe_folder(snap, "HF cache", repo):
                entries.append(e)
            for path in _ggufs(snap, 1):
                if e := describe_gguf(path, "HF cache", f"{repo}/{path.name}"):
                    entries.append(e)
    for root in stores.lmstudio:
        for path in _ggufs(root, 2):
            name = "/".join(path.relative_to(root).parts)
            if e := describe_gguf(path, "LM Studio", name):
                entries.append(e)
    for root in stores.ollama:
        for m in ollama_models(root):
            if m.blob is None:
                entries.append(damaged(m.manifest, m.name, "Ollama", m.problem or ""))
            elif not is_gguf(m.blob):  # (Ollama's own safetensors-based models)
                entries.append(damaged(m.blob, m.name, "Ollama", f"its model blob {m.blob} is not a GGUF file",
                                       _size(m.blob), "unsupported"))
            elif e := describe_gguf(m.blob, "Ollama", m.name):
                entries.append(e)
    return entries

