"""Quantized checkpoints end to end on one device: tiny random Llama checkpoints in compressed-tensors FP8
(per channel, dynamic), HF block fp8 (128x128), GPTQ (group 32, asymmetric, act order) and ``--quantization
fp8``, each served next to the same model with the format's dequantized weights as float weights, and on CUDA
``--kv-cache-dtype fp8`` (alone and with FP8 weights) next to the bf16 model; greedy tokens must agree or part
by vLLM's top-5 rule. Prints a table, writes JSON.

    python benchmarks/quantized_check.py --out /tmp/quantized_check.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The quick brown fox", "Hello world, this is", "def add(a, b):", "Numbers: 1 2 3"]


def tiny_llama(root: Path) -> Path:
    from tests.conftest import build_tiny_checkpoint
    return build_tiny_checkpoint(root / "base", "llama", hidden_size=256, intermediate_size=512,
                                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)


def fp8_channel(w: torch.Tensor):
    s = (w.float().abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
    q = (w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": s}, q.float() * s


def fp8_block(w: torch.Tensor, block: int = 128):
    out_f, in_f = w.shape
    wb = w.float().view(out_f // block, block, in_f // block, block)
    s = (wb.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)                     # [out/b, in/b]
    q = (wb / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (q.float() * s[:, None, :, None]).view(out_f, in_f)
    return {"weight": q.view(out_f, in_f), "weight_scale_inv": s}, deq


def gptq_act_order(w: torch.Tensor, group: int = 32, seed: int = 0):
    out_f, in_f = w.shape
    perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_f) // group).to(torch.int32)
    wf = w.float()
    q = torch.empty(out_f, in_f, dtype=torch.int32)
    scales = torch.empty(in_f // group, out_f)
    zeros = torch.empty(in_f // group, out_f)
    for g in range(in_f // group):
        cols = (g_idx == g).nonzero().flatten()
        lo, hi = wf[:, cols].amin(1), wf[:, cols].amax(1)
        s = ((hi - lo) / 15).clamp(min=1e-8).half().float()
        z = torch.round(-lo / s).clamp(0, 15)
        q[:, cols] = torch.clamp(torch.round(wf[:, cols] / s[:, None]) + z[:, None], 0, 15).to(torch.int32)
        scales[g], zeros[g] = s, z
    deq = (q.float() - zeros[g_idx.long()].t()) * scales[g_idx.long()].t()
    qt = q.t().contiguous()
    qweight = torch.zeros(in_f // 8, out_f, dtype=torch.int32)
    for i in range(8):
        qweight |= qt[i::8] << (4 * i)
    zt = zeros.to(torch.int32) - 1
    qzeros = torch.zeros(in_f // group, out_f // 8, dtype=torch.int32)
    for i in range(8):
        qzeros |= (zt[:, i::8] & 0xF) << (4 * i)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.half(), "g_idx": g_idx}, deq


CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
FORMATS = {
    "ct-fp8-channel": (fp8_channel, CT_FP8),
    "hf-fp8-block": (fp8_block, {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
    "gptq-g32-actorder": (gptq_act_order, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                           "sym": False}),
}


def write_variant(base: Path, root: Path, name: str, convert, qcfg) -> tuple[Path, Path]:
    weights = load_file(base / "model.safetensors")
    quant, deq = root / name, root / f"{name}-dequantized"
    for d in (quant, deq):
        shutil.copytree(base, d)
    q_sd, d_sd = {}, {}
    for k, v in weights.items():
        if k.endswith("proj.weight"):
            tensors, w = convert(v)
            q_sd.update({k.rsplit(".", 1)[0] + "." + s: t.contiguous() for s, t in tensors.items()})
            d_sd[k] = w.to(v.dtype)
        else:
            q_sd[k] = d_sd[k] = v
    save_file(q_sd, quant / "model.safetensors")
    save_file(d_sd, deq / "model.safetensors")
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (quant / "config.json").write_text(json.dumps(cfg))
    return quant, deq


def compare(a, b) -> dict:
    agree, parted_ok, max_lp = 0, 0, 0.0
    for x, y in zip(a, b):
        xs, ys = x.outputs[0], y.outputs[0]
        for i, (s, t) in enumerate(zip(xs.token_ids, ys.token_ids)):
            if s != t:
                parted_ok += int(s in ys.logprobs[i] and t in xs.logprobs[i])
                break
            max_lp = max(max_lp, abs(xs.logprobs[i][s].logprob - ys.logprobs[i][t].logprob))
        else:
            agree += 1
    return {"prompts": len(a), "identical": agree, "parted_within_top5": parted_ok,
            "ok": agree + parted_ok == len(a), "max_logprob_diff_before_parting": round(max_lp, 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = tiny_llama(root)
        for name, (convert, qcfg) in FORMATS.items():
            quant, deq = write_variant(base, root, name, convert, qcfg)
            a = LLM(model=str(quant), dtype="bfloat16", max_model_len=256).generate(PROMPTS, params, use_tqdm=False)
            b = LLM(model=str(deq), dtype="bfloat16", max_model_len=256).generate(PROMPTS, params, use_tqdm=False)
            rows[name] = compare(a, b)
        a = LLM(model=str(base), dtype="bfloat16", max_model_len=256, quantization="fp8").generate(
            PROMPTS, params, use_tqdm=False)
        b = LLM(model=str(base), dtype="bfloat16", max_model_len=256).generate(PROMPTS, params, use_tqdm=False)
        rows["online-fp8-vs-bf16"] = compare(a, b)
        if torch.cuda.is_available():   # the FP8 KV cache is a CUDA feature
            a = LLM(model=str(base), dtype="bfloat16", max_model_len=256, kv_cache_dtype="fp8").generate(
                PROMPTS, params, use_tqdm=False)
            rows["fp8-kv-cache-vs-bf16"] = compare(a, b)
            both = LLM(model=str(base), dtype="bfloat16", max_model_len=256, kv_cache_dtype="fp8",
                          quantization="fp8").generate(PROMPTS, params, use_tqdm=False)
            rows["fp8-weights-and-kv-vs-bf16"] = compare(both, b)
    print(f"{'format':24} {'prompts':>7} {'same':>5} {'top5':>5} {'ok':>4} {'max |dlogprob|':>15}")
    for name, r in rows.items():
        print(f"{name:24} {r['prompts']:>7} {r['identical']:>5} {r['parted_within_top5']:>5} {str(r['ok']):>4} "
              f"{r['max_logprob_diff_before_parting']:>15}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available()
                                              else "cpu", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
