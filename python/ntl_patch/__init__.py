"""ntl_patch: run `ntl-patch step` graphs (docs/STEP_GRAPH.md) with onnxruntime + numpy only."""

from .runner import StepRunner

__all__ = ["StepRunner"]
