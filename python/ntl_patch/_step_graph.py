"""One step graph file as the trainers run it: its contract (_contract, the one place graph names
come from) and an onnxruntime session of it that holds none of the training state
(_sessions.session_without), with the session's inputs and outputs looked up by name."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from . import _contract
from ._sessions import ORT_TYPES, session_without


class StepGraph:
    def __init__(self, path: Path, contract: _contract.StepMetadata, session: ort.InferenceSession):
        self.path, self.contract, self.session = path, contract, session
        # ntl/lr keeps its initializer: an "overridable initializer" to ORT
        self.inputs = {i.name: i for i in (*session.get_inputs(), *session.get_overridable_initializers())}
        self.outputs = session.get_outputs()
        self.input_types = {n: ORT_TYPES.get(i.type) for n, i in self.inputs.items()}

    @classmethod
    def load(cls, path: Path, contract: _contract.StepMetadata, session_options, providers) -> "StepGraph":
        """The graph at path in a session without the initializers of contract's state inputs."""
        return cls(path, contract, session_without(path, contract.state_inputs, session_options, providers))

    def missing(self, inputs, outputs) -> list[str]:
        """The names among inputs and outputs that the session does not have."""
        have = {o.name for o in self.outputs}
        return [n for n in inputs if n not in self.inputs] + [n for n in outputs if n not in have]
