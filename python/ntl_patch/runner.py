"""Run an ``ntl-patch step`` graph (docs/STEP_GRAPH.md) with plain ONNX Runtime.

Needs only ``onnxruntime`` (any build: CPU, ``onnxruntime-gpu``, ...) and ``numpy``. The training
state (parameters, optimizer moments, step count) stays on the session's device between steps as
OrtValues; each step sends the batch and returns the three loss scalars::

    import numpy as np
    from ntl_patch import StepRunner

    runner = StepRunner("model.step.onnx", providers=["CUDAExecutionProvider"])
    for batch in batches:                    # dict: data input name -> np.ndarray
        lr = 1e-3 * min(1.0, (runner.steps_taken + 1) / 100)    # optional schedule
        total, ce, number = runner.step(batch, lr=lr)
        if runner.steps_taken % 50 == 0:
            print(f"step {runner.steps_taken}: {total:.4f} (ce {ce:.4f}, number {number:.4f})")
    np.savez("checkpoint.npz", **runner.state_dict())    # resume: runner.load_state_dict(...)
    runner.save_inference_model("model.onnx", "model.trained.onnx")

fp16 step graphs (`ntl-patch step --precision fp16`) scale the loss dynamically, as
torch.amp.GradScaler: ``runner.last_step_skipped`` tells whether the last step found an inf/NaN
gradient and changed nothing, ``runner.loss_scale`` is the current scale, ``runner.skipped_steps``
counts the skipped steps (``steps_taken`` counts the applied ones, as the optimizer's step count).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from . import _contract, _exports, _lora
from ._sessions import trainer_providers
from ._step_graph import StepGraph
from ._training_state import TrainingState, initial_values


# execution provider -> IOBinding device type of its memory
_PROVIDER_DEVICE = {
    "CPUExecutionProvider": "cpu",
    "CUDAExecutionProvider": "cuda",
    "TensorrtExecutionProvider": "cuda",
    "NvTensorRTRTXExecutionProvider": "cuda",
    # AMD: ORT's GPU device (untested; with vendor-keyed allocators pass device= explicitly)
    "ROCMExecutionProvider": "cuda",
    "MIGraphXExecutionProvider": "cuda",
    "DmlExecutionProvider": "dml",
    "CANNExecutionProvider": "cann",
    "WebGpuExecutionProvider": "webgpu",
}
_DEFAULT_PROVIDERS = ("CUDAExecutionProvider", "ROCMExecutionProvider", "MIGraphXExecutionProvider",
                      "DmlExecutionProvider")


def _default_providers() -> list[str]:
    available = ort.get_available_providers()
    return [p for p in _DEFAULT_PROVIDERS if p in available][:1] + ["CPUExecutionProvider"]


class StepRunner:
    """Trains with a step graph: one ``InferenceSession`` run per training step.

    path: the step graph (``MODEL.step.onnx``). providers / session_options: as for
    ``onnxruntime.InferenceSession`` (default: CUDA, ROCm, MIGraphX or DirectML when this
    onnxruntime build has it, else CPU). device / device_id: where the state lives (default: the
    first provider's memory, e.g. ``"cuda"``; override for providers not listed in
    ``_PROVIDER_DEVICE``). tf32: float32 matrix products on CUDA in TF32 (True) or strict float32
    (False); default: strict, as torch's default, unless the CUDA provider's options give
    ``use_tf32`` (onnxruntime's own default is TF32). Without session_options, ORT logs errors only, its memory pattern
    is off (with it, the second step plans a second full-size block that stays: peak RSS
    1.3-1.7x higher) and the CPU arena grows by what is asked for, not to the next power of two
    (0.92x instead of 1.03x torch eager's peak on the Qwen2-0.5B shape; bench/README.md). The
    CUDA and ROCm providers' arenas grow so too (``arena_extend_strategy="kSameAsRequested"``)
    unless their options say otherwise.

    The state lives once, in OrtValues this runner owns: the session is built without the
    state's initializers (their values are uploaded once), and each step writes the next value
    of every tensor the graph marks ``in_place`` (the optimizer moments, the step count) into
    that tensor's own memory; the trained parameters get new memory, and the old values are
    released when the step returns.
    """

    def __init__(self, path, providers=None, session_options=None, *, device: str | None = None,
                 device_id: int | None = None, tf32: bool | None = None):
        self.path = Path(os.fspath(path))
        # the graph's contract (_contract); metadata: the same as the JSON object it was read from
        self.contract: _contract.StepMetadata = _contract.read(self.path)
        meta = self.contract
        self.metadata: dict = meta.raw
        self.state_names: list[tuple[str, str]] = list(meta.state)
        self.parameter_names: list[str] = list(meta.parameters)
        self.data_inputs: list[str] = list(meta.data_inputs)
        self.losses: list[str] = list(meta.losses)
        self.lr_input: str | None = meta.lr_input
        # fp16: the bool output telling a skipped step (None for graphs without loss scaling)
        self.skip_output: str | None = meta.skip_output
        state_inputs = meta.state_inputs

        providers = list(providers) if providers is not None else _default_providers()
        self._graph = StepGraph.load(self.path, meta, session_options, trainer_providers(providers, tf32))
        self.session = self._graph.session
        absent = self._graph.missing(self.data_inputs + state_inputs,
                                     self.losses + [o for _, o in self.state_names] +
                                     ([self.skip_output] if self.skip_output else []))
        if absent or len(self.losses) != 3:
            raise ValueError(f"{self.path}: graph does not match its 'ntl_step' metadata "
                             f"(missing {absent[:5]}, losses {self.losses}); split-form graphs "
                             f"(--split) are not run by StepRunner")
        if self.lr_input is not None and self.lr_input not in self._graph.inputs:
            raise ValueError(f"{self.path}: lr input {self.lr_input!r} is not a graph input")
        self._input_types = self._graph.input_types

        provider = self.session.get_providers()[0]
        self.device = device or _PROVIDER_DEVICE.get(provider, "cpu")
        if device_id is None:
            opts = self.session.get_provider_options().get(provider, {})
            device_id = int(opts.get("device_id", 0) or 0)
        self.device_id = device_id

        try:
            values = initial_values([(self.path, state_inputs)], self.device, self.device_id)
        except KeyError as e:
            raise ValueError(f"{e.args[0]}: every state input needs its initial value as an "
                             f"initializer (docs/STEP_GRAPH.md)") from None
        # the state, held once: each step writes the `in_place` tensors over themselves
        self._training = TrainingState(
            values, self.state_names, set(meta.in_place or []) & set(state_inputs), self.device,
            self.device_id, meta.step_input,
            failed=f"{self.path}: a step failed while it updated the state in place",
            remedy="load_state_dict() a saved state to go on")
        self.skipped_steps = 0
        self.last_step_skipped = False

    # --- training -----------------------------------------------------------------------------

    @property
    def steps_taken(self) -> int:
        """Steps applied by this runner (plus the step count of a state loaded by
        load_state_dict); fp16 steps skipped for an inf/NaN gradient are not counted."""
        return self._training.steps

    @property
    def loss_scale(self) -> float | None:
        """fp16: the current loss scale (state ``ntl/state/loss_scale``); None without one."""
        name = self.contract.loss_scale_input
        if name is None or name not in self._training.values:
            return None
        return self._training.scalar(name)

    @property
    def in_place(self) -> list[str]:
        """The state inputs each step updates in their own memory (the graph's ``in_place``)."""
        return [n for n, _ in self.state_names if n in self._training.in_place]

    def step(self, batch: dict, lr: float | None = None) -> tuple[float, float, float]:
        """One training step on batch (data input name -> array); lr overrides the graph's
        learning rate for this step. Returns (total, ce_loss, number_loss)."""
        state = self._training
        state.check_usable()
        arrays = self._check_batch(batch)
        # A new binding per step: the output OrtValues reference the binding that made them
        # (onnxruntime <= 1.19 frees them if that binding is cleared or reused).
        b = self.session.io_binding()
        keep = []  # host arrays must outlive the run
        for name, value in arrays.items():
            if isinstance(value, ort.OrtValue):
                b.bind_ortvalue_input(name, value)
            else:
                keep.append(value)
                b.bind_cpu_input(name, value)
        state.bind(b, [name for name, _ in self.state_names])
        if lr is not None:
            if self.lr_input is None:
                raise ValueError(f"{self.path}: the graph has no lr input; step(lr=...) is not possible")
            lr_arr = np.array(lr, dtype=self._input_types.get(self.lr_input) or np.float32)
            # bind_cpu_input cannot bind an input that has an initializer: bind an OrtValue
            b.bind_ortvalue_input(self.lr_input, ort.OrtValue.ortvalue_from_numpy(lr_arr))
        for name in self.losses:
            b.bind_output(name, "cpu")
        state.bind_next(b, self.state_names)
        if self.skip_output:
            b.bind_output(self.skip_output, "cpu")
        state.run(self.session, b)
        values = b.get_outputs()
        b.clear_binding_inputs()  # release the previous parameters; the outputs stay with b
        losses = tuple(float(np.asarray(v.numpy()).reshape(-1)[0]) for v in values[:3])
        n = len(self.state_names)
        state.take_next(self.state_names, values[3:3 + n])
        self.last_step_skipped = bool(self.skip_output) and bool(np.asarray(values[3 + n].numpy()).reshape(-1)[0])
        if self.last_step_skipped:
            self.skipped_steps += 1
        else:
            state.steps += 1
        del keep
        return losses  # type: ignore[return-value]

    def _check_batch(self, batch) -> dict:
        if not isinstance(batch, dict):
            raise TypeError(f"batch must be a dict of data input name -> array, not {type(batch).__name__}")
        missing = [n for n in self.data_inputs if n not in batch]
        extra = [n for n in batch if n not in self.data_inputs]
        if missing or extra:
            raise ValueError(f"batch must have exactly the data inputs {self.data_inputs}: "
                             f"missing {missing}, unexpected {extra}")
        out = {}
        for name in self.data_inputs:
            value = batch[name]
            if not isinstance(value, ort.OrtValue):
                value = np.ascontiguousarray(value)
                want = self._input_types.get(name)
                if want is not None and value.dtype != want:
                    raise ValueError(f"batch[{name!r}] is {value.dtype}, the graph wants "
                                     f"{np.dtype(want)}")
            out[name] = value
        return out

    # --- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every state tensor (parameters, optimizer state, step count) copied to host, keyed by
        its state input name."""
        return self._training.state_dict()

    def parameters(self) -> dict[str, np.ndarray]:
        """The trained parameters copied to host, keyed by initializer name."""
        return self._training.parameters(self.parameter_names)

    def load_state_dict(self, state: dict) -> None:
        """Upload a state from state_dict() (e.g. a checkpoint) to the device, one tensor at a
        time (each old tensor is released as its new one arrives)."""
        self._training.load(state)

    # --- export -------------------------------------------------------------------------------

    def save_inference_model(self, original_model, out, strict: bool = True,
                             external_data: bool | None = None) -> Path:
        """Write original_model (an ONNX file whose initializers carry the parameter names, e.g.
        the exported training graph or a logits-only model) to out with each trained parameter's
        initializer replaced by its trained value; every other byte is kept. Atomic.
        strict=False skips parameters the model does not hold.

        external_data: None (default) writes the weights as ONNX external data, in
        ``<out name>.data`` beside out, when original_model has external data or would not fit
        protobuf's 2 GB inline; True always, False never (ValueError when it would not fit).
        With external data, out and its data file are all the model needs (the original's
        other external initializers are copied into the data file). The float32 master copies
        of a float16/bfloat16 export (`--precision`) are rounded to its type. For a LoRA graph
        (`--lora-r`) each adapted weight becomes ``W + scaling·B·A`` (float32 arithmetic, stored
        in the weight's own type): the merged model, as PEFT's ``merge_and_unload()``. For a
        QLoRA graph (``--quantize-base``) W is the dequantised base the step trained on, as
        ``merge_and_unload()`` on a 4-bit base."""
        self._training.check_usable()
        _exports.trained_model(self._training, self.parameter_names, self.contract, self.path,
                               original_model, out, strict, external_data)
        return Path(out)

    # --- LoRA (`ntl-patch step --lora-r R`) ---------------------------------------------------

    def save_adapter(self, directory, base_model_name_or_path: str | None = None,
                     task_type: str | None = "CAUSAL_LM") -> Path:
        """Write the trained LoRA adapter as Hugging Face PEFT saves one: ``adapter_config.json``
        and ``adapter_model.safetensors`` (keys ``base_model.model.<module>.lora_A.weight`` /
        ``.lora_B.weight``) in directory, so ``peft.PeftModel.from_pretrained(base, directory)``
        loads it. base_model_name_or_path goes into the config (e.g. the hub id the model was
        exported from); task_type None for a base model that is not a transformers causal LM
        (PEFT's CAUSAL_LM wrapper needs ``prepare_inputs_for_generation``). Layers whose module
        path the export lost are written under their ONNX weight names, with a warning.
        Parameters trained with ``--train`` go in as PEFT's ``modules_to_save`` (the whole
        module is then PEFT's trained copy; the weight of an adapted layer cannot be, and is
        left out with a warning). ValueError for a graph without LoRA. Atomic."""
        self._training.check_usable()
        lora = _lora.lora_metadata(self.contract, self.path)
        return _exports.peft_adapter(self._training, self.parameter_names, lora, directory,
                                     base_model_name_or_path, task_type)

    def save_onnx_adapter(self, out, adapter_version: int = 1, model_version: int = 1,
                          original_model=None, out_model=None) -> Path:
        """Write the trained A and B tensors (float32, under their parameter names) as an
        onnxruntime ``.onnx_adapter`` file: a model that takes those names as inputs runs them
        through ``RunOptions.add_active_adapter(onnxruntime.LoraAdapter)``. With original_model
        (the export the step graph was made from, or one of the same model keeping its names)
        and out_model, also that model (`ntl-patch lora-model`). Needs onnxruntime >= 1.20
        (``onnxruntime.AdapterFormat``; RuntimeError otherwise, nothing written). Atomic."""
        self._training.check_usable()
        lora = _lora.lora_metadata(self.contract, self.path)
        return _exports.onnx_adapter(self._training, lora, self.path, out, adapter_version,
                                     model_version, original_model, out_model)

    def __repr__(self) -> str:
        return (f"StepRunner({str(self.path)!r}, device={self.device}:{self.device_id}, "
                f"parameters={len(self.parameter_names)}, steps_taken={self._training.steps})")
