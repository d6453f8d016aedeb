"""Does vLLM load mileage's adapter export and generate what transformers + PEFT generate?

    mileage export-hf --load RUN --out ADAPTER --adapter-only
    PYTHONPATH=$PWD python scripts/vllm_lora_check.py --vllm-python VENV/bin/python --adapter ADAPTER

The base is the one the adapter records (mileage_base.json). vLLM (offline `LLM` API, CPU or
GPU, fp32, eager) generates greedily from a few prompts with the adapter as a `LoRARequest`;
transformers + PEFT (`PeftModel.from_pretrained`) generate from the same token ids in this
process. Prints, per prompt, whether the tokens match and the largest log-prob difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

VLLM_SIDE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
base, adapter, rank, tokens, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
fits = [r for r in (8, 16, 32, 64, 128, 256) if r >= rank][0]
llm = LLM(model=base, enable_lora=True, max_lora_rank=fits, max_loras=1, dtype="float32",
          enforce_eager=True, kv_cache_memory_bytes=1 << 30, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=0)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                    lora_request=LoRARequest("mileage", 1, adapter))
rows = []
for out in outs:
    c = out.outputs[0]
    rows.append({"tokens": list(c.token_ids),
                 "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]})
print("RESULT " + json.dumps(rows))
"""


def peft_side(base: str, adapter: str, prompts: list[list[int]], tokens: int) -> list[dict]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).eval()
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=tokens, do_sample=False, output_scores=True,
                return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
        new = out.sequences[0, len(prompt) :].tolist()
        logprobs = [
            torch.log_softmax(score[0].float(), -1)[t].item()
            for score, t in zip(out.scores, new, strict=True)
        ]
        # how far the adapter moves the next-token distribution from the base's: a match with
        # vLLM means something only when this is well above the match's own tolerance
        with torch.no_grad():
            adapted = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
            with model.disable_adapter():
                base_lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
        shift = (adapted - base_lp).abs().max().item()
        rows.append({"tokens": new, "logprobs": logprobs, "adapter_shift": shift})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--adapter", required=True, help="an export-hf --adapter-only directory")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    adapter = Path(args.adapter)
    base = json.loads((adapter / "mileage_base.json").read_text())["path"]
    rank = json.loads((adapter / "adapter_config.json").read_text())["r"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    texts = ["What is 12 + 35?", "Reverse the word 'lantern'.", "Name a prime number above 50."]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    done = subprocess.run(
        [args.vllm_python, "-c", VLLM_SIDE, base, str(adapter), str(rank), str(args.tokens),
         json.dumps(prompts)],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return 1
    vllm_rows = json.loads(lines[-1].removeprefix("RESULT "))
    peft_rows = peft_side(base, str(adapter), prompts, args.tokens)
    same = True
    for text, v, p in zip(texts, vllm_rows, peft_rows, strict=True):
        n = min(len(v["tokens"]), len(p["tokens"]))
        match = v["tokens"][:n] == p["tokens"][:n]
        # log-probs compare up to and including the first token where the two differ
        k = next((i for i in range(n) if v["tokens"][i] != p["tokens"][i]), n - 1) + 1
        diff = max(abs(a - b) for a, b in zip(v["logprobs"][:k], p["logprobs"][:k], strict=True))
        same &= match
        print(
            f"{text!r}: tokens {'match' if match else 'DIFFER'} ({n}), max |logprob diff| "
            f"{diff:.2e}; the adapter moves the first token's log-probs by up to "
            f"{p['adapter_shift']:.2e}"
        )
        print(f"  vllm {v['tokens']}\n  peft {p['tokens']}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
