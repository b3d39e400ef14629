"""MXFP8 accuracy against bf16 on the same values: an MXFP8 model (random weights quantized)
and its dequantised twin (``build_dequantized_twin``: a bf16 model holding the dequantised
weights) run the same prompts, then a greedy decode of ``--steps`` steps teacher-forced by the
MXFP8 model's own tokens (both models see the same sequence, so every step is compared on the
same inputs).

Reported: the relative error of the prompt logits, per decode step the logits' relative error
(median, p90, max) and whether the two greedy tokens agree, and the agreement fraction. On the
GPU the MXFP8 model runs the fp8 kernels the tuner chose (fused MoE on fp8 experts, the fp8
projections); its twin the bf16 kernels: the difference is theirs, not the weights'.

The noise floor beside it: a second bf16 twin on the plain-torch op table (the same weights and
maths, other kernels and summation orders) against the first, over the same tokens. A random
model amplifies any rounding difference over depth and steps; MXFP8 is as accurate as its
dequantised weights allow when its figures sit at that floor.

Usage (GPU): ``python benchmarks/mxfp8_accuracy.py --layers 20 --json out.json``; three models
of ``--layers`` rank-of-8 layers must fit (bf16 ~1.7 GB a layer twice, MXFP8 about half). CPU:
``--preset tiny --device cpu`` checks the script (fp32, the torch path).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from models.minimax_m3 import build_from_preset
from models.minimax_m3.build import build_dequantized_twin
from models.minimax_m3.config import MiniMaxM3Config
from steps import TokenChunk


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="rank-of-8")
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    config = MiniMaxM3Config.preset(args.preset, quantization="mxfp8")
    config = config.first_layers(min(args.layers, config.num_hidden_layers))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    n, plen = args.requests, args.prompt_len
    q8 = build_from_preset(config, args.device, dtype, max_tokens=max(n * plen, 64), max_seqs=n,
                           max_seq_len=plen + args.steps + 8)
    twin = build_dequantized_twin(q8)
    floor = build_dequantized_twin(q8, producer="torch")  # the noise floor: other kernels, same maths
    for r in (q8, twin, floor):  # kernel choices for the two row counts the script runs
        for rows in sorted({n, n * plen}):
            r.model.ops.choose_kernels(r.model, rows)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (plen,), generator=gen).tolist() for _ in range(n)]
    for r in (q8, twin, floor):
        for i in range(n):
            r.add_request(i)
    first = [TokenChunk(i, 0, prompts[i]) for i in range(n)]
    lq, lt, lf = q8.run_chunks(first), twin.run_chunks(first), floor.run_chunks(first)
    prompt_err, prompt_floor = rel_err(lq, lt), rel_err(lf, lt)
    tokens = lq.argmax(-1).tolist()
    errs, agree, f_errs, f_agree = [], [], [], []
    for _ in range(args.steps):
        chunks = [TokenChunk(i, q8.num_written(i), [tokens[i]]) for i in range(n)]
        lq, lt, lf = q8.run_chunks(chunks), twin.run_chunks(chunks), floor.run_chunks(chunks)
        errs.append(rel_err(lq, lt))
        f_errs.append(rel_err(lf, lt))
        tokens = lq.argmax(-1).tolist()  # teacher forcing: all continue with the MXFP8 tokens
        want = lt.argmax(-1).tolist()
        agree.append(sum(a == b for a, b in zip(tokens, want)))
        f_agree.append(sum(a == b for a, b in zip(lf.argmax(-1).tolist(), want)))

    def spread(v: list[float]) -> dict:
        s = sorted(v)
        return {"median": statistics.median(s), "p90": s[int(0.9 * (len(s) - 1))], "max": s[-1]}

    result = {
        "preset": args.preset, "layers": config.num_hidden_layers, "device": args.device, "requests": n,
        "prompt_len": plen, "steps": args.steps,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "prompt_logits_rel_err": prompt_err, "decode_logits_rel_err": spread(errs),
        "greedy_agreement": sum(agree) / (n * args.steps), "agree_per_step": agree,
        "noise_floor": {"prompt_logits_rel_err": prompt_floor, "decode_logits_rel_err": spread(f_errs),
                        "greedy_agreement": sum(f_agree) / (n * args.steps)},
        "kernels": {"mxfp8": q8.model.ops.name, "bf16 twin": twin.model.ops.name, "floor": floor.model.ops.name},
    }
    print(f"MXFP8 vs bf16 on the dequantised weights, {args.preset} {config.num_hidden_layers} layers on "
          f"{args.device}: prompt logits rel err {prompt_err:.2e}; decode {args.steps} steps x {n} requests: logits "
          f"rel err median {result['decode_logits_rel_err']['median']:.2e}, max "
          f"{result['decode_logits_rel_err']['max']:.2e}; greedy agreement {100 * result['greedy_agreement']:.1f}%",
          flush=True)
    nf = result["noise_floor"]
    print(f"noise floor (bf16 twin, torch ops, against the bf16 twin): prompt logits rel err "
          f"{nf['prompt_logits_rel_err']:.2e}; decode logits rel err median "
          f"{nf['decode_logits_rel_err']['median']:.2e}, max {nf['decode_logits_rel_err']['max']:.2e}; "
          f"greedy agreement {100 * nf['greedy_agreement']:.1f}%",
          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
