"""ProfileSession on a plain torch module: one named range per layer, operators ranked, no hooks
left."""

from __future__ import annotations

import torch
from torch import nn

from rebar.obs.profiling import ProfileSession


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x


def test_session_names_layers_ranks_operators_and_removes_its_hooks() -> None:
    model = Tiny()
    session = ProfileSession(model, torch.device("cpu"), top=3).start()
    for _ in range(2):
        model(torch.tensor([1, 2, 3]))
        session.step_done()
    result = session.finish()

    names = {event.get("name") for event in result.trace["traceEvents"]}
    assert {"embed", "layers.0", "layers.1", "layers.0.proj", "layers.1.norm"} <= names
    assert "layers" not in names  # a ModuleList runs nothing itself
    assert result.num_steps == 2 and result.summary()["steps_profiled"] == 2
    selfs = [op.self_ms for op in result.top_operators]
    assert 1 <= len(selfs) <= 3 and selfs == sorted(selfs, reverse=True)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
