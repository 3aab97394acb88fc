"""Activation-aware int4 (AWQ-style) for Llama-family models, applied in place to a float model.

1. Forward pre-hooks record, over the calibration set, each linear input's mean |x| per channel and
   a seeded sample of input rows.
2. For every group of linears that share an input, search alpha on a grid: s = mean|x|^alpha
   (normalised), quantize W*s, and keep the s whose output on the sampled rows, Q(W*s) (x/s), is
   closest to W x. alpha = 0 is plain round-to-nearest, so the search never does worse than it.
3. Fold s into the op that produces the input (x/s): an RMSNorm's weight, or the rows of the linear
   before (v_proj before o_proj, up_proj before down_proj), so the float model computes the same.
4. Search a clipping ratio per weight group (shrinking its [min, max]) that minimises the error of
   that group's partial products. q/k are left unclipped: attention scores amplify their errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from rebar.kernels.attention import AttentionMetadata, KVCache, pad_block_tables
from rebar.model.llama import LlamaModel, RMSNorm
from rebar.quant.int_formats import fake_quantize_int4

NUM_ALPHAS = 20  # alpha in {0, 0.05, ..., 0.95}
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(10))  # 1.0 down to 0.55
_CLIP_OUT_CHUNK = 256  # output channels per step of the clip search (bounds its memory)
_UNCLIPPED = ("attn.q_proj", "attn.k_proj")


@dataclass(frozen=True)
class ScaleGroup:
    """Linears of one layer that read the same input, and the op whose output that input is."""

    linears: tuple[str, ...]  # module paths; the first one's input is recorded
    previous: str  # RMSNorm (weight /= s) or Linear (output rows /= s)
    kv_repeat: int = 1  # o_proj under grouped-query attention: one scale per v channel, shared by heads


def scale_groups(model: LlamaModel) -> list[ScaleGroup]:
    config = model.config
    groups = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        groups += [
            ScaleGroup((p + "attn.q_proj", p + "attn.k_proj", p + "attn.v_proj"), p + "input_norm"),
            ScaleGroup((p + "attn.o_proj",), p + "attn.v_proj", config.num_heads // config.num_kv_heads),
            ScaleGroup((p + "mlp.gate_proj", p + "mlp.up_proj"), p + "post_attn_norm"),
            ScaleGroup((p + "mlp.down_proj",), p + "mlp.up_proj"),
        ]
    return groups


# ----- recording activations -------------------------------------------------------------------


@dataclass
class _Recording:
    abs_sum: torch.Tensor | None = None
    num_rows: int = 0
    samples: list[torch.Tensor] = field(default_factory=list)


class ActivationRecorder:
    """Forward pre-hooks on `modules` (path -> module): mean |x| per input channel over every row seen,
    and up to `rows_per_call` rows per forward call, chosen by a seeded generator."""

    def __init__(self, modules: dict[str, nn.Module], rows_per_call: int, seed: int) -> None:
        self.modules = modules
        self.rows_per_call = rows_per_call
        self.generator = torch.Generator().manual_seed(seed)
        self.recordings = {name: _Recording() for name in modules}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, name: str) -> Callable:
        def record(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            rows = args[0].reshape(-1, args[0].shape[-1]).float()
            entry = self.recordings[name]
            total = rows.abs().sum(0)
            entry.abs_sum = total if entry.abs_sum is None else entry.abs_sum + total
            entry.num_rows += rows.shape[0]
            picked = torch.randperm(rows.shape[0], generator=self.generator)[: self.rows_per_call]
            entry.samples.append(rows[picked.sort().values].clone())

        return record

    def __enter__(self) -> ActivationRecorder:
        self._handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in self.modules.items()]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()

    def mean_abs(self, name: str) -> torch.Tensor:  # [in]
        entry = self.recordings[name]
        return entry.abs_sum / entry.num_rows

    def samples(self, name: str) -> torch.Tensor:  # [rows, in]
        return torch.cat(self.recordings[name].samples)


@torch.inference_mode()
def run_sequence(model: LlamaModel, token_ids: Sequence[int], block_size: int = 16) -> torch.Tensor:
    """Hidden states [len, hidden] of one sequence from an empty, private KV cache."""
    config = model.config
    device = model.embed_tokens.weight.device
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    dtype = model.norm.weight.dtype
    cache = KVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device)
    meta = AttentionMetadata(
        query_lens=(num_tokens,),
        context_lens=(num_tokens,),
        slot_mapping=torch.arange(num_tokens, device=device),  # blocks 0..n-1 in order: slot == position
        block_tables=pad_block_tables([list(range(num_blocks))], device),
    )
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    return model(ids, torch.arange(num_tokens, device=device), meta, cache)


# ----- searches ---------------------------------------------------------------------------------


def _expand_kv(scales: torch.Tensor, kv_repeat: int, head_dim: int) -> torch.Tensor:
    """Per-v-channel scales [kv_heads * head_dim] -> per-o_proj-input scales [heads * head_dim]."""
    if kv_repeat == 1:
        return scales
    per_head = scales.reshape(-1, 1, head_dim).expand(-1, kv_repeat, head_dim)
    return per_head.reshape(-1)


def _reduce_kv(per_channel: torch.Tensor, kv_repeat: int, head_dim: int) -> torch.Tensor:
    """Inverse direction of `_expand_kv`: average the heads that share a v channel."""
    if kv_repeat == 1:
        return per_channel
    return per_channel.reshape(-1, kv_repeat, head_dim).mean(1).reshape(-1)


@dataclass(frozen=True)
class ScaleSearch:
    alpha: float
    scales: torch.Tensor  # the searched variable: [in] (or [kv channels] for o_proj under GQA)
    rtn_error: float  # mean squared output error at alpha = 0 (plain round-to-nearest)
    error: float  # at the chosen alpha


def search_scales(
    weight: torch.Tensor,  # [out, in], the group's linears stacked
    inputs: torch.Tensor,  # [rows, in]
    mean_abs: torch.Tensor,  # [n] per searched channel
    group_size: int,
    expand: Callable[[torch.Tensor], torch.Tensor] = lambda s: s,
) -> ScaleSearch:
    reference = inputs @ weight.T
    best: ScaleSearch | None = None
    rtn_error = math.inf
    for step in range(NUM_ALPHAS):
        alpha = step / NUM_ALPHAS
        scales = mean_abs.pow(alpha).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        full = expand(scales)
        quantized = fake_quantize_int4(weight * full, group_size) / full
        error = (inputs @ quantized.T - reference).pow(2).mean().item()
        if step == 0:
            rtn_error = error
        if best is None or error < best.error:
            best = ScaleSearch(alpha, scales, rtn_error, error)
    assert best is not None
    return ScaleSearch(best.alpha, best.scales, rtn_error, best.error)


def search_clip(weight: torch.Tensor, inputs: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group clip ratio [out, num_groups] minimising each group's partial-product error."""
    out_features, in_features = weight.shape
    num_groups = in_features // group_size
    x = inputs.reshape(-1, num_groups, group_size)  # [rows, groups, g]
    best_ratio = torch.ones(out_features, num_groups)
    for start in range(0, out_features, _CLIP_OUT_CHUNK):
        w = weight[start : start + _CLIP_OUT_CHUNK]
        grouped = w.reshape(-1, num_groups, group_size)
        reference = torch.einsum("ngk,ogk->nog", x, grouped)
        best_error = torch.full((w.shape[0], num_groups), math.inf)
        for ratio in CLIP_RATIOS:
            quantized = fake_quantize_int4(w, group_size, ratio).reshape(-1, num_groups, group_size)
            error = (torch.einsum("ngk,ogk->nog", x, quantized) - reference).pow(2).mean(0)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_ratio[start : start + w.shape[0]][better] = ratio
    return best_ratio


# ----- applying ---------------------------------------------------------------------------------


def _fold(model: nn.Module, group: ScaleGroup, scales: torch.Tensor, full: torch.Tensor) -> None:
    previous = model.get_submodule(group.previous)
    if isinstance(previous, RMSNorm):
        previous.weight.div_(full)
    else:  # a Linear whose output rows feed this group
        previous.weight.div_(scales.unsqueeze(1))
        if previous.bias is not None:
            previous.bias.div_(scales)
    for path in group.linears:
        model.get_submodule(path).weight.mul_(full)


@dataclass(frozen=True)
class AwqResult:
    clip_ratios: dict[str, torch.Tensor]  # weight name -> [out, num_groups]
    searches: dict[str, ScaleSearch]  # first linear of each group -> its search


@torch.inference_mode()
def record_activations(
    model: LlamaModel,
    sequences: Sequence[Sequence[int]],
    num_sample_rows: int = 512,
    seed: int = 0,
    progress: Callable[[str, int], Callable[[], None]] | None = None,
) -> ActivationRecorder:
    """Run the calibration sequences through `model`, recording the input of each scale group."""
    recorded = {group.linears[0]: model.get_submodule(group.linears[0]) for group in scale_groups(model)}
    rows_per_call = max(1, -(-num_sample_rows // len(sequences)))
    recorder = ActivationRecorder(recorded, rows_per_call, seed)
    tick = progress("calibrating", len(sequences)) if progress else lambda: None
    with recorder:
        for ids in sequences:
            run_sequence(model, ids)
            tick()
    return recorder


@torch.inference_mode()
def apply_awq(
    model: LlamaModel,
    recorder: ActivationRecorder,
    group_size: int,
    progress: Callable[[str, int], Callable[[], None]] | None = None,
) -> AwqResult:
    """Search and fold scales (in place), then pick clip ratios, for every decoder-layer linear.

    `recorder` holds what `record_activations` saw on this model before any scaling.
    `progress(label, total)` returns a callback called once per finished unit (optional).
    """
    groups = scale_groups(model)
    head_dim = model.config.head_dim
    searches: dict[str, ScaleSearch] = {}
    scaled_inputs: dict[str, torch.Tensor] = {}
    tick = progress("searching scales", len(groups)) if progress else lambda: None
    for group in groups:
        first = group.linears[0]
        expand = lambda s, r=group.kv_repeat: _expand_kv(s, r, head_dim)  # noqa: E731
        weight = torch.cat([model.get_submodule(p).weight for p in group.linears])
        inputs = recorder.samples(first)
        mean_abs = _reduce_kv(recorder.mean_abs(first), group.kv_repeat, head_dim)
        search = search_scales(weight, inputs, mean_abs, group_size, expand)
        full = expand(search.scales)
        _fold(model, group, search.scales, full)
        searches[first] = search
        for path in group.linears:
            scaled_inputs[path] = inputs / full
        tick()

    clip_ratios = {}
    clipped = [path for path in scaled_inputs if not path.endswith(_UNCLIPPED)]
    tick = progress("searching clip ratios", len(clipped)) if progress else lambda: None
    for path in clipped:
        clip_ratios[f"{path}.weight"] = search_clip(model.get_submodule(path).weight, scaled_inputs[path], group_size)
        tick()
    return AwqResult(clip_ratios, searches)
