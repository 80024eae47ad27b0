"""Data-parallel training of `ntl-patch step --split` graphs on torch.distributed.

Each rank runs the gradient graph (MODEL.grad.onnx) on its own shard with onnxruntime, the
gradients are averaged over the ranks with one ``torch.distributed.all_reduce`` (gloo on CPU, NCCL
on GPUs; the OrtValues and torch tensors share memory through DLPack), and every rank runs the same
update graph (MODEL.update.onnx) on the same averaged gradient, so all ranks hold the same state.
The semantics are torch's DistributedDataParallel: the gradient is the mean over ranks of each
rank's gradient of its own mean loss (and over the k micro-batches with gradient accumulation);
``--max-grad-norm`` (in the update graph) clips that averaged gradient, as ``clip_grad_norm_``
after DDP's all-reduce does. torch is imported only here, when the class is used::

    # torchrun --nproc-per-node 2 train.py
    import torch.distributed as dist
    from ntl_patch import DataParallel

    dist.init_process_group("gloo")                # or "nccl"; DataParallel does it if not done
    dp = DataParallel("model.grad.onnx")           # model.update.onnx beside it
    for batch in my_shard_of_the_batches:          # dict: data input name -> array
        total, ce, number = dp.step(batch)         # averaged over the ranks
    dp.save_state("ckpt.safetensors")              # every rank calls it; rank 0 writes
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from . import _contract, _exports, _lora, _safetensors, _sharding
from ._collective import Collective
from ._gradient_layout import GradientLayout
from ._replicated import Replicated
from ._sessions import trainer_providers
from ._split_runs import GradientRun, UpdateRun
from ._step_graph import StepGraph
from ._training_state import TrainingState, initial_values

CHECKPOINT_FORMAT = "ntl_patch.DataParallel/1"
_GPU_PROVIDERS = {"CUDAExecutionProvider", "ROCMExecutionProvider", "MIGraphXExecutionProvider"}


def _update_path(grad_graph: Path) -> Path:
    name = grad_graph.name
    stem = name[: -len(".grad.onnx")] if name.endswith(".grad.onnx") else grad_graph.stem
    return grad_graph.with_name(f"{stem}.update.onnx")


def _metadata(path: Path) -> _contract.StepMetadata:
    try:
        meta = _contract.read(path)
    except ValueError as e:
        raise ValueError(f"{e}; write the graphs with `ntl-patch step MODEL --split`") from None
    if not meta.split:
        raise ValueError(f"{path}: a single step graph, not the split form: write MODEL.grad.onnx "
                         f"and MODEL.update.onnx with `ntl-patch step MODEL --split` (a single "
                         f"step graph trains with StepRunner)")
    return meta


def _placement(torch, providers):
    """(providers, device, device_id): default the CUDA provider on GPU LOCAL_RANK when both
    onnxruntime and torch have CUDA, else CPU; the device is the first provider's."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if providers is None:
        if "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available():
            providers = [("CUDAExecutionProvider", {"device_id": local}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
    providers = list(providers)
    first = providers[0]
    name, opts = (first, {}) if isinstance(first, str) else (first[0], dict(first[1]))
    if name in _GPU_PROVIDERS:
        return providers, "cuda", int(opts.get("device_id", local))
    return providers, "cpu", 0


class DataParallel:
    """Trains split step graphs data-parallel over the ranks of torch.distributed.

    grad_graph: MODEL.grad.onnx; update_graph: default MODEL.update.onnx beside it.
    accumulation_steps: k micro-batches per optimizer step (``step`` then takes a list of k
    batches; the gradient is their mean, as torch's loss/k + no_sync accumulation).
    providers / session_options: as for ``onnxruntime.InferenceSession``. Default: the CUDA provider
    on GPU ``LOCAL_RANK`` when both onnxruntime and torch have CUDA, else CPU (pass e.g.
    ``[("ROCMExecutionProvider", {"device_id": r})]`` for AMD). group: a torch.distributed process
    group (default: the world). If torch.distributed is not initialized and torchrun's environment
    is set, ``init_process_group`` is called with gloo (CPU) or NCCL (GPU); with neither, it runs
    as a single process (world size 1).
    shard: "none" (every rank holds the whole state), "optimizer" (ZeRO stage 1: each rank holds
    and updates the optimizer moments of its shard of the parameters only; the gradients are
    all-reduced) or "gradients" (stage 2: each shard's gradient reduced to its owner only); in
    both, a rank keeps only its own shard's reduced gradient; see ``_sharding``.
    tf32: as StepRunner's (default strict float32 on CUDA, as torch).
    """

    def __init__(self, grad_graph, update_graph=None, *, accumulation_steps: int = 1,
                 providers=None, session_options=None, group=None, shard: str = "none",
                 tf32: bool | None = None):
        try:
            import torch
            import torch.distributed as dist
        except ImportError as e:
            raise ImportError(f"ntl_patch.DataParallel needs torch ({e}); install it, e.g. "
                              f"`pip install torch` (StepRunner and the command wrappers do not)") from None

        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) \
                or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an int >= 1, not {accumulation_steps!r}")
        self.accumulation_steps = accumulation_steps
        self.grad_path = Path(os.fspath(grad_graph))
        self.update_path = Path(os.fspath(update_graph)) if update_graph is not None \
            else _update_path(self.grad_path)
        for p in (self.grad_path, self.update_path):
            if not p.is_file():
                raise FileNotFoundError(f"{p}: no such file (write it with `ntl-patch step MODEL --split`)")

        providers, self.device, self.device_id = _placement(torch, providers)
        providers = trainer_providers(providers, tf32)
        self.torch_device = torch.device(self.device if self.device == "cpu" else f"cuda:{self.device_id}")
        self.group = group
        if self.device != "cpu":
            torch.cuda.set_device(self.torch_device)  # NCCL's communicator uses the current device
        if not (dist.is_available() and dist.is_initialized()) and group is None:
            if dist.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                dist.init_process_group("gloo" if self.device == "cpu" else "nccl")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.shard = _sharding.check_mode(shard, self.world_size)
        self._collective = Collective(torch, dist, group, self.world_size, self.rank, self.device,
                                      self.device_id)

        meta = _metadata(self.grad_path)
        umeta = _metadata(self.update_path)
        if meta.state != umeta.state or meta.parameters != umeta.parameters:
            raise ValueError(f"{self.grad_path} and {self.update_path} come from different "
                             f"`ntl-patch step --split` runs (their state differs)")
        # the graphs' contracts (_contract): the update graph's names the tensors of its
        # optimizer; metadata: the gradient graph's, as the JSON object it was read from
        self.contract: _contract.StepMetadata = meta
        self.update_contract: _contract.StepMetadata = umeta
        self.metadata: dict = meta.raw
        state_inputs = meta.state_inputs
        # neither session keeps the state: the parameters (the gradient graph's initializers)
        # and the optimizer state (the update graph's) live once, in self._training
        self._grad_graph = StepGraph.load(self.grad_path, meta, session_options, providers)
        self.grad_session = self._grad_graph.session
        self._check_grad_graph()
        # replicated or sharded: the state this rank holds, the part of it the update graph
        # writes, and the step's collective calls
        if self.shard == "none":
            self._strategy = Replicated(self._layout, self._collective, self.state_names, accumulation_steps)
        else:
            self._strategy = _sharding.Sharded(self.shard, self._layout, self._collective, meta, umeta,
                                               self.update_path, accumulation_steps, self._scale_input,
                                               self.torch_device)
        self.update_session = self._strategy.update_session(self.update_path, state_inputs,
                                                            session_options, providers)
        self._check_update_graph()
        # sharded, on CPU: each run hands its arena memory back when it ends (onnxruntime keeps
        # the largest a run ever needed otherwise), so the gradient graph's working memory and
        # the update's temporaries (of the largest tensor of the shard) are never held at once
        run_options = None
        if self.shard != "none" and self.device == "cpu":
            run_options = ort.RunOptions()
            run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self._training = self._initial_state()
        self._gradient_run = GradientRun(torch, self.grad_session, self._layout, self._training,
                                         self.data_inputs, self.losses, self.parameter_names,
                                         self._scale_input, self.torch_device, run_options)
        self._update_run = UpdateRun(torch, self.update_session, self._training, self._strategy.updated,
                                     self.lr_input, self.skip_output, self.torch_device, run_options)
        self.skipped_steps = 0
        self.last_step_skipped = False

    # --- setup -------------------------------------------------------------------------------

    def _check_grad_graph(self) -> None:
        meta = self.contract
        self.parameter_names: list[str] = list(meta.parameters)
        self.data_inputs: list[str] = list(meta.data_inputs)
        self.losses: list[str] = list(meta.losses)
        self.state_names: list[tuple[str, str]] = list(meta.state)
        self.lr_input: str = meta.lr_input
        # fp16: the update graph's skip output; the gradient graph reads the loss scale (its
        # gradients are scaled; the update graph unscales the averaged gradient and checks it
        # for inf/NaN, which an inf on any rank carries into the average: a global check)
        self.skip_output: str | None = meta.skip_output
        scale = meta.loss_scale_input
        self._scale_input = scale if scale in self._grad_graph.inputs else None
        self.step_input = meta.step_input or self.state_names[-1][0]
        outs = [o.name for o in self._grad_graph.outputs]
        self.grad_names = outs[3:]
        if outs[:3] != self.losses or len(self.grad_names) != len(self.parameter_names):
            raise ValueError(f"{self.grad_path}: outputs {outs[:5]}... are not the losses then one "
                             f"gradient per parameter")
        shapes = {o.name: o.shape for o in self._grad_graph.outputs}
        self._layout = GradientLayout.of(self.grad_names,
                                         [tuple(int(d) for d in shapes[g]) for g in self.grad_names])

    def _check_update_graph(self) -> None:
        uin = {i.name for i in (*self.update_session.get_inputs(),
                                *self.update_session.get_overridable_initializers())}
        missing = [n for n in [*self._strategy.own_grads, *(i for i, _ in self._strategy.updated)]
                   if n not in uin]
        if missing:
            raise ValueError(f"{self.update_path}: inputs {missing[:5]} missing")

    def _initial_state(self) -> TrainingState:
        params = set(self.parameter_names)
        held = self._strategy.held
        names = [i for i, _ in held]  # a sharded rank reads only its own moments
        try:
            values = initial_values([(self.grad_path, [n for n in names if n in params]),
                                     (self.update_path, [n for n in names if n not in params])],
                                    self.device, self.device_id)
        except KeyError as e:
            raise ValueError(f"{e.args[0]}: every state tensor needs its initial value as an "
                             f"initializer (docs/STEP_GRAPH.md)") from None
        # the update graph may write each listed tensor's next value over the tensor itself
        # (the update graph's list, which the gradient graph's metadata repeats)
        in_place = set(self.update_contract.in_place or []) & set(self.contract.state_inputs)
        return TrainingState(values, held, in_place, self.device, self.device_id, self.step_input,
                             failed=f"{self.update_path}: an update failed while it wrote the state in place",
                             remedy="load_state() a checkpoint to go on")

    # --- training ----------------------------------------------------------------------------

    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken (the state's step count; fp16 steps skipped for an inf/NaN
        gradient are not counted)."""
        return self._training.steps

    @property
    def loss_scale(self) -> float | None:
        """fp16: the current loss scale (the same on every rank); None without one."""
        if self._scale_input is None:
            return None
        return self._training.scalar(self._scale_input)

    def step(self, batch, lr: float | None = None) -> tuple[float, float, float]:
        """One optimizer step. batch: this rank's shard, a dict (data input name -> numpy array,
        torch tensor or OrtValue), or a list of accumulation_steps such dicts. lr overrides the
        graph's learning rate for this step (the same on every rank). Returns (total, ce_loss,
        number_loss), each the mean over micro-batches and ranks."""
        self._training.check_usable()
        micro = [batch] if isinstance(batch, dict) else batch
        if not isinstance(micro, (list, tuple)) or len(micro) != self.accumulation_steps \
                or not all(isinstance(b, dict) for b in micro):
            raise TypeError(f"step() takes a dict of data inputs (accumulation_steps=1) or a list of "
                            f"{self.accumulation_steps} such dicts, not {type(batch).__name__}"
                            + (f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else ""))
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating,
                                                                           np.integer))):
            raise TypeError(f"lr must be a number, not {type(lr).__name__}")
        self.last_step_skipped, losses = self._strategy.step(micro, lr, self._gradient_run,
                                                             self._update_run, self._training)
        if self.last_step_skipped:
            self.skipped_steps += 1
        else:
            self._training.steps += 1
        return tuple(float(x) for x in losses)  # type: ignore[return-value]

    # --- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters, optimizer moments and the step count, copied to host (state input names).
        Sharded: this rank's state (every parameter, the moments of its shard)."""
        return self._training.state_dict()

    def parameters(self) -> dict[str, np.ndarray]:
        """The trained parameters, copied to host."""
        return self._training.parameters(self.parameter_names)

    def load_state_dict(self, state: dict) -> None:
        """Upload a state (e.g. from state_dict()); names, dtypes and shapes must match. Each old
        tensor is released as its new one arrives."""
        self._training.load(state, copy=True)

    def save_state(self, path) -> Path:
        """Write the state (parameters, optimizer moments, step count) as a safetensors file.
        Call it on every rank: rank 0 writes (all ranks hold the same state), the others wait.
        Sharded: each rank writes its shard beside path (``NAME.shard<r>of<R>.safetensors``) and
        path is their index; it loads with any number of ranks (>= 2) and the same shard mode."""
        path = Path(os.fspath(path))
        meta = {"format": CHECKPOINT_FORMAT, "shard": self.shard,
                "parameters": json.dumps(self.parameter_names),
                "optimizer": json.dumps(self.metadata.get("optimizer")),
                "steps": str(self._training.steps)}
        self._strategy.save(path, meta, self._training)
        return path

    def load_state(self, path) -> None:
        """Load a save_state() file on every rank (it must be readable from each)."""
        path = Path(os.fspath(path))
        _, meta = _safetensors.load(path, names=())
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: not a DataParallel checkpoint (format {meta.get('format')!r})")
        mode = meta.get("shard", "none")
        if mode != self.shard:
            raise ValueError(f"{path}: a checkpoint of shard={mode!r} training; load it with "
                             f"DataParallel(..., shard={mode!r}), not shard={self.shard!r}")
        tensors = self._strategy.load(path, meta)
        self._training.load(tensors, copy=False)  # the arrays are fresh: the state may keep them

    def save_inference_model(self, original_model, out, strict: bool = True,
                             external_data: bool | None = None) -> Path:
        """original_model with the trained parameters (see StepRunner.save_inference_model,
        external data and LoRA merging included). Call it on every rank: rank 0 writes."""
        if self.rank == 0:
            self._training.check_usable()
            _exports.trained_model(self._training, self.parameter_names, self.contract, self.grad_path,
                                   original_model, out, strict, external_data)
        self._collective.barrier()
        return Path(out)

    def save_adapter(self, directory, base_model_name_or_path: str | None = None,
                     task_type: str | None = "CAUSAL_LM") -> Path:
        """The trained LoRA adapter as PEFT's files (see StepRunner.save_adapter). Call it on
        every rank: rank 0 writes."""
        lora = _lora.lora_metadata(self.contract, self.grad_path)
        if self.rank == 0:
            self._training.check_usable()
            _exports.peft_adapter(self._training, self.parameter_names, lora, directory,
                                  base_model_name_or_path, task_type)
        self._collective.barrier()
        return Path(os.fspath(directory))

    def save_onnx_adapter(self, out, adapter_version: int = 1, model_version: int = 1,
                          original_model=None, out_model=None) -> Path:
        """The trained A and B as an onnxruntime ``.onnx_adapter`` file, and with original_model
        and out_model the model taking them as inputs (see StepRunner.save_onnx_adapter). Call
        it on every rank: rank 0 writes."""
        lora = _lora.lora_metadata(self.contract, self.grad_path)
        if self.rank == 0:
            self._training.check_usable()
            _exports.onnx_adapter(self._training, lora, self.grad_path, out, adapter_version,
                                  model_version, original_model, out_model)
        self._collective.barrier()
        return Path(os.fspath(out))

    def __repr__(self) -> str:
        return (f"DataParallel({str(self.grad_path)!r}, rank {self.rank}/{self.world_size}, "
                f"device={self.device}:{self.device_id}, accumulation_steps="
                f"{self.accumulation_steps}, shard={self.shard!r}, steps_taken={self._training.steps})")
