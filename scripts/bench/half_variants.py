"""Half-precision variants of models for scripts/bench/compare_outputs.sh (EXTRA_MODELS=DIR):
every float32 initializer of two or more values stored as float16 (NAME_f16.onnx) and as
bfloat16 (NAME_bf16.onnx), nothing else changed. No fixture is a half export, so these
exercise step's upcast and frozen-half passes.

    .venv/bin/python scripts/bench/half_variants.py fixtures/models OUT_DIR
"""
import sys, glob, os
import numpy as np
import onnx
from onnx import numpy_helper, TensorProto, helper

src, dst = sys.argv[1], sys.argv[2]
for path in sorted(glob.glob(os.path.join(src, "*.onnx"))):
    for kind in ("f16", "bf16"):
        m = onnx.load(path)
        for t in m.graph.initializer:
            if t.data_type == TensorProto.FLOAT and int(np.prod(t.dims)) >= 2:
                a = numpy_helper.to_array(t).astype(np.float32)
                if kind == "f16":
                    n = numpy_helper.from_array(a.astype(np.float16), t.name)
                else:
                    bits = (a.view(np.uint32) >> 16).astype(np.uint16)
                    n = helper.make_tensor(t.name, TensorProto.BFLOAT16, a.shape, bits.tobytes(), raw=True)
                t.CopyFrom(n)
        name = os.path.basename(path)[:-5] + f"_{kind}.onnx"
        onnx.save(m, os.path.join(dst, name))
