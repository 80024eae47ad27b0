"""DataParallel's ``shard="none"``: every rank holds the whole training state. The gradients are
averaged with one all-reduce of a flat buffer (laid out by a GradientLayout), and every rank runs
the whole update graph on the same average, so all ranks stay equal; rank 0 writes checkpoints.
The sharded modes (_sharding) answer the same calls."""

from __future__ import annotations

from pathlib import Path

from . import _dlpack, _safetensors
from ._collective import Collective
from ._gradient_layout import GradientLayout
from ._sessions import session_without
from ._split_runs import GradientRun, UpdateRun
from ._training_state import TrainingState


class Replicated:
    def __init__(self, layout: GradientLayout, collective: Collective, state_names: list[tuple[str, str]],
                 accumulation_steps: int):
        self.layout, self.collective, self.accumulation_steps = layout, collective, accumulation_steps
        # the state this rank holds, the part of it the update graph writes, the gradients it reads
        self.held = self.updated = state_names
        self.own_grads = layout.names

    def update_session(self, path: Path, drop: list[str], session_options, providers):
        return session_without(path, drop, session_options, providers)

    def step(self, micro: list, lr, gradients: GradientRun, update: UpdateRun,
             state: TrainingState) -> tuple[bool, list[float]]:
        """Returns (skipped, the three mean losses)."""
        c = self.collective
        flat = gradients.gradients(micro)[0]
        if c.world_size > 1:
            c.dist.all_reduce(flat, op=c.dist.ReduceOp.SUM, group=c.group)
        flat.div_(c.world_size * self.accumulation_steps)
        grads = [_dlpack.from_torch(g) for g in self.layout.views(flat)]
        skipped = update(list(zip(self.layout.names, grads)), lr)
        del grads
        return skipped, flat[self.layout.numel:].tolist()

    def save(self, path: Path, meta: dict, state: TrainingState) -> None:
        """Rank 0 writes path (all ranks hold the same state), the others wait."""
        if self.collective.rank == 0:
            state.check_usable()
            # straight from the state's memory on CPU, one tensor at a time off a GPU
            _safetensors.save(path, {n: state.host_bytes(n) for n, _ in self.held}, meta)
        self.collective.barrier()

    def load(self, path: Path, meta: dict) -> dict:
        return _safetensors.load(path)[0]
