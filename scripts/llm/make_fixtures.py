#!/usr/bin/env python3
"""Writes the tiny language models `tests/llm.rs` checks Lazuli against.

Each fixture is a small random model in one storage type and a JSON file of
what a float64 numpy reference computes from the weights *as stored* (read
back from the written file and dequantized by the `gguf` package): the
logits of every position of a prompt and the greedy continuation. The
reference is itself checked here against llama.cpp (`llama-cpp-python`) on
the f32 and f16 files, and the K-quant files are made by llama.cpp's own
quantizer (`llama_model_quantize`), as a new user's files would be.

    pip install gguf numpy llama-cpp-python tokenizers
    python3 scripts/llm/make_fixtures.py            # writes tests/fixtures/llm/

Rust tests read the committed outputs and never run Python.
"""

import json
import os
import struct
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "llm")
CONTINUE = 12  # greedy tokens in each reference
MIN_MARGIN = 0.05  # top-1 minus top-2 logit along the reference continuation


# ---------------------------------------------------------------- vocabularies

def spm_vocab():
    """A SentencePiece-style vocabulary: specials, 256 byte tokens, pieces."""
    pieces = ["\u2581", "e", "t", "a", "o", "h", "l", "r", "d", "w", "n", "s", "i",
              "\u2581t", "he", "\u2581the", "ll", "\u2581he", "llo", "\u2581hello",
              "or", "\u2581w", "\u2581wor", "ld", "\u2581world", "\u2581a", "en", "\u2581en",
              "\u2581end", "in", "\u2581in", "\u2581s", "\u2581o", "\u2581on", "er", "es", "\u2581i",
              "\u2581is", "an", "\u2581an", "\u2581and"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    # Longer pieces merge first where they compete: score by length.
    for i, p in enumerate(pieces):
        scores[259 + i] = float(len(p)) - i * 1e-3
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def bpe_vocab():
    """A byte-level BPE vocabulary (GPT-2's byte alphabet) and its merges."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("\u0120", "w"), ("o", "r"),
              ("\u0120w", "or"), ("l", "d"), ("\u0120wor", "ld"), ("\u0120", "t"), ("\u0120t", "he"),
              ("e", "n"), ("\u0120", "en"), ("\u0120en", "d"), ("a", "n"), ("\u0120", "an"), ("\u0120an", "d")]
    for a, b in merges:
        tokens.append(a + b)
    tokens.append("<|endoftext|>")
    return tokens, [f"{a} {b}" for a, b in merges]


# ---------------------------------------------------------------- the reference

def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def ln(x, w, b, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * w + b


def rope(x, pos, base, style):
    """x [t, heads, hd] rotated at positions pos."""
    hd = x.shape[-1]
    half = hd // 2
    inv = base ** (-(2.0 * np.arange(half)) / hd)
    ang = pos[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if style == "interleaved":
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out
    x0, x1 = x[..., :half], x[..., half:]
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], -1)


def attend(q, k, v):
    """Causal grouped-query attention: q [t, h, d], k, v [t, g, d]."""
    t, h, d = q.shape
    g = k.shape[1]
    out = np.zeros((t, h, v.shape[-1]))
    for j in range(h):
        kk, vv = k[:, j // (h // g)], v[:, j // (h // g)]
        s = q[:, j] @ kk.T / np.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, j] = p @ vv
    return out


def forward(cfg, W, ids):
    """Float64 logits [t, vocab] of every position."""
    t = len(ids)
    pos = np.arange(t, dtype=np.float64)
    x = W["token_embd.weight"][ids]
    gpt2 = cfg["arch"] == "gpt2"
    if gpt2:
        x = x + W["position_embd.weight"][:t]
    h, g, hd, eps = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["eps"]
    norm = (lambda x, n: ln(x, W[n + ".weight"], W[n + ".bias"], eps)) if gpt2 else (lambda x, n: rms(x, W[n + ".weight"], eps))
    lin = lambda x, n: x @ W[n + ".weight"].T + (W[n + ".bias"] if n + ".bias" in W else 0.0)
    for i in range(cfg["layers"]):
        p = f"blk.{i}."
        a = norm(x, p + "attn_norm")
        if gpt2:
            qkv = lin(a, p + "attn_qkv")
            q, k, vv = qkv[:, :h * hd], qkv[:, h * hd:(h + g) * hd], qkv[:, (h + g) * hd:]
        else:
            q, k, vv = lin(a, p + "attn_q"), lin(a, p + "attn_k"), lin(a, p + "attn_v")
        q, k, vv = q.reshape(t, h, hd), k.reshape(t, g, hd), vv.reshape(t, g, hd)
        if not gpt2:
            style = "interleaved" if cfg["arch"] == "llama" else "half"
            q, k = rope(q, pos, cfg["rope_base"], style), rope(k, pos, cfg["rope_base"], style)
        o = attend(q, k, vv).reshape(t, h * hd)
        x = x + lin(o, p + "attn_output")
        f = norm(x, p + "ffn_norm")
        if gpt2:
            u = lin(f, p + "ffn_up")
            u = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
            x = x + lin(u, p + "ffn_down")
        else:
            gt = lin(f, p + "ffn_gate")
            x = x + lin(gt / (1 + np.exp(-gt)) * lin(f, p + "ffn_up"), p + "ffn_down")
    x = norm(x, "output_norm")
    out = W.get("output.weight", W["token_embd.weight"])
    return x @ out.T


def greedy(cfg, W, ids, n):
    ids = list(ids)
    margins = []
    for _ in range(n):
        l = forward(cfg, W, ids)[-1]
        top = np.sort(l)[::-1]
        margins.append(float(top[0] - top[1]))
        ids.append(int(l.argmax()))
    return ids[-n:], min(margins)


# ---------------------------------------------------------------- writing

def random_weights(cfg, rng):
    d, h, g, hd, f, v = cfg["dim"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["ffn"], cfg["vocab"]
    W = {}
    mat = lambda o, i, s=1.0: (rng.standard_normal((o, i)) * s / np.sqrt(i)).astype(np.float32)
    vec = lambda n, c=1.0, s=0.1: (c + rng.standard_normal(n) * s).astype(np.float32)
    W["token_embd.weight"] = (rng.standard_normal((v, d))).astype(np.float32)
    gpt2 = cfg["arch"] == "gpt2"
    if gpt2:
        W["position_embd.weight"] = (rng.standard_normal((cfg["ctx"], d)) * 0.5).astype(np.float32)
    for i in range(cfg["layers"]):
        p = f"blk.{i}."
        W[p + "attn_norm.weight"] = vec(d)
        W[p + "ffn_norm.weight"] = vec(d)
        if gpt2:
            W[p + "attn_norm.bias"] = vec(d, 0.0)
            W[p + "ffn_norm.bias"] = vec(d, 0.0)
            W[p + "attn_qkv.weight"] = mat((h + 2 * g) * hd, d)
            W[p + "attn_qkv.bias"] = vec((h + 2 * g) * hd, 0.0)
            W[p + "attn_output.bias"] = vec(d, 0.0)
            W[p + "ffn_up.weight"] = mat(f, d)
            W[p + "ffn_up.bias"] = vec(f, 0.0)
            W[p + "ffn_down.bias"] = vec(d, 0.0)
        else:
            W[p + "attn_q.weight"] = mat(h * hd, d)
            W[p + "attn_k.weight"] = mat(g * hd, d)
            W[p + "attn_v.weight"] = mat(g * hd, d)
            W[p + "ffn_gate.weight"] = mat(f, d)
            W[p + "ffn_up.weight"] = mat(f, d)
            if cfg["arch"] == "qwen2":
                W[p + "attn_q.bias"] = vec(h * hd, 0.0)
                W[p + "attn_k.bias"] = vec(g * hd, 0.0)
                W[p + "attn_v.bias"] = vec(g * hd, 0.0)
        W[p + "attn_output.weight"] = mat(d, h * hd)
        W[p + "ffn_down.weight"] = mat(d, f)
    W["output_norm.weight"] = vec(d)
    if gpt2:
        W["output_norm.bias"] = vec(d, 0.0)
    if not cfg.get("tied"):
        W["output.weight"] = mat(v, d, 4.0)
    return W


def write_gguf(path, cfg, W, qtype, vocab):
    arch = cfg["arch"]
    w = gguf.GGUFWriter(path, arch)
    w.add_name(os.path.basename(path))
    w.add_context_length(cfg["ctx"])
    w.add_embedding_length(cfg["dim"])
    w.add_block_count(cfg["layers"])
    w.add_feed_forward_length(cfg["ffn"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    if arch == "gpt2":
        w.add_layer_norm_eps(cfg["eps"])
    else:
        w.add_layer_norm_rms_eps(cfg["eps"])
        w.add_rope_freq_base(cfg["rope_base"])
        w.add_rope_dimension_count(cfg["head_dim"])
    w.add_file_type({Q.F32: 0, Q.F16: 1, Q.Q4_0: 2, Q.Q8_0: 7, Q.Q5_0: 8, Q.BF16: 32}[qtype])
    kind, tokens, extra = vocab
    w.add_tokenizer_model(kind)
    w.add_token_list(tokens)
    if kind == "llama":
        scores, types = extra
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
    else:
        w.add_token_merges(extra)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_bos_token_id(len(tokens) - 1)
    for name, a in W.items():
        if a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, a)
        elif qtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_back(path):
    """The weights as stored, dequantized to float64, and the types."""
    r = gguf.GGUFReader(path)
    W, types = {}, {}
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]
        a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        W[t.name] = a.astype(np.float64)
        types[t.name] = t.tensor_type.name
    return W, types


def llama_cpp_logits(path, ids):
    """llama.cpp's logits of every position (None if it is not installed)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    m = llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    m.eval(ids)
    return np.array(m.scores[: len(ids)], dtype=np.float64)


def quantize_with_llama_cpp(src, dst, ftype):
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed on {src}: {rc}")


def dequant_samples(path):
    """Per tensor type, the first rows of one tensor as the `gguf` package
    decodes them, as f32 bit patterns (checked bit for bit in Rust)."""
    r = gguf.GGUFReader(path)
    out = {}
    for t in r.tensors:
        name = t.tensor_type.name
        if name in out or len(t.shape) != 2:
            continue
        rows = np.asarray(t.data)[:2]
        vals = gguf.quants.dequantize(rows, t.tensor_type).astype(np.float32).reshape(-1)
        out[name] = {"tensor": t.name, "rows": 2, "bits": [int(x) for x in vals.view(np.uint32)]}
    return out


def tokenize_reference(path, text):
    """llama.cpp's ids for `text` (None without llama-cpp-python)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    m = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    return m.tokenize(text.encode(), add_bos=True, special=False)


TEXT = "hello world and the end"


def reference(path, cfg, prompt, name):
    W, types = read_back(path)
    logits = forward(cfg, W, prompt)
    cont, margin = greedy(cfg, W, prompt, CONTINUE)
    return {
        "dequant": dequant_samples(path),
        "text": TEXT,
        "text_ids": tokenize_reference(path, TEXT),
        "file": os.path.basename(path),
        "arch": cfg["arch"],
        "types": sorted(set(types.values())),
        "prompt_ids": prompt,
        "vocab": cfg["vocab"],
        "logits": [round(float(x), 7) for x in logits.reshape(-1)],
        "greedy": cont,
        "greedy_margin": margin,
    }, W


def main():
    os.makedirs(OUT, exist_ok=True)
    spm = spm_vocab()
    bpe_tokens, bpe_merges = bpe_vocab()
    small = dict(arch="llama", dim=64, heads=4, kv_heads=2, head_dim=16, ffn=128, layers=2,
                 vocab=len(spm[0]), ctx=64, eps=1e-5, rope_base=10000.0)
    kq = dict(small, dim=256, heads=4, kv_heads=2, head_dim=64, ffn=288, layers=1)
    qwen = dict(small, arch="qwen2", vocab=len(bpe_tokens), tied=True, rope_base=1e6)
    gpt2 = dict(small, arch="gpt2", heads=4, kv_heads=4, ffn=256, vocab=len(bpe_tokens))
    prompt_spm = [1, 290, 281, 262, 299, 271, 275]  # "<s>" and a few pieces
    prompt_bpe = [260, 87, 270, 265, 72, 268]
    index = {}

    def emit(name, cfg, W, qtype, vocab, prompt, seed_check=True):
        path = os.path.join(OUT, name + ".gguf")
        write_gguf(path, cfg, W, qtype, vocab)
        ref, Wd = reference(path, cfg, prompt, name)
        if ref["greedy_margin"] < MIN_MARGIN:
            raise SystemExit(f"{name}: greedy margin {ref['greedy_margin']:.3g}: pick another seed")
        check_against_llama_cpp(path, prompt, Wd, cfg, ref)
        with open(os.path.join(OUT, name + ".json"), "w") as f:
            json.dump(ref, f)
        index[name] = ref["types"]
        return Wd

    W = pick_weights(small, [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q5_0], prompt_spm, 7)
    llama_vocab = ("llama", spm[0], (spm[1], spm[2]))
    for qt, name in [(Q.F32, "llama-f32"), (Q.F16, "llama-f16"), (Q.BF16, "llama-bf16"),
                     (Q.Q8_0, "llama-q8_0"), (Q.Q4_0, "llama-q4_0"), (Q.Q5_0, "llama-q5_0")]:
        emit(name, small, W, qt, llama_vocab, prompt_spm)

    Wq = pick_weights(qwen, [Q.Q8_0], prompt_bpe, 5)
    emit("qwen2-q8_0", qwen, Wq, Q.Q8_0, ("gpt2", bpe_tokens, bpe_merges), prompt_bpe)
    Wg = pick_weights(gpt2, [Q.Q8_0], prompt_bpe, 3)
    emit("gpt2-q8_0", gpt2, Wg, Q.Q8_0, ("gpt2", bpe_tokens, bpe_merges), prompt_bpe)

    write_hf_llama(W, small, spm)
    # The K-quants from llama.cpp's own quantizer (a Q4_K_M mix: q4_K,
    # q6_K and, for rows of 288, q5_0 / q8_0), and all-Q6_K.
    Wk = pick_weights(kq, [Q.Q4_K, Q.Q6_K], prompt_spm, 11)
    src = os.path.join(OUT, "_kq-f32.gguf")
    write_gguf(src, kq, Wk, Q.F32, llama_vocab)
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("the K-quant fixtures need llama-cpp-python (pip install llama-cpp-python)")
    for ftype, name in [(llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "llama-q4_k_m"), (llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, "llama-q6_k")]:
        dst = os.path.join(OUT, name + ".gguf")
        quantize_with_llama_cpp(src, dst, ftype)
        ref, Wd = reference(dst, kq, prompt_spm, name)
        if ref["greedy_margin"] < MIN_MARGIN:
            raise SystemExit(f"{name}: greedy margin {ref['greedy_margin']:.3g}")
        check_against_llama_cpp(dst, prompt_spm, Wd, kq, ref)
        with open(os.path.join(OUT, name + ".json"), "w") as f:
            json.dump(ref, f)
        index[name] = ref["types"]
    os.remove(src)

    with open(os.path.join(OUT, "index.json"), "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)


def stored(a, qtype):
    """What a file of `qtype` holds for the f32 matrix `a`, as float64."""
    if a.ndim == 1 or qtype == Q.F32:
        return a.astype(np.float64)
    if qtype == Q.F16:
        return a.astype(np.float16).astype(np.float64)
    return gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).reshape(a.shape).astype(np.float64)


def pick_weights(cfg, qtypes, prompt, seed):
    """Random weights whose greedy continuation keeps a clear margin in
    every storage type (so an f32 engine and the float64 reference agree
    on every token); K-quant types are approximated by Q8_0 here."""
    for s in range(seed, seed + 200):
        W = random_weights(cfg, np.random.default_rng(s))
        ok = True
        for qt in qtypes:
            qt = Q.Q8_0 if qt in (Q.Q4_K, Q.Q6_K) else qt
            Wd = {k: stored(v, qt) for k, v in W.items()}
            if greedy(cfg, Wd, prompt, CONTINUE)[1] < 2 * MIN_MARGIN:
                ok = False
                break
        if ok:
            print(f"{cfg['arch']} dim {cfg['dim']}: seed {s}")
            return W
    raise SystemExit("no seed gives clear greedy margins")


def check_against_llama_cpp(path, prompt, Wd, cfg, ref):
    """The numpy reference must agree with llama.cpp on the same file."""
    got = llama_cpp_logits(path, prompt)
    if got is None:
        print(f"{os.path.basename(path)}: llama-cpp-python missing, reference not cross-checked")
        return
    want = np.array(ref["logits"]).reshape(len(prompt), -1)
    err = np.abs(got - want).max() / (np.abs(want).max() + 1e-9)
    print(f"{os.path.basename(path)}: numpy vs llama.cpp max relative error {err:.2e}")
    # llama.cpp quantizes activations to 8 bits for quantized weights.
    if err > 5e-2:
        raise SystemExit(f"{path}: the reference disagrees with llama.cpp ({err:.2e})")


def write_hf_llama(W, cfg, spm):
    """The f16 GGUF's weights as a Hugging Face folder: q and k rows back in
    HF's half-rotation layout, f16 safetensors, config.json. Its logits must
    equal llama-f16's."""
    d = os.path.join(OUT, "hf-llama")
    os.makedirs(d, exist_ok=True)
    h, g, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]

    def unpermute(w, n):
        return w.reshape(n, hd // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)

    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    parts = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    tensors = {}
    for name, a in W.items():
        if name.startswith("blk."):
            _, i, part, suffix = name.split(".")
            hf = f"model.layers.{i}.{parts[part]}.{suffix}"
            if part == "attn_q":
                a = unpermute(a, h)
            if part == "attn_k":
                a = unpermute(a, g)
        else:
            hf = names[name]
        tensors[hf] = a.astype(np.float16) if a.ndim == 2 else a.astype(np.float32)
    header, blobs, off = {}, [], 0
    for k in sorted(tensors):
        a = tensors[k]
        b = a.tobytes()
        header[k] = {"dtype": "F16" if a.dtype == np.float16 else "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hb = json.dumps(header).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg["vocab"],
              "hidden_size": cfg["dim"], "intermediate_size": cfg["ffn"], "num_hidden_layers": cfg["layers"],
              "num_attention_heads": h, "num_key_value_heads": g, "max_position_embeddings": cfg["ctx"],
              "rms_norm_eps": cfg["eps"], "rope_theta": cfg["rope_base"], "torch_dtype": "float16"}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    # A byte-level BPE tokenizer.json (the `tokenizers` package), so the
    # folder loads as a new user's would; ids differ from the SPM vocab,
    # which the tests only use through ids.
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    except ImportError:
        print("tokenizers missing: hf-llama has no tokenizer.json")
        return
    bt, bm = bpe_vocab()
    vocab = {t: i for i, t in enumerate(bt)}
    tk = Tokenizer(models.BPE(vocab, [tuple(m.split(" ")) for m in bm]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.save(os.path.join(d, "tokenizer.json"))


if __name__ == "__main__":
    main()
