"""JAX (XLA CPU) twins of Lazuli's CPU training-step workloads, timed beside `lazuli bench --device cpu`
in one run, for the ratios of issue 47 (the CPU engine).

Workloads (same sizes, same batches, weights of the same distributions, same protocol as `lazuli bench`:
3 warm-ups, N timed iterations, each ending when the result is ready, medians):
  G8  GPT train step at `--size small` (vocab 256, 2 layers, n_embd 64, 4 heads, context 64, batch 16):
      one-hot token lookup times wte (as Lazuli's G8), learned positions, pre-LayerNorm blocks with causal
      attention and a GELU (erf) MLP, final LayerNorm, lm_head tied to wte, cross-entropy, AdamW
      (lr 3e-4, weight decay 0.01); token ids from the LCG of `lazuli::bench::Gpt::new`.
  L1  LeNet-style CNN train step (the digits demo's model): batch 64 of 8x8 images, conv 3x3 1->16 pad 1,
      ReLU, max-pool 2, conv 3x3 16->32 pad 1, ReLU, max-pool 2, Linear(128, 10), cross-entropy, SGD lr
      0.05 with Nesterov momentum 0.9 and weight decay 1e-4; images `uniform_data(64 * 64, 31)`, labels
      `i * 7 % 10`.
  G7  MLP train step at `--size small`: [256, 256] -> Linear(256, 1024) -> ReLU -> Linear(1024, 256) ->
      cross-entropy (labels i * 7 % 256), SGD lr 0.01; x `uniform_data(256 * 256, 17)`.
  W4  MLP train step: [256, 64] -> Linear(64, 256) -> ReLU -> Linear(256, 10), SGD lr 0.1; x
      `uniform_data(256 * 64, 5)`.
  W5  100 times x = x * 1.0001 + 0.0001 on f32 [1024], jitted.

Each workload runs in a process of its own, Lazuli's and JAX's in turn (A B A B over `--rounds`), so each
figure comes with that process's peak resident memory (the kernel's accounting of the child). Besides the
wall-time medians, each side reports its process's CPU time per timed iteration (all threads): on a busy
host, where other processes take the cores, wall time measures the share a process got as much as its
work, and the CPU time is the work. `--lazuli-b PATH` adds a second Lazuli build to the rotation (A/B of
a change beside the twin, in the same run). The step
each JAX user would write is jitted whole, with the parameters and optimizer state donated.

    python3 scripts/jax_twin.py [--lazuli target/release/lazuli] [--lazuli-b OTHER] [--rounds 2] [--iters 20] [W ...]
    python3 scripts/jax_twin.py --child G8 --iters 20        # one JAX workload, one JSON row
"""
import json, os, statistics, subprocess, sys, time

ALL = ["G8", "L1", "G7", "W4", "W5"]
# Lazuli's row names (`lazuli bench --size small`) for each workload.
ROWS = {
    "G8": "G8 GPT train step [L2 C64 T64 B16]",
    "L1": "L1 CNN train step",
    "G7": "G7 MLP train step",
    "W4": "W4",
    "W5": "W5",
}


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def uniform_data(n, seed):
    """`lazuli::bench::uniform_data`: the same LCG, the same f32 values."""
    import numpy as np
    m = (1 << 64) - 1
    s = (seed * 6364136223846793005 + 1442695040888963407) & m
    out = np.empty(n, np.float32)
    for i in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) & m
        out[i] = np.float32((s >> 40) / float(1 << 24)) * np.float32(2.0) - np.float32(1.0)
    return out


def gpt_tokens(b, t, v):
    """The token ids and targets of `lazuli::bench::Gpt::new` (its LCG)."""
    import numpy as np
    m = (1 << 64) - 1
    s = 0x9E3779B97F4A7C15
    toks = []
    for _ in range(b * (t + 1)):
        s = (s * 6364136223846793005 + 1442695040888963407) & m
        toks.append((s >> 33) % v)
    toks = np.array(toks, np.int32).reshape(b, t + 1)
    return toks[:, :t].reshape(-1), toks[:, 1:].reshape(-1)


def timed(f, iters):
    """Wall ms of each timed iteration, and the process's CPU ms per iteration (all threads)."""
    import jax
    for _ in range(3):
        jax.block_until_ready(f())
    ts = []
    cpu0 = time.process_time()
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        ts.append((time.perf_counter() - t0) * 1e3)
    return ts, (time.process_time() - cpu0) * 1e3 / iters


def cross_entropy(logits, labels):
    import jax, jax.numpy as jnp
    lp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[:, None], 1))


def linear_init(key, i, o):
    """PyTorch's nn.Linear initialization (uniform in +-1/sqrt(in)), weight [in, out]."""
    import jax
    k1, k2 = jax.random.split(key)
    bound = 1.0 / i ** 0.5
    return (jax.random.uniform(k1, (i, o), minval=-bound, maxval=bound),
            jax.random.uniform(k2, (o,), minval=-bound, maxval=bound))


def sgd_step(lr, momentum, wd):
    """torch.optim.SGD with Nesterov momentum and weight decay: (params, grads, bufs) -> (params, bufs)."""
    import jax

    def update(params, grads, bufs):
        bufs = jax.tree.map(lambda b, g, p: momentum * b + g + wd * p, bufs, grads, params)
        params = jax.tree.map(lambda p, g, b: p - lr * (g + wd * p + momentum * b), params, grads, bufs)
        return params, bufs
    return update


def mlp_workload(batch, din, hidden, classes, lr, seed, iters):
    import jax, jax.numpy as jnp
    k = jax.random.PRNGKey(seed)
    k1, k2 = jax.random.split(k)
    params = {"l1": linear_init(k1, din, hidden), "l2": linear_init(k2, hidden, classes)}
    x = jnp.asarray(uniform_data(batch * din, seed).reshape(batch, din))
    y = jnp.asarray([(i * 7) % classes for i in range(batch)], jnp.int32)

    def loss_fn(p):
        h = jax.nn.relu(x @ p["l1"][0] + p["l1"][1])
        return cross_entropy(h @ p["l2"][0] + p["l2"][1], y)

    def step(p):
        loss, g = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, b: a - lr * b, p, g), loss
    step = jax.jit(step, donate_argnums=(0,))
    state = [params]

    def run():
        state[0], loss = step(state[0])
        return loss
    return timed(run, iters)


def cnn_workload(iters):
    import jax, jax.numpy as jnp
    from jax import lax
    batch = 64
    k = jax.random.split(jax.random.PRNGKey(31), 3)

    def conv_init(key, o, i):
        k1, k2 = jax.random.split(key)
        bound = 1.0 / (i * 9) ** 0.5
        return (jax.random.uniform(k1, (o, i, 3, 3), minval=-bound, maxval=bound),
                jax.random.uniform(k2, (o,), minval=-bound, maxval=bound))
    params = {"c1": conv_init(k[0], 16, 1), "c2": conv_init(k[1], 32, 16), "fc": linear_init(k[2], 128, 10)}
    bufs = jax.tree.map(jnp.zeros_like, params)
    x = jnp.asarray(uniform_data(batch * 64, 31).reshape(batch, 1, 8, 8))
    y = jnp.asarray([(i * 7) % 10 for i in range(batch)], jnp.int32)

    def conv(h, w, b):
        out = lax.conv_general_dilated(h, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return out + b[None, :, None, None]

    def pool(h):
        return lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")

    def loss_fn(p):
        h = pool(jax.nn.relu(conv(x, *p["c1"])))
        h = pool(jax.nn.relu(conv(h, *p["c2"])))
        return cross_entropy(h.reshape(batch, -1) @ p["fc"][0] + p["fc"][1], y)
    update = sgd_step(0.05, momentum=0.9, wd=1e-4)

    def step(p, b):
        loss, g = jax.value_and_grad(loss_fn)(p)
        p, b = update(p, g, b)
        return p, b, loss
    step = jax.jit(step, donate_argnums=(0, 1))
    state = [params, bufs]

    def run():
        state[0], state[1], loss = step(state[0], state[1])
        return loss
    return timed(run, iters)


def gpt_workload(iters):
    import jax, jax.numpy as jnp
    V, L, C, H, T, B = 256, 2, 64, 4, 64, 16
    D = C // H
    keys = iter(jax.random.split(jax.random.PRNGKey(8), 4 + 4 * L))

    def ln_init():
        return (jnp.ones(C), jnp.zeros(C))
    params = {
        "wte": jax.random.normal(next(keys), (V, C)),
        "wpe": jax.random.normal(next(keys), (T, C)),
        "lnf": ln_init(),
        "blocks": [
            {"ln1": ln_init(), "qkv": linear_init(next(keys), C, 3 * C), "proj": linear_init(next(keys), C, C),
             "ln2": ln_init(), "fc": linear_init(next(keys), C, 4 * C), "out": linear_init(next(keys), 4 * C, C)}
            for _ in range(L)
        ],
    }
    ids, targets = gpt_tokens(B, T, V)
    ids, targets = jnp.asarray(ids), jnp.asarray(targets)

    def layer_norm(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p[0] + p[1]
    mask = jnp.tril(jnp.ones((T, T), bool))

    def block(p, x):
        qkv = layer_norm(x, p["ln1"]) @ p["qkv"][0] + p["qkv"][1]
        q, k, v = (qkv[:, i * C:(i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3))
        s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / D ** 0.5)
        att = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), -1) @ v
        x = x + att.transpose(0, 2, 1, 3).reshape(B * T, C) @ p["proj"][0] + p["proj"][1]
        m = jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["fc"][0] + p["fc"][1], approximate=False)
        return x + m @ p["out"][0] + p["out"][1]

    def loss_fn(p):
        tok = jax.nn.one_hot(ids, V) @ p["wte"]
        x = (tok.reshape(B, T, C) + p["wpe"]).reshape(B * T, C)
        for bp in p["blocks"]:
            x = block(bp, x)
        return cross_entropy(layer_norm(x, p["lnf"]) @ p["wte"].T, targets)
    lr, b1, b2, eps, wd = 3e-4, 0.9, 0.999, 1e-8, 0.01

    def step(p, m, v, t):
        loss, g = jax.value_and_grad(loss_fn)(p)
        t = t + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        p = jax.tree.map(lambda p, m, v: p * (1 - lr * wd) - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), p, m, v)
        return p, m, v, t, loss
    step = jax.jit(step, donate_argnums=(0, 1, 2))
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = [params, zeros, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32)]

    def run():
        *st, loss = step(*state)
        state[:] = st
        return loss
    return timed(run, iters)


def w5_workload(iters):
    import jax, jax.numpy as jnp
    x = jnp.asarray(uniform_data(1024, 6))

    @jax.jit
    def chain(v):
        for _ in range(100):
            v = v * 1.0001 + 0.0001
        return v
    return timed(lambda: chain(x), max(iters, 50))


def child(name, iters):
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    ts, cpu = {
        "G8": lambda: gpt_workload(iters),
        "L1": lambda: cnn_workload(iters),
        "G7": lambda: mlp_workload(256, 256, 1024, 256, 0.01, 17, iters),
        "W4": lambda: mlp_workload(256, 64, 256, 10, 0.1, 5, iters),
        "W5": lambda: w5_workload(iters),
    }[name]()
    print(json.dumps({"workload": ROWS[name], "device": "jax-cpu", "median_ms": statistics.median(ts),
                      "min_ms": min(ts), "max_ms": max(ts), "cpu_ms": cpu}), flush=True)


def run_child(cmd):
    """Runs `cmd`; returns its stdout and its peak resident memory in MiB."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}")
    return out, usage.ru_maxrss / 1024.0


def main():
    iters = int(arg("--iters", "20"))
    if "--child" in sys.argv:
        return child(arg("--child", ""), iters)
    builds = [("lazuli", arg("--lazuli", "target/release/lazuli"))]
    if "--lazuli-b" in sys.argv:
        builds.append(("lazuli-b", arg("--lazuli-b", "")))
    rounds = int(arg("--rounds", "2"))
    names = [a for a in sys.argv[1:] if a in ALL] or ALL
    results = {}
    for _ in range(rounds):
        for name in names:
            for side, exe in builds:
                out, peak = run_child([exe, "bench", name, "--size", "small", "--device", "cpu", "--json",
                                       "--iterations", str(iters)])
                row = next(r for r in json.loads(out) if r["workload"] == ROWS[name])
                results.setdefault((name, side), []).append((row["median_ms"], row.get("cpu_ms"), peak))
            out, peak = run_child([sys.executable, __file__, "--child", name, "--iters", str(iters)])
            row = json.loads(out)
            results.setdefault((name, "jax"), []).append((row["median_ms"], row["cpu_ms"], peak))
    sides = [side for side, _ in builds] + ["jax"]
    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else float("nan")
    print(f"{'workload':<36} {'side':<9} {'wall ms':>9} {'cpu ms':>9} {'peak MiB':>9} {'jax/this wall':>14} {'jax/this cpu':>13}")
    rows = []
    for name in names:
        jw = med(r[0] for r in results[(name, "jax")])
        jc = med(r[1] for r in results[(name, "jax")])
        for side in sides:
            rs = results[(name, side)]
            w, c, pk = med(r[0] for r in rs), med(r[1] for r in rs), max(r[2] for r in rs)
            print(f"{ROWS[name]:<36} {side:<9} {w:>9.3f} {c:>9.3f} {pk:>9.0f} {jw / w:>13.2f}x {jc / c:>12.2f}x")
            rows.append({"workload": ROWS[name], "side": side, "wall_ms": w, "cpu_ms": c, "peak_mib": pk,
                         "jax_over_this_wall": jw / w, "jax_over_this_cpu": jc / c, "rounds": rounds})
    if "--json" in sys.argv:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
