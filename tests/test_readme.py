"""The README against the program: every claim of an outcome it makes is checked here, so that
it cannot drift from what mileage does and prints.

- Every `mileage ...` command of its shell blocks parses with the real command line, and every
  flag of "Flags at a glance" (with its listed choices) is in `mileage train --help`.
- The quick start's command, run at the demo's own size for its last three rollouts
  (`--start-rollout-id 147`: the same flags and per-rollout work as the 2-minute demo, without
  its first 147 rollouts), prints rollout lines with the fields and number formats of the README's
  sample line, writes the checkpoint layout the README shows, stops on SIGTERM with the message
  it quotes, and rerun verbatim says the quoted `run already complete (150 of 150 rollouts)`.
- "What the default run does" names the defaults the same command resolves to.

The "Real models" section's commands are run as written by tests/test_real_model_path.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")

# the README runs commands from a venv; these tests run the same program from this checkout
MILEAGE = re.compile(r"(?:^|/|-m )mileage$")


def section(heading: str) -> str:
    """The text under a `#`-heading of the README, up to the next heading of its level or above."""
    match = re.search(rf"^(#+) {re.escape(heading)}\n", README, re.M)
    assert match, f"README has no section {heading!r}"
    level = len(match.group(1))
    rest = README[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every ``` block in `text`, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


def block_after(text: str, sentence: str) -> str:
    """The body of the first fenced block after `sentence` in `text`."""
    at = text.find(sentence)
    assert at >= 0, f"README no longer says {sentence!r}"
    return fenced_blocks(text[at:])[0][1]


def claim(pattern: str, text: str = README) -> re.Match:
    """`pattern` in `text` with its line breaks and indents read as single spaces."""
    match = re.search(pattern, " ".join(text.split()))
    assert match, f"README no longer matches {pattern!r}"
    return match


def mileage_commands(shell: str) -> list[list[str]]:
    """The arguments of every `mileage` invocation in a shell block (after `mileage`)."""
    shell = shell.replace("\\\n", " ")
    pieces = []
    for line in shell.splitlines():
        if line.lstrip().startswith("#"):  # a comment: only the commands it quotes
            pieces += re.findall(r"`([^`]*mileage [^`]*)`", line)
            continue
        line = line.split(" #")[0]
        # a command substitution is a command of its own
        pieces += re.findall(r"\$\(([^)]*)\)", line)
        pieces += re.split(r"&&|;|\|", re.sub(r"\$\([^)]*\)", "", line))
    commands = []
    for piece in pieces:
        tokens = shlex.split(piece)
        for i, token in enumerate(tokens):
            joined = f"{tokens[i - 1]} {token}" if i else token
            if MILEAGE.search(token) or MILEAGE.search(joined):
                # `...` stands for "the rest of the flags" in the README
                commands.append([t for t in tokens[i + 1 :] if t != "..."])
                break
    return commands


def test_every_mileage_command_in_the_readme_parses():
    from mileage.cli.main import build_parser

    commands = [cmd for lang, body in fenced_blocks(README) if lang == "bash" for cmd in
                mileage_commands(body)]  # fmt: skip
    subcommands = {cmd[0] for cmd in commands}
    # the quick start, the real-model and engine examples, export, plot, serve, torchrun
    assert {"train", "export-hf", "plot", "serve", "smollm2"} <= subcommands, subcommands
    assert len(commands) >= 10, commands
    for cmd in commands:
        try:
            build_parser().parse_args(cmd)
        except Exception as exc:  # a UserError names the bad flag or value
            pytest.fail(f"README command `mileage {shlex.join(cmd)}` does not parse: {exc}")


@pytest.fixture(scope="module")
def train_help() -> str:
    """`mileage train --help` and `mileage train-async --help` (the async flags are its own)."""
    texts = []
    for command in ("train", "train-async"):
        done = subprocess.run(
            [sys.executable, "-m", "mileage", command, "--help"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert done.returncode == 0, done.stderr
        texts.append(done.stdout)
    return "\n".join(texts)


def help_flags(help_text: str) -> dict[str, set[str] | None]:
    """flag -> its choices (None when it takes no fixed choices), as `--help` lists them."""
    flags: dict[str, set[str] | None] = {}
    for flag, choices in re.findall(r"(--[a-z0-9][a-z0-9-]*)(?: \{([^}]*)\})?", help_text):
        if choices or flag not in flags:
            flags[flag] = set(choices.split(",")) if choices else None
    return flags


def test_flags_at_a_glance_are_in_train_help_with_their_choices(train_help):
    table = section("Flags at a glance")
    rows = [line.split("|")[2] for line in table.splitlines() if line.startswith("| ")]
    readme = re.findall(r"(--[a-z0-9][a-z0-9-]*)(?: \{([^}]*)\})?", "\n".join(rows))
    assert len(readme) > 60, "the table lost its flags"
    known = help_flags(train_help)
    missing = sorted({flag for flag, _ in readme if flag not in known})
    assert not missing, (
        f"README flags missing from `mileage train --help` and `train-async --help`: {missing}"
    )
    for flag, choices in readme:
        if choices:
            assert known[flag] is not None, f"{flag}: README lists choices, --help none"
            extra = set(choices.split(",")) - known[flag]
            assert not extra, f"{flag}: README choices {sorted(extra)} are not in --help"
    # the commands the paragraph under the table names
    others = re.findall(r"`mileage ([a-z0-9-]+)", table.split("Other commands:")[1])
    from mileage.cli.main import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    assert others and set(others) <= set(sub.choices), sorted(set(others) - set(sub.choices))


def test_what_the_default_run_does_is_what_the_quick_start_command_resolves_to(builtin_model):
    from mileage.cli.main import build_parser
    from mileage.rollout.tasks import builtin_task
    from mileage.run_config import DEFAULT_NUM_ROLLOUT, RunConfig

    text = section("What the default run does")
    cfg = RunConfig.from_args(build_parser().parse_args(quick_start_command()))
    params = claim(r"a ([\d.]+)M-parameter `LlamaForCausalLM`", text)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(builtin_model)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == float(params[1])
    held_out = claim(r"greedy accuracy on (\d+) held-out sums, then runs (\d+) GRPO rollouts", text)
    assert len(builtin_task("addition")[1]) == int(held_out[1])
    assert cfg.loop.num_rollout is None and int(held_out[2]) == DEFAULT_NUM_ROLLOUT
    assert cfg.algo.advantage_estimator == "grpo"
    shape = claim(
        r"\((\d+) prompts × (\d+) samples, temperature ([\d.]+), PPO-clip, AdamW ([\d.e-]+)\), "
        r"evaluating every (\d+)",
        text,
    )
    assert cfg.rollout.rollout_batch_size == int(shape[1])
    assert cfg.rollout.n_samples_per_prompt == int(shape[2])
    assert cfg.rollout.rollout_temperature == float(shape[3])
    assert cfg.optim.lr == float(shape[4])
    assert cfg.loop.eval_interval == int(shape[5])


def quick_start_command() -> list[str]:
    """`train --save runs/demo --load runs/demo`, as the quick start's block says."""
    block = block_after(section("Quick start"), "Set up and run the built-in default")
    (command,) = mileage_commands(block)
    return command


def number_pattern(sample: str) -> re.Pattern:
    """A regex for lines like `sample`: same text, each number in the same format (sign,
    decimals, exponent) with any digits."""
    parts, pos = [], 0
    for m in re.finditer(r"[+-]?\d+(?:\.(\d+))?(?:e[+-]\d+)?", sample):
        token = m.group(0)
        parts.append(re.escape(sample[pos : m.start()]))
        parts.append(
            (r"[+-]" if token[0] in "+-" else "")
            + r"\d+"
            + (rf"\.\d{{{len(m.group(1))}}}" if m.group(1) is not None else "")
            + (r"e[+-]\d{2}" if "e" in token else "")
        )
        pos = m.end()
    parts.append(re.escape(sample[pos:]))
    return re.compile("".join(parts))


@pytest.fixture(scope="module")
def demo(mileage_home, builtin_model, tmp_path_factory) -> dict:
    """The quick start's command in a fresh directory: its last three rollouts, a SIGTERM at the
    second (rollout 148), the same command again (rollout 149), and once more (complete).

    `--num-threads 1` is added to every launch (the machine running the tests is shared; the
    thread count changes no claim checked here)."""
    cwd = tmp_path_factory.mktemp("readme_demo")
    command = [*quick_start_command(), "--num-threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def launch(*extra: str, **more_env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mileage", *command, *extra],
            capture_output=True,
            text=True,
            cwd=cwd,
            env={**env, **more_env},
            timeout=900,
        )

    stopped = launch("--start-rollout-id", "147", MILEAGE_SIGNAL_AT="after_train:SIGTERM:2")
    again = launch()
    complete = launch()
    plot = mileage_commands(claim(r"`(mileage plot runs/demo)` draws them into `([^`]+)`")[1])[0]
    plotted = subprocess.run(
        [sys.executable, "-m", "mileage", *plot], capture_output=True, text=True, cwd=cwd, env=env
    )
    return {
        "cwd": cwd,
        "save": cwd / command[command.index("--save") + 1],
        "stopped": stopped,
        "again": again,
        "complete": complete,
        "plotted": plotted,
    }


def test_rollout_lines_have_the_fields_and_formats_of_the_readme_sample(demo):
    intro = "While training you see a progress bar with ETA and one line per rollout:"
    (sample,) = block_after(section("What the default run does"), intro).strip().splitlines()
    assert demo["stopped"].returncode == 0, demo["stopped"].stderr[-3000:]
    lines = demo["stopped"].stdout.splitlines()
    printed = [line for line in lines if line.startswith("rollout 147 ")]
    # rollout 147 neither evaluates nor saves, like the README's rollout 41
    assert len(printed) == 1 and number_pattern(sample).fullmatch(printed[0]), (sample, printed)


def test_sigterm_stops_with_the_message_the_readme_quotes(demo):
    quoted = claim(r"exits 0 with `(stopped after rollout N \(SIGTERM\); [^`]*N\+1)`")[1]
    expected = re.sub(r"\bN\b", "148", re.sub(r"\bN\+1\b", "149", quoted))
    stopped = demo["stopped"]
    assert stopped.returncode == 0 and expected in stopped.stdout, stopped.stdout[-2000:]
    again = demo["again"]
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.search(r"^rollout 149 \|", again.stdout, re.M) and "rollout 148 |" not in again.stdout


def test_rerunning_the_completed_quick_start_says_what_the_readme_quotes(demo):
    said = claim(
        r"Run the same command again and it says `(run already complete \(\d+ of \d+ rollouts\))` "
        "and exits 0"
    )[1]
    complete = demo["complete"]
    assert complete.returncode == 0 and said in complete.stdout, complete.stdout[-2000:]
    # the real-model section's general form of the same message
    general = claim(r"it says `run already complete \((N) of (N) rollouts\)`")
    assert general[1] == general[2] == "N"


def test_the_checkpoint_layout_is_the_one_the_readme_shows(demo):
    layout = block_after(section("Resume: the contract"), "`--save DIR` writes Megatron-style")
    save = demo["save"]
    tracker = claim(r"DIR/(\S+\.txt)\s+the last rollout", layout)[1]
    assert (save / tracker).read_text().strip() == "149"
    iteration = claim(r"DIR/(iter_(\d+))/", layout)
    name = f"iter_{149:0{len(iteration[2])}d}"
    described = layout.split(iteration[0])[1]
    files = set(re.findall(r"\b([a-z_]+/|[a-z_]+\.(?:json|safetensors))", described))
    assert {"model/", "optimizer/", "manifest.json"} <= files, files
    for entry in files:
        assert (save / name / entry.rstrip("/")).exists(), f"{name}/{entry} missing"


def test_metrics_and_plot_are_where_the_readme_says(demo):
    where = claim(r"Metrics are appended to `([^`]+)`")[1]
    records = (demo["cwd"] / where).read_text().splitlines()
    assert len(records) == 3  # rollouts 147-149: no evaluation before training at 147
    png = claim(r"`mileage plot runs/demo` draws them into `([^`]+)`")[1]
    assert demo["plotted"].returncode == 0, demo["plotted"].stderr
    assert (demo["cwd"] / png).stat().st_size > 0
