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

from . import _contract, _dlpack, _lora, _onnx_wire, _safetensors, _sharding, _state

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

        self._torch, self._dist = torch, dist
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

        providers, self.device, self.device_id = self._placement(providers)
        providers = _state.with_tf32(providers, tf32)
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
        # and the optimizer state (the update graph's) live once, in self._state
        self.grad_session = _state.session_without(self.grad_path, state_inputs, session_options, providers)
        self._check_grad_graph()
        # the state this rank holds, and the part of it the update graph writes
        self._sharded = _sharding.Sharded(self, self.shard) if self.shard != "none" else None
        self._held = self._sharded.held if self._sharded else self.state_names
        self._updated = self._sharded.updated if self._sharded else self.state_names
        if self._sharded:
            self.update_session = self._sharded.session(session_options, providers)
        else:
            self.update_session = _state.session_without(self.update_path, state_inputs,
                                                         session_options, providers)
        self._check_update_graph()
        # sharded, on CPU: each run hands its arena memory back when it ends (onnxruntime keeps
        # the largest a run ever needed otherwise), so the gradient graph's working memory and
        # the update's temporaries (of the largest tensor of the shard) are never held at once
        self._run_options = None
        if self._sharded and self.device == "cpu":
            self._run_options = ort.RunOptions()
            self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self._state = self._initial_state()
        self._broken: str | None = None
        self._steps = int(np.asarray(self._state_host(self.step_input)))
        self.skipped_steps = 0
        self.last_step_skipped = False

    # --- setup -------------------------------------------------------------------------------

    def _placement(self, providers):
        torch = self._torch
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
        gin = {i.name for i in (*self.grad_session.get_inputs(),
                                *self.grad_session.get_overridable_initializers())}
        scale = meta.loss_scale_input
        self._scale_input = scale if scale in gin else None
        self.step_input = meta.step_input or self.state_names[-1][0]
        # the update graph may write each listed tensor's next value over the tensor itself
        # (the update graph's list, which the gradient graph's metadata repeats)
        self._in_place: set[str] = set(self.update_contract.in_place or []) & set(meta.state_inputs)
        outs = [o.name for o in self.grad_session.get_outputs()]
        self.grad_names = outs[3:]
        if outs[:3] != self.losses or len(self.grad_names) != len(self.parameter_names):
            raise ValueError(f"{self.grad_path}: outputs {outs[:5]}... are not the losses then one "
                             f"gradient per parameter")
        shapes = {o.name: o.shape for o in self.grad_session.get_outputs()}
        self._shapes = [tuple(int(d) for d in shapes[g]) for g in self.grad_names]
        self._spans, off = [], 0
        for shape in self._shapes:
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            self._spans.append((off, n))
            off += n
        self._numel = off

    def _check_update_graph(self) -> None:
        uin = {i.name for i in (*self.update_session.get_inputs(),
                                *self.update_session.get_overridable_initializers())}
        grads = self._sharded.own_grads if self._sharded else self.grad_names
        missing = [n for n in [*grads, *(i for i, _ in self._updated)] if n not in uin]
        if missing:
            raise ValueError(f"{self.update_path}: inputs {missing[:5]} missing")

    def _initial_state(self) -> dict:
        params = set(self.parameter_names)
        names = [i for i, _ in self._held]  # a sharded rank reads only its own moments
        try:
            return _state.initial_state([(self.grad_path, [n for n in names if n in params]),
                                         (self.update_path, [n for n in names if n not in params])],
                                        self.device, self.device_id)
        except KeyError as e:
            raise ValueError(f"{e.args[0]}: every state tensor needs its initial value as an "
                             f"initializer (docs/STEP_GRAPH.md)") from None

    # --- training ----------------------------------------------------------------------------

    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken (the state's step count; fp16 steps skipped for an inf/NaN
        gradient are not counted)."""
        return self._steps

    @property
    def loss_scale(self) -> float | None:
        """fp16: the current loss scale (the same on every rank); None without one."""
        if self._scale_input is None:
            return None
        return float(np.asarray(self._state_host(self._scale_input)).reshape(-1)[0])

    def step(self, batch, lr: float | None = None) -> tuple[float, float, float]:
        """One optimizer step. batch: this rank's shard, a dict (data input name -> numpy array,
        torch tensor or OrtValue), or a list of accumulation_steps such dicts. lr overrides the
        graph's learning rate for this step (the same on every rank). Returns (total, ce_loss,
        number_loss), each the mean over micro-batches and ranks."""
        torch = self._torch
        self._check_usable()
        micro = [batch] if isinstance(batch, dict) else batch
        if not isinstance(micro, (list, tuple)) or len(micro) != self.accumulation_steps \
                or not all(isinstance(b, dict) for b in micro):
            raise TypeError(f"step() takes a dict of data inputs (accumulation_steps=1) or a list of "
                            f"{self.accumulation_steps} such dicts, not {type(batch).__name__}"
                            + (f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else ""))
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating,
                                                                           np.integer))):
            raise TypeError(f"lr must be a number, not {type(lr).__name__}")
        if self._sharded:
            self.last_step_skipped, losses = self._sharded.step(micro, lr)
        else:
            flat = self._gradients(micro)[0]
            if self.world_size > 1:
                self._dist.all_reduce(flat, op=self._dist.ReduceOp.SUM, group=self.group)
            flat.div_(self.world_size * self.accumulation_steps)
            grads = [_dlpack.from_torch(g) for g in self._views(flat)]
            self.last_step_skipped = self._update(list(zip(self.grad_names, grads)), lr)
            del grads
            losses = flat[self._numel:].tolist()
        if self.last_step_skipped:
            self.skipped_steps += 1
        else:
            self._steps += 1
        return tuple(float(x) for x in losses)  # type: ignore[return-value]

    def _gradients(self, micro: list, bounds: list[int] | None = None) -> list:
        """This rank's summed gradients of the micro-batches, flat, then the 3 summed losses.
        bounds (parameter indices): one buffer per run of parameters between them, so that a
        rank can free the others' buffers (default: one buffer). The first micro-batch's
        gradient graph writes into them directly, later ones through a scratch buffer."""
        torch = self._torch
        bounds = bounds or [0, len(self.parameter_names)]
        parts, views = [], []
        for a, b in zip(bounds, bounds[1:]):
            n = sum(m for _, m in self._spans[a:b]) + (3 if b == bounds[-1] else 0)
            parts.append(torch.empty(n, dtype=torch.float32, device=self.torch_device))
            views += self._views(parts[-1], self._spans[a][0] if a < b else 0, a, b)
        losses = parts[-1][-3:]
        losses.zero_()
        scratch = None
        for i, batch in enumerate(micro):
            if i == 1:
                scratch = torch.empty(self._numel, dtype=torch.float32, device=self.torch_device)
                scratch_views = self._views(scratch)
            self._accumulate(batch, views if scratch is None else scratch_views, losses)
            if scratch is not None:
                for g, s in zip(views, scratch_views):
                    g.add_(s)
        return parts

    def _bind_data(self, binding, batch: dict, keep: list) -> None:
        torch = self._torch
        missing = [n for n in self.data_inputs if n not in batch]
        extra = [n for n in batch if n not in self.data_inputs]
        if missing or extra:
            raise ValueError(f"batch must have exactly the data inputs {self.data_inputs}: "
                             f"missing {missing}, unexpected {extra}")
        for name in self.data_inputs:
            v = batch[name]
            if isinstance(v, torch.Tensor):
                v = _dlpack.from_torch(v.contiguous())
            if isinstance(v, ort.OrtValue):
                keep.append(v)
                binding.bind_ortvalue_input(name, v)
            else:
                arr = np.asarray(v, order="C")
                keep.append(arr)
                binding.bind_cpu_input(name, arr)

    def _sync_torch(self) -> None:
        # ORT runs on its own stream: torch's writes must be done before ORT reads them
        if self.device != "cpu":
            self._torch.cuda.current_stream(self.torch_device).synchronize()

    def _views(self, buffer, start: int = 0, first: int = 0, last: int | None = None) -> list:
        """Views of buffer, one per gradient first..last-1 in the gradients' shapes; buffer
        starts at flat offset start."""
        return [buffer[off - start:off - start + n].view(shape)
                for (off, n), shape in zip(self._spans[first:last], self._shapes[first:last])]

    def _accumulate(self, batch: dict, grads: list, losses) -> None:
        """Runs the gradient graph on batch; its gradients go into grads (torch views, one per
        parameter), its losses are added to losses."""
        b = self.grad_session.io_binding()
        keep: list = []
        self._bind_data(b, batch, keep)
        for p in self.parameter_names:
            b.bind_ortvalue_input(p, self._state[p])
        if self._scale_input:
            b.bind_ortvalue_input(self._scale_input, self._state[self._scale_input])
        for name in self.losses:
            b.bind_output(name, self.device, self.device_id)
        outputs = [_dlpack.from_torch(g) for g in grads]  # alive until the run is done
        for name, g in zip(self.grad_names, outputs):
            b.bind_ortvalue_output(name, g)
        self._sync_torch()
        self.grad_session.run_with_iobinding(b, self._run_options)
        b.synchronize_outputs()
        outs = b.get_outputs()
        for j, v in enumerate(outs[:3]):
            losses[j].add_(_dlpack.to_torch(v).reshape(()).to(losses.dtype))
        del keep, outputs

    def _update(self, grads: list, lr, feeds: dict | None = None) -> bool:
        """Runs the update graph on grads ((name, OrtValue) pairs) and feeds (name -> host
        array); True when it skipped the step (fp16, an inf/NaN gradient)."""
        b = self.update_session.io_binding()
        for name, _ in self._updated:
            b.bind_ortvalue_input(name, self._state[name])
        for name, g in grads:
            b.bind_ortvalue_input(name, g)
        for name, value in (feeds or {}).items():
            b.bind_cpu_input(name, value)
        if lr is not None:
            b.bind_ortvalue_input(self.lr_input, ort.OrtValue.ortvalue_from_numpy(np.array(lr, np.float32)))
        _state.bind_next(b, self._updated, self._state, self._in_place, self.device, self.device_id)
        if self.skip_output:
            b.bind_output(self.skip_output, "cpu")
        self._sync_torch()
        try:
            self.update_session.run_with_iobinding(b, self._run_options)
        except Exception as e:
            if self._in_place:
                self._broken = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            raise
        b.synchronize_outputs()
        values = b.get_outputs()
        b.clear_binding_inputs()
        _state.take_next(self._updated, self._state, self._in_place, values)
        if not self.skip_output:
            return False
        return bool(np.asarray(values[len(self._updated)].numpy()).reshape(-1)[0])

    # --- state ---------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"{self.update_path}: an update failed while it wrote the state in "
                               f"place ({self._broken}), so the state may be partly updated; "
                               f"load_state() a checkpoint to go on")

    def _state_host(self, name: str) -> np.ndarray:
        return _state.host(self._state[name])

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters, optimizer moments and the step count, copied to host (state input names).
        Sharded: this rank's state (every parameter, the moments of its shard)."""
        self._check_usable()
        return {n: self._state_host(n) for n, _ in self._held}

    def parameters(self) -> dict[str, np.ndarray]:
        """The trained parameters, copied to host."""
        self._check_usable()
        return {n: self._state_host(n) for n in self.parameter_names}

    def load_state_dict(self, state: dict) -> None:
        """Upload a state (e.g. from state_dict()); names, dtypes and shapes must match. Each old
        tensor is released as its new one arrives."""
        self._load(state, copy=True)

    def _load(self, state: dict, copy: bool) -> None:
        names = [n for n, _ in self._held]
        _state.check_state(names, self._state, state)
        _state.replace_state(names, self._state, state, self.device, self.device_id, copy=copy)
        self._broken = None
        self._steps = int(np.asarray(state[self.step_input]))

    def _barrier(self) -> None:
        if self.world_size > 1:
            if self.device == "cpu":
                self._dist.barrier(group=self.group)
            else:
                self._dist.barrier(group=self.group, device_ids=[self.device_id])

    def save_state(self, path) -> Path:
        """Write the state (parameters, optimizer moments, step count) as a safetensors file.
        Call it on every rank: rank 0 writes (all ranks hold the same state), the others wait.
        Sharded: each rank writes its shard beside path (``NAME.shard<r>of<R>.safetensors``) and
        path is their index; it loads with any number of ranks (>= 2) and the same shard mode."""
        path = Path(os.fspath(path))
        meta = {"format": CHECKPOINT_FORMAT, "shard": self.shard,
                "parameters": json.dumps(self.parameter_names),
                "optimizer": json.dumps(self.metadata.get("optimizer")),
                "steps": str(self._steps)}
        if self._sharded:
            self._check_usable()
            self._sharded.save(path, meta)
            return path
        if self.rank == 0:
            self._check_usable()
            # straight from the state's memory on CPU, one tensor at a time off a GPU
            _safetensors.save(path, {n: _state.host_bytes(self._state[n]) for n, _ in self.state_names},
                              meta)
        self._barrier()
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
        tensors = self._sharded.load(path, meta) if self._sharded else _safetensors.load(path)[0]
        self._load(tensors, copy=False)  # the arrays are fresh: the state may keep them

    def save_inference_model(self, original_model, out, strict: bool = True,
                             external_data: bool | None = None) -> Path:
        """original_model with the trained parameters (see StepRunner.save_inference_model,
        external data and LoRA merging included). Call it on every rank: rank 0 writes."""
        if self.rank == 0:
            self._check_usable()
            values = {n: _state.host_bytes(self._state[n]) for n in self.parameter_names}
            if self.contract.lora:
                values = _lora.merged_values(original_model,
                                             _lora.lora_metadata(self.contract, self.grad_path), values)
            _onnx_wire.replace_initializers(original_model, out, values, strict=strict,
                                            external_data=external_data)
        self._barrier()
        return Path(out)

    def save_adapter(self, directory, base_model_name_or_path: str | None = None,
                     task_type: str | None = "CAUSAL_LM") -> Path:
        """The trained LoRA adapter as PEFT's files (see StepRunner.save_adapter). Call it on
        every rank: rank 0 writes."""
        lora = _lora.lora_metadata(self.contract, self.grad_path)
        if self.rank == 0:
            self._check_usable()
            names = _lora.lora_names(lora)
            values = {n: _state.host_bytes(self._state[n]) for n in names}
            extra = {n: _state.host_bytes(self._state[n]) for n in self.parameter_names if n not in names}
            _lora.save_adapter(directory, lora, values, base_model_name_or_path, task_type, extra)
        self._barrier()
        return Path(os.fspath(directory))

    def save_onnx_adapter(self, out, adapter_version: int = 1, model_version: int = 1,
                          original_model=None, out_model=None) -> Path:
        """The trained A and B as an onnxruntime ``.onnx_adapter`` file, and with original_model
        and out_model the model taking them as inputs (see StepRunner.save_onnx_adapter). Call
        it on every rank: rank 0 writes."""
        lora = _lora.lora_metadata(self.contract, self.grad_path)
        if self.rank == 0:
            self._check_usable()
            values = {n: self._state_host(n) for n in _lora.lora_names(lora)}
            _lora.save_onnx_adapter(out, lora, values, adapter_version, model_version)
            if original_model is not None or out_model is not None:
                _lora.write_serving_model(original_model, self.grad_path, out_model)
        self._barrier()
        return Path(os.fspath(out))

    def __repr__(self) -> str:
        return (f"DataParallel({str(self.grad_path)!r}, rank {self.rank}/{self.world_size}, "
                f"device={self.device}:{self.device_id}, accumulation_steps="
                f"{self.accumulation_steps}, shard={self.shard!r}, steps_taken={self._steps})")
