"""Kept for the names docs/PYTHON.md gave before the split: ``ntl_patch._state.exact_cpu_arena``
and ``default_session_options`` (now in _sessions; the state tensors are in _training_state)."""

from ._sessions import default_session_options, exact_cpu_arena

__all__ = ["default_session_options", "exact_cpu_arena"]
