"""What the recurrent token mixers (runtime/deltanet.py, runtime/mamba2.py, runtime/shortconv.py) share: their
passes. The input projection runs once over all of a pass's tokens, the mixer's own `scan` over each sequence's state
(the cache's first B rows in `forward`, each segment's row in `forward_rows`), the output projection once."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

from tandem.runtime.state import LayerCaches, StateCache

if TYPE_CHECKING:
    from tandem.runtime.config import ModelConfig
    from tandem.runtime.model import MoEModel, Segment


def own_state(cache: Any, kind: type) -> Any:
    """The state of class `kind` within a model's cache (itself, or a part of a hybrid's LayerCaches)."""
    return cache.part(kind) if isinstance(cache, LayerCaches) else cache


class RecurrentMixer:
    """A token mixer with a recurrent state (runtime/layer_kind.py `Mixer`): a subclass gives its name, module, state
    class, tensors, load and `scan`. Its weights have `proj` and `out` (and their biases, None where it has none)."""

    name: str
    module: str
    cache: type[StateCache]
    host_cache = False  # (its state lives where the model runs; batch mode's cache in RAM beside an accelerator
    # keeps attention's keys and values only)

    def step_refusal(self, cfg: ModelConfig) -> str | None:
        """The decode step runs every recurrent mixer (through `step_args`) where the recurrent kernels do
        (runtime/decode_step.py why_not asks that of the model)."""
        return None

    def step_args(self, model: MoEModel, i: int, w: Any, p: torch.Tensor, out: torch.Tensor
                  ) -> tuple[ctypes.Structure, list[torch.Tensor]]:
        """Layer i's one-token step of row 0, planned for the decode step: its kernel's arguments reading p [1, P]
        (the projection, float32) and writing out [1, inner] (float32), and the buffers they point to besides (the
        caller keeps them)."""
        raise NotImplementedError

    def scan(self, model: MoEModel, i: int, w: Any, p: torch.Tensor, state: Any, rows: int) -> torch.Tensor:
        """Layer i over projections p [B = rows, T, P], `state`'s first `rows` rows updated -> [B, T, inner] in the
        compute dtype, for the output projection."""
        raise NotImplementedError

    def forward(self, model: MoEModel, i: int, w: Any, x: torch.Tensor, start: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        p = model.linear(x, w.proj, w.proj_bias)  # [B, T, P]
        y = self.scan(model, i, w, p, own_state(model.cache, self.cache), x.shape[0])
        return model.linear(y, w.out, w.out_bias, out_dtype=torch.float32)

    def forward_rows(self, model: MoEModel, i: int, w: Any, x: torch.Tensor, segments: list[Segment],
                     rows: list[Any], spans: list[int]) -> torch.Tensor:
        """The projections are one product each over all N tokens; the scan runs segment by segment over its row's
        state."""
        p = model.linear(x, w.proj, w.proj_bias)  # [1, N, P]
        ys = [self.scan(model, i, w, p[:, lo:hi], own_state(row, self.cache), 1)
              for row, lo, hi in zip(rows, spans, spans[1:], strict=False)]
        y = torch.cat(ys, dim=1) if len(ys) > 1 else ys[0]  # [1, N, inner]
        return model.linear(y, w.out, w.out_bias, out_dtype=torch.float32)
