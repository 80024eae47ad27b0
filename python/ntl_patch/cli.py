"""Python wrappers of the `ntl-patch` commands: each runs the bundled binary with ``--json`` and
returns its summary as a dict.

    import ntl_patch
    s = ntl_patch.step("model.onnx", loss="ntil", optimizer="sgd", lr=1e-2, freeze=["emb."])
    s["outputs"]                          # ['model.step.onnx']

Options are the CLI flags in snake_case (``max_grad_norm=1.0`` -> ``--max-grad-norm=1.0``); True
gives a bare switch, False / None leave the option out, a list repeats a repeatable flag. A failing
command raises NtlPatchError with the binary's one-line message and its exit code.
"""

from __future__ import annotations

import difflib
import json
import logging
import numbers
import os
import subprocess

from . import _binary
from ._options import COMMA_LISTS, FLAG, MULTI, OPTIONS, flag

log = logging.getLogger("ntl_patch")


class NtlPatchError(Exception):
    """A failed ntl-patch command.

    message: the binary's one-line error (without ``error:``); exit_code: its exit status (1 input
    or usage error, 2 internal error, negative: killed by that signal; None: it did not run);
    result: the parsed JSON report where the command printed one (``validate`` whose checks
    failed); stderr: everything it wrote to stderr."""

    def __init__(self, message: str, exit_code: int | None = None, *, result: dict | None = None,
                 stderr: str = ""):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.result = result
        self.stderr = stderr

    def __str__(self) -> str:
        return self.message if self.exit_code is None else f"{self.message} (exit code {self.exit_code})"


def _fail_type(func: str, msg: str):
    # raised from here, not from deep inside: the traceback ends at the caller's line + this
    return TypeError(f"ntl_patch.{func}(): {msg}")


def _path(func: str, what: str, value) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise _fail_type(func, f"{what} must be a path (str or os.PathLike), not "
                               f"{type(value).__name__}")
    text = os.fsdecode(os.fspath(value))
    if "\0" in text:
        raise ValueError(f"ntl_patch.{func}(): {what} contains a NUL character")
    return text


def _value(func: str, name: str, value) -> str:
    if isinstance(value, bool):
        raise _fail_type(func, f"option {name!r} takes a value, not {value!r}")
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, (str, os.PathLike)):
        return _path(func, f"option {name!r}", value)
    raise _fail_type(func, f"option {name!r} must be a str, number or path, not "
                           f"{type(value).__name__}")


def arguments(command: str, options: dict, func: str | None = None) -> list[str]:
    """The CLI arguments for keyword options of `command` (see the module doc)."""
    func = func or command
    table = OPTIONS[command]
    args: list[str] = []
    for name, value in options.items():
        kind = table.get(name)
        if kind is None:
            if name == "json":
                raise _fail_type(func, "'json' is not an option here: the wrappers always pass "
                                       "--json and return the summary as a dict")
            close = difflib.get_close_matches(name, table, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _fail_type(func, f"unknown option {name!r}{hint}; valid options: "
                                   f"{', '.join(sorted(table))}")
        if value is None:
            continue
        if kind == FLAG:
            if not isinstance(value, bool):
                raise _fail_type(func, f"option {name!r} is a switch: pass True or False, not "
                                       f"{value!r}")
            if value:
                args.append(flag(name))
        elif kind == MULTI and isinstance(value, (list, tuple)):
            args += [f"{flag(name)}={_value(func, name, v)}" for v in value]
        elif name in COMMA_LISTS and isinstance(value, (list, tuple)) and value \
                and all(isinstance(v, str) and v and "," not in v for v in value):
            args.append(f"{flag(name)}={_value(func, name, ','.join(value))}")
        else:
            if isinstance(value, (list, tuple, set, frozenset, dict)):
                what = "one value or a list of values" if kind == MULTI else "one value"
                raise _fail_type(func, f"option {name!r} takes {what}, not a "
                                       f"{type(value).__name__}")
            args.append(f"{flag(name)}={_value(func, name, value)}")
    return args


def _error_line(stderr: str) -> str | None:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln[len("error:"):].strip()
    return lines[-1] if lines else None


def run(command: str, positional, options: dict, func: str | None = None) -> dict:
    """Run `ntl-patch [command] --json OPTIONS -- POSITIONAL` and return its JSON summary."""
    func = func or command
    what = "directory" if command == "artifacts" else "model"
    argv = ([] if command == "patch" else [command]) + ["--json"]
    argv += arguments(command, options, func)
    argv += ["--", _path(func, what, positional)]
    try:
        exe = _binary.find()
    except _binary.BinaryNotFound as e:
        raise NtlPatchError(str(e)) from None
    try:
        proc = subprocess.run([exe, *argv], capture_output=True, text=True, errors="replace",
                              stdin=subprocess.DEVNULL)
    except OSError as e:
        raise NtlPatchError(f"could not run {exe}: {e.strerror or e}") from None
    for ln in proc.stderr.splitlines():
        if ln.startswith("warning:"):
            log.warning("%s", ln[len("warning:"):].strip())
        elif ln.startswith("note:"):
            log.info("%s", ln[len("note:"):].strip())
    result = None
    try:
        parsed = json.loads(proc.stdout) if proc.stdout.strip() else None
        result = parsed if isinstance(parsed, dict) else None
    except ValueError:
        pass
    if proc.returncode < 0:
        raise NtlPatchError(f"ntl-patch {command} was killed by signal {-proc.returncode}",
                            proc.returncode, stderr=proc.stderr) from None
    if proc.returncode != 0:
        message = _error_line(proc.stderr)
        if message is None and result is not None and result.get("passed") is False:
            failed = [c.get("output", "?") for c in result.get("checks", [])
                      if isinstance(c, dict) and not c.get("passed", True)]
            message = f"validation failed: {', '.join(map(str, failed)) or 'see .result'}"
        raise NtlPatchError(message or f"ntl-patch {command} exited with {proc.returncode}",
                            proc.returncode, result=result, stderr=proc.stderr) from None
    if result is None:
        raise NtlPatchError(f"ntl-patch {command} printed no JSON summary (stdout: "
                            f"{proc.stdout.strip()[:200]!r})", proc.returncode,
                            stderr=proc.stderr) from None
    return result


def patch(model, out=None, loss: str = "wasserstein", **options) -> dict:
    """`ntl-patch MODEL`: the patched forward graph (default MODEL.ntl.onnx). Returns the summary
    (output, ce_node, pattern, logits_width, number_tokens, tokenizer, loss, weight, ...)."""
    return run("patch", model, {"out": out, "loss": loss, **options})


def step(model, out=None, loss: str = "wasserstein", **options) -> dict:
    """`ntl-patch step MODEL`: the training-step graph (``split=True``: gradient + update graphs).
    Returns the summary (outputs, parameters, frozen, buffers, optimizer, warnings, ...)."""
    return run("step", model, {"out": out, "loss": loss, **options})


def artifacts(directory, out=None, loss: str = "wasserstein", **options) -> dict:
    """`ntl-patch artifacts DIR`: patch ONNX Runtime training artifacts (default DIR-ntl)."""
    return run("artifacts", directory, {"out": out, "loss": loss, **options})


def validate(model, **options) -> dict:
    """`ntl-patch validate MODEL`: the report; failed checks raise NtlPatchError (its .result
    holds the report)."""
    return run("validate", model, options)


def inspect(model, **options) -> dict:
    """`ntl-patch inspect MODEL` (``target="cuda"`` or a list: the GPU kernel check)."""
    return run("inspect", model, options)


def lora_model(model, step, out=None, **options) -> dict:
    """`ntl-patch lora-model MODEL --step STEP`: MODEL with the LoRA step graph's adapters as
    inputs (default MODEL.lora.onnx), for onnxruntime's ``.onnx_adapter`` files. Returns the
    summary (output, adapter_inputs)."""
    return run("lora-model", model, {"step": step, "out": out, **options}, "lora_model")


def version() -> str:
    """The bundled binary's version (``ntl-patch --version``), e.g. ``"0.1.0"``."""
    try:
        exe = _binary.find()
        proc = subprocess.run([exe, "--version"], capture_output=True, text=True, errors="replace",
                              stdin=subprocess.DEVNULL)
    except _binary.BinaryNotFound as e:
        raise NtlPatchError(str(e)) from None
    except OSError as e:
        raise NtlPatchError(f"could not run the ntl-patch binary: {e.strerror or e}") from None
    if proc.returncode != 0:
        raise NtlPatchError(_error_line(proc.stderr) or "ntl-patch --version failed", proc.returncode)
    return proc.stdout.strip().split()[-1]
