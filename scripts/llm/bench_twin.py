#!/usr/bin/env python3
"""Decode and prefill tokens/s and peak resident memory of `lazuli generate`
beside llama.cpp (`llama-cpp-python`) on the same GGUF files, the same
prompt and the same number of threads, in one run, alternating A B A B.

    pip install gguf numpy llama-cpp-python
    cargo build --release --bin lazuli
    python3 scripts/llm/bench_twin.py [--threads 2] [--repeats 2] [--dim 1024 --layers 8]

The models are random Llama weights written here (not committed): f32, then
Q8_0 and Q4_0 through the `gguf` package. Each engine runs in a child
process whose peak RSS (`wait4`) is reported beside the file size and the
KV cache. Greedy decoding; llama.cpp's own timings (`llama_perf_context`)
give its prompt and decode rates; Lazuli's come from its `--json`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_fixtures import random_weights, write_gguf, spm_vocab  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))

LLAMA_CHILD = r"""
import json, sys, time, llama_cpp, numpy as np
path, threads, prompt, n = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
m = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + n + 8, n_threads=threads, n_threads_batch=threads,
                    n_batch=512, verbose=False, use_mmap=True, logits_all=True)
t0 = time.perf_counter()
m.eval(prompt)
t1 = time.perf_counter()
ids = []
for i in range(n):
    t = int(np.argmax(m.scores[m.n_tokens - 1]))
    ids.append(t)
    if i + 1 < n:
        m.eval([t])
t2 = time.perf_counter()
print(json.dumps({"prompt_tps": len(prompt) / (t1 - t0), "decode_tps": (n - 1) / (t2 - t1), "generated_ids": ids}))
"""


def measured(cmd, threads):
    """stdout and peak RSS (bytes) of a child (`wait4`), with `threads`
    worker threads (rayon's pool for Lazuli)."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed ({status}): {err.decode()[-3000:]}")
    return out.decode(), usage.ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--lazuli", default=os.path.join(ROOT, "target", "release", "lazuli"))
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "lazuli-llm-bench"))
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    tokens, scores, types = spm_vocab()
    cfg = dict(arch="llama", dim=a.dim, heads=a.dim // 64, kv_heads=a.dim // 128, head_dim=64, ffn=a.ffn,
               layers=a.layers, vocab=len(tokens), ctx=a.prompt + a.tokens + 16, eps=1e-5, rope_base=10000.0)
    W = None
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(3, len(tokens), a.prompt)]
    rows = []
    for qt, name in [(Q.Q8_0, "q8_0"), (Q.Q4_0, "q4_0")]:
        path = os.path.join(a.dir, f"bench-{a.dim}x{a.layers}-{name}.gguf")
        if not os.path.exists(path):
            if W is None:
                W = random_weights(cfg, np.random.default_rng(1))
            write_gguf(path, cfg, W, qt, ("llama", tokens, (scores, types)))
        size = os.path.getsize(path)
        kv = 2 * cfg["layers"] * cfg["kv_heads"] * cfg["head_dim"] * (a.prompt + a.tokens) * 4
        for rep in range(a.repeats):
            lz_out, lz_rss = measured([a.lazuli, "generate", "--model", path, "--device", "cpu", "--prompt-ids",
                                       ",".join(map(str, prompt)), "--max-tokens", str(a.tokens), "--greedy",
                                       "--chunk", "64", "--json"], a.threads)
            lz = json.loads(lz_out.strip().splitlines()[-1])
            ll_out, ll_rss = measured([sys.executable, "-c", LLAMA_CHILD, path, str(a.threads), json.dumps(prompt),
                                       str(a.tokens)], a.threads)
            ll = json.loads(ll_out.strip().splitlines()[-1])
            same = sum(x == y for x, y in zip(lz["generated_ids"], ll["generated_ids"]))
            rows.append(dict(model=name, rep=rep, file_mb=size / 1e6, kv_mb=kv / 1e6,
                             lazuli_decode=lz["decode_tps"], llama_decode=ll["decode_tps"],
                             lazuli_prompt=lz["prompt_tps"], llama_prompt=ll["prompt_tps"],
                             lazuli_rss_mb=lz_rss / 1e6, llama_rss_mb=ll_rss / 1e6,
                             lazuli_weights_mb=lz["weights_bytes"] / 1e6, same_ids=f"{same}/{a.tokens}"))
            r = rows[-1]
            print(f"{name} #{rep}: decode tok/s lazuli {r['lazuli_decode']:.1f} llama.cpp {r['llama_decode']:.1f} "
                  f"(x{r['lazuli_decode'] / r['llama_decode']:.2f}); prefill tok/s {r['lazuli_prompt']:.1f} vs "
                  f"{r['llama_prompt']:.1f}; peak RSS MB {r['lazuli_rss_mb']:.0f} vs {r['llama_rss_mb']:.0f} "
                  f"(file {r['file_mb']:.0f}, cache {r['kv_mb']:.1f}); greedy ids equal {r['same_ids']}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
