#!/usr/bin/env python3
"""A copy of a model with `Where(IsNaN(p), 0, p)` after each Softmax, as optimum's export of
SDPA writes it (a row of the softmax with every key masked by −∞ becomes zeros, not NaN): the
guarded attention of bench/README.md's "Rows of −∞ found from the masks".

    .venv/bin/python scripts/bench/nan_guard_model.py SRC.onnx OUT.onnx

The weights go to OUT.onnx.data (external data); SRC is not modified.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import helper, numpy_helper


def main() -> None:
    src, out = sys.argv[1], sys.argv[2]
    m = onnx.load(src)
    g = m.graph
    fill = helper.make_node("Constant", [], ["nan_guard/zero"], value=numpy_helper.from_array(np.zeros(1, np.float32)))
    nodes, guarded = [fill], 0
    for n in list(g.node):
        nodes.append(n)
        if n.op_type != "Softmax":
            continue
        p, kept = n.output[0], n.output[0] + "/nan_guarded"
        for reader in g.node:
            reader.input[:] = [kept if i == p else i for i in reader.input]
        for o in g.output:
            if o.name == p:
                sys.exit(f"{src}: the Softmax output '{p}' is a graph output; not guarded")
        nodes += [helper.make_node("IsNaN", [p], [p + "/is_nan"]),
                  helper.make_node("Where", [p + "/is_nan", "nan_guard/zero", p], [kept])]
        guarded += 1
    del g.node[:]
    g.node.extend(nodes)
    onnx.save(m, out, save_as_external_data=True, location=out.split("/")[-1] + ".data")
    print(f"{out}: {guarded} softmaxes guarded")


if __name__ == "__main__":
    main()
