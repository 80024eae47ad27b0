"""The step graph's ``ntl_step`` metadata as one typed object: the contract between the graphs
``ntl-patch step`` writes and the trainers that run them (docs/STEP_GRAPH.md).

It mirrors the Rust struct ``StepMetadata`` (src/passes/contract.rs) field for field; the names
the trainers feed or read (state, learning rate, step count, loss scale, skip flag, the clipping
norm and the overflow flag) come from here and nowhere else. Keys this version does not know are
ignored and keys added after a graph was written default to None, so older and newer graphs
load; a missing or mistyped required key is a ValueError naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ._onnx_decode import read_metadata

METADATA_KEY = "ntl_step"
# graphs written before the metadata named the step count and the loss scale: their
# documented names (docs/STEP_GRAPH.md), taken where the state lists them
OLD_STEP_INPUT = "ntl/state/step"
OLD_LOSS_SCALE_INPUT = "ntl/state/loss_scale"
# what every version wrote; the rest is optional
REQUIRED_KEYS = ("state", "parameters", "lr_input", "losses", "data_inputs")


def _get(d: dict, key: str, kind, where: str, default=...):
    """d[key], checked to be of kind (a type or tuple of types; None allowed where the default
    is None)."""
    if key not in d:
        if default is ...:
            raise ValueError(f"'{METADATA_KEY}' metadata lacks {where}{key}")
        return default
    value = d[key]
    if value is None and default is None:
        return None
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise ValueError(f"'{METADATA_KEY}' metadata: {where}{key} is {value!r}, not a number")
    if not isinstance(value, kind):
        raise ValueError(f"'{METADATA_KEY}' metadata: {where}{key} is {value!r}")
    return value


def _names(d: dict, key: str, where: str = "", default=...) -> list[str] | None:
    value = _get(d, key, list, where, default)
    if value is None:
        return None
    if not all(isinstance(v, str) for v in value):
        raise ValueError(f"'{METADATA_KEY}' metadata: {where}{key} must list names")
    return list(value)


def _object(d: dict, key: str, parse):
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"'{METADATA_KEY}' metadata: {key} is {value!r}, not an object")
    return parse(value)


NUMBER = (int, float)


@dataclass(frozen=True)
class Optimizer:
    """The options as written; a graph written by hand may leave those of the other optimizer
    null."""

    name: str
    lr: float
    beta1: float | None
    beta2: float | None
    eps: float | None
    weight_decay: float | None
    momentum: float | None
    max_grad_norm: float | None

    @classmethod
    def parse(cls, d: dict) -> Optimizer:
        w = "optimizer."
        return cls(_get(d, "name", str, w), _get(d, "lr", NUMBER, w),
                   *(_get(d, k, NUMBER, w, None) for k in ("beta1", "beta2", "eps", "weight_decay", "momentum")),
                   _get(d, "max_grad_norm", NUMBER, w, None))


@dataclass(frozen=True)
class LossScale:
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int

    @classmethod
    def parse(cls, d: dict) -> LossScale:
        w = "loss_scale."
        return cls(*(float(_get(d, k, NUMBER, w)) for k in ("init_scale", "growth_factor", "backoff_factor")),
                   _get(d, "growth_interval", int, w))


@dataclass(frozen=True)
class FusedHead:
    chunk_tokens: int
    hidden: str
    weight: str
    trans_weight: bool
    bias: str
    labels: str
    class_weights: str | None
    # the steps from the projection to the logits, in order: "Tanh", {"Mul": c} or {"Div": c}
    logit_map: list | None

    @classmethod
    def parse(cls, d: dict) -> FusedHead:
        w = "fused_head."
        logit_map = _get(d, "logit_map", list, w, None)
        for step in logit_map or []:
            ok = step == "Tanh" or (isinstance(step, dict) and len(step) == 1 and set(step) <= {"Mul", "Div"}
                                    and isinstance(next(iter(step.values())), (int, float)))
            if not ok:
                raise ValueError(f"'{METADATA_KEY}' metadata: {w}logit_map has the step {step!r}")
        return cls(_get(d, "chunk_tokens", int, w), _get(d, "hidden", str, w), _get(d, "weight", str, w),
                   _get(d, "trans_weight", bool, w), _get(d, "bias", str, w), _get(d, "labels", str, w),
                   _get(d, "class_weights", str, w, None), logit_map)


@dataclass(frozen=True)
class LoraLayer:
    module: str | None
    weight: str
    lora_A: str
    lora_B: str
    in_features: int
    out_features: int
    weight_layout: str
    fan_in_fan_out: bool

    @classmethod
    def parse(cls, d: dict) -> LoraLayer:
        w = "a lora layer's "
        if not isinstance(d, dict):
            raise ValueError(f"'{METADATA_KEY}' metadata: a lora layer is {d!r}")
        layout = _get(d, "weight_layout", str, w)
        if layout not in ("out_in", "in_out"):
            raise ValueError(f"unknown weight_layout {layout!r} of {d.get('weight')!r} (expected "
                             f"'out_in' or 'in_out')")
        return cls(_get(d, "module", str, w, None), _get(d, "weight", str, w), _get(d, "lora_A", str, w),
                   _get(d, "lora_B", str, w), _get(d, "in_features", int, w),
                   _get(d, "out_features", int, w), layout,
                   bool(_get(d, "fan_in_fan_out", bool, w, None)))


@dataclass(frozen=True)
class Lora:
    r: int
    lora_alpha: float
    scaling: float
    use_rslora: bool
    lora_dropout: float
    target_modules: list[str]
    init: str | None
    seed: int | None
    bias: str
    layers: list[LoraLayer]

    @classmethod
    def parse(cls, d: dict) -> Lora:
        w = "lora."
        layers = _get(d, "layers", list, w)
        if not layers:
            raise ValueError(f"'{METADATA_KEY}' metadata: lora.layers is empty")
        r = _get(d, "r", int, w)
        return cls(r, float(_get(d, "lora_alpha", NUMBER, w, None) or r), float(_get(d, "scaling", NUMBER, w)),
                   bool(_get(d, "use_rslora", bool, w, None)),
                   float(_get(d, "lora_dropout", NUMBER, w, None) or 0.0),
                   _names(d, "target_modules", w, None) or [], _get(d, "init", str, w, None),
                   _get(d, "seed", int, w, None), _get(d, "bias", str, w, None) or "none",
                   [LoraLayer.parse(x) for x in layers])


def _floats(values: list | None) -> list[float] | None:
    return None if values is None else [float(v) for v in values]


@dataclass(frozen=True)
class QuantizedLayer:
    weight: str
    module: str | None
    codes: str
    absmax: str | None  # nf4 (double_quant: the absmax' uint8 codes)
    scales: str | None  # int8 / int4
    shape: tuple[int, int]
    weight_layout: str
    absmax_scales: str | None = None  # nf4 double_quant: float32 [ceil(blocks / 256), 1]
    absmax_offset: str | None = None  # nf4 double_quant: float32 scalar

    @classmethod
    def parse(cls, d: dict) -> QuantizedLayer:
        w = "a quantize_base layer's "
        shape = _get(d, "shape", list, w)
        if len(shape) != 2 or not all(isinstance(s, int) for s in shape):
            raise ValueError(f"'{METADATA_KEY}' metadata: {w}shape is {shape!r}")
        absmax, scales = _get(d, "absmax", str, w, None), _get(d, "scales", str, w, None)
        if (absmax is None) == (scales is None):
            raise ValueError(f"'{METADATA_KEY}' metadata: {w}block scales must be named by "
                             f"exactly one of 'absmax' (nf4) and 'scales' (int8/int4)")
        return cls(_get(d, "weight", str, w), _get(d, "module", str, w, None), _get(d, "codes", str, w),
                   absmax, scales, (shape[0], shape[1]), _get(d, "weight_layout", str, w),
                   _get(d, "absmax_scales", str, w, None), _get(d, "absmax_offset", str, w, None))


@dataclass(frozen=True)
class QuantizeBase:
    quant_type: str
    blocksize: int
    double_quant: bool
    code: list[float] | None  # nf4's code table
    qmax: int | None  # int8 / int4
    bytes_before: int
    bytes_after: int
    layers: list[QuantizedLayer]
    absmax_code: list[float] | None = None  # double_quant: the absmax codes' table (256)
    absmax_blocksize: int | None = None  # double_quant: absmax codes per scale (256)

    @classmethod
    def parse(cls, d: dict) -> QuantizeBase:
        w = "quantize_base."
        return cls(_get(d, "quant_type", str, w), _get(d, "blocksize", int, w),
                   bool(_get(d, "double_quant", bool, w, None)),
                   _floats(_get(d, "code", list, w, None)), _get(d, "qmax", int, w, None),
                   _get(d, "bytes_before", int, w),
                   _get(d, "bytes_after", int, w),
                   [QuantizedLayer.parse(x) for x in _get(d, "layers", list, w)],
                   _floats(_get(d, "absmax_code", list, w, None)),
                   _get(d, "absmax_blocksize", int, w, None))


@dataclass(frozen=True)
class Recompute:
    mode: str
    blocks: int
    layers: str | None
    recomputed_nodes: int
    reason: str | None

    @classmethod
    def parse(cls, d: dict) -> Recompute:
        w = "recompute."
        return cls(_get(d, "mode", str, w), _get(d, "blocks", int, w), _get(d, "layers", str, w, None),
                   _get(d, "recomputed_nodes", int, w), _get(d, "reason", str, w, None))


@dataclass(frozen=True)
class LeftAttention:
    node: str
    why: str


@dataclass(frozen=True)
class Attention:
    mode: str
    block: int
    replaced: int
    left: list[LeftAttention]
    reason: str | None
    # --attention onnx: forwards written as the ONNX Attention operator, and those that kept the
    # blockwise forward (with why)
    fused: int | None = None
    blockwise_forward: list[LeftAttention] | None = None

    @classmethod
    def parse(cls, d: dict) -> Attention:
        w = "attention."

        def listed(key: str, default=...) -> list[LeftAttention] | None:
            items = _get(d, key, list, w, default)
            return None if items is None else [
                LeftAttention(_get(x, "node", str, w + key + "."), _get(x, "why", str, w + key + "."))
                for x in items]

        return cls(_get(d, "mode", str, w), _get(d, "block", int, w), _get(d, "replaced", int, w),
                   listed("left"), _get(d, "reason", str, w, None), _get(d, "fused", int, w, None),
                   listed("blockwise_forward", None))


@dataclass(frozen=True)
class StepMetadata:
    """A step graph's (or a ``--split`` graph's) ``ntl_step`` metadata; ``raw`` is the JSON
    object as written (keys this version does not know included)."""

    version: str | None
    state: list[tuple[str, str]]
    parameters: list[str]
    frozen: list[str]
    buffers: list[str]
    optimizer: Optimizer | None
    lr_input: str
    losses: list[str]
    data_inputs: list[str]
    split: bool
    precision: str
    loss_scale: LossScale | None
    skip_output: str | None
    # written since the contract was typed; None in older graphs
    step_input: str | None
    loss_scale_input: str | None
    grad_norm_sq: str | None
    found_inf: str | None
    fused_head: FusedHead | None
    lora: Lora | None
    quantize_base: QuantizeBase | None
    recompute: Recompute | None
    attention: Attention | None
    in_place: list[str] | None
    raw: dict

    @classmethod
    def parse(cls, meta) -> StepMetadata:
        if not isinstance(meta, dict):
            raise ValueError(f"'{METADATA_KEY}' metadata is {type(meta).__name__}, not an object")
        missing = [k for k in REQUIRED_KEYS if k not in meta]
        if missing:
            raise ValueError(f"'{METADATA_KEY}' metadata lacks {', '.join(missing)}")
        state = _get(meta, "state", list, "")
        if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(n, str) for n in p) for p in state):
            raise ValueError(f"'{METADATA_KEY}' metadata: state must list [input, output] name pairs")
        return cls(
            version=_get(meta, "version", str, "", None),
            state=[(i, o) for i, o in state],
            parameters=_names(meta, "parameters"),
            frozen=_names(meta, "frozen", "", None) or [],
            buffers=_names(meta, "buffers", "", None) or [],
            optimizer=_object(meta, "optimizer", Optimizer.parse),
            lr_input=_get(meta, "lr_input", str, ""),
            losses=_names(meta, "losses"),
            data_inputs=_names(meta, "data_inputs"),
            split=bool(_get(meta, "split", bool, "", None)),
            precision=_get(meta, "precision", str, "", None) or "fp32",
            loss_scale=_object(meta, "loss_scale", LossScale.parse),
            skip_output=_get(meta, "skip_output", str, "", None),
            step_input=_get(meta, "step_input", str, "", None) or _old(state, OLD_STEP_INPUT),
            loss_scale_input=(_get(meta, "loss_scale_input", str, "", None)
                              or _old(state, OLD_LOSS_SCALE_INPUT)),
            grad_norm_sq=_get(meta, "grad_norm_sq", str, "", None),
            found_inf=_get(meta, "found_inf", str, "", None),
            fused_head=_object(meta, "fused_head", FusedHead.parse),
            lora=_object(meta, "lora", Lora.parse),
            quantize_base=_object(meta, "quantize_base", QuantizeBase.parse),
            recompute=_object(meta, "recompute", Recompute.parse),
            attention=_object(meta, "attention", Attention.parse),
            in_place=_names(meta, "in_place", "", None),
            raw=meta,
        )

    @property
    def state_inputs(self) -> list[str]:
        return [i for i, _ in self.state]

    @property
    def recomputes(self) -> bool:
        """Whether the backward recomputes layers (`--recompute`)."""
        return self.recompute is not None and self.recompute.blocks > 0


def _old(state, name: str) -> str | None:
    return name if any(i == name for i, _ in state) else None


def read(path: Path) -> StepMetadata:
    """The graph's ``ntl_step`` metadata, parsed (ValueError naming the file and what is wrong)."""
    raw = read_metadata(path).get(METADATA_KEY)
    if raw is None:
        raise ValueError(f"{path}: not a step graph (no '{METADATA_KEY}' metadata); write one with "
                         f"`ntl-patch step MODEL`")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: '{METADATA_KEY}' metadata is not JSON ({e})") from None
    try:
        return StepMetadata.parse(meta)
    except ValueError as e:
        raise ValueError(f"{path}: {e}; write the graph again with `ntl-patch step`") from None
