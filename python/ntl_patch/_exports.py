"""What both trainers write from their training state once trained: the model with the trained
parameters (LoRA merged), and a LoRA step graph's adapter as PEFT's files or as an onnxruntime
``.onnx_adapter``. The trainers check first (a usable state; DataParallel: rank 0 writes)."""

from __future__ import annotations

from pathlib import Path

from . import _contract, _lora
from ._onnx_rewrite import replace_initializers
from ._training_state import TrainingState


def trained_model(state: TrainingState, parameters: list[str], contract: _contract.StepMetadata,
                  graph: Path, original_model, out, strict: bool, external_data: bool | None) -> None:
    """original_model written to out with the trained parameters. A QLoRA graph's merged weights
    start from the base the step trained on (dequantised from graph's codes, as PEFT's
    merge_and_unload on a 4-bit base), not from original_model's float ones."""
    values = {n: state.host_bytes(n) for n in parameters}
    if contract.lora:
        quantized = contract.quantize_base
        bases = _lora.dequantised_bases(graph, quantized) if quantized else None
        values = _lora.merged_values(original_model, _lora.lora_metadata(contract, graph), values, bases)
    replace_initializers(original_model, out, values, strict=strict, external_data=external_data)


def peft_adapter(state: TrainingState, parameters: list[str], lora: dict, directory,
                 base_model_name_or_path: str | None, task_type: str | None) -> Path:
    names = _lora.lora_names(lora)
    values = {n: state.host_bytes(n) for n in names}
    extra = {n: state.host_bytes(n) for n in parameters if n not in names}
    return _lora.save_adapter(directory, lora, values, base_model_name_or_path, task_type, extra)


def onnx_adapter(state: TrainingState, lora: dict, graph: Path, out, adapter_version: int,
                 model_version: int, original_model, out_model) -> Path:
    values = {n: state.host(n) for n in _lora.lora_names(lora)}
    path = _lora.save_onnx_adapter(out, lora, values, adapter_version, model_version)
    if original_model is not None or out_model is not None:
        _lora.write_serving_model(original_model, graph, out_model)
    return path
