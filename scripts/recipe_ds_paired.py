"""The recipe of docs/recipe.md with and without dynamic sampling, at the same budget, compared
on the same held-out items.

    python scripts/recipe_ds_paired.py [OUT_DIR]        (default runs/recipe_ds)
    python scripts/recipe_ds_paired.py OUT --rollouts 20 --pilot-rollouts 3 --cores 0,1

Why it is built this way: the machine may be shared, so wall-clock time alone is no fair budget.
1. Pilot: both arms run `--pilot-rollouts` rollouts at the same time, each pinned to one core;
   the ratio of their rollout times (the first rollout, which warms up, left out) sets the
   dynamic-sampling arm's `--num-rollout`, i.e. the length of its LR schedule, so that the
   schedule ends near the budget.
2. Both arms start at the same time, each pinned to its own core with `--num-threads 1`. The
   plain arm runs `--rollouts` rollouts. Its wall time W and its CPU seconds C (of its process
   and children, from wait4) are the dynamic-sampling arm's two budgets: when the plain arm
   ends, the other arm gets SIGTERM (mileage finishes its rollout, saves, exits 75).
3. Both arms commit a checkpoint after every rollout; the script notes when each commit lands
   and the CPU seconds spent by then. The dynamic-sampling arm is judged by its last checkpoint
   committed within both budgets (the earlier one binds), so the rollout finished after
   SIGTERM does not count.
4. Greedy scores of the same held-out items (those of `scripts/recipe_paired_eval.py`) for the
   starting model and both checkpoints; the paired differences with bootstrap 95 % intervals,
   exact answers, and the groups drawn / kept / dropped from metrics.jsonl.

Writes OUT/summary.json and OUT/items.json (every held-out item's responses and scores).
Arm names: `plain` (no dynamic sampling) and `ds` (`check_reward_nonzero_std`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe_paired_eval import MAX_LEN, TASK  # noqa: E402

from mileage.checkpoint.layout import read_tracker  # noqa: E402
from mileage.cli.model_commands import default_smollm2_dir  # noqa: E402

FILTER = "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
TICK = float(os.sysconf("SC_CLK_TCK"))
PROG = Path(sys.argv[0]).stem  # this script, or recipe_precision_paired.py that reuses it


def recipe_flags(lr: str, temp: str) -> list[str]:
    """docs/recipe.md's flags, minus evaluation (both arms are scored afterwards, the same way)."""
    return ["--hf-checkpoint", str(default_smollm2_dir()), "--prompt-data", TASK,
            "--apply-chat-template", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
            "--rollout-max-response-len", str(MAX_LEN), "--rollout-temperature", temp,
            "--lr", lr, "--eval-interval", "0", "--num-threads", "1",
            # the same update as one micro-batch (docs/flags.md), with a quarter of the peak
            # memory: two arms of ~7 GB each drew the OOM killer on a shared 24 GB machine
            "--micro-batch-size", "16"]  # fmt: skip


def arm_flags(arm: str, max_rounds: int, over_sampling: int) -> list[str]:
    if arm == "plain":
        return []
    return ["--dynamic-sampling-filter-path", FILTER, "--over-sampling-batch-size",
            str(over_sampling), "--dynamic-sampling-max-rounds", str(max_rounds)]  # fmt: skip


def cpu_seconds(pid: int) -> float:
    """utime+stime of a running process and of its waited-for children."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICK


class Arm:
    """One `mileage train` process pinned to one core, with its commit times."""

    def __init__(self, name: str, core: str, out: Path, flags: list[str], rollouts: int):
        self.name, self.dir = name, out / name
        self.flags = [*flags, "--num-rollout", str(rollouts)]
        cmd = [sys.executable, "-m", "mileage", "train", *self.flags,
               "--save", str(self.dir), "--load", str(self.dir), "--save-interval", "1",
               "--save-keep-last", "4",
               "--save-debug-rollout-data", str(self.dir / "samples" / "{rollout_id}.json")]  # fmt: skip
        self.log = open(out / f"{name}.log", "a")  # noqa: SIM115 (closed in wait)
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            ["taskset", "-c", core, *cmd], stdout=self.log, stderr=subprocess.STDOUT
        )
        self.commits: list[dict] = []  # {iteration, wall_s, cpu_s} per committed checkpoint
        self.wall = self.cpu = math.nan
        self.rc: int | None = None
        self.stopped_at: dict | None = None

    def poll(self) -> bool:
        """Note a new commit; True while the process runs."""
        if self.rc is None:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                self.rc = os.waitstatus_to_exitcode(status)
                self.wall = time.monotonic() - self.start
                self.cpu = usage.ru_utime + usage.ru_stime
                self.proc.returncode = self.rc
                self.log.close()
        tracker = read_tracker(self.dir)
        last = self.commits[-1]["iteration"] if self.commits else None
        if tracker.exists and tracker.iteration is not None and tracker.iteration != last:
            cpu = self.cpu if self.rc is not None else cpu_seconds(self.proc.pid)
            wall = time.monotonic() - self.start
            self.commits.append({"iteration": tracker.iteration, "wall_s": wall, "cpu_s": cpu})
        return self.rc is None

    def terminate(self) -> None:
        self.stopped_at = {"wall_s": time.monotonic() - self.start,
                           "cpu_s": cpu_seconds(self.proc.pid)}  # fmt: skip
        self.proc.send_signal(signal.SIGTERM)


def run_arms(
    out: Path,
    specs: list[tuple[str, str, list[str], int]],
    stop_with_first: bool,
    stop_after: float | None = None,
):
    """Start the arms at once; with `stop_with_first`, SIGTERM the others when the first
    (the plain arm) ends. After `stop_after` seconds the first arm gets SIGTERM too (its
    schedule is then cut short, and its wall and CPU seconds are still the budget). Waits at
    most 3 hours."""
    arms = [Arm(name, core, out, flags, n) for name, core, flags, n in specs]
    deadline = time.monotonic() + 3 * 3600
    while any([arm.poll() for arm in arms]):
        lead = arms[0]
        late = stop_after is not None and time.monotonic() - lead.start > stop_after
        if late and lead.rc is None and lead.stopped_at is None:
            lead.terminate()
        if time.monotonic() > deadline:
            for arm in arms:
                if arm.rc is None:
                    arm.proc.kill()
            raise SystemExit(f"{PROG}: the arms ran past 3 hours; killed")
        lead = arms[0]
        if stop_with_first and lead.rc is not None:
            for arm in arms[1:]:
                if arm.rc is None and arm.stopped_at is None:
                    arm.terminate()
        time.sleep(0.5)
    for arm in arms:
        arm.poll()
        if arm.rc != 0:
            raise SystemExit(f"{PROG}: arm {arm.name} exited {arm.rc}; see its log")
    return arms


def judged_commit(commits: list[dict], wall: float, cpu: float) -> tuple[dict, int, int]:
    """The last commit within both budgets, and the last iterations within each one alone
    (-1: none); the earlier budget binds."""
    by_wall = [c["iteration"] for c in commits if c["wall_s"] <= wall]
    by_cpu = [c["iteration"] for c in commits if c["cpu_s"] <= cpu]
    within = [c for c in commits if c["wall_s"] <= wall and c["cpu_s"] <= cpu]
    if not within:
        raise SystemExit("recipe_ds_paired: the ds arm committed nothing within the budget")
    return within[-1], (by_wall or [-1])[-1], (by_cpu or [-1])[-1]


def step_times(run_dir: Path) -> list[float]:
    return [r["step_time"] for r in records(run_dir)]


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("rollout_id", -1) >= 0]


def pilot(out: Path, base: list[str], ds: list[str], n: int, cores: list[str]) -> float:
    """The ratio of a dynamic-sampling rollout's time to a plain one's, both arms running at
    once on their own cores."""
    pilot_dir = out / "pilot"
    pilot_dir.mkdir(parents=True, exist_ok=True)
    if not (pilot_dir / "ds" / "metrics.jsonl").is_file():
        run_arms(pilot_dir, [("plain", cores[0], base, n), ("ds", cores[1], base + ds, n)], False)
    skip = 1 if n > 1 else 0  # the first rollout also warms up
    plain, dyn = step_times(pilot_dir / "plain")[skip:], step_times(pilot_dir / "ds")[skip:]
    return (sum(dyn) / len(dyn)) / (sum(plain) / len(plain))


def group_counts(samples_dir: Path, files: int, n: int) -> dict:
    """Zero-variance groups and exact answers among the sampled groups, from the saved samples
    (one file per rollout for the plain arm, per sampling round for the ds arm)."""
    groups = zero = exact = total = 0
    for index in range(files):
        path = samples_dir / f"{index}.json"
        rewards = [s["reward"] for s in json.loads(path.read_text())["samples"]]
        for start in range(0, len(rewards), n):
            group = rewards[start : start + n]
            groups += 1
            zero += all(r == group[0] for r in group)
        exact += sum(r >= 1.0 for r in rewards)
        total += len(rewards)
    return {"groups_sampled": groups, "groups_zero_variance": zero,
            "samples": total, "samples_exact": exact}  # fmt: skip


def ds_counts(run_dir: Path, upto: int) -> dict:
    """dynamic_filter/* totals over rollouts 0..upto (miles' zero_std_* drop reasons)."""
    total: dict[str, float] = {}
    for r in records(run_dir):
        if r["rollout_id"] > upto:
            continue
        for key, value in r.items():
            if key.startswith("dynamic_filter/"):
                name = key.removeprefix("dynamic_filter/")
                total[name] = total.get(name, 0) + value
    total.pop("groups_buffered", None)  # a level, not a count: the last rollout's is below
    drawn = total.get("groups_drawn", 0)
    total["share_dropped"] = round(total.get("groups_dropped", 0) / drawn, 4) if drawn else 0.0
    return total


def summary_rounds(run_dir: Path, chosen: dict) -> float:
    """Sampling rounds (= slots, numbered from 0) the ds arm took up to the judged rollout."""
    return ds_counts(run_dir, chosen["iteration"]).get("rounds", 0)


def score(flags: list[str], limit: int | None = None) -> list[tuple[float, str, float]]:
    """(greedy reward, response, log P(exact answer)) of every held-out item under the weights
    `flags` load. log P is the policy's teacher-forced log-probability of the bare label followed
    by the end of the turn: how likely sampling is to ever produce the exact answer."""
    import torch

    from mileage.cli.main import build_parser
    from mileage.components import build_run, restore
    from mileage.preflight import preflight
    from mileage.rollout.engine import SamplingParams
    from mileage.rollout.rollout import generate_samples
    from mileage.run_config import RunConfig

    cfg = RunConfig.from_args(build_parser().parse_args(["train", *flags]))
    run = build_run(cfg, preflight(cfg), lambda *_: None)
    restore(run, lambda *_: None)
    params = SamplingParams(max_new_tokens=MAX_LEN, temperature=0.0)
    prompts = run.eval_sets[0].prompts[:limit]
    samples = generate_samples(
        run.engine, run.encode, prompts, params, 1, run.reward_fn, seed=0, rollout_id=0
    )
    model = run.model.eval()
    exact_logp = []
    with torch.no_grad():
        for prompt in prompts:
            head = run.encode.prompt_ids(prompt)
            tail = [*run.tokenizer(prompt.label, add_special_tokens=False)["input_ids"],
                    run.engine.eos_id]  # fmt: skip
            ids = torch.tensor([head + tail])
            logits = model(ids).logits[0, len(head) - 1 : -1].float()
            picked = logits.log_softmax(-1).gather(1, torch.tensor(tail)[:, None])
            exact_logp.append(float(picked.sum()))
    return [(s.reward, s.response, lp) for s, lp in zip(samples, exact_logp, strict=True)]


def paired(after: list[float], before: list[float]) -> dict:
    n = len(before)
    diff = [a - b for a, b in zip(after, before, strict=True)]
    rng = __import__("random").Random(0)
    means = sorted(sum(rng.choice(diff) for _ in range(n)) / n for _ in range(10_000))
    return {"mean_difference": round(sum(diff) / n, 4),
            "bootstrap_95": [round(means[250], 4), round(means[9749], 4)],
            "items_better": sum(d > 0 for d in diff), "items_worse": sum(d < 0 for d in diff)}  # fmt: skip


def evaluate_arms(out: Path, base: list[str], ds: list[str], plain_iter: int, ds_iter: int):
    evals = {"start": [*base, "--eval-interval", "10", "--num-rollout", "1"]}
    for name, extra, it in (("plain", [], plain_iter), ("ds", ds, ds_iter)):
        evals[name] = [*base, *extra, "--eval-interval", "10", "--load", str(out / name),
                       "--ckpt-step", str(it), "--num-rollout", str(it + 2)]  # fmt: skip
    scored = {name: score(flags) for name, flags in evals.items()}
    rewards = {name: [r for r, _, _ in items] for name, items in scored.items()}
    n = len(rewards["start"])
    items = [{name: dict(zip(("reward", "response", "exact_logp"), scored[name][i], strict=True))
              for name in scored} for i in range(n)]  # fmt: skip
    exact_p = {name: [math.exp(lp) for _, _, lp in items] for name, items in scored.items()}
    (out / "items.json").write_text(json.dumps(items, indent=1))
    return {
        "held_out_items": n,
        "score": {k: round(sum(v) / n, 4) for k, v in rewards.items()},
        "exact": {k: sum(r >= 1.0 for r in v) for k, v in rewards.items()},
        # the mean probability that one sample at temperature 1 is exactly the answer
        "exact_answer_probability": {k: float(f"{sum(v) / n:.3g}") for k, v in exact_p.items()},
        "exact_answer_log_probability_median": {
            k: round(sorted(math.log(p) for p in v)[n // 2], 2) for k, v in exact_p.items()
        },
        "greedy_contains_answer": {k: sum(r > 0 for r in v) for k, v in rewards.items()},
        "ds_minus_plain": paired(rewards["ds"], rewards["plain"]),
        "plain_minus_start": paired(rewards["plain"], rewards["start"]),
        "ds_minus_start": paired(rewards["ds"], rewards["start"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="runs/recipe_ds")
    ap.add_argument("--rollouts", type=int, default=20, help="the plain arm's schedule")
    ap.add_argument("--pilot-rollouts", type=int, default=3)
    ap.add_argument("--ds-rollouts", type=int, help="skip the pilot: the ds arm's schedule")
    ap.add_argument("--cores", default="0,1", help="the plain arm's core, the ds arm's core")
    ap.add_argument("--lr", default="1e-5")
    ap.add_argument("--temperature", default="1.0")
    ap.add_argument("--over-sampling-batch-size", type=int, default=8)
    ap.add_argument("--max-rounds", type=int, default=100)
    ap.add_argument(
        "--stop-after-min",
        type=float,
        help="SIGTERM the plain arm after this many minutes (a schedule that time cuts short)",
    )
    ap.add_argument("--eval-only", action="store_true", help="score the arms of OUT/summary.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = args.cores.split(",")
    base = recipe_flags(args.lr, args.temperature)
    ds = arm_flags("ds", args.max_rounds, args.over_sampling_batch_size)
    if args.eval_only:
        summary = json.loads((out / "summary.json").read_text())
        plain_iter = summary["commits"]["plain"][-1]["iteration"]
        finish(out, summary, base, ds, plain_iter, summary["ds_arm"]["judged_iteration"])
        return
    summary: dict = {"rollouts_plain_schedule": args.rollouts}
    if args.ds_rollouts is None:
        ratio = pilot(out, base, ds, args.pilot_rollouts, cores)
        summary["pilot_ds_over_plain_rollout_time"] = round(ratio, 3)
        ds_rollouts = max(1, round(args.rollouts / ratio))
    else:
        ds_rollouts = args.ds_rollouts
    summary["rollouts_ds_schedule"] = ds_rollouts
    print(f"arms: plain {args.rollouts} rollouts, ds {ds_rollouts} rollouts", flush=True)
    plain, dyn = run_arms(
        out,
        [("plain", cores[0], base, args.rollouts), ("ds", cores[1], base + ds, ds_rollouts)],
        stop_with_first=True,
        stop_after=None if args.stop_after_min is None else 60 * args.stop_after_min,
    )
    budget = {"wall_s": round(plain.wall, 1), "cpu_s": round(plain.cpu, 1),
              "plain_sigterm_at": plain.stopped_at}  # fmt: skip
    chosen, by_wall, by_cpu = judged_commit(dyn.commits, plain.wall, plain.cpu)
    summary |= {
        "budget_from_plain_arm": budget,
        "ds_arm": {
            "wall_s": round(dyn.wall, 1),
            "cpu_s": round(dyn.cpu, 1),
            "sigterm_at": dyn.stopped_at,
            "last_iteration_within_wall": by_wall,
            "last_iteration_within_cpu": by_cpu,
            "judged_iteration": chosen,
        },  # fmt: skip
        "commits": {"plain": plain.commits, "ds": dyn.commits},
        "rollouts_done": {
            "plain": plain.commits[-1]["iteration"] + 1,
            "ds_judged": chosen["iteration"] + 1,
        },  # fmt: skip
        "ds_filter": ds_counts(dyn.dir, chosen["iteration"]),
        "sampled_groups": {
            "plain": group_counts(plain.dir / "samples", plain.commits[-1]["iteration"] + 1, 8),
            "ds": group_counts(dyn.dir / "samples", int(summary_rounds(dyn.dir, chosen)), 8),
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    finish(out, summary, base, ds, plain.commits[-1]["iteration"], chosen)


def finish(out: Path, summary: dict, base: list, ds: list, plain_iter: int, chosen: dict) -> None:
    """Score both arms' judged checkpoints and the start on the held-out items; print it all."""
    summary["held_out"] = evaluate_arms(out, base, ds, plain_iter, chosen["iteration"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "commits"}, indent=1))


if __name__ == "__main__":
    main()
