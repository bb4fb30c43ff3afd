"""Finding models to chat with: the configured folders, the Hugging Face cache, and the built-in model."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import psutil
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label, Static

from tandem.kernels.errors import TandemError
from tandem.runtime.families import parse_config
from tandem.runtime.weights import dense_tensors, expert_tensors


@dataclass(frozen=True)
class ModelEntry:
    path: str | None  # None: the built-in model
    name: str
    family: str
    params: int
    experts: int
    size_bytes: int
    source: str  # "built-in", "folder", "HF cache"

    @property
    def fits(self) -> bool:
        """Whether the weights fit in this machine's RAM (memory-mapped experts stream from disk otherwise)."""
        return self.size_bytes <= psutil.virtual_memory().total

    def fits_vram(self, vram: int | None) -> str:
        """All of it on the GPU, part of it (the rest on the CPU), or no GPU."""
        if not vram:
            return "no GPU"
        return "all" if self.size_bytes <= vram * 0.9 else f"{min(99, int(100 * vram * 0.9 / self.size_bytes))}%"


def describe_folder(folder: Path, source: str) -> ModelEntry | None:
    """A supported MoE checkpoint folder -> its entry; anything else -> None."""
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        spec, cfg = parse_config(raw, str(folder / "config.json"))
    except (OSError, ValueError, TandemError, KeyError, TypeError):
        return None
    shapes = dense_tensors(cfg, spec) | expert_tensors(cfg, spec)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    if size == 0:
        return None
    return ModelEntry(str(folder), folder.name, spec.display_name, sum(math.prod(s) for s in shapes.values()),
                      cfg.num_experts, size, source)


def hf_cache_dir() -> Path:
    home = os.environ.get("HF_HOME")
    return Path(home) / "hub" if home else Path.home() / ".cache" / "huggingface" / "hub"


def discover(folders: list[Path], builtin: Path | None = None) -> list[ModelEntry]:
    entries: list[ModelEntry] = []
    if builtin is not None:
        e = describe_folder(builtin, "built-in") if builtin.exists() else None
        entries.append(ModelEntry(None, "built-in: SmolLM2-135M ×8 experts", "Mixtral", e.params if e else 0,
                                  8, e.size_bytes if e else 0, "built-in"))
    for root in folders:
        if root.is_dir():
            for sub in sorted([root, *root.iterdir()]):
                if sub.is_dir() and (e := describe_folder(sub, "folder")):
                    entries.append(e)
    hub = hf_cache_dir()
    if hub.is_dir():
        for snap in sorted(hub.glob("models--*/snapshots/*")):
            if e := describe_folder(snap, "HF cache"):
                name = snap.parent.parent.name.removeprefix("models--").replace("--", "/")
                entries.append(ModelEntry(e.path, name, e.family, e.params, e.experts, e.size_bytes, e.source))
    return entries


def _human(n: float, unit: str) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f} {suffix}{unit}"
    return f"{n:.0f} {unit}"


class PickerScreen(ModalScreen[ModelEntry | None]):
    """Choose a model; Escape keeps the current one. An error from a failed load is shown on top."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, entries: list[ModelEntry], error: str = "", vram: int | None = None) -> None:
        super().__init__()
        self.entries = entries
        self.error = error
        self.vram = vram  # bytes of GPU memory, None without a GPU

    def compose(self) -> ComposeResult:
        with Vertical(id="picker"):
            yield Label("Models (Enter loads, Esc cancels)")
            yield Static(self.error, id="picker-error")
            yield DataTable(id="models", cursor_type="row")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("model", "family", "params", "experts", "on disk", "fits RAM", "on GPU", "from")
        for e in self.entries:
            unbuilt = e.source == "built-in" and e.size_bytes == 0
            table.add_row(e.name, e.family, "135 M ×8" if unbuilt else _human(e.params, ""), str(e.experts),
                          "built on first use" if unbuilt else _human(e.size_bytes, "B"),
                          "yes" if e.fits else "no (streams)", e.fits_vram(self.vram), e.source)
        table.focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(self.entries[event.cursor_row])
