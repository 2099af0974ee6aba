#!/usr/bin/env python3
"""Makes the ONNX model fixtures of tests/onnx_models.rs (and `lazuli bench`).

Needs `pip install onnx onnxruntime numpy` (and `torch` for the exported
models). Rust never runs this: its outputs are committed under
tests/fixtures/onnx/. Run from anywhere:

    python3 scripts/onnx/make-fixtures.py

What it writes, one folder per model (`model.onnx`, `input_<k>.pb`,
`output_<k>.pb` as TensorProtos named after the graph's values, and
`meta.json` with the tolerances and notes):

- `light/<name>`: the `onnx` wheel's `backend/test/data/light` models
  (ResNet50, VGG19, Inception v1/v2, ShuffleNet, SqueezeNet, DenseNet121,
  AlexNet, ZFNet512), whose weights are `ConstantOfShape` nodes (checked
  here: no initializer is larger than 64 elements). Their input is the ONNX
  backend runner's dummy input, `arange(n) / n` in f32, which the Rust test
  makes itself (`meta.json` says `"dummy_input": true`), so only the
  outputs are stored. The expected outputs come from onnxruntime; the
  wheel's own `_output_0.pb` is checked against them within the suite's
  tolerance.
- `pytorch-converted/<name>`, `pytorch-operator/<name>`, `simple/<name>`:
  the wheel's model tests with their inputs; outputs recomputed by
  onnxruntime (and checked against the wheel's). A test whose data is over
  256 KiB is cut to its first batch entry (the model's declared batch
  rewritten to 1) and, if still large, to spatial dims holding a few windows of
  its first node, with new random inputs: noted in `meta.json`; one still
  over the limit is skipped (MaxPool2d_stride_padding_dilation: a 591x791
  window needs a 2 MB input). Tests onnxruntime cannot run
  (string and training ops) are stored without outputs: Lazuli must list
  their nodes as unsupported at load.
- `exported/<name>`: small models exported from PyTorch by this script
  (`torch.onnx.export`, dynamic axes), with inputs and onnxruntime outputs
  at two sizes (`input_<k>.pb` / `output_<k>.pb` for the first size,
  `size2/` for the second).
"""

import glob
import json
import math
import os
import shutil
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
OUT = os.path.join(ROOT, "tests", "fixtures", "onnx")
DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
BIG = 256 * 1024


def session(model_path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])


def save_tensor(path, array, name):
    t = numpy_helper.from_array(np.ascontiguousarray(array), name)
    with open(path, "wb") as f:
        f.write(t.SerializeToString())


def load_tensor(path):
    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def graph_inputs(model):
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def close(a, b, rtol, atol):
    return a.shape == b.shape and np.allclose(a, b, rtol=rtol, atol=atol)


def light():
    rtols = {"densenet121": 2e-3}
    for path in sorted(glob.glob(os.path.join(DATA, "light", "light_*.onnx"))):
        name = os.path.basename(path)[len("light_"):-len(".onnx")]
        model = onnx.load(path)
        big = [i.name for i in model.graph.initializer if np.prod(i.dims) > 64]
        assert not big, f"{name}: initializers are not all small: {big[:3]}"
        ops = {n.op_type for n in model.graph.node}
        assert "ConstantOfShape" in ops, f"{name}: weights are not ConstantOfShape"
        feeds = {}
        for x in graph_inputs(model):
            shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in x.type.tensor_type.shape.dim)
            n = int(np.prod(shape))
            feeds[x.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
        outs = session(path).run(None, feeds)
        rtol, atol = rtols.get(name, 1e-3), 1e-7
        wheel = path[: -len(".onnx")] + "_output_0.pb"
        if os.path.exists(wheel):
            ref = load_tensor(wheel)
            assert close(outs[0], ref, rtol, atol), f"{name}: onnxruntime differs from the wheel's output"
        d = os.path.join(OUT, "light", name)
        os.makedirs(d, exist_ok=True)
        shutil.copy(path, os.path.join(d, "model.onnx"))
        for k, (o, v) in enumerate(zip(model.graph.output, outs)):
            save_tensor(os.path.join(d, f"output_{k}.pb"), v, o.name)
        meta = {"rtol": rtol, "atol": atol, "dummy_input": True, "source": "onnx wheel backend/test/data/light"}
        write_meta(d, meta)
        print(f"light/{name}: {outs[0].shape}")


def write_meta(d, meta):
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")


def model_tests(suite):
    for src in sorted(glob.glob(os.path.join(DATA, suite, "test_*"))):
        name = os.path.basename(src)[len("test_"):]
        model_path = os.path.join(src, "model.onnx")
        model = onnx.load(model_path)
        data = os.path.join(src, "test_data_set_0")
        inputs = [load_tensor(p) for p in sorted(glob.glob(os.path.join(data, "input_*.pb")))]
        wheel_outs = [load_tensor(p) for p in sorted(glob.glob(os.path.join(data, "output_*.pb")))]
        notes = []
        size = sum(a.nbytes for a in inputs + wheel_outs)
        if size > BIG:
            for x in graph_inputs(model):
                x.type.tensor_type.shape.dim[0].dim_value = 1
            for o in model.graph.output:
                if o.type.tensor_type.shape.dim:
                    o.type.tensor_type.shape.dim[0].dim_value = 1
            inputs = [a[:1] for a in inputs]
            notes.append(f"data of {size} bytes cut to its first batch entry")
            if sum(a.nbytes for a in inputs) > BIG // 2:
                # Still big: smaller spatial dims (at most 32), new random data.
                rng = np.random.default_rng(46)
                small = []
                # Keep room for a few windows of the first node's pooling.
                att = {a.name: list(a.ints) for a in model.graph.node[0].attribute}
                k = att.get("kernel_shape", [])
                dil = att.get("dilations", [1] * len(k))
                st = att.get("strides", [1] * len(k))
                caps = [max(64, dl * (kk - 1) + 1 + 3 * s) for kk, dl, s in zip(k, dil, st)]
                for x, a in zip(graph_inputs(model), inputs):
                    spatial = a.shape[2:]
                    cap = caps if len(caps) == len(spatial) else [64] * len(spatial)
                    shape = list(a.shape[:2]) + [min(n, c) for n, c in zip(spatial, cap)]
                    for i, n in enumerate(shape):
                        x.type.tensor_type.shape.dim[i].dim_value = n
                    small.append(rng.standard_normal(shape).astype(a.dtype))
                for o in model.graph.output:
                    for i, dim in enumerate(o.type.tensor_type.shape.dim):
                        if i >= 2:
                            dim.dim_param = f"d{i}"
                inputs = small
                notes.append("spatial dims cut to a few windows of its pooling, random inputs")
                if sum(a.nbytes for a in inputs) > BIG:
                    print(f"{suite}/{name}: SKIPPED, still {sum(a.nbytes for a in inputs)} bytes of input")
                    continue
        d = os.path.join(OUT, suite, name)
        os.makedirs(d, exist_ok=True)
        onnx.save(model, os.path.join(d, "model.onnx"))
        names = [x.name for x in graph_inputs(model)]
        for k, (n, a) in enumerate(zip(names, inputs)):
            save_tensor(os.path.join(d, f"input_{k}.pb"), a, n)
        meta = {"rtol": 1e-3, "atol": 1e-7, "source": f"onnx wheel backend/test/data/{suite}"}
        try:
            outs = session(os.path.join(d, "model.onnx")).run(None, dict(zip(names, inputs)))
        except Exception as e:  # noqa: BLE001 - onnxruntime refuses string/training ops
            outs = None
            first = str(e).splitlines()[0][:200]
            # onnxruntime has no kernels for opsets before 7: run the same
            # model converted to opset 7 (the committed file keeps its opset).
            try:
                from onnx import version_converter
                conv = version_converter.convert_version(model, 7)
                tmp = os.path.join(d, "opset7.onnx")
                onnx.save(conv, tmp)
                try:
                    outs = session(tmp).run(None, dict(zip(names, inputs)))
                finally:
                    os.remove(tmp)
                notes.append("onnxruntime ran the model converted to opset 7 (it has no older kernels)")
            except Exception:  # noqa: BLE001
                if wheel_outs and not any("random inputs" in n for n in notes):
                    # The wheel's outputs (computed by PyTorch) are the reference.
                    outs = wheel_outs
                    notes.append(f"onnxruntime cannot run it ({first[:80]}): the wheel's outputs kept")
                else:
                    meta["onnxruntime"] = f"cannot run: {first}"
        if outs is not None and not all(isinstance(o, np.ndarray) and o.dtype.kind in "biuf" for o in outs):
            meta["onnxruntime"] = "its outputs are not numeric tensors (sequences or strings)"
            outs = None
        if outs is not None:
            if size <= BIG and outs is not wheel_outs:
                for a, b in zip(outs, wheel_outs):
                    if not close(a, b, 1e-3, 1e-5):
                        notes.append("onnxruntime differs from the wheel's output (onnxruntime kept)")
            for k, (o, v) in enumerate(zip(model.graph.output, outs)):
                save_tensor(os.path.join(d, f"output_{k}.pb"), v, o.name)
        if notes:
            meta["notes"] = notes
        write_meta(d, meta)
        print(f"{suite}/{name}: {'ok' if outs is not None else meta['onnxruntime'][:60]} {' '.join(notes)}")


def exported():
    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001
        print(f"exported: torch is not importable ({e}); skipped")
        return
    torch.manual_seed(46)

    class Block(nn.Module):
        """A pre-norm transformer encoder layer written out (attention with a
        padding mask, LayerNorm, GELU), as BERT-style exports look."""

        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.ff1 = nn.Linear(d, 4 * d)
            self.ff2 = nn.Linear(4 * d, d)

        def forward(self, x, keep):
            b, t, d = x.shape
            h = self.heads
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q = q.reshape(b, t, h, d // h).transpose(1, 2)
            k = k.reshape(b, t, h, d // h).transpose(1, 2)
            v = v.reshape(b, t, h, d // h).transpose(1, 2)
            s = q @ k.transpose(-1, -2) / math.sqrt(d // h)
            s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
            a = torch.softmax(s, dim=-1) @ v
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))

    class Encoder(nn.Module):
        """Token embedding, learnt positions, two encoder layers, a final
        LayerNorm, per-token logits and a masked mean."""

        def __init__(self, vocab=100, d=64, heads=4, layers=2):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(1, 256, d) * 0.02)
            self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, 8)

        def forward(self, ids):
            t = ids.shape[1]
            keep = ids != 0
            x = self.emb(ids) + self.pos[:, :t]
            for blk in self.blocks:
                x = blk(x, keep)
            x = self.ln(x)
            m = keep.unsqueeze(-1).to(x.dtype)
            return self.head(x), (x * m).sum(dim=1) / m.sum(dim=1)

    class Cnn(nn.Module):
        """MobileNetV3-style blocks: depthwise conv, BatchNorm, HardSwish,
        squeeze-excite with HardSigmoid, then upsampling (Resize) and a
        transposed convolution, as detection and segmentation heads use."""

        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.Hardswish())
            self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, groups=16), nn.BatchNorm2d(16), nn.ReLU())
            self.se1 = nn.Conv2d(16, 4, 1)
            self.se2 = nn.Conv2d(4, 16, 1)
            self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
            self.out = nn.Conv2d(8 + 3, 4, 3, padding=1)

        def forward(self, x):
            y = self.dw(self.stem(x))
            s = F.adaptive_avg_pool2d(y, 1)
            y = y * F.hardsigmoid(self.se2(F.relu(self.se1(s))))
            u = self.up(y)
            b = F.interpolate(y, scale_factor=2.0, mode="bilinear", align_corners=False)
            u = u + b[:, :8]
            return self.out(torch.cat([u, x], dim=1)).clamp(-3.0, 3.0)

    class Recurrent(nn.Module):
        """An LSTM (bidirectional, two layers) feeding a GRU."""

        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(12, 16, num_layers=2, bidirectional=True)
            self.gru = nn.GRU(32, 8)

        def forward(self, x):
            y, _ = self.lstm(x)
            z, h = self.gru(y)
            return z, h

    cases = [
        (
            "encoder",
            Encoder(),
            ["ids"],
            ["logits", "pooled"],
            {"ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}, "pooled": {0: "batch"}},
            lambda s: [torch.randint(1, 100, (2, s))],
            (16, 40),
        ),
        (
            "cnn",
            Cnn(),
            ["image"],
            ["mask"],
            {"image": {0: "batch", 2: "height", 3: "width"}, "mask": {0: "batch", 2: "height", 3: "width"}},
            lambda s: [torch.randn(1, 3, s, s)],
            (32, 48),
        ),
        (
            "recurrent",
            Recurrent(),
            ["x"],
            ["y", "h"],
            {"x": {0: "seq", 1: "batch"}, "y": {0: "seq", 1: "batch"}, "h": {1: "batch"}},
            # The second size changes the batch: a new sequence length is a
            # new unrolled graph, a new batch only a size variant.
            lambda s: [torch.randn(6, s, 12)],
            (3, 5),
        ),
    ]
    for name, module, in_names, out_names, axes, make, sizes in cases:
        module.eval()
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
        d = os.path.join(OUT, "exported", name)
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "model.onnx")
        args = make(sizes[0])
        if name == "encoder":
            args[0][1, -3:] = 0  # padding at the end of the second sequence
        with torch.no_grad():
            torch.onnx.export(
                module, tuple(args), path, input_names=in_names, output_names=out_names,
                dynamic_axes=axes, opset_version=17, dynamo=False,
            )
        sess = session(path)
        for k, s in enumerate(sizes):
            target = d if k == 0 else os.path.join(d, "size2")
            os.makedirs(target, exist_ok=True)
            inputs = args if k == 0 else make(s)
            feeds = {n: a.numpy() for n, a in zip(in_names, inputs)}
            outs = sess.run(None, feeds)
            with torch.no_grad():
                want = module(*inputs)
            want = want if isinstance(want, tuple) else (want,)
            for a, b in zip(outs, want):
                assert close(a, b.numpy(), 1e-3, 1e-4), f"{name}: onnxruntime differs from PyTorch"
            for j, (n, a) in enumerate(feeds.items()):
                save_tensor(os.path.join(target, f"input_{j}.pb"), a, n)
            for j, (n, a) in enumerate(zip(out_names, outs)):
                save_tensor(os.path.join(target, f"output_{j}.pb"), a, n)
        write_meta(d, {"rtol": 1e-3, "atol": 1e-4, "source": f"torch {torch.__version__} torch.onnx.export, opset 17",
                       "sizes": list(sizes)})
        print(f"exported/{name}: {os.path.getsize(path)} bytes, sizes {sizes}")


if __name__ == "__main__":
    which = sys.argv[1:] or ["light", "pytorch-converted", "pytorch-operator", "simple", "exported"]
    for w in which:
        if w == "light":
            light()
        elif w == "exported":
            exported()
        else:
            model_tests(w)
