"""ZeRO stage 1 and 2 for DataParallel: the optimizer state split over the ranks (``shard=
"optimizer"``), and with ``shard="gradients"`` the reduced gradient too.

The trained parameters, in the graphs' order, are cut into R contiguous runs of whole tensors
(``partition``: each cut at the tensor edge nearest to r/R of the elements), so the gradient
graph writes one buffer per shard; after the reduction (an all-reduce of each with "optimizer", a
reduce to its owner with "gradients") a rank keeps its own shard's only. Each rank runs the
update graph cut at load time to its own shard (``_graph_cut.cut_graph``): it reads and writes
only its parameters, their moments and the shared scalars (step count, loss scale and its
tracker), each written in place as before. The moments of other shards never exist on a rank, not
even their initial zeros: the initial state is read tensor by tensor, and only the rank's own.
The update graph's two global decisions become inputs of the cut graph, computed from one
all-reduce of Σ‖g‖² over the shards: the squared clipping norm and fp16's overflow flag, the
tensors the update graph's metadata names (``grad_norm_sq``, ``found_inf``), so every rank clips
by the global norm and skips the same steps. Then each owner broadcasts its updated parameters, tensor by tensor into the
other ranks' parameter memory (no staging buffer; gloo has no all-gather of unequal sizes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnxruntime as ort

from . import _contract, _dlpack, _safetensors
from ._collective import Collective
from ._graph_cut import cut_graph, nodes
from ._gradient_layout import GradientLayout
from ._onnx_rewrite import session_model
from ._sessions import default_session_options
from ._split_runs import GradientRun, UpdateRun
from ._training_state import TrainingState

MODES = ("none", "optimizer", "gradients")
FLOAT, BOOL = 1, 9


def check_mode(mode, world_size: int) -> str:
    if mode not in MODES:
        raise ValueError(f"shard must be 'none', 'optimizer' or 'gradients', not {mode!r}")
    if mode != "none" and world_size < 2:
        raise ValueError(f"shard={mode!r} splits the optimizer state over the ranks and needs at "
                         f"least 2 (world size {world_size}): start with `torchrun "
                         f"--nproc-per-node N` (N >= 2), or use shard='none'")
    return mode


def partition(sizes: list[int], ranks: int) -> list[int]:
    """Boundaries b (b[0] = 0, b[ranks] = len(sizes)): rank r owns tensors b[r]..b[r+1]-1. Each
    cut is the tensor edge nearest to r/ranks of the elements (the earlier edge on a tie), so
    the same sizes and ranks always give the same shards."""
    prefix = np.cumsum([0, *sizes], dtype=np.int64)
    bounds = [0]
    for r in range(1, ranks):
        target = prefix[-1] * r / ranks
        edges = range(bounds[-1], len(sizes) + 1)
        bounds.append(min(edges, key=lambda i: (abs(prefix[i] - target), i)))
    return bounds + [len(sizes)]


def state_owners(state_names, parameters) -> dict:
    """state input -> the parameter it belongs to (the parameter itself, or one of its moments,
    ``ntl/state/<param>/<slot>``, listed after it); None for the shared scalars."""
    params, owner, current = set(parameters), {}, None
    for name, _ in state_names:
        if name in params:
            current = name
            owner[name] = name
        else:
            owner[name] = current if current and name.startswith(f"ntl/state/{current}/") else None
    return owner


def shard_file(path: Path, rank: int, world: int) -> Path:
    return path.with_name(f"{path.stem}.shard{rank}of{world}{path.suffix}")



def global_tensor(update_contract: _contract.StepMetadata, update_path: Path, key: str, graph_nodes) -> str:
    """The update graph's tensor its metadata names under key (``grad_norm_sq``, ``found_inf``):
    one that reads every gradient, which the cut graph is fed instead."""
    name = getattr(update_contract, key)
    if name is None or not any(name in n.outputs for n in graph_nodes):
        raise ValueError(f"{update_path}: its metadata names no {key} tensor of the update graph "
                         f"(written before the metadata named it): write the graphs again with "
                         f"this version's `ntl-patch step --split`")
    return name


class Sharded:
    """One rank's shard of the update: which state it holds and updates, its cut update graph,
    the step's reduction, update and broadcast, and checkpoints of its shard.

    contract / update_contract: the gradient and the update graph's; scale_input: the loss
    scale in the state (fp16), or None."""

    def __init__(self, mode: str, layout: GradientLayout, collective: Collective,
                 contract: _contract.StepMetadata, update_contract: _contract.StepMetadata,
                 update_path: Path, accumulation_steps: int, scale_input: str | None, torch_device):
        self.mode, self.layout, self.collective = mode, layout, collective
        self.update_contract, self.update_path = update_contract, update_path
        self.accumulation_steps, self.scale_input, self.torch_device = accumulation_steps, scale_input, torch_device
        self.skip_output = contract.skip_output
        self.parameters = params = list(contract.parameters)
        self.state_names = state_names = list(contract.state)
        rank = collective.rank
        self.bounds = partition([n for _, n in layout.spans], collective.world_size)
        self.shards = [params[a:b] for a, b in zip(self.bounds, self.bounds[1:])]
        self.rank_of = {p: r for r, shard in enumerate(self.shards) for p in shard}
        own = set(self.shards[rank])
        owner = state_owners(state_names, params)
        self.owner = owner
        # every rank holds every parameter (the gradient graph reads them); moments: its own only
        self.held = [(i, o) for i, o in state_names
                     if owner[i] is None or owner[i] == i or owner[i] in own]
        self.updated = [(i, o) for i, o in state_names if owner[i] is None or owner[i] in own]
        first, last = self.bounds[rank], self.bounds[rank + 1]
        self.lo = layout.spans[first][0] if first < len(params) else layout.numel
        self.hi = self.lo + layout.size(first, last)
        self.own_grads = layout.names[first:last]
        self.own_spans = [(off - self.lo, n) for off, n in layout.spans[first:last]]
        self.own_shapes = layout.shapes[first:last]
        self.norm_input = self.found_input = None

    # --- the cut update graph ----------------------------------------------------------------

    def update_session(self, path: Path, drop: list[str], session_options, providers) -> ort.InferenceSession:
        """The update graph at path without any initializer in drop (the state), cut to this
        rank's outputs."""
        model = session_model(path, drop)
        graph_nodes = nodes(model)
        feeds = {}
        optimizer = self.update_contract.optimizer
        if optimizer is not None and optimizer.max_grad_norm is not None:
            self.norm_input = global_tensor(self.update_contract, self.update_path, "grad_norm_sq", graph_nodes)
            feeds[self.norm_input] = FLOAT
        if self.skip_output:
            self.found_input = global_tensor(self.update_contract, self.update_path, "found_inf", graph_nodes)
            feeds[self.found_input] = BOOL
        outputs = [o for _, o in self.updated] + ([self.skip_output] if self.skip_output else [])
        model = cut_graph(model, outputs, feeds)
        so = session_options if session_options is not None else default_session_options()
        return ort.InferenceSession(model, sess_options=so, providers=providers)

    # --- one step ----------------------------------------------------------------------------

    def _reduce(self, micro, gradients: GradientRun):
        """This rank's slice of the summed gradient of micro, and the summed losses (a list).
        The gradient graph writes one buffer per shard; after the reduction only this rank's
        is kept (the others are freed before the update, without a copy)."""
        c = self.collective
        parts = gradients.gradients(micro, self.bounds)
        if self.mode == "optimizer":  # every shard's sum on every rank: one all-reduce per shard
            for part in parts:
                if part.numel():
                    c.dist.all_reduce(part, group=c.group)
            return parts[c.rank][:self.hi - self.lo], parts[-1][-3:].tolist()
        # gradients: each shard's buffer reduced to its owner only (a reduce-scatter of unequal
        # sizes, which gloo has too)
        losses = parts[-1][-3:].clone()
        c.dist.all_reduce(losses, group=c.group)
        for r, part in enumerate(parts):
            n = part.numel() - (3 if r == len(parts) - 1 else 0)
            if n:
                c.dist.reduce(part[:n], dst=c.global_rank(r), group=c.group)
        return parts[c.rank][:self.hi - self.lo], losses.tolist()

    def _global_feeds(self, views, state: TrainingState) -> dict:
        """The update graph's global scalars from Σ‖g‖² over all shards (one all-reduce)."""
        if self.norm_input is None and self.found_input is None:
            return {}
        c = self.collective
        torch = c.torch
        sq = torch.zeros(1, dtype=torch.float64, device=self.torch_device)
        for g in views:  # per tensor in float32, as the graph's ReduceSum, summed in float64
            sq += torch.dot(g.reshape(-1), g.reshape(-1)).double()
        c.dist.all_reduce(sq, group=c.group)
        total = float(sq.item())
        feeds = {}
        if self.norm_input:  # the norm of the unscaled gradient: fp16's 1/scale is a power of 2
            scale = state.scalar(self.scale_input) if self.scale_input else None
            inv = 1.0 / scale if scale else 1.0
            feeds[self.norm_input] = np.array(total * inv * inv, np.float32)
        if self.found_input:  # an inf/NaN in any shard makes the sum inf/NaN on every rank
            feeds[self.found_input] = np.array(not math.isfinite(total))
        return feeds

    def step(self, micro: list, lr, gradients: GradientRun, update: UpdateRun,
             state: TrainingState) -> tuple[bool, list[float]]:
        """Gradients of the micro-batches, reduced; this shard's update; every shard's
        parameters broadcast by its owner. Returns (skipped, the three mean losses)."""
        grad, losses = self._reduce(micro, gradients)
        mean = self.collective.world_size * self.accumulation_steps
        grad.div_(mean)
        views = [grad[off:off + m].view(shape) for (off, m), shape in zip(self.own_spans, self.own_shapes)]
        feeds = self._global_feeds(views, state)
        grads = [(name, _dlpack.from_torch(v)) for name, v in zip(self.own_grads, views)]
        skipped = update(grads, lr, feeds)
        del grads, views, grad  # the gradient buffer is freed before the broadcasts
        if not skipped:
            self._broadcast(state)
        return skipped, [x / mean for x in losses]

    def _broadcast(self, state: TrainingState) -> None:
        c = self.collective
        for p in self.parameters:
            c.dist.broadcast(_dlpack.to_torch(state.values[p]), src=c.global_rank(self.rank_of[p]),
                             group=c.group)

    # --- checkpoints -------------------------------------------------------------------------

    def metadata(self) -> dict:
        return {"shard": self.mode, "world_size": str(self.collective.world_size),
                "partition": json.dumps(self.shards)}

    def save(self, path: Path, meta: dict, state: TrainingState) -> None:
        """Each rank writes its shard (its parameters, their moments and the shared scalars) to
        shard_file(path); rank 0 then writes path, an index of the shard files."""
        c = self.collective
        state.check_usable()
        R = c.world_size
        meta = {**meta, **self.metadata()}
        _safetensors.save(shard_file(path, c.rank, R),
                          {n: state.host_bytes(n) for n, _ in self.updated},
                          {**meta, "rank": str(c.rank)})
        c.barrier()
        if c.rank == 0:  # the index last: it exists only when every shard does
            files = [shard_file(path, r, R).name for r in range(R)]
            _safetensors.save(path, {}, {**meta, "files": json.dumps(files)})
        c.barrier()

    def load(self, path: Path, meta: dict) -> dict:
        """The state this rank holds, read from the shard files of the index at path: any number
        of ranks wrote them (the tensors are found by name), and only this rank's moments and
        every parameter are read."""
        try:
            files = [path.with_name(f) for f in json.loads(meta["files"])]
            shards = json.loads(meta["partition"])
        except (KeyError, ValueError):
            raise ValueError(f"{path}: a sharded checkpoint index without its shard files") from None
        where = {p: r for r, shard in enumerate(shards) for p in shard}
        wanted: dict[int, set] = {}
        for name, _ in self.held:
            owner = self.owner[name]
            wanted.setdefault(where.get(owner, 0) if owner else 0, set()).add(name)
        state: dict = {}
        for r, names in sorted(wanted.items()):
            if r >= len(files):
                raise ValueError(f"{path}: the index lists {len(files)} shard files for "
                                 f"{len(shards)} shards")
            tensors, _ = _safetensors.load(files[r], names=names)
            state.update(tensors)
        return state
