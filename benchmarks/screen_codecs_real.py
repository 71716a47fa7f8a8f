"""Screen KV quantisation variants cheaply on real KV: SmolLM2-135M (HF transformers) on the real-text
corpus, each variant applied to the prompt's cached prefix block by block, next-token distribution
compared with the unquantised cache's.

    .venv/bin/python benchmarks/screen_codecs_real.py --step 16 --offset 0 [--variants fp8 int8 ...]

Prototype quantisers in plain torch (not kvstore's codecs, which only some variants became): a
variant that screens well is then implemented as a codec and confirmed through vLLM and a real
daemon by ``bench_fidelity_real.py``. Per prompt: the model (float32 compute, the cache rounded to
bf16 as an engine stores it) runs the prompt's full 32-token blocks (at least one token left),
each variant quantises and dequantises that cached prefix per block (K and V ``[heads, 32, 64]``
per layer), then the rest of the prompt runs on it; KL(unquantised || variant) of the next-token
distribution over the full vocabulary and top-1 agreement. Needs transformers (the vLLM venv has
it) and the real model (``scripts/real-model.sh``).

Variants: ``k_chanG`` keys INT4 per channel over G tokens (KIVI; ``int4_gN`` is
``k_chan(min(N, 32))`` + ``v_gN``), ``v_gN`` / ``k_tokN`` INT4 per token over N dims, ``had`` a
Hadamard rotation along head_dim before quantising and after dequantising (QuaRot; ``hadN``: on
groups of N dims; ``k_hadchan16``: keys rotated, then per channel over 16 tokens), ``fp8`` e4m3 per
(token, head) row, ``int8`` symmetric per row, ``_kchan`` keys with one scale per (head, channel)
over the block's tokens, ``_k`` / ``_v`` only keys / values rotated (the other plain), ``k_fp8`` /
``k_int8kchan`` 8-bit keys beside INT4 values, ``+sink_X`` the sequence's first block through
variant X (``int8h``: int8_had) instead, ``_t0`` every block's token 0 kept exactly and the rest quantised
without it (``int4_g64_t0``; ``_konly`` / ``_vonly``: only its keys / values quantised, to see which
error dominates), ``_out1`` one token per block kept exactly in K and V, the one whose removal shrinks
its key channels' ranges most (``_t0_out1``: token 0 and that token among the others).
``bf16_ulp`` is not a codec: every element moved to a neighbouring bf16 value, a yardstick for how
small an error is.

    --compute bfloat16 --greedy 32     # the model in bf16 (as an engine), and 32-token greedy identity
"""

import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from prompts.corpus import load_prompts  # noqa: E402

BLOCK = 32


def hadamard(x):  # along last dim (64), orthonormal
    D = x.shape[-1]; h = 1; y = x.float().clone()
    while h < D:
        y = y.view(*y.shape[:-1], D // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).view(*x.shape[:-2], x.shape[-2], D)
        h *= 2
    return y / math.sqrt(D)

def hadamard_groups(x, n):
    """``hadamard`` on each group of ``n`` consecutive dims (a cheaper, block-diagonal rotation)."""
    return hadamard(x.reshape(*x.shape[:-1], x.shape[-1] // n, n)).reshape(x.shape)


def int4(x, dim, group):
    """asymmetric 4-bit along `dim` in groups of `group` (x float32)."""
    x = x.movedim(dim, -1)
    s = x.shape
    g = x.reshape(*s[:-1], s[-1] // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    sc = ((hi - lo) / 15).clamp_min(1e-30)
    q = ((g - lo) / sc).round().clamp(0, 15)
    return (q * sc + lo).reshape(s).movedim(-1, dim)

def fp8(x, dim=-1):
    amax = x.abs().amax(dim, keepdim=True)
    sc = (amax / 448).clamp_min(1e-30)
    return (x / sc).to(torch.float8_e4m3fn).float() * sc

def K_chan(g): return lambda k: int4(k, 1, min(g, k.shape[1]))            # per channel over tokens
def K_tok(g, rot): return lambda k: (hadamard(int4(hadamard(k), 2, g)) if rot else int4(k, 2, g))
def V_tok(g, rot): return lambda v: (hadamard(int4(hadamard(v), 2, g)) if rot else int4(v, 2, g))
FP8 = lambda x: fp8(x, -1)
def int8(x, dim=-1):
    amax = x.abs().amax(dim, keepdim=True)
    sc = (amax / 127).clamp_min(1e-30)
    return (x / sc).round().clamp(-127, 127) * sc
FP8_KCHAN = lambda k: fp8(k, 1)
INT8_HAD = lambda x: hadamard(int8(hadamard(x)))
INT8_KCHAN = lambda k: int8(k, 1)                                        # per (head, channel) over the tokens
FP8_HAD = lambda x: hadamard(fp8(hadamard(x)))
def INT8_HADN(n): return lambda x: hadamard_groups(int8(hadamard_groups(x, n)), n)
INT8 = lambda x: int8(x)


def bf16_ulp(x):
    """Every element moved to a neighbouring bf16 value (its magnitude one step up or down at random;
    a zero one step up): a perturbation as small as a bf16 cache can carry every element (not a codec)."""
    b = x.bfloat16()
    g = torch.Generator().manual_seed(int(x.numel()) + int(b.view(torch.int16).sum()) % 1000)
    step = torch.where(torch.rand(x.shape, generator=g) < 0.5, -1, 1).to(torch.int16)
    bits = b.view(torch.int16)
    mag = bits & 0x7FFF
    mag = torch.where(mag == 0, torch.ones_like(mag), mag + step)
    return ((bits & -0x8000) | mag).view(torch.bfloat16).float()


def T0(f):
    """``f`` over the block's tokens 1.. only, token 0 kept exactly (the sequence's first token, the
    attention sink, is token 0 of its first block): ``int4_g64_t0``."""
    def g(x):
        out = x.clone()
        out[:, 1:] = f(x[:, 1:])
        return out
    return g


def K_chan_all(k):   # per channel over all the tokens it is given
    return int4(k, 1, k.shape[1])


def outlier_token(k):
    """The token of a block's keys ``[H, T, D]`` whose removal shrinks the per-channel ranges most
    (summed over heads and channels, each relative to its range)."""
    top = k.topk(2, dim=1).values        # [H, 2, D]
    bot = (-k).topk(2, dim=1).values.neg()
    rng = (top[:, 0] - bot[:, 0]).clamp_min(1e-30)
    gain_hi = (top[:, 0] - top[:, 1]) / rng   # if the argmax token goes
    gain_lo = (bot[:, 1] - bot[:, 0]) / rng
    gain = torch.zeros(k.shape[1])
    gain.index_add_(0, k.argmax(1).reshape(-1), gain_hi.reshape(-1))
    gain.index_add_(0, k.argmin(1).reshape(-1), gain_lo.reshape(-1))
    return int(gain.argmax())


def OUT1(fk, fv, first: bool = False):
    """One token per block (``outlier_token`` of its keys) kept exactly in K and V, the rest through
    ``fk`` / ``fv``; with ``first``, token 0 kept too and the outlier token chosen among the others."""
    def joint(kb, vb):
        t = outlier_token(kb[:, 1:]) + 1 if first else outlier_token(kb)
        keep = [i for i in range(kb.shape[1]) if i != t and not (first and i == 0)]
        ko, vo = kb.clone(), vb.clone()
        ko[:, keep] = fk(kb[:, keep])
        vo[:, keep] = fv(vb[:, keep])
        return ko, vo
    return joint


VARIANTS = {
    "fp8": (FP8, FP8),
    "fp8_kchan": (FP8_KCHAN, FP8),
    "fp8_had": (FP8_HAD, FP8_HAD),
    "int8": (INT8, INT8),
    "int8_kchan": (INT8_KCHAN, INT8),
    "int8_had": (INT8_HAD, INT8_HAD),
    "int8_had_k": (INT8_HAD, INT8),
    "int8_had_v": (INT8, INT8_HAD),
    "int8_kchan+v_had": (INT8_KCHAN, INT8_HAD),
    "int8_had16": (INT8_HADN(16), INT8_HADN(16)),
    "int8_had8": (INT8_HADN(8), INT8_HADN(8)),
    "int8_had16_k": (INT8_HADN(16), INT8),
    "bf16_ulp": (bf16_ulp, bf16_ulp),
    "k_chan16+v_g64": (K_chan(16), V_tok(64, False)),
    "k_chan8+v_g64": (K_chan(8), V_tok(64, False)),
    "k_chan16+v_g32": (K_chan(16), V_tok(32, False)),
    "int4_g64": (K_chan(64), V_tok(64, False)),
    "int4_g32": (K_chan(32), V_tok(32, False)),
    "k_chan+v_had64": (K_chan(64), V_tok(64, True)),
    "k_chan16+v_had64": (K_chan(16), V_tok(64, True)),
    "k_chan+v_had32": (K_chan(64), V_tok(32, True)),
    "k_hadchan16+v_had64": (lambda k: hadamard(K_chan(16)(hadamard(k))), V_tok(64, True)),
    "k_had64+v_had64": (K_tok(64, True), V_tok(64, True)),
    "k_had32+v_had32": (K_tok(32, True), V_tok(32, True)),
    "k_tok64+v_tok64": (K_tok(64, False), V_tok(64, False)),
    "k_fp8+v_had64": (FP8, V_tok(64, True)),
    "k_fp8+v_g64": (FP8, V_tok(64, False)),
    "k_int8kchan+v_had64": (INT8_KCHAN, V_tok(64, True)),
    "int4_g64_t0": (T0(K_chan_all), T0(V_tok(64, False))),
    "int4_g32_t0": (T0(K_chan_all), T0(V_tok(32, False))),
    "int4_g64_t0_konly": (T0(K_chan_all), lambda v: v),
    "int4_g64_t0_vonly": (lambda k: k, T0(V_tok(64, False))),
    "int4_g64_out1": (type("J", (), {"joint": staticmethod(OUT1(K_chan_all, V_tok(64, False)))})(), None),
    "int4_g64_t0_out1": (type("J", (), {"joint": staticmethod(OUT1(K_chan_all, V_tok(64, False), True))})(), None),
}
#: "+sink_X": the sequence's first block through variant X instead
SINKS = {"fp8": (FP8, FP8), "int8h": (INT8_HAD, INT8_HAD)}
for name in ("int4_g64", "k_chan+v_had64", "k_had64+v_had64", "k_chan16+v_g64", "k_chan16+v_had64",
             "k_chan+v_had32"):
    for sink in SINKS:
        VARIANTS[f"{name}+sink_{sink}"] = VARIANTS[name] + (SINKS[sink],)


def apply(cache, P, fk, fv, sink):
    if getattr(fk, "joint", None):
        for layer in cache.layers:
            k, v = layer.keys[0, :, :P].float(), layer.values[0, :, :P].float()
            ko, vo = [], []
            for b in range(P // BLOCK):
                a, c = fk.joint(k[:, b * BLOCK:(b + 1) * BLOCK], v[:, b * BLOCK:(b + 1) * BLOCK])
                ko.append(a); vo.append(c)
            layer.keys[0, :, :P] = torch.cat(ko, 1).to(layer.keys.dtype)
            layer.values[0, :, :P] = torch.cat(vo, 1).to(layer.values.dtype)
        return
    for layer in cache.layers:
        for i, (attr, f) in enumerate((("keys", fk), ("values", fv))):
            t = getattr(layer, attr)  # [1, H, P, D]
            x = t[0, :, :P].float()
            out = []
            for b in range(P // BLOCK):
                blk = x[:, b * BLOCK:(b + 1) * BLOCK]
                out.append(sink[i](blk) if (sink and b == 0) else f(blk))
            t[0, :, :P] = torch.cat(out, 1).to(t.dtype)


def prefix(model, ids):
    n = len(ids)
    P = (n - 1) // BLOCK * BLOCK
    with torch.no_grad():
        cache = model(torch.tensor([ids[:P]]), use_cache=True).past_key_values
    for layer in cache.layers:   # the KV an engine stores: bf16
        layer.keys.copy_(layer.keys.bfloat16().to(layer.keys.dtype))
        layer.values.copy_(layer.values.bfloat16().to(layer.values.dtype))
    return P, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers], cache


def run(model, ids, variant, pre, greedy: int = 0):
    """The next-token log-probabilities after the prompt with ``variant``'s prefix KV, and (``greedy``
    > 0) the ``greedy`` tokens greedy decoding then produces."""
    P, saved, cache = pre
    for layer, (k, v) in zip(cache.layers, saved):
        layer.keys, layer.values = k.clone(), v.clone()
    with torch.no_grad():
        if variant is not None:
            fk, fv, *s = VARIANTS[variant]
            apply(cache, P, fk, fv, s[0] if s else None)
            for layer in cache.layers:
                layer.keys = layer.keys.bfloat16().to(k.dtype)
                layer.values = layer.values.bfloat16().to(v.dtype)
        out = model(torch.tensor([ids[P:]]), past_key_values=cache, use_cache=True)
        first = out.logits[0, -1].float().log_softmax(-1)
        tokens = [int(first.argmax())]
        while len(tokens) < greedy:
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return first, tokens


def machine(compute: str) -> str:
    from kvstore.ops.machine import machine_facts
    m = machine_facts()
    return (f"{m.get('cpu_model')}, {m.get('cores_usable')} usable cores, shared; load average "
            f"{os.getloadavg()[0]:.1f} at the end; transformers in {compute} on one thread; {m.get('time_utc')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("KVSTORE_REAL_MODEL"), help="the real model's directory")
    ap.add_argument("--step", type=int, default=16, help="every STEP-th prompt of the corpus")
    ap.add_argument("--offset", type=int, default=0, help="starting at this one")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--compute", choices=("float32", "bfloat16"), default="float32",
                    help="the model's dtype (bfloat16: as an engine computes; the cache is bf16 either way)")
    ap.add_argument("--greedy", type=int, default=0, help="also compare this many greedy tokens (0: first token only)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.compute)).eval()
    prompts = load_prompts()[a.offset::a.step]
    res = {v: {"top1": 0, "kl": [], "greedy_same": 0} for v in a.variants}
    t0 = time.time()
    for i, p in enumerate(prompts):
        ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if len(ids) < BLOCK + 1:
            continue
        pre = prefix(model, ids)
        ref, ref_tokens = run(model, ids, None, pre, a.greedy)
        for v in a.variants:
            lp, tokens = run(model, ids, v, pre, a.greedy)
            res[v]["greedy_same"] += int(tokens == ref_tokens)
            res[v]["top1"] += int(lp.argmax() == ref.argmax())
            res[v]["kl"].append(float((ref.exp() * (ref - lp)).sum()))
        print(i, len(prompts), f"{time.time() - t0:.0f}s", flush=True)
    n = len(res[a.variants[0]]["kl"])
    summary = {v: {"n": n, "top1": r["top1"] / n, "kl_mean": sum(r["kl"]) / n, "kl_max": max(r["kl"]),
                   **({"greedy": r["greedy_same"] / n} if a.greedy else {})} for v, r in res.items()}
    with open(a.out, "w") as f:
        json.dump({"step": a.step, "offset": a.offset, "prompts": n, "compute": a.compute, "greedy_tokens": a.greedy,
                   "variants": summary,
                   "machine": machine(a.compute), "seconds": time.time() - t0}, f, indent=1)
    for v, s in summary.items():
        print(f"{v:28s} top1 {s['top1']:.3f} KL mean {s['kl_mean']:.2e} max {s['kl_max']:.2e}"
              f" greedy {s.get('greedy', float('nan')):.3f}")


def render(runs: list[dict]) -> str:
    """A markdown table of one or more runs' results (each variant: mean over the runs' prompts); runs
    of one compute dtype (float32 unless a run says otherwise), with greedy identity where they have it."""
    compute = {r.get("compute", "float32") for r in runs}
    assert len(compute) == 1, f"runs of different compute dtypes: {compute}"
    compute = compute.pop()
    greedy = min(r.get("greedy_tokens", 0) for r in runs)
    names = list(dict.fromkeys(v for r in runs for v in r["variants"]))
    lines = ["# Codec variants screened on real KV (SmolLM2-135M, HF transformers)", "",
             "Produced by `python benchmarks/screen_codecs_real.py` (method and variant names in its docstring): "
             + "; ".join(f"every {r['step']}th corpus prompt from offset {r['offset']} ({r['prompts']} prompts, "
                         f"{len(r['variants'])} variants)" for r in runs)
             + f". The model in {compute}. Next-token distribution with the variant's prefix KV against the "
             "unquantised bf16 cache: KL over the full vocabulary (nats) and top-1 agreement"
             + (f", and {greedy} greedy tokens identical" if greedy else "")
             + ", over the prompts of the runs that tried the variant. "
             "Screening only: what a codec does in a real engine is in [fidelity_real.md](fidelity_real.md).", "",
             "| variant | payload / raw bytes (32-token block, head_dim 64) | prompts | KL mean | KL max | top-1 agreement |"
             + (f" {greedy} greedy tokens identical |" if greedy else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if greedy else "")]
    rows = []
    for v in names:
        mine = list({(r["step"], r["offset"]): r for r in runs if v in r["variants"]}.values())  # a rerun replaces
        m = sum(r["prompts"] for r in mine)
        kl = sum(r["variants"][v]["kl_mean"] * r["prompts"] for r in mine) / m
        top1 = sum(r["variants"][v]["top1"] * r["prompts"] for r in mine) / m
        same = sum(r["variants"][v].get("greedy", 0) * r["prompts"] for r in mine) / m
        rows.append((kl, v, m, max(r["variants"][v]["kl_max"] for r in mine), top1, same))
    for kl, v, m, kl_max, top1, same in sorted(rows):
        lines.append(f"| {v} | {SIZES.get(v.split('+sink_')[0], '-')} | {m} | {kl:.2e} | {kl_max:.2e} "
                     f"| {100 * top1:.1f}% |" + (f" {100 * same:.1f}% |" if greedy else ""))
    lines += ["", "Machine: " + "; ".join(dict.fromkeys(r.get("machine", "") for r in runs)) + "."]
    return "\n".join(lines) + "\n"


#: payload bytes over raw bytes per (layer, head) of a 32-token block, head_dim 64, bf16 statistics
#: (a +sink_X variant adds the first block's X size once per sequence; bf16_ulp is not a codec)
SIZES = {"fp8": "0.52", "fp8_kchan": "0.52", "fp8_had": "0.52", "int8": "0.52", "int8_had": "0.52",
         "int8_kchan": "0.52", "int8_had_k": "0.52", "int8_had16": "0.52", "int8_had8": "0.52", "int8_had16_k": "0.52",
         "int8_kchan+v_had": "0.52", "bf16_ulp": "1.00", "k_chan+v_had32": "0.31", "k_hadchan16+v_had64": "0.33",
         "k_int8kchan+v_had64": "0.41",
         "int4_g64": "0.30", "int4_g32": "0.31", "k_chan16+v_g64": "0.33", "k_chan8+v_g64": "0.39",
         "k_chan16+v_g32": "0.34", "k_chan+v_had64": "0.30", "k_chan16+v_had64": "0.33",
         "k_had64+v_had64": "0.28", "k_had32+v_had32": "0.31", "k_tok64+v_tok64": "0.28",
         "k_fp8+v_had64": "0.40", "k_fp8+v_g64": "0.40",
         "int4_g64_t0": "0.32", "int4_g32_t0": "0.34", "int4_g64_out1": "0.33", "int4_g64_t0_out1": "0.36"}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:   # --render OUT.md RUN.json ...: the markdown of one or more runs
        loaded = [json.load(open(f)) for f in sys.argv[3:]]
        runs = [r for x in loaded for r in x.get("runs", [x])]   # (a file of several runs: {"runs": [...]})
        with open(sys.argv[2], "w") as f:
            f.write(render(runs))
    else:
        main()
