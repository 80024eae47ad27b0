"""Inputs for the file-handling paths of scripts/bench/compare_outputs.sh (JOB_INPUTS=DIR):

- DIR/art/NAME/: ONNX Runtime training artifacts made from fixtures/models/NAME.onnx as
  tests/common's `training_graph` makes them (the SoftmaxCrossEntropyLoss given a log_prob
  output and a `SoftmaxCrossEntropyLossGrad` after it), the model itself as the eval graph,
  small stand-ins for the optimizer model and the checkpoint, and the fixture tokenizer;
- DIR/ext/NAME.onnx (+ NAME.data): the fixture with its initializers in external data, so
  step writes the optimizer state's sparse `.state.bin` and patch plans external data.

    .venv/bin/python scripts/bench/job_inputs.py fixtures OUT_DIR
"""
import sys, os, shutil
import onnx
from onnx import helper, TensorProto

src, dst = sys.argv[1], sys.argv[2]
tok = os.path.join(src, "tokenizer.json")

for name in ("lm_flat", "lm_bvt", "lm_flat_labels"):
    path = os.path.join(src, "models", name + ".onnx")
    m = onnx.load(path)
    g = m.graph
    ce = [n for n in g.node if n.op_type == "SoftmaxCrossEntropyLoss"]
    if len(ce) != 1:
        continue
    ce = ce[0]
    del ce.output[:]
    ce.output.extend(["loss", "log_prob"])
    g.node.append(helper.make_node(
        "SoftmaxCrossEntropyLossGrad", ["loss_grad", "log_prob", ce.input[1]],
        [ce.input[0] + "_grad"], name="grad", domain="com.microsoft"))
    g.input.append(helper.make_tensor_value_info("loss_grad", TensorProto.FLOAT, []))
    out = os.path.join(dst, "art", name)
    os.makedirs(out, exist_ok=True)
    onnx.save(m, os.path.join(out, "training_model.onnx"))
    shutil.copy(path, os.path.join(out, "eval_model.onnx"))
    with open(os.path.join(out, "optimizer_model.onnx"), "wb") as f:
        f.write(b"opt")
    with open(os.path.join(out, "checkpoint"), "wb") as f:
        f.write(b"ckpt")
    shutil.copy(tok, os.path.join(out, "tokenizer.json"))

os.makedirs(os.path.join(dst, "ext"), exist_ok=True)
for name in ("lm_flat", "gpt2_ts", "llama_ts"):
    m = onnx.load(os.path.join(src, "models", name + ".onnx"))
    onnx.save(m, os.path.join(dst, "ext", name + ".onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location=name + ".data", size_threshold=0)
