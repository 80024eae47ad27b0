"""LoRA step graphs (`ntl-patch step --lora-r R`): the adapters saved as people load them.

The step graph's ``ntl_step`` metadata carries a ``"lora"`` entry (docs/STEP_GRAPH.md): r,
lora_alpha, scaling, the target modules and, per adapted linear layer, the module path PEFT uses
(or null where the export lost it), the base weight's initializer name, the names of the trained
``lora_A`` [r, in] and ``lora_B`` [out, r] parameters and how the initializer stores W
(``"out_in"`` as nn.Linear, ``"in_out"`` as GPT-2's Conv1D or a pre-transposed MatMul weight).
The forward is PEFT's: ``y = base(x) + (x·Aᵀ·Bᵀ)·scaling``.

What StepRunner and DataParallel share:
- ``save_adapter``: Hugging Face PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``
  (keys ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``), as PEFT 0.21.2's
  ``save_pretrained`` writes them, so ``PeftModel.from_pretrained(base, DIR)`` loads them;
- ``merged_values``: the inference model's weights with ``W + scaling·B·A`` folded in (float32
  arithmetic, stored in the original initializer's type);
- ``save_onnx_adapter``: onnxruntime's ``.onnx_adapter`` file of the A and B tensors (onnxruntime
  >= 1.20, ``onnxruntime.AdapterFormat``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np

from . import _contract, _safetensors
from ._array_bytes import ArrayBytes
from ._atomic_write import atomic_write, temp_beside
from ._onnx_decode import initializers, map_file, tensor_to_numpy, type_name, unmap_file

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
# The PEFT release whose files these are: save_pretrained of peft 0.21.2 writes exactly these
# keys (tests/python/test_lora.py compares them with a real save). PEFT's LoraConfig defaults
# for everything ntl-patch does not use.
PEFT_FORMAT_VERSION = "0.21.2"
_PEFT_DEFAULTS = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None,
    "auto_mapping": None, "corda_config": None, "ensure_weight_tying": False, "eva_config": None,
    "exclude_modules": None, "inference_mode": True, "init_lora_weights": True,
    "kasa_config": None, "layer_replication": None, "layers_pattern": None,
    "layers_to_transform": None, "loftq_config": {}, "lora_bias": False, "lora_ga_config": None,
    "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
    "monteclora_config": None, "qalora_group_size": 16, "rank_pattern": {}, "revision": None,
    "target_parameters": None, "trainable_token_indices": None, "use_bdlora": None,
    "use_dora": False, "use_qalora": False, "velora_config": None,
}


def lora_metadata(meta: _contract.StepMetadata, path) -> dict:
    """The graph's ``lora`` metadata as written (checked when the contract parsed it: r,
    scaling, each layer's names, sizes and layout); ValueError (one line) for a graph without
    it."""
    if meta.lora is None:
        raise ValueError(f"{path}: not a LoRA step graph (no 'lora' in its 'ntl_step' metadata); "
                         f"write one with `ntl-patch step MODEL --lora-r R`")
    return meta.raw["lora"]


def lora_names(lora: dict) -> set[str]:
    """The LoRA parameters (every A and B) of a graph's ``lora`` metadata."""
    return {layer[k] for layer in lora["layers"] for k in ("lora_A", "lora_B")}


def _module(layer: dict) -> str:
    """The module path of a layer's PEFT keys: PEFT's, or the ONNX weight name without a
    trailing ``.weight`` where the export lost the module path."""
    module = layer.get("module")
    if module:
        return str(module)
    name = str(layer["weight"])
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _number(x):
    """An integral float as int (PEFT writes lora_alpha as it was given: 8, not 8.0)."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def adapter_config(lora: dict, base_model_name_or_path: str | None = None,
                   task_type: str | None = "CAUSAL_LM", modules_to_save: list[str] | None = None) -> dict:
    """PEFT's adapter_config.json for a graph's ``lora`` metadata (peft 0.21.2's key set)."""
    if lora.get("bias", "none") != "none":
        raise ValueError(f"LoRA bias {lora.get('bias')!r}: only 'none' is written as a PEFT adapter")
    fan_in_fan_out = any(bool(layer.get("fan_in_fan_out")) for layer in lora["layers"])
    config = dict(_PEFT_DEFAULTS)
    config.update({
        "base_model_name_or_path": None if base_model_name_or_path is None else str(base_model_name_or_path),
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "lora_alpha": _number(lora.get("lora_alpha", lora["r"])),
        "lora_dropout": float(lora.get("lora_dropout", 0.0)),
        "modules_to_save": sorted(modules_to_save) if modules_to_save else None,
        "peft_type": "LORA",
        "peft_version": PEFT_FORMAT_VERSION,
        "r": int(lora["r"]),
        "target_modules": list(lora.get("target_modules") or []),
        "task_type": task_type,
        "use_rslora": bool(lora.get("use_rslora", False)),
    })
    return dict(sorted(config.items()))


def _check_scaling(lora: dict) -> float:
    """The metadata's scaling, which must be PEFT's lora_alpha / r (rsLoRA: / sqrt(r))."""
    scaling = float(lora["scaling"])
    r, alpha = float(lora["r"]), float(lora.get("lora_alpha", lora["r"]))
    want = alpha / (math.sqrt(r) if lora.get("use_rslora") else r)
    if not math.isclose(scaling, want, rel_tol=1e-6):
        raise ValueError(f"LoRA scaling {scaling} is not lora_alpha / {'sqrt(r)' if lora.get('use_rslora') else 'r'}"
                         f" = {want}: the graph's metadata is inconsistent")
    return scaling


def adapter_tensors(lora: dict, values) -> tuple[dict, list[str]]:
    """({PEFT key: value}, [layers written under their ONNX weight name]) where values maps the
    LoRA parameter names to arrays (or ArrayBytes)."""
    tensors: dict = {}
    unmapped: list[str] = []
    for layer in lora["layers"]:
        if not layer.get("module"):
            unmapped.append(str(layer["weight"]))
        base = KEY_PREFIX + _module(layer)
        for part in ("lora_A", "lora_B"):
            key = f"{base}.{part}.weight"
            if key in tensors:
                raise ValueError(f"two LoRA layers map to the PEFT key {key!r}")
            tensors[key] = values[layer[part]]
    return tensors, unmapped


def trained_modules(lora: dict, extra) -> tuple[dict, list[str], list[str]]:
    """The trained parameters beyond A and B (``--train``) as PEFT's ``modules_to_save``:
    ({PEFT key: value}, [module paths], [parameters PEFT cannot hold]). A parameter
    ``<module>.<leaf>`` is saved as ``base_model.model.<module>.<leaf>`` (PEFT loads it into
    its copy of the module, whose other parameters keep the base model's values). PEFT cannot
    hold a parameter of a LoRA-adapted layer (a module is a LoRA target or saved whole, not
    both), nor a parameter whose name is no module path (``onnx::MatMul_12``)."""
    adapted = {str(layer["weight"]) for layer in lora["layers"]}
    adapted |= {str(layer["module"]) for layer in lora["layers"] if layer.get("module")}
    tensors: dict = {}
    modules: set[str] = set()
    skipped: list[str] = []
    for name, value in (extra or {}).items():
        module, _, leaf = name.rpartition(".")
        if name in adapted or module in adapted or not module or not leaf or "::" in name or "/" in name:
            skipped.append(name)
            continue
        modules.add(module)
        tensors[KEY_PREFIX + name] = value
    return tensors, sorted(modules), skipped


def _shown(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _write_json(path: Path, obj) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    atomic_write(path, [text.encode("utf-8")])


def save_adapter(directory, lora: dict, values, base_model_name_or_path: str | None = None,
                 task_type: str | None = "CAUSAL_LM", extra=None) -> Path:
    """Write PEFT's adapter_config.json and adapter_model.safetensors into directory. values:
    the A and B tensors by parameter name; extra: the other trained parameters (``--train``),
    written as PEFT's ``modules_to_save`` where PEFT can hold them (a warning names the others).

    A new directory is written whole under a temporary name and renamed into place; in an
    existing one each file is written to a temporary name and renamed (the weights first, so a
    config never describes weights that are not there yet)."""
    _check_scaling(lora)
    tensors, unmapped = adapter_tensors(lora, values)
    saved, modules, skipped = trained_modules(lora, extra)
    clash = [k for k in saved if k in tensors]
    if clash:
        raise ValueError(f"trained parameter key {clash[0]!r} is also a LoRA key")
    tensors.update(saved)
    config = adapter_config(lora, base_model_name_or_path, task_type, modules)
    if unmapped:
        warnings.warn(f"save_adapter: the export lost the module path of {len(unmapped)} adapted "
                      f"layer(s) ({_shown(unmapped)}), so their adapter keys use the ONNX weight "
                      f"names and PEFT cannot map them onto the transformers model (export with "
                      f"the dynamo exporter, or TorchScript with do_constant_folding=False, to "
                      f"keep the module names)", stacklevel=3)
    if skipped:
        warnings.warn(f"save_adapter: {len(skipped)} trained base parameter(s) ({_shown(skipped)}) "
                      f"are not in the adapter: PEFT cannot hold a parameter of a LoRA-adapted layer "
                      f"or a parameter without a module path; save_inference_model writes them",
                      stacklevel=3)
    directory = Path(os.fspath(directory))
    if directory.exists():
        if not directory.is_dir():
            raise NotADirectoryError(f"{directory}: exists and is not a directory")
        _safetensors.save(directory / WEIGHTS_NAME, tensors, {"format": "pt"})
        _write_json(directory / CONFIG_NAME, config)
        return directory
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=parent))
    try:
        _safetensors.save(tmp / WEIGHTS_NAME, tensors, {"format": "pt"})
        _write_json(tmp / CONFIG_NAME, config)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


# --- the merged inference model -----------------------------------------------------------------

def _read_weight(original: Path, name: str) -> tuple[np.ndarray, int]:
    """(float32 value, ONNX data type) of an initializer of the original model; float16 and
    bfloat16 are widened exactly."""
    mm, buf = map_file(original)
    try:
        found = next((t for t in initializers(buf) if t.name == name), None)
        if found is None:
            raise ValueError(f"{original}: no initializer named {name!r}, the base weight of a LoRA "
                             f"layer; pass the model the step graph was made from")
        dtype = found.data_type
        if dtype == 16:  # bfloat16: its bits as uint16, widened to float32
            found.data_type = 4
            bits = tensor_to_numpy(buf, found, original.parent)
            value = (bits.astype(np.uint32) << 16).view(np.float32)
        elif dtype in (1, 10):
            value = tensor_to_numpy(buf, found, original.parent).astype(np.float32)
        else:
            raise ValueError(f"{original}: LoRA base weight {name!r} is "
                             f"{type_name(dtype)}; only float, float16 and bfloat16 merge")
        return value, dtype
    finally:
        unmap_file(mm, buf)


def dequantised_bases(step_graph, quantized: _contract.QuantizeBase) -> dict:
    """Each quantised base weight of a QLoRA step graph (its ``quantize_base`` metadata),
    dequantised as the graph does it, in float32 and in the original weight's layout: nf4 the
    code pair of each byte (high nibble first) times its block's absmax (double_quant: the
    absmax themselves ``absmax_code[q] · scale + offset``, blocks of 256 codes a scale);
    int8/int4 the integer values (int4 two a byte, low nibble first) times their block's
    scale."""
    step_graph = Path(os.fspath(step_graph))
    kind = quantized.quant_type
    nested = quantized.double_quant
    if kind not in ("nf4", "int8", "int4") or (nested and kind != "nf4"):
        raise ValueError(f"{step_graph}: cannot dequantise a {kind!r} base "
                         f"(double_quant={nested}); nf4 (with or without double_quant), int8 "
                         f"and int4 merge")
    if nested and (quantized.absmax_code is None or quantized.absmax_blocksize is None):
        raise ValueError(f"{step_graph}: its double_quant metadata lacks absmax_code / "
                         f"absmax_blocksize; re-run ntl-patch step")
    block = quantized.blocksize
    scales_of = {layer.weight: layer.absmax if kind == "nf4" else layer.scales
                 for layer in quantized.layers}
    wanted = {}
    for layer in quantized.layers:
        wanted[layer.codes] = wanted[scales_of[layer.weight]] = None
        if nested:
            wanted[layer.absmax_scales] = wanted[layer.absmax_offset] = None
    mm, buf = map_file(step_graph)
    try:
        for t in initializers(buf):
            if t.name in wanted:
                if t.data_type == 22:  # int4: read its packed bytes
                    t.data_type, t.dims = 2, [int(np.prod(t.dims)) // 2]
                wanted[t.name] = tensor_to_numpy(buf, t, step_graph.parent)
    finally:
        unmap_file(mm, buf)
    out = {}
    for layer in quantized.layers:
        scales_name = scales_of[layer.weight]
        codes, scales = wanted[layer.codes], wanted[scales_name]
        if codes is None or scales is None:
            raise ValueError(f"{step_graph}: the quantised weight {layer.weight!r} has no "
                             f"{layer.codes!r} / {scales_name!r} initializer")
        if nested:
            scales = _nested_absmax(step_graph, layer, scales, wanted, quantized)
        if kind == "nf4":
            packed = np.asarray(codes, dtype=np.uint8).reshape(-1)
            values = np.asarray(quantized.code, dtype=np.float32)[
                np.stack([packed >> 4, packed & 0x0F], axis=1).reshape(-1)]
        elif kind == "int4":
            packed = np.asarray(codes, dtype=np.uint8).reshape(-1)
            nibbles = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1).astype(np.int8)
            values = np.where(nibbles > 7, nibbles - 16, nibbles).astype(np.float32)
        else:
            values = np.asarray(codes, dtype=np.int8).reshape(-1).astype(np.float32)
        values = values.reshape(-1, block) * np.asarray(scales, np.float32).reshape(-1, 1)
        w = values.reshape(*layer.shape)  # [out, in]
        out[layer.weight] = w.T.copy() if layer.weight_layout == "in_out" else w
    return out


def _nested_absmax(step_graph, layer, codes, wanted: dict, quantized) -> np.ndarray:
    """A double-quantised layer's float32 absmax, as its graph computes them: the dynamic-map
    value of each code times its block of 256's scale (a product), plus the offset (a sum)."""
    scales, offset = wanted[layer.absmax_scales], wanted[layer.absmax_offset]
    if scales is None or offset is None:
        raise ValueError(f"{step_graph}: the quantised weight {layer.weight!r} has no "
                         f"{layer.absmax_scales!r} / {layer.absmax_offset!r} initializer")
    q = np.asarray(codes, dtype=np.uint8).reshape(-1)
    per = np.asarray(scales, np.float32).reshape(-1)[np.arange(q.size) // quantized.absmax_blocksize]
    values = np.asarray(quantized.absmax_code, dtype=np.float32)[q] * per
    return values + np.asarray(offset, np.float32).reshape(())


def merged_values(original, lora: dict, parameters: dict, bases: dict | None = None) -> dict:
    """The initializer values for ``replace_initializers(original, ...)``: every trained
    parameter that is not a LoRA tensor as it is, and each adapted base weight as
    ``W + scaling·B·A`` (transposed for "in_out" layouts), computed in float32. A float16 or
    bfloat16 weight is returned in float32 and rounded to its type when written. A base weight
    that also trained (``--train``) gets its trained value plus the update; one in ``bases``
    (a quantised base, dequantised) is read from there instead of the original."""
    original = Path(os.fspath(original))
    scaling = np.float32(_check_scaling(lora))
    names = lora_names(lora)
    out = {n: v for n, v in parameters.items() if n not in names}
    by_weight: dict[str, list[dict]] = {}
    for layer in lora["layers"]:
        by_weight.setdefault(str(layer["weight"]), []).append(layer)
    for weight, layers in by_weight.items():
        if len({(la["lora_A"], la["lora_B"]) for la in layers}) > 1:
            raise ValueError(f"LoRA base weight {weight!r} has {len(layers)} different adapters; "
                             f"the merged model cannot hold them in one weight")
        layer = layers[0]
        if weight in parameters:
            w = np.asarray(_load(parameters[weight]), dtype=np.float32)
        elif bases and weight in bases:  # a quantised base: the values the step trained on
            w = bases[weight]
        else:
            w, _ = _read_weight(original, weight)
        a = np.asarray(_load(parameters[layer["lora_A"]]), dtype=np.float32)
        b = np.asarray(_load(parameters[layer["lora_B"]]), dtype=np.float32)
        r = int(lora["r"])
        n_in, n_out = int(layer["in_features"]), int(layer["out_features"])
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise ValueError(f"LoRA layer {weight!r}: A {list(a.shape)} and B {list(b.shape)}, "
                             f"expected [{r}, {n_in}] and [{n_out}, {r}]")
        delta = (b @ a) * scaling  # [out, in], as PEFT's get_delta_weight
        if layer["weight_layout"] == "in_out":
            delta = delta.T
        if w.shape != delta.shape:
            raise ValueError(f"LoRA base weight {weight!r} is {list(w.shape)} in {original.name}, the "
                             f"update {list(delta.shape)} ({layer['weight_layout']})")
        out[weight] = (w + delta).astype(np.float32)
    for weight, w in (bases or {}).items():  # quantised bases without an adapter: as trained on
        out.setdefault(weight, w.astype(np.float32))
    return out


def _load(value):
    return value.load() if isinstance(value, ArrayBytes) else value


# --- onnxruntime's adapter format ---------------------------------------------------------------

def has_onnx_adapter_api() -> bool:
    import onnxruntime as ort

    return hasattr(ort, "AdapterFormat") and hasattr(ort.RunOptions, "add_active_adapter")


def write_serving_model(original_model, step_graph, out_model) -> Path:
    """`ntl-patch lora-model`: original_model with the step graph's adapters as inputs."""
    if original_model is None or out_model is None:
        raise ValueError("give both original_model (the export) and out_model (where the model "
                         "with adapter inputs goes), or neither")
    from . import cli

    return Path(cli.lora_model(original_model, step_graph, out=out_model)["output"])


def save_onnx_adapter(out, lora: dict, values, adapter_version: int = 1, model_version: int = 1) -> Path:
    """Write onnxruntime's ``.onnx_adapter`` file holding every A and B under its parameter name
    (float32), atomically. RuntimeError where the installed onnxruntime lacks the adapter API."""
    import onnxruntime as ort

    if not has_onnx_adapter_api():
        raise RuntimeError(f"onnxruntime {ort.__version__} has no adapter API "
                           f"(onnxruntime.AdapterFormat, RunOptions.add_active_adapter; onnxruntime "
                           f">= 1.20): install a newer onnxruntime to write .onnx_adapter files")
    params = {}
    for name in sorted(lora_names(lora)):
        arr = np.ascontiguousarray(_load(values[name]), dtype=np.float32)
        params[name] = ort.OrtValue.ortvalue_from_numpy(arr)
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(int(adapter_version))
    fmt.set_model_version(int(model_version))
    fmt.set_parameters(params)
    out = Path(os.fspath(out))
    fd, tmp = temp_beside(out)  # its mode as the umask asks, like every output
    os.close(fd)
    try:
        fmt.export_adapter(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
