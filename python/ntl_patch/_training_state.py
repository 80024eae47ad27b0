"""The training state a trainer owns: every state tensor (parameters, optimizer moments, step
count) as an OrtValue on the trainer's device, held once, and what both trainers do with it.

The sessions hold none of it (_sessions.session_without): the initial values are read from the
graph files and uploaded one tensor at a time (initial_values). Each run writes the next value of
every tensor the graph lists under ``in_place`` into that tensor's own memory (bind_next): a
moment or parameter is updated where it lies, and the old value is never held beside the new
one. A run that fails after it began writing in place leaves the state partly updated: the state
then refuses to be read or run until a saved state is loaded (check_usable).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from . import _onnx_decode
from ._array_bytes import ArrayBytes
from ._sessions import ORT_TYPES


def upload(arr: np.ndarray, device: str, device_id: int) -> ort.OrtValue:
    """A new OrtValue on the device holding arr's values (on CPU it keeps arr itself)."""
    arr = np.asarray(arr)
    if not arr.flags.c_contiguous:
        arr = np.array(arr, order="C")  # not ascontiguousarray: it makes scalars [1]
    return ort.OrtValue.ortvalue_from_numpy(arr, device, device_id)


def initial_values(sources: list[tuple[Path, list[str]]], device: str, device_id: int) -> dict:
    """name -> OrtValue of each named initializer of each (graph, names) source: read, uploaded
    and the host copy dropped one tensor at a time (KeyError if one is absent). A tensor that is
    a hole of a sparse file (the optimizer's zero moments) becomes lazily allocated zeros."""
    values = {}
    for path, names in sources:
        # looked up on the module when called: a test records which tensors a rank reads
        for name, arr in _onnx_decode.each_initializer(path, names):
            values[name] = upload(arr, device, device_id)
    return values


def host(value: ort.OrtValue) -> np.ndarray:
    """A host copy of value (never a view of the state's memory)."""
    arr = value.numpy()  # a copy from a device; a view of the state's memory on CPU
    return arr.copy() if value.device_name().lower() == "cpu" else arr


def host_bytes(value: ort.OrtValue) -> ArrayBytes:
    """value's bytes for a file writer, copied off the device only when written; on CPU the
    writer reads the state's memory directly (no copy)."""
    dtype = ORT_TYPES.get(value.data_type())
    if dtype is None:
        raise NotImplementedError(f"state tensor of type {value.data_type()} cannot be written")
    return ArrayBytes(dtype, value.shape(), value.numpy)


def _describe(value: ort.OrtValue) -> tuple[np.dtype, tuple[int, ...]]:
    return np.dtype(ORT_TYPES.get(value.data_type(), np.float32)), tuple(value.shape())


class TrainingState:
    """The state tensors one trainer holds (name -> OrtValue in ``values``), the step count, and
    whether a failed in-place run spoilt them.

    held: the (state input, state output) pairs this trainer holds, in the graph's order (a
    sharded rank holds every parameter but only its own moments). in_place: the state inputs the
    graph lets a run write over. failed / remedy: the start and the end of the RuntimeError once
    a run failed in place (each trainer names its own graph and its own way back)."""

    def __init__(self, values: dict, held: list[tuple[str, str]], in_place: set[str], device: str,
                 device_id: int, step_input: str | None, failed: str, remedy: str):
        self.values = values
        self.held = held
        self.in_place = in_place
        self.device, self.device_id = device, device_id
        self.step_input = step_input
        self.steps = int(np.asarray(host(values[step_input]))) if step_input else 0
        self.broken: str | None = None
        self._failed, self._remedy = failed, remedy

    # --- reading ------------------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"{self._failed} ({self.broken}), so the state may be partly updated; "
                               f"{self._remedy}")

    def host(self, name: str) -> np.ndarray:
        return host(self.values[name])

    def host_bytes(self, name: str) -> ArrayBytes:
        return host_bytes(self.values[name])

    def scalar(self, name: str) -> float:
        return float(np.asarray(self.host(name)).reshape(-1)[0])

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every held tensor copied to host, keyed by its state input name."""
        self.check_usable()
        return {n: self.host(n) for n, _ in self.held}

    def parameters(self, names: list[str]) -> dict[str, np.ndarray]:
        self.check_usable()
        return {n: self.host(n) for n in names}

    # --- loading ------------------------------------------------------------------------------

    def load(self, state: dict, copy: bool = True) -> None:
        """Upload state (name -> array: exactly the held tensors, in their dtypes and shapes),
        releasing each old tensor as its new one arrives; it takes the step count of the state.
        copy=False: on CPU the state may keep the given arrays themselves."""
        names = [n for n, _ in self.held]
        missing = [n for n in names if n not in state]
        extra = [n for n in state if n not in names]
        if missing or extra:
            raise ValueError(f"state must have exactly the state tensors: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
        for n in names:
            arr = np.asarray(state[n])
            dtype, shape = _describe(self.values[n])
            if tuple(arr.shape) != shape or arr.dtype != dtype:
                raise ValueError(f"state[{n!r}] is {arr.dtype}{list(arr.shape)}, expected "
                                 f"{dtype}{list(shape)}")
        for n in names:
            arr = np.array(state[n], copy=True, order="C") if copy else np.asarray(state[n])
            self.values[n] = upload(arr, self.device, self.device_id)
        self.broken = None
        if self.step_input in state:
            self.steps = int(np.asarray(state[self.step_input]))

    # --- one run ------------------------------------------------------------------------------

    def bind(self, binding, names) -> None:
        for name in names:
            binding.bind_ortvalue_input(name, self.values[name])

    def bind_next(self, binding, pairs) -> None:
        """Binds each state output of pairs ((input, output)): into its input's own memory where
        the graph allows it (``in_place``), else to new memory the session allocates as the
        value is written (measured: lower peaks than a second buffer per parameter made ahead,
        which exists before the activations are freed)."""
        for name, out in pairs:
            if name in self.in_place:
                binding.bind_ortvalue_output(out, self.values[name])
            else:
                binding.bind_output(out, self.device, self.device_id)

    def run(self, session, binding, run_options=None) -> None:
        """session's run on binding; one that fails with in-place outputs bound spoils the state."""
        try:
            session.run_with_iobinding(binding, run_options)
        except Exception as e:
            if self.in_place:
                self.broken = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            raise

    def take_next(self, pairs, outputs) -> None:
        """After a run: the state inputs not written in place take their new values (the in-place
        ones already hold theirs, and keep their own OrtValue, which owns the memory)."""
        for (name, _), value in zip(pairs, outputs):
            if name not in self.in_place:
                self.values[name] = value
