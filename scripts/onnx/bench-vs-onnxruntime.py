#!/usr/bin/env python3
"""Times the O1 models (`lazuli bench O1`) on Lazuli's CPU device beside
onnxruntime's CPU provider, alternating A B A B in one run, with the same
number of threads, and prints each model's medians and the ratio
Lazuli / onnxruntime (below 1: Lazuli faster).

    cargo build --release
    python3 scripts/onnx/bench-vs-onnxruntime.py [--threads N] [--repeat N] [--rounds N] [--json]

Lazuli runs through `target/release/lazuli run MODEL --device cpu --repeat
N --json` (the median of N runs, the first included: one compile among
them), its rayon pool sized by RAYON_NUM_THREADS; onnxruntime runs the
same file with `intra_op_num_threads = N`, `inter_op_num_threads = 1`,
all graph optimizations on, 3 warm-up runs, then the median of N. Inputs:
the light models get the ONNX runner's dummy input (`arange(n) / n`), the
encoder random ids at batch 8, sequence 128 (`--dim batch=8 --dim seq=128`;
Lazuli draws its own random inputs of the same shapes: the work does not
depend on the values). Needs `pip install onnxruntime numpy`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
FIX = os.path.join(ROOT, "tests", "fixtures", "onnx")
LIGHT = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet",
         "squeezenet", "vgg19", "zfnet512"]


def models():
    out = [(f"O1 {m}", os.path.join(FIX, "light", m, "model.onnx"), {}) for m in LIGHT]
    out.append(("O1 encoder b8 t128", os.path.join(FIX, "exported", "encoder", "model.onnx"), {"batch": 8, "seq": 128}))
    return out


def ort_median(path, dims, threads, repeat):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    feeds = {}
    for x in sess.get_inputs():
        shape = [d if isinstance(d, int) else dims.get(d, 1) for d in x.shape]
        n = int(np.prod(shape))
        if x.type == "tensor(int64)":
            feeds[x.name] = (np.arange(n) % 97 + 1).reshape(shape).astype(np.int64)
        else:
            feeds[x.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    for _ in range(3):
        sess.run(None, feeds)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def lazuli_median(exe, path, dims, threads, repeat):
    cmd = [exe, "run", path, "--device", "cpu", "--repeat", str(repeat), "--json"]
    for k, v in dims.items():
        cmd += ["--dim", f"{k}={v}"]
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), LAZULI_CACHE_DIR="")
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lazuli", default=os.path.join(ROOT, "target", "release", "lazuli"))
    ap.add_argument("--only", nargs="*", default=None, help="row names containing these words")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for name, path, dims in models():
        if args.only and not any(w in name for w in args.only):
            continue
        ort_ms, laz_ms, kernels = [], [], None
        for _ in range(args.rounds):
            ort_ms.append(ort_median(path, dims, args.threads, args.repeat))
            r = lazuli_median(args.lazuli, path, dims, args.threads, args.repeat + 1)
            laz_ms.append(r["median_ms"])
            kernels = r["kernels"]
        ratios = [a / b for a, b in zip(laz_ms, ort_ms)]
        row = {"workload": name, "threads": args.threads, "onnxruntime_ms": ort_ms, "lazuli_cpu_ms": laz_ms,
               "ratio_lazuli_over_ort": ratios, "onnxruntime": ort.__version__}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{name:<22} ort {min(ort_ms):9.2f} ms  lazuli cpu {min(laz_ms):9.2f} ms  "
                  f"lazuli/ort {' '.join(f'{x:.2f}x' for x in ratios)}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
