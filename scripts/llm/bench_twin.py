#!/usr/bin/env python3
"""Decode and prefill tokens/s and peak resident memory of `lazuli generate`
beside llama.cpp (`llama-cpp-python`) on the same GGUF files, the same
prompt and the same number of threads, in one run, alternating A B A B.

    pip install gguf numpy llama-cpp-python
    cargo build --release --bin lazuli
    python3 scripts/llm/bench_twin.py [--threads 2] [--repeats 2] [--dim 1024 --layers 8] \
        [--exact] [--baseline path/to/main/lazuli]

The models are random Llama weights written here (not committed): f32, then
Q8_0 and Q4_0 through the `gguf` package. Each engine runs in a child
process whose peak RSS (`wait4`) is reported beside the file size and the
KV cache. Greedy decoding; llama.cpp's own timings (`llama_perf_context`)
give its prompt and decode rates; Lazuli's come from its `--json`.

`--exact` also runs the same binary with `LAZULI_CPU_Q8_ACTIVATIONS=0` (the
exact f32 products), `--baseline` another build of `lazuli` (main's, for an
A/B of a change); every engine runs once per repeat, in turn, so all see
the same load.
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


def measured(cmd, threads, extra_env=None):
    """stdout and peak RSS (bytes) of a child (`wait4`), with `threads`
    worker threads (Lazuli's pool: `LAZULI_CPU_THREADS`, and rayon's)."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), LAZULI_CPU_THREADS=str(threads), **(extra_env or {}))
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
    ap.add_argument("--exact", action="store_true", help="also run with LAZULI_CPU_Q8_ACTIVATIONS=0")
    ap.add_argument("--baseline", help="another lazuli binary (main's) run in the same alternation")
    a = ap.parse_args()
    variants = [("lazuli", a.lazuli, {})]
    if a.exact:
        variants.append(("exact", a.lazuli, {"LAZULI_CPU_Q8_ACTIVATIONS": "0"}))
    if a.baseline:
        variants.append(("baseline", a.baseline, {}))
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
            runs = {}
            for label, binary, env in variants:
                out, rss = measured([binary, "generate", "--model", path, "--device", "cpu", "--prompt-ids",
                                     ",".join(map(str, prompt)), "--max-tokens", str(a.tokens), "--greedy",
                                     "--chunk", "64", "--json"], a.threads, env)
                runs[label] = (json.loads(out.strip().splitlines()[-1]), rss)
            ll_out, ll_rss = measured([sys.executable, "-c", LLAMA_CHILD, path, str(a.threads), json.dumps(prompt),
                                       str(a.tokens)], a.threads)
            ll = json.loads(ll_out.strip().splitlines()[-1])
            lz, lz_rss = runs["lazuli"]
            same = sum(x == y for x, y in zip(lz["generated_ids"], ll["generated_ids"]))
            rows.append(dict(model=name, rep=rep, threads=a.threads, file_mb=size / 1e6, kv_mb=kv / 1e6,
                             lazuli_decode=lz["decode_tps"], llama_decode=ll["decode_tps"],
                             lazuli_prompt=lz["prompt_tps"], llama_prompt=ll["prompt_tps"],
                             lazuli_rss_mb=lz_rss / 1e6, llama_rss_mb=ll_rss / 1e6,
                             lazuli_weights_mb=lz["weights_bytes"] / 1e6, same_ids=f"{same}/{a.tokens}"))
            r = rows[-1]
            print(f"{name} #{rep}: decode tok/s lazuli {r['lazuli_decode']:.1f} llama.cpp {r['llama_decode']:.1f} "
                  f"(x{r['lazuli_decode'] / r['llama_decode']:.2f}); prefill tok/s {r['lazuli_prompt']:.1f} vs "
                  f"{r['llama_prompt']:.1f}; peak RSS MB {r['lazuli_rss_mb']:.0f} vs {r['llama_rss_mb']:.0f} "
                  f"(file {r['file_mb']:.0f}, cache {r['kv_mb']:.1f}); greedy ids equal {r['same_ids']}", flush=True)
            for label in runs:
                if label == "lazuli":
                    continue
                other, rss = runs[label]
                same = sum(x == y for x, y in zip(lz["generated_ids"], other["generated_ids"]))
                r[f"{label}_decode"], r[f"{label}_prompt"] = other["decode_tps"], other["prompt_tps"]
                r[f"{label}_rss_mb"], r[f"{label}_same_ids"] = rss / 1e6, f"{same}/{a.tokens}"
                print(f"    {label}: decode tok/s {other['decode_tps']:.1f} (x{other['decode_tps'] / ll['decode_tps']:.2f}"
                      f" of llama.cpp), prefill {other['prompt_tps']:.1f}, peak RSS MB {rss / 1e6:.0f}, "
                      f"greedy ids equal to lazuli's {same}/{a.tokens}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
