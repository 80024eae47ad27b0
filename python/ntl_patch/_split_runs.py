"""The two runs of one DataParallel step on the `--split` graphs: the gradient graph writing into
torch buffers laid out by a GradientLayout (GradientRun), and the update graph writing the
training state (UpdateRun). The training strategies (_replicated, _sharding) call them around
their collective calls; the OrtValues and torch tensors share memory through DLPack."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from . import _dlpack
from ._gradient_layout import GradientLayout
from ._training_state import TrainingState


def sync_torch(torch, device: str, torch_device) -> None:
    # ORT runs on its own stream: torch's writes must be done before ORT reads them
    if device != "cpu":
        torch.cuda.current_stream(torch_device).synchronize()


class GradientRun:
    """The gradient graph: a rank's summed gradients of its micro-batches, and the losses.

    data_inputs / losses / parameters: the graph's names (its contract); scale_input: the loss
    scale the gradient graph reads (fp16), or None."""

    def __init__(self, torch, session: ort.InferenceSession, layout: GradientLayout, state: TrainingState,
                 data_inputs: list[str], losses: list[str], parameters: list[str],
                 scale_input: str | None, torch_device, run_options):
        self.torch, self.session, self.layout, self.state = torch, session, layout, state
        self.data_inputs, self.losses, self.parameters = data_inputs, losses, parameters
        self.scale_input = scale_input
        self.torch_device, self.run_options = torch_device, run_options

    def gradients(self, micro: list, bounds: list[int] | None = None) -> list:
        """This rank's summed gradients of the micro-batches, flat, then the 3 summed losses.
        bounds (parameter indices): one buffer per run of parameters between them, so that a
        rank can free the others' buffers (default: one buffer). The first micro-batch's
        gradient graph writes into them directly, later ones through a scratch buffer."""
        torch, layout = self.torch, self.layout
        bounds = bounds or [0, len(self.parameters)]
        parts, views = [], []
        for a, b in zip(bounds, bounds[1:]):
            n = layout.size(a, b) + (3 if b == bounds[-1] else 0)
            parts.append(torch.empty(n, dtype=torch.float32, device=self.torch_device))
            views += layout.views(parts[-1], layout.spans[a][0] if a < b else 0, a, b)
        losses = parts[-1][-3:]
        losses.zero_()
        scratch = None
        for i, batch in enumerate(micro):
            if i == 1:
                scratch = torch.empty(layout.numel, dtype=torch.float32, device=self.torch_device)
                scratch_views = layout.views(scratch)
            self.accumulate(batch, views if scratch is None else scratch_views, losses)
            if scratch is not None:
                for g, s in zip(views, scratch_views):
                    g.add_(s)
        return parts

    def accumulate(self, batch: dict, grads: list, losses) -> None:
        """Runs the gradient graph on batch; its gradients go into grads (torch views, one per
        parameter), its losses are added to losses."""
        state = self.state
        b = self.session.io_binding()
        keep: list = []
        self._bind_data(b, batch, keep)
        state.bind(b, self.parameters)
        if self.scale_input:
            state.bind(b, [self.scale_input])
        for name in self.losses:
            b.bind_output(name, state.device, state.device_id)
        outputs = [_dlpack.from_torch(g) for g in grads]  # alive until the run is done
        for name, g in zip(self.layout.names, outputs):
            b.bind_ortvalue_output(name, g)
        sync_torch(self.torch, state.device, self.torch_device)
        self.session.run_with_iobinding(b, self.run_options)
        b.synchronize_outputs()
        outs = b.get_outputs()
        for j, v in enumerate(outs[:3]):
            losses[j].add_(_dlpack.to_torch(v).reshape(()).to(losses.dtype))
        del keep, outputs

    def _bind_data(self, binding, batch: dict, keep: list) -> None:
        missing = [n for n in self.data_inputs if n not in batch]
        extra = [n for n in batch if n not in self.data_inputs]
        if missing or extra:
            raise ValueError(f"batch must have exactly the data inputs {self.data_inputs}: "
                             f"missing {missing}, unexpected {extra}")
        for name in self.data_inputs:
            v = batch[name]
            if isinstance(v, self.torch.Tensor):
                v = _dlpack.from_torch(v.contiguous())
            if isinstance(v, ort.OrtValue):
                keep.append(v)
                binding.bind_ortvalue_input(name, v)
            else:
                arr = np.asarray(v, order="C")
                keep.append(arr)
                binding.bind_cpu_input(name, arr)


class UpdateRun:
    """The update graph (the whole one, or a rank's cut of it): reads the gradients and the state
    tensors of updated, writes their next values (in place where the graph allows).

    lr_input: the learning-rate input; skip_output: fp16's skipped-step flag, or None."""

    def __init__(self, torch, session: ort.InferenceSession, state: TrainingState,
                 updated: list[tuple[str, str]], lr_input: str, skip_output: str | None,
                 torch_device, run_options):
        self.torch, self.session, self.state, self.updated = torch, session, state, updated
        self.lr_input, self.skip_output = lr_input, skip_output
        self.torch_device, self.run_options = torch_device, run_options

    def __call__(self, grads: list, lr, feeds: dict | None = None) -> bool:
        """Runs the update graph on grads ((name, OrtValue) pairs) and feeds (name -> host
        array); True when it skipped the step (fp16, an inf/NaN gradient)."""
        state = self.state
        b = self.session.io_binding()
        state.bind(b, [name for name, _ in self.updated])
        for name, g in grads:
            b.bind_ortvalue_input(name, g)
        for name, value in (feeds or {}).items():
            b.bind_cpu_input(name, value)
        if lr is not None:
            b.bind_ortvalue_input(self.lr_input, ort.OrtValue.ortvalue_from_numpy(np.array(lr, np.float32)))
        state.bind_next(b, self.updated)
        if self.skip_output:
            b.bind_output(self.skip_output, "cpu")
        sync_torch(self.torch, state.device, self.torch_device)
        state.run(self.session, b, self.run_options)
        b.synchronize_outputs()
        values = b.get_outputs()
        b.clear_binding_inputs()
        state.take_next(self.updated, values)
        if not self.skip_output:
            return False
        return bool(np.asarray(values[len(self.updated)].numpy()).reshape(-1)[0])
