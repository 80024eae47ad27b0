"""Step graphs run and compared the way test_step.py does it, for every module that checks a
step graph against a reference (test_step.py, test_recompute.py, test_attention*.py,
test_data_parallel.py, test_sharding.py): the dense and fused LM heads, the plain
InferenceSession that feeds each step's state back, the norm-relative parameter check (floor
1e-3·‖all‖) and the mask of exactly-zero gradients AdamW may not be held to; and `run_step`,
`ntl-patch step` with the wasserstein loss at weight 0.3 on a fixture or a path (from
test_recompute.py); `reads_past_views`, what reads a stored tensor (the QLoRA tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from conftest import MODELS, TOKENIZER, run_patch
from ort_helpers import norm_rel, quiet_ort

TRAJ_RTOL = 1e-4
STEPS = 20
# the dense LM head, and the fused one (passes/fused_head) over chunks of 3 positions: chunk
# borders fall inside sequences and the last chunk is padded
HEADS = {"dense": ["--fused-head", "off"], "fused": ["--fused-head", "on", "--head-chunk-tokens", "3"]}


def session(path: Path):
    ort = quiet_ort()
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def run_step_graph(path: Path, batches, on_step=None):
    """Feeds each step's state outputs back as the next step's inputs (plain InferenceSession);
    `on_step(outputs)` sees each step's outputs by name."""
    sess = session(path)
    meta = json.loads(sess.get_modelmeta().custom_metadata_map["ntl_step"])
    state = {}
    losses = []
    out_names = [o.name for o in sess.get_outputs()]
    for x, y in batches:
        outs = sess.run(None, {"input_ids": x, "labels": y, **state})
        got = dict(zip(out_names, outs))
        if on_step:
            on_step(got)
        losses.append(float(outs[0]))
        state = {i: got[o] for i, o in meta["state"]}
    return losses, {p: state[p] for p in meta["parameters"]}, meta


def with_meta_output(path: Path, key: str, elem_type: int) -> tuple[Path, str]:
    """A copy of the step graph (beside it) with the scalar tensor the metadata names under
    `key` (e.g. `grad_norm_sq`) as one more output, and that tensor's name."""
    import onnx

    model = onnx.load(str(path))
    meta = json.loads({p.key: p.value for p in model.metadata_props}["ntl_step"])
    name = meta[key]
    model.graph.output.append(onnx.helper.make_tensor_value_info(name, elem_type, []))
    probe = path.with_name(path.stem + f".{key}.onnx")
    onnx.save(model, str(probe))
    return probe, name


def assert_params_close(got: dict, want: dict, zero_grad: dict | None = None) -> None:
    """Norm-relative per parameter (floor 1e-3·‖all‖) and over all parameters.

    `zero_grad` (AdamW runs): elements whose true gradient is exactly zero, e.g. the key bias of
    attention (softmax ignores a shift of a whole row of scores). Their float32 gradient is
    round-off, which Adam normalises into ±lr steps of arbitrary sign in any two
    implementations, so they are left out; SGD keeps them small and compares everything."""
    zero_grad = zero_grad or {}
    keep = {p: ~zero_grad[p] if p in zero_grad else np.ones(w.shape, bool) for p, w in want.items()}
    want = {p: w[keep[p]] for p, w in want.items()}
    got = {p: got[p][keep[p]] for p in want}
    all_want = np.concatenate([w.ravel() for w in want.values()])
    floor = 1e-3 * float(np.linalg.norm(all_want))
    errs = {p: norm_rel(got[p], want[p], floor) for p in want}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TRAJ_RTOL, f"{worst}: {errs[worst]:.3g}"
    all_got = np.concatenate([got[p].ravel() for p in want])
    assert norm_rel(all_got, all_want, 0.0) <= TRAJ_RTOL


def zero_grad_mask(grads64: dict) -> dict:
    """Elements of an exactly-zero float64 reference gradient (relative to the largest)."""
    top = max(float(np.max(np.abs(g))) for g in grads64.values())
    return {p: np.abs(g) <= 1e-9 * top for p, g in grads64.items()}


def run_step(model: str | Path, out: Path, *extra, ok=True):
    src = model if isinstance(model, Path) else MODELS / f"{model}.onnx"
    args = ["step", src, "--loss", "wasserstein", "--tokenizer", TOKENIZER,
            "--weight", "0.3", "-o", out, "--json", *extra]
    r = run_patch(args)
    if ok:
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr}"
        return json.loads(r.stdout)
    return r


def reads_past_views(graph, stored: str) -> list[tuple[str, str]]:
    """(where, op) of each first node past the zero-copy views (Reshape) of the stored tensor
    `stored`, in `graph` and its loop bodies: what reads a quantised weight's codes."""
    return _reads_past(graph, {stored}, "graph")


def _reads_past(graph, views: set[str], where: str) -> list[tuple[str, str]]:
    found, views = [], set(views)
    for n in graph.node:
        for a in n.attribute:
            for g in [a.g] * a.HasField("g") + list(a.graphs):
                found += _reads_past(g, views, f"{n.op_type} body")
        if n.input and n.input[0] in views:
            if n.op_type == "Reshape":
                views.add(n.output[0])
            elif n.op_type != "Shape":
                found.append((where, n.op_type))
    return found
