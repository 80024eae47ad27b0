"""Where each parameter's gradient lies in the flat float32 buffer DataParallel reduces: the
gradient graph writes every gradient into a view of one buffer (or of one buffer per shard), so
that one collective call moves them all. Both training strategies (_replicated, _sharding) are
handed this layout; nothing else about the trainer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GradientLayout:
    names: list[str]  # the gradient graph's gradient outputs, one per parameter, in order
    shapes: list[tuple[int, ...]]
    spans: list[tuple[int, int]]  # (flat offset, element count) of each gradient
    numel: int  # the elements of every gradient together

    @classmethod
    def of(cls, names: list[str], shapes: list[tuple[int, ...]]) -> "GradientLayout":
        spans, off = [], 0
        for shape in shapes:
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            spans.append((off, n))
            off += n
        return cls(list(names), list(shapes), spans, off)

    def size(self, first: int = 0, last: int | None = None) -> int:
        """The elements of gradients first..last-1."""
        return sum(n for _, n in self.spans[first:last])

    def views(self, buffer, start: int = 0, first: int = 0, last: int | None = None) -> list:
        """Views of buffer, one per gradient first..last-1 in the gradients' shapes; buffer
        starts at flat offset start."""
        return [buffer[off - start:off - start + n].view(shape)
                for (off, n), shape in zip(self.spans[first:last], self.shapes[first:last])]
