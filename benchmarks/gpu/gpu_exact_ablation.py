"""Which GPU decode change moves bfloat16 greedy outputs: CUDA graphs (batches padded to a
bucket, so GEMMs of another height), the fused layer ops, the tuned decode attention launch, on the exact step's models and prompts (gpu_suite.py), against
transformers' greedy generate in bfloat16. Reports exact sequences per variant and, at each
divergence, the reference's top-2 gap and the size of one bf16 step at that logit.

    python3 -m benchmarks.gpu.gpu_exact_ablation --out DIR
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.gpu.gpu_suite import NEW_TOKENS, _free_gpu, _prompts, compare, reference_greedy


def run_variant(path, prompts, refs, graphs: bool, fused: bool, tuned: bool, saved_tuning) -> list[dict]:
    from pdserve import LLM, SamplingParams
    from pdserve.kernels import triton_ops
    triton_ops.DECODE_TUNING = saved_tuning if tuned else None
    llm = LLM(model=str(path), dtype="bfloat16", device="cuda", kernel_backend="triton",
              num_kv_blocks=256, enforce_eager=not graphs)
    if not fused:
        llm.engine.model.fused = None
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = []
    for o, (want, logits) in zip(outs, refs):
        r = compare(o.outputs[0].token_ids, want, logits)
        if not r["exact"] and r.get("first_divergence") is not None:
            top = float(logits[r["first_divergence"]].max())
            r["bf16_step_at_top_logit"] = float(torch.tensor(top).bfloat16().float().abs()) * 2 ** -7
        rows.append(r)
    del llm
    _free_gpu()
    return rows


def main() -> None:
    from pdserve.kernels import triton_ops
    from pdserve.testing.model_factory import ARCHS, make_model
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    saved = triton_ops.DECODE_TUNING
    root = Path(tempfile.mkdtemp())
    variants = {v: [] for v in [(True, True, True), (False, True, True), (True, False, True),
                                (True, True, False), (False, False, False)]}
    for kind in ARCHS:
        path = make_model(root, kind)
        prompts = _prompts(261)
        refs = reference_greedy(path, torch.bfloat16, prompts)
        for (graphs, fused, tuned), rows in variants.items():
            for r in run_variant(path, prompts, refs, graphs, fused, tuned, saved):
                rows.append({"model": kind, **r})
    result = {}
    for (graphs, fused, tuned), rows in variants.items():
        div = [r for r in rows if not r["exact"]]
        result[f"graphs={graphs},fused={fused},tuned={tuned}"] = {
            "exact": sum(r["exact"] for r in rows), "sequences": len(rows),
            "divergences": [{k: r.get(k) for k in ("model", "first_divergence", "top2_gap",
                                                   "bf16_step_at_top_logit")} for r in div]}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "exact_ablation.json").write_text(json.dumps(result, indent=1))
    for k, v in result.items():
        print(k, v["exact"], "/", v["sequences"], [(d["top2_gap"], d["bf16_step_at_top_logit"]) for d in v["divergences"]])


if __name__ == "__main__":
    main()
