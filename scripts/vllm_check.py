"""mileage on a real vLLM server: weight sync, log-prob mismatch, seeded determinism, resume.

    scripts/install_vllm.sh /work/cache/vllm-venv        # once
    PYTHONPATH=$PWD python scripts/vllm_check.py --vllm-python /work/cache/vllm-venv/bin/python

What it does, on SmolLM2-135M-Instruct (`mileage smollm2`), each vLLM server launched by mileage
(`--rollout-engine vllm --vllm-python ...`, with mileage's launch defaults):

1. `mileage train` for 2 rollouts (A, uninterrupted), saving every rollout's samples and weights.
   The weight sync took effect when rollout 1's engine log-probs match the weights after step 1
   (the trainer's) much better than the starting weights (what a server that missed the sync
   would have served). The logged per-rollout mismatch must stay under `TOLERANCE`.
2. The same run killed after rollout 0 and run again (B: resumes at rollout 1 on a new server);
   its samples and checkpoints are compared with A's and the result is reported (not required).
3. mileage's `VLLMEngine` in this process: the same seeded requests twice, once alone and once
   among other requests, must give identical tokens; after `update_weights` with A's final
   weights the same seeded requests are generated again and the tokens that changed are counted.

Prints a report (paste it into docs/engines.md) and exits 1 if a required check fails. Takes
about 4 server starts and 4 SmolLM2 training steps: ~5 minutes on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# mean |engine log-prob - trainer log-prob| per response token, both in fp32 on the CPU; what
# the bf16 GPU engines of miles/verl show is ~1e-2, fp32 here measured ~1e-5 to 1e-4
TOLERANCE = 1e-3
QUESTIONS = [(3, 4), (2, 5), (6, 1), (4, 4), (1, 2), (5, 3), (2, 2), (7, 1)]


def run(command: list[str], log) -> float:
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    took = time.monotonic() - started
    log(f"$ {' '.join(command[2:])}\n  exit {done.returncode} after {took:.0f}s")
    for line in done.stdout.splitlines():
        if line.startswith(("rollout ", "launching vLLM", "vLLM is up", "stopped", "resume")):
            log(f"  | {line}")
    if done.returncode != 0:
        raise SystemExit(f"mileage failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return took


def smollm2_dir() -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "mileage", "smollm2"], capture_output=True, text=True, check=True
    )
    return Path(done.stdout.strip().splitlines()[-1])


def samples(work: Path, run_name: str, rollout_id: int) -> list[dict]:
    return json.loads((work / run_name / f"samples_{rollout_id}.json").read_text())["samples"]


def load_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def trainer_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    """Log-probs of `response` after `prompt` at temperature 1, as the trainer scores them."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def mean_abs_diff(model, batch: list[tuple[list[int], list[int], list[float]]]) -> float:
    total, count = 0.0, 0
    for prompt, response, engine in batch:
        mine = trainer_logprobs(model, prompt, response)
        total += sum(abs(a - b) for a, b in zip(mine, engine, strict=True))
        count += len(engine)
    return total / count


def train_runs(args, model_dir: Path, work: Path, log) -> dict:
    data = work / "add.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"prompt": f"What is {a}+{b}? Answer with the number only.", "label": str(a + b)}
            )
            + "\n"
            for a, b in QUESTIONS
        )
    )

    # lr 1e-5 constant: big enough that the policy visibly moves in one step
    def command(name: str, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "mileage", "train", "--hf-checkpoint", str(model_dir),
            "--prompt-data", str(data), "--apply-chat-template", "--rm-type", "math",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "16", "--num-rollout", "2", "--eval-interval", "0",
            "--lr", "1e-5", "--lr-decay-style", "constant", "--seed", "1", "--num-threads", "1",
            "--rollout-engine", "vllm", "--vllm-python", args.vllm_python,
            "--save", str(work / name), "--load", str(work / name), "--save-interval", "1",
            "--save-debug-rollout-data", str(work / name / "samples_{rollout_id}.json"),
            "--save-hf", str(work / name / "hf_{rollout_id}"), *extra,
        ]  # fmt: skip

    times = {"A": run(command("A"), log)}
    times["B1"] = run(command("B", "--debug-exit-after-rollout", "1"), log)
    times["B2"] = run(command("B"), log)
    return times


def check_training(model_dir: Path, work: Path, log) -> list[str]:
    failures = []
    records = [json.loads(line) for line in (work / "A" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        diff = record["logprob_abs_diff"]
        verdict = "ok" if diff <= TOLERANCE else "OVER"
        log(f"rollout {record['rollout_id']}: mean |engine - trainer| log-prob = {diff:.2e} "
            f"(tolerance {TOLERANCE:.0e}: {verdict}), reward {record['reward_mean']:.3f}")  # fmt: skip
        if diff > TOLERANCE:
            failures.append(f"rollout {record['rollout_id']}: mismatch {diff:.2e} > {TOLERANCE}")

    # rollout 1 was generated after the first sync of trained weights
    batch = [(s["prompt_ids"], s["response_ids"], s["logprobs"]) for s in samples(work, "A", 1)]
    against_new = mean_abs_diff(load_model(work / "A" / "hf_0"), batch)
    against_old = mean_abs_diff(load_model(model_dir), batch)
    log(f"rollout 1's engine log-probs vs the weights after step 1: {against_new:.2e}; "
        f"vs the starting weights: {against_old:.2e} ({against_old / against_new:.0f}x)")  # fmt: skip
    if not against_old > 10 * against_new:
        failures.append("rollout 1 was not generated with the synced weights")
    return failures


def compare_resume(work: Path, log) -> None:
    from mileage.testing.compare import compare_runs, count_tensor_differences

    for rollout_id in (0, 1):
        a, b = samples(work, "A", rollout_id), samples(work, "B", rollout_id)
        tokens = sum(x["response_ids"] == y["response_ids"] for x, y in zip(a, b, strict=True))
        logprobs = sum(x["logprobs"] == y["logprobs"] for x, y in zip(a, b, strict=True))
        log(f"resumed vs uninterrupted, rollout {rollout_id}: {tokens}/{len(a)} samples with "
            f"equal tokens, {logprobs}/{len(a)} with bit-equal log-probs")  # fmt: skip
    diffs = compare_runs(work / "A", work / "B")
    log(f"resumed vs uninterrupted, checkpoints: {count_tensor_differences(diffs)} differing "
        f"tensors; {len(diffs)} differences in all" + "".join(f"\n  - {d}" for d in diffs[:8]))  # fmt: skip


def check_engine(args, model_dir: Path, work: Path, log) -> list[str]:
    from mileage.models.hf import load_tokenizer
    from mileage.rollout.engine import SamplingParams
    from mileage.rollout.engines.base import SamplingSeed
    from mileage.rollout.engines.config import EngineConfig
    from mileage.rollout.engines.vllm import VLLMEngine

    failures = []
    tokenizer = load_tokenizer(model_dir)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a}+{b}? Answer with the number only."}],
            add_generation_prompt=True, tokenize=True, return_dict=True,
        )["input_ids"]
        for a, b in QUESTIONS
    ]  # fmt: skip
    cfg = EngineConfig(rollout_engine="vllm", vllm_python=args.vllm_python)
    before = load_model(model_dir)
    started = time.monotonic()
    engine = VLLMEngine(cfg, before.config.vocab_size, tokenizer.eos_token_id, str(model_dir), log)
    log(f"engine up in {time.monotonic() - started:.0f}s")
    try:
        engine.update_weights(before, 0)
        params = SamplingParams(max_new_tokens=24, temperature=1.0)
        seed = SamplingSeed(seed=7, rollout_id=0)
        first = engine.generate(prompts[:4], params, seed)
        again = engine.generate(prompts[:4], params, seed)
        # the same 4 requests among 12 others: other batch compositions in the server
        crowded = engine.generate(prompts[:4] + prompts[4:] * 3, params, seed)[:4]
        for name, other in (("repeated", again), ("among 12 other requests", crowded)):
            same = sum(x.response_ids == y.response_ids for x, y in zip(first, other, strict=True))
            bits = sum(x.logprobs == y.logprobs for x, y in zip(first, other, strict=True))
            log(
                f"seeded requests {name}: {same}/4 identical tokens, {bits}/4 bit-identical "
                "log-probs"
            )
            if same != 4:
                failures.append(f"seeded requests {name} gave other tokens")
        greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
        greedy_before = engine.generate(prompts, greedy)

        after = load_model(work / "A" / "hf_1")
        engine.update_weights(after, 2)
        changed = engine.generate(prompts[:4], params, seed)
        greedy_after = engine.generate(prompts, greedy)
        moved = sum(x.response_ids != y.response_ids for x, y in zip(first, changed, strict=True))
        moved_greedy = sum(
            x.response_ids != y.response_ids
            for x, y in zip(greedy_before, greedy_after, strict=True)
        )
        batch = [(c.prompt_ids, c.response_ids, c.logprobs) for c in changed]
        against_new, against_old = mean_abs_diff(after, batch), mean_abs_diff(before, batch)
        log(f"after update_weights (A's final weights): {moved}/4 seeded samples and "
            f"{moved_greedy}/{len(prompts)} greedy answers changed; their engine log-probs vs "
            f"the new weights {against_new:.2e}, vs the old {against_old:.2e}")  # fmt: skip
        pairs = zip(greedy_before, greedy_after, strict=True)
        for old, new in [(o, n) for o, n in pairs if o.response_ids != n.response_ids][:3]:
            log(f"  greedy {tokenizer.decode(old.response_ids)!r} -> "
                f"{tokenizer.decode(new.response_ids)!r}")  # fmt: skip
        if not against_old > 10 * against_new:
            failures.append("after update_weights the engine does not serve the new weights")
    finally:
        engine.close()
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="the Python of the vLLM venv")
    parser.add_argument("--work", help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines: list[str] = []

    def log(message: str) -> None:
        print(message, flush=True)
        lines.append(message)

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="vllm-check-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = smollm2_dir()
    version = subprocess.run(
        [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    log(f"vLLM {version} ({args.vllm_python}), model {model_dir}, work {work}")
    started = time.monotonic()
    train_runs(args, model_dir, work, log)
    failures = check_training(model_dir, work, log)
    compare_resume(work, log)
    failures += check_engine(args, model_dir, work, log)
    log(f"total {time.monotonic() - started:.0f}s; "
        + ("all required checks passed" if not failures else "FAILED: " + "; ".join(failures)))  # fmt: skip
    (work / "report.txt").write_text("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
