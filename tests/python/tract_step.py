"""Runs ntl-patch step graphs in tract (real float16 kernels) with the state fed back."""
from __future__ import annotations
import json
from pathlib import Path
import numpy as np
import onnx
from onnx import numpy_helper
import tract

_DT = {np.dtype(np.float32): "f32", np.dtype(np.int64): "i64", np.dtype(np.float16): "f16",
       np.dtype(np.bool_): "bool", np.dtype(np.int32): "i32"}

def _primitive_ce(graph):
    """tract has no SoftmaxCrossEntropyLoss: spelled out (LogSoftmax, GatherElements, the
    ignore index, the reduction); [N, C] scores, no class weights (what the step graphs hold)."""
    from onnx import helper as h, TensorProto as T
    out = []
    for k, n in enumerate(graph.node):
        if n.op_type != "SoftmaxCrossEntropyLoss":
            out.append(n)
            continue
        a = {x.name: h.get_attribute_value(x) for x in n.attribute}
        assert len([i for i in n.input if i]) == 2, "class weights"
        red = a.get("reduction", b"mean").decode()
        ign = a.get("ignore_index")
        p = f"tract_ce{k}/"
        scores, labels = n.input[0], n.input[1]
        logp = n.output[1] if len(n.output) > 1 and n.output[1] else p + "logp"

        def c(name, v):
            graph.initializer.append(h.make_tensor(p + name, T.INT64, [], [v]))
            return p + name
        nodes = [h.make_node("LogSoftmax", [scores], [logp], axis=1)]
        if ign is not None:
            nodes += [h.make_node("Equal", [labels, c("ign", ign)], [p + "ignored"]),
                      h.make_node("Not", [p + "ignored"], [p + "kept"]),
                      h.make_node("Where", [p + "kept", labels, c("zero", 0)], [p + "safe"])]
            safe = p + "safe"
        else:
            safe = labels
        one = p + "axes"
        graph.initializer.append(h.make_tensor(one, T.INT64, [1], [1]))
        nodes += [h.make_node("Unsqueeze", [safe, one], [p + "col"]),
                  h.make_node("GatherElements", [logp, p + "col"], [p + "picked2"], axis=1),
                  h.make_node("Squeeze", [p + "picked2", one], [p + "picked"]),
                  h.make_node("Neg", [p + "picked"], [p + "nll_all"])]
        if ign is not None:
            nodes += [h.make_node("Cast", [p + "kept"], [p + "kept_f"], to=T.FLOAT),
                      h.make_node("Mul", [p + "nll_all", p + "kept_f"], [p + "nll"])]
            nll = p + "nll"
        else:
            nll = p + "nll_all"
        if red == "none":
            nodes.append(h.make_node("Identity", [nll], [n.output[0]]))
        elif red == "sum":
            nodes.append(h.make_node("ReduceSum", [nll], [n.output[0]], keepdims=0))
        else:
            count = p + "kept_f" if ign is not None else None
            nodes.append(h.make_node("ReduceSum", [nll], [p + "total"], keepdims=0))
            if count:
                nodes += [h.make_node("ReduceSum", [count], [p + "count"], keepdims=0),
                          h.make_node("Div", [p + "total", p + "count"], [n.output[0]])]
            else:
                nodes += [h.make_node("Shape", [nll], [p + "n"]),
                          h.make_node("Cast", [p + "n"], [p + "nf"], to=T.FLOAT),
                          h.make_node("ReduceSum", [p + "nf"], [p + "nsc"], keepdims=0),
                          h.make_node("Div", [p + "total", p + "nsc"], [n.output[0]])]
        out += nodes
    del graph.node[:]
    graph.node.extend(out)


def _gemm_as_matmul(graph):
    """tract 0.23 types a float16 Gemm's expansion float32 ("Output mismatch after rewiring
    expansion"): Gemm(alpha=beta=1) written as Transpose + MatMul + Add, the same arithmetic."""
    from onnx import helper as h
    out = []
    for k, n in enumerate(graph.node):
        if n.op_type != "Gemm":
            out.append(n)
            continue
        a = {x.name: h.get_attribute_value(x) for x in n.attribute}
        assert a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0, n.name
        p = f"tract_gemm{k}/"
        x, w = n.input[0], n.input[1]
        if a.get("transA", 0):
            out.append(h.make_node("Transpose", [x], [p + "a"], perm=[1, 0]))
            x = p + "a"
        if a.get("transB", 0):
            out.append(h.make_node("Transpose", [w], [p + "b"], perm=[1, 0]))
            w = p + "b"
        has_c = len(n.input) > 2 and n.input[2]
        out.append(h.make_node("MatMul", [x, w], [p + "ab" if has_c else n.output[0]]))
        if has_c:
            out.append(h.make_node("Add", [p + "ab", n.input[2]], [n.output[0]]))
    del graph.node[:]
    graph.node.extend(out)


class TractStep:
    def __init__(self, path, tmpdir):
        m = onnx.load(str(path))
        self.meta = json.loads({p.key: p.value for p in m.metadata_props}["ntl_step"])
        self.pairs = [tuple(p) for p in self.meta["state"]]
        names = {i for i, _ in self.pairs}
        keep, self.state = [], {}
        for t in m.graph.initializer:
            if t.name in names:
                self.state[t.name] = numpy_helper.to_array(t).copy()
            else:
                keep.append(t)
        del m.graph.initializer[:]
        m.graph.initializer.extend(keep)
        kept = {t.name for t in keep}
        self.inputs = [i.name for i in m.graph.input if i.name not in kept]
        self.outputs = [o.name for o in m.graph.output]
        _primitive_ce(m.graph)
        _gemm_as_matmul(m.graph)
        self.file = Path(tmpdir) / (Path(path).stem + ".tract.onnx")
        onnx.save(m, str(self.file))
        self._plans = {}
        self.feeds_extra = {}

    def _plan(self, feeds):
        key = tuple((n, feeds[n].shape, feeds[n].dtype.str) for n in self.inputs)
        if key not in self._plans:
            im = tract.onnx().load(str(self.file))
            for k, n in enumerate(self.inputs):
                a = feeds[n]
                spec = ",".join([str(d) for d in a.shape] + [_DT[a.dtype]])
                im.set_input_fact(k, spec)
            self._plans[key] = im.into_model().into_runnable()
        return self._plans[key]

    def step(self, batch, **extra):
        feeds = dict(batch); feeds.update(self.state); feeds.update(extra)
        for k, v in list(feeds.items()):
            feeds[k] = np.ascontiguousarray(v)
        plan = self._plan(feeds)
        outs = plan.run([feeds[n] for n in self.inputs])
        outs = dict(zip(self.outputs, [o.to_numpy() for o in outs]))
        for i, o in self.pairs:  # tract gives scalars as [1]
            self.state[i] = outs[o].reshape(self.state[i].shape)
        return outs
