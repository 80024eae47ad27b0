"""ntl_patch: the `ntl-patch` command from Python, and trainers for its step graphs
(docs/PYTHON.md).

- ``patch``, ``step``, ``artifacts``, ``validate``, ``inspect``: run the bundled binary with
  ``--json`` and return its summary as a dict; failures raise ``NtlPatchError`` (cli.py).
- ``StepRunner``: trains a step graph (docs/STEP_GRAPH.md) with onnxruntime + numpy only.
- ``DataParallel``: trains ``step --split`` graphs on torch.distributed (imports torch when used).
"""

from .cli import NtlPatchError, artifacts, inspect, lora_model, patch, step, validate, version
from .data_parallel import DataParallel
from .runner import StepRunner

__all__ = ["DataParallel", "NtlPatchError", "StepRunner", "artifacts", "inspect", "lora_model", "patch", "step",
           "validate", "version"]
