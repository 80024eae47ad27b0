#!/usr/bin/env python3
"""One benchmark configuration of scripts/bench/bench_step_graph.py, in its own process.

    PYTHON scripts/bench/bench_step_graph_worker.py KIND WORKDIR --threads 2

KIND: `step` (the `ntl-patch step` graph run by plain onnxruntime through
python/ntl_patch StepRunner; run it with .venv-rt/bin/python), `ort` (ORT Training artifacts of the
forward patch; .venv), `torch` (torch eager CE + 0.3*ntloss NTLoss, AdamW; .venv), `onnxsim`
(onnxsim.compile_training_loop on the forward patch with static shapes; .venv-bench).
WORKDIR is one model's folder written by bench_step_graph.py (model.onnx, batch.npz, ...).

Protocol (one JSON object per line on stdout): after loading it prints {"ready": ...} (or
{"error": ...} and exits 1); then reads commands from stdin: `step` runs one training step and
prints {"s": wall seconds, "cpu": process CPU seconds, "loss": ...}; `quit` prints
{"peak_rss_mib": VmHWM, "rss_mib": VmRSS} and exits. Only one configuration runs at a time (the
driver waits for each reply), so the steps of different configurations interleave without
competing for the 2 cores.

`profile` KIND (.venv-rt): runs the step graph with enable_profiling and prints a per-node JSON
summary (used by the driver's --profile). `memprobe` KIND (.venv-rt):
`memprobe WORKDIR --threads 2 ARENA PATTERN STEPS` prints the peak RSS after each step with ORT's CPU
memory arena (ARENA 0/1) and memory pattern (PATTERN 0/1) on or off.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WEIGHT = 0.3
LR = 1e-3


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def proc_status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load_batch(work: Path):
    import numpy as np

    z = np.load(work / "batch.npz")
    return z["input_ids"], z["labels"]


# ----------------------------------------------------------------------------- configurations


def make_step(work: Path, threads: int, graph: str = "model.step.onnx"):
    import onnxruntime as ort

    sys.path.insert(0, str(REPO / "python"))
    from ntl_patch import StepRunner

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.enable_mem_pattern = False  # StepRunner's default
    runner = StepRunner(work / graph, providers=["CPUExecutionProvider"], session_options=so)
    ids, labels = load_batch(work)
    batch = {"input_ids": ids, "labels": labels}

    def step():
        return runner.step(batch)[0]

    return step, {"ort": ort.__version__}


def make_ort(work: Path, threads: int):
    import onnxruntime as ort
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    art = work / "ort-artifacts"
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"),
                    device="cpu", session_options=so)
    opt = Optimizer(str(art / "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR)
    module.train()
    ids, labels = load_batch(work)

    def step():
        out = module(ids, labels)
        out = out[0] if isinstance(out, (tuple, list)) else out
        opt.step()
        module.lazy_reset_grad()
        return float(out)

    return step, {"ort": ort.__version__}


def make_torch(work: Path, threads: int):
    import ntloss
    import torch
    import torch.nn.functional as F
    from transformers import PreTrainedTokenizerFast

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    meta = json.loads((work / "meta.json").read_text())
    model = build_torch_model(meta).train()
    vocab = meta["vocab"]
    ids, labels = (torch.from_numpy(a) for a in load_batch(work))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(work / "tokenizer.json"))
    ntl = ntloss.NTLoss(tok, vocab_size=vocab, digit_level=True, reweigh=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # torch defaults = ORT/ntl-patch defaults

    def losses():
        if meta["arch"] == "tinylm":
            logits, lab = model.logits(ids), labels
        else:  # GPT-2 shifts inside its loss: predict token t+1 from position t
            logits = model(input_ids=ids).logits[:, :-1, :]
            lab = labels[:, 1:]
        ce = F.cross_entropy(logits.reshape(-1, vocab), lab.reshape(-1), ignore_index=-100)
        return ce + WEIGHT * ntl(logits, lab, reduction="mean")

    def step():
        total = losses()
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    return step, {"torch": torch.__version__}


def make_onnxsim(work: Path, threads: int):
    import onnx
    import onnxruntime as ort

    import onnxsim

    # onnxsim's Runner builds its SessionOptions itself (no thread setting, optimization level 0):
    # pin the thread counts like every other configuration
    orig = ort.SessionOptions

    def pinned():
        so = orig()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        return so

    ort.SessionOptions = pinned
    meta = json.loads((work / "meta.json").read_text())
    model = simplify_keeping_params(work / "model.static.ntl.onnx", meta["parameters"])
    loop = onnxsim.compile_training_loop(model, "loss", meta["parameters"], optimizer="adam")
    ids, labels = load_batch(work)
    feeds = {"input_ids": ids, "labels": labels}
    try:
        loop(feeds, lr=LR)  # compiles (differentiates the whole graph): fails here if it cannot
    except Exception as e:
        from onnxsim import graph_grad

        ops = sorted({n.op_type for n in model.graph.node} - graph_grad.supported_ops() - {"Constant"})
        raise type(e)(f"{str(e).split(';')[0]} [op types in the graph without an onnxsim gradient "
                      f"rule: {', '.join(ops)}]") from None

    def step():
        return float(loop(feeds, lr=LR))

    return step, {"onnxsim": onnxsim.version.version if hasattr(onnxsim, "version") else "?",
                  "ort": ort.__version__}


def simplify_keeping_params(path: Path, params: list):
    """onnxsim.simplify of the static-shape forward patch, with the trained parameters held as graph
    inputs while it folds (so the shape arithmetic becomes constant -- compile_training_loop
    refuses the exporter's Shape/Range chains as non-static -- while no parameter is folded into
    a new constant, e.g. Transpose(weight)), then put back as initializers."""
    import onnx
    from onnx import helper

    import onnxsim

    m = onnx.load(str(path))
    held = [t for t in m.graph.initializer if t.name in set(params)]
    keep = [t for t in m.graph.initializer if t.name not in set(params)]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    for t in held:
        m.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    ms, ok = onnxsim.simplify(m, perform_optimization=False)
    if not ok:
        raise RuntimeError("onnxsim.simplify: check failed")
    names = {t.name for t in held}
    inputs = [i for i in ms.graph.input if i.name not in names]
    del ms.graph.input[:]
    ms.graph.input.extend(inputs)
    ms.graph.initializer.extend(held)
    return ms


def build_torch_model(meta: dict):
    """The torch model of one bench folder, with the weights the ONNX export got."""
    import torch

    if meta["arch"] == "tinylm":
        sys.path.insert(0, str(REPO / "fixtures"))
        import tiny_lm

        torch.manual_seed(meta["seed"])
        return tiny_lm.TinyLM(vocab=meta["vocab"], dim=meta["dim"], hidden=meta["hidden"], ce="flat")
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()

    class GPT2WithLoss(GPT2LMHeadModel):
        def forward(self, input_ids, labels=None):
            if labels is None:
                return super().forward(input_ids=input_ids)
            return super().forward(input_ids=input_ids, labels=labels).loss

    cfg = GPT2Config(vocab_size=meta["vocab"], n_positions=max(meta["seq"], 256), n_embd=meta["dim"],
                     n_layer=meta["layers"], n_head=meta["heads"], resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, tie_word_embeddings=meta["tied"], attn_implementation="eager",
                     use_cache=False, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(meta["seed"])
    m = GPT2WithLoss(cfg)
    assert m.config._attn_implementation == "eager"
    return m


# ----------------------------------------------------------------------------- profile


def profile_step(work: Path, threads: int, warm: int, runs: int):
    import collections

    import onnxruntime as ort

    sys.path.insert(0, str(REPO / "python"))
    from ntl_patch import StepRunner

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = str(work / "profile-step")
    runner = StepRunner(work / graph, providers=["CPUExecutionProvider"], session_options=so)
    ids, labels = load_batch(work)
    batch = {"input_ids": ids, "labels": labels}
    walls = []
    for i in range(warm + runs):
        t0 = time.perf_counter()
        runner.step(batch)
        walls.append(time.perf_counter() - t0)
    prof = runner.session.end_profiling()
    events = json.loads(Path(prof).read_text())
    node_durs = collections.defaultdict(list)
    kinds = {}
    runs_us = []
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            node = e["name"][: -len("_kernel_time")]
            node_durs[node].append(e["dur"])
            kinds[node] = e["args"].get("op_name", "?")
        elif e.get("cat") == "Session" and e["name"] == "model_run":
            runs_us.append(e["dur"])
    import statistics

    # ms per step: the median over the profiled runs (robust to a load spike in one of them)
    per_node = {n: statistics.median(d[-runs:]) / 1000 for n, d in node_durs.items()}
    emit({"profile_file": prof, "per_node": per_node, "kinds": kinds,
          "model_run_ms": [u / 1000 for u in runs_us[-runs:]], "walls": walls[-runs:]})


def memprobe(work: Path, threads: int, arena: bool, pattern: bool, steps: int):
    """Peak RSS of the step graph after each step under ORT's CPU memory arena / memory-pattern
    settings (StepRunner's defaults are both on)."""
    import onnxruntime as ort

    sys.path.insert(0, str(REPO / "python"))
    from ntl_patch import StepRunner

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.enable_cpu_mem_arena = arena
    so.enable_mem_pattern = pattern
    runner = StepRunner(work / graph, providers=["CPUExecutionProvider"], session_options=so)
    ids, labels = load_batch(work)
    batch = {"input_ids": ids, "labels": labels}
    rows = [{"after": "session", "hwm_mib": proc_status("VmHWM"), "rss_mib": proc_status("VmRSS")}]
    for i in range(steps):
        t0 = time.perf_counter()
        runner.step(batch)
        rows.append({"after": f"step {i + 1}", "s": time.perf_counter() - t0, "hwm_mib": proc_status("VmHWM"),
                     "rss_mib": proc_status("VmRSS")})
    emit({"arena": arena, "mem_pattern": pattern, "rows": rows})


# ----------------------------------------------------------------------------- main


def make_step16(work: Path, threads: int):
    """The `--precision fp16` step graph (onnxruntime's CPU provider runs its float16 nodes in
    float32 between casts: this measures what the casts cost on a CPU, not float16 arithmetic)."""
    return make_step(work, threads, "model.step16.onnx")


MAKERS = {"step": make_step, "step16": make_step16, "ort": make_ort, "torch": make_torch,
          "onnxsim": make_onnxsim,
          "dense": lambda work, threads: make_step(work, threads, "model.dense.step.onnx")}


def main():
    kind, work = sys.argv[1], Path(sys.argv[2])
    threads = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 2
    if kind == "memprobe":  # memprobe WORKDIR --threads 2 ARENA(0|1) PATTERN(0|1) STEPS
        a, pat, n = sys.argv[-3:]
        memprobe(work, threads, a == "1", pat == "1", int(n))
        return
    if kind == "profile":
        profile_step(work, threads, int(os.environ.get("BENCH_PROFILE_WARM", "3")),
                     int(os.environ.get("BENCH_PROFILE_RUNS", "5")))
        return
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    global emit

    def emit(obj):  # noqa: F811
        real_stdout.write(json.dumps(obj) + "\n")
        real_stdout.flush()

    t0 = time.perf_counter()
    try:
        step, versions = MAKERS[kind](work, threads)
    except Exception as e:  # reported, not raised: "cannot run" is a result
        emit({"error": f"{type(e).__name__}: {e}".strip()[:2000], "where": "load",
              "trace": traceback.format_exc()[-3000:]})
        sys.exit(1)
    emit({"ready": True, "load_s": time.perf_counter() - t0, "versions": versions,
          "rss_mib": proc_status("VmRSS")})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            try:
                c0, w0 = time.process_time(), time.perf_counter()
                loss = step()
                emit({"s": time.perf_counter() - w0, "cpu": time.process_time() - c0, "loss": loss})
            except Exception as e:
                emit({"error": f"{type(e).__name__}: {e}".strip()[:2000], "where": "step",
                      "trace": traceback.format_exc()[-3000:]})
                sys.exit(1)
        elif cmd == "quit":
            emit({"peak_rss_mib": proc_status("VmHWM"), "rss_mib": proc_status("VmRSS")})
            return


if __name__ == "__main__":
    main()
