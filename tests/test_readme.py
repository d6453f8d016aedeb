"""The README against the program: every claim of an outcome it makes is checked here, so that
it cannot drift from what mileage does and prints.

- Every shell command of the README and docs/*.md is as written (checked without running it:
  `mileage` subcommands and flags against the real parser, scripts and paths in the repo, pip
  from the checkout into the named venv) or its block says what it needs (`<!-- needs: ... -->`);
  every flag of "Flags at a glance" (with its listed choices) is in `mileage train --help`; the
  test command is `.ci/run`'s; docs/verifiers.md's example taskset loads.
- The quick start's command, run at the demo's own size for its last three rollouts
  (`--start-rollout-id 147`: the same flags and per-rollout work as the 2-minute demo, without
  its first 147 rollouts), prints rollout lines with the fields and number formats of the README's
  sample line, writes the checkpoint layout docs/resume.md shows, stops on SIGTERM with the
  message it quotes, and rerun verbatim says the quoted `run already complete (150 of 150 rollouts)`.
- "What the default run does" names the defaults the same command resolves to.

The "Real models" section's commands are run as written by tests/test_real_model_path.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

from mileage.preemption import STOPPED_EXIT

README = (REPO / "README.md").read_text(encoding="utf-8")
# the resume contract the README links to, checked against the same runs
RESUME = (REPO / "docs" / "resume.md").read_text(encoding="utf-8")

# the README runs commands from a venv; these tests run the same program from this checkout
MILEAGE = re.compile(r"(?:^|/|-m )mileage$")


def section(heading: str, text: str = README) -> str:
    """The text under a `#`-heading of `text`, up to the next heading of its level or above."""
    match = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
    assert match, f"no section {heading!r}"
    level = len(match.group(1))
    rest = text[match.end() :]
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


# The commands of the README and docs/ are checked without running them (most need minutes, a
# model or a server): a `mileage` command's subcommand and every `--flag` must be its parser's, a
# repo script must exist and take the flags given, a path into the repo must exist, and pip
# installs mileage from the checkout (`-e`) into the named venv. A block that needs what CI lacks
# says so right before its fence: `<!-- needs: gpu -->`, `server`, `vllm` (scripts/install_vllm.sh's
# venv) or `extra NAME` (a pyproject extra); only such a block may run other programs.
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:<!-- needs: ([^>]*?) -->\n)?^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL_TOOLS = {"source", ".", "rm", "cd", "mkdir", "cp", "export", "git", "echo"}
WRAPPERS = {"taskset": 2, "timeout": 1, "/usr/bin/time": 0, "env": 0}  # program -> its arguments
REPO_PATH = re.compile(r"^(?:scripts|bench|docs|examples|tests|mileage)/[\w./-]+")
LOOKS_LIKE_A_COMMAND = re.compile(r"^(?:mileage|python3?|\.venv/|pip|torchrun|scripts/)\S* ")


def doc_blocks() -> list[tuple[str, str, str, set[str]]]:
    """(file, language, body, needs) of every fenced block of the README and docs/*.md."""
    blocks = []
    for path in DOCS:
        for needs, lang, body in FENCE.findall(path.read_text(encoding="utf-8")):
            marks = {m.strip() for m in needs.split(",") if m.strip()}
            blocks.append((str(path.relative_to(REPO)), lang, body, marks))
    return blocks


def shell_commands(body: str) -> list[list[str]]:
    """Each simple command of a shell block as tokens: comments dropped, continuations joined,
    split at `&&`, `||`, `;`, `|` and `&`; a command substitution is a command of its own."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        pieces = [re.sub(r"\$\([^)]*\)", "SUBST", line), *re.findall(r"\$\(([^)]*)\)", line)]
        for piece in pieces:
            lexer = shlex.shlex(piece, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            command: list[str] = []
            for token in lexer:
                if set(token) <= set(";&|"):
                    commands.append(command)
                    command = []
                else:
                    command.append(token)
            commands.append(command)
    return [c for c in commands if c]


def pyproject_extras() -> set[str]:
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(data["project"]["optional-dependencies"])


def pip_problems(tokens: list[str]) -> list[str]:
    """A pip line must name the venv and take mileage from the checkout (`-e .` / `-e '.[x]'`)."""
    if tokens[0] != ".venv/bin/pip":
        return [f"`{tokens[0]}`: name the venv (`.venv/bin/pip`)"]
    problems, args = [], iter(tokens[2:])
    for arg in args:
        if arg == "-e":
            spec = next(args, "")
            match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", spec)
            if not match:
                problems.append(f"-e {spec}: install from the checkout, `-e .` or `-e '.[extra]'`")
            elif match[1] and set(match[1].split(",")) - pyproject_extras():
                problems.append(f"-e {spec}: no such extra in pyproject.toml")
        elif arg in ("-r", "--index-url"):
            value = next(args, "")
            if arg == "-r" and not (REPO / value).exists():
                problems.append(f"-r {value}: no such file")
        elif arg == "--no-deps":
            continue
        elif re.match(r"mileage\b", arg) or not re.fullmatch(r"[\w.-]+==[\w.+-]+", arg):
            problems.append(f"{arg}: mileage is not on a package index; others pin `NAME==VER`")
    return problems


def mileage_problems(args: list[str]) -> list[str]:
    """A `mileage` command: its subcommand and every `--flag` exist in the real parser."""
    from mileage.cli.main import build_parser

    parser = build_parser()
    words = [a for a in args if a != "..."]
    while words:
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)] or [None]
        if sub is None:
            break
        if words[0] not in sub.choices:
            return [f"mileage: no subcommand {words[0]!r}"]
        # cli.main builds a command's flags only when it is parsed (`_Commands.parser_of`)
        of = getattr(sub, "parser_of", sub.choices.__getitem__)
        parser, words = of(words[0]), words[1:]
    known = parser._option_string_actions
    return [f"`{flag}` is not a flag of this command" for flag in
            (w.split("=")[0] for w in words if w.startswith("--") and " " not in w)
            if flag not in known]  # fmt: skip


def script_problems(script: str, args: list[str]) -> list[str]:
    """A repo script: it exists, and every `--flag` before `--` is in its source."""
    path = REPO / script
    if not path.is_file():
        return [f"{script}: no such script"]
    source = path.read_text()
    flags = [a.split("=")[0] for a in args[: args.index("--") if "--" in args else None]]
    return [f"{script} has no {f}" for f in flags if f.startswith("--") and f not in source]


def command_problems(tokens: list[str], needs: set[str]) -> list[str]:
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):  # VAR=value prefixes
        tokens = tokens[1:]
    while tokens and tokens[0] in WRAPPERS:
        tokens = tokens[1 + WRAPPERS[tokens[0]] :]
        while tokens and tokens[0].startswith("-"):
            tokens = tokens[1:]
    if not tokens or tokens == ["SUBST"]:
        return []
    problems = [
        f"{path}: no such file in the repo"
        for token in tokens
        for path in REPO_PATH.findall(token.split("=")[-1].split(":")[0])
        if not (REPO / path).exists()
    ]
    program, args = tokens[0], tokens[1:]
    if program in ("mileage", ".venv/bin/mileage"):
        return problems + mileage_problems(args)
    if program.endswith("pip") and args[:1] == ["install"]:
        return problems + pip_problems(tokens)
    if program == "torchrun" and "-m" in args:
        module = args[args.index("-m") + 1 :]
        if module[:1] == ["mileage"]:
            return problems + mileage_problems(module[1:])
    if program in ("python", "python3", ".venv/bin/python"):
        if args[:1] == ["-m"]:
            if args[1] == "mileage":
                return problems + mileage_problems(args[2:])
            if args[1] in ("pytest", "venv"):
                return problems
        elif args and REPO_PATH.match(args[0]):
            return problems + script_problems(args[0], args[1:])
    if REPO_PATH.match(program) or program == "bash":
        script = args[0] if program == "bash" else program
        return problems + ([] if (REPO / script).is_file() else [f"{script}: no such script"])
    if program in SHELL_TOOLS or needs:
        return problems
    return problems + [f"`{program}` cannot be checked here: mark the block <!-- needs: ... -->"]


def test_every_command_in_the_readme_and_docs_is_as_written():
    extras = pyproject_extras()
    problems, checked = [], 0
    for path, lang, body, needs in doc_blocks():
        for mark in needs:
            words = mark.split()
            if mark not in ("gpu", "server", "vllm") and not (
                words[0] == "extra" and len(words) == 2 and words[1] in extras
            ):
                problems.append(f"{path}: unknown mark `needs: {mark}`")
        if lang != "bash":
            problems += [
                f"{path}: a command in a ```{lang} block (tag it bash): {line}"
                for line in body.splitlines()
                if LOOKS_LIKE_A_COMMAND.match(line)
            ]
            continue
        for tokens in shell_commands(body):
            checked += 1
            problems += [
                f"{path}: `{shlex.join(tokens)}`: {p}" for p in command_problems(tokens, needs)
            ]
    # an inline `pip install` of mileage in prose is followed as often as a block
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for span in re.findall(r"`([^`\n]*pip install [^`\n]*(?:mileage|-e )[^`\n]*)`", text):
            problems += [f"{path.name}: `{span}`: {p}" for p in pip_problems(shlex.split(span))]
    assert not problems, "\n".join(problems)
    assert checked > 60, checked  # the blocks were found


def test_the_readme_test_command_is_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = block_after(section("Quick start"), "run the whole test suite").strip()
    assert readme == ci


def test_the_verifiers_example_loads_as_docs_verifiers_runs_it(monkeypatch):
    """docs/verifiers.md's command names examples/vf_addition.py's taskset; its training and
    held-out specs load through mileage's own loader, and they do not overlap."""
    from mileage.rollout.vfenv import load_tasks, parse_verifiers_spec

    text = (REPO / "docs" / "verifiers.md").read_text()
    (command,) = [c for _, _, body, needs in doc_blocks() if "extra verifiers" in needs
                  for c in shell_commands(body) if "PYTHONPATH=examples" in c]  # fmt: skip
    assert "examples/vf_addition.py" in text
    # tests/test_verifiers.py imports a small module of the same name: on a shared xdist worker
    # sys.modules (and the loader's cache) would hand its 40 tasks to this test
    monkeypatch.delitem(sys.modules, "vf_addition", raising=False)
    load_tasks.cache_clear()
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    train = load_tasks(parse_verifiers_spec(command[command.index("--prompt-data") + 1]))
    held_spec = command[command.index("--eval-prompt-data") + 2]
    held = load_tasks(parse_verifiers_spec(held_spec, "--eval-prompt-data"))
    assert (len(train), len(held)) == (2000, 200)
    assert not {t.data.prompt for t in train} & {t.data.prompt for t in held}


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
    assert demo["stopped"].returncode == STOPPED_EXIT, demo["stopped"].stderr[-3000:]
    lines = demo["stopped"].stdout.splitlines()
    printed = [line for line in lines if line.startswith("rollout 147 ")]
    # rollout 147 neither evaluates nor saves, like the README's rollout 41
    assert len(printed) == 1 and number_pattern(sample).fullmatch(printed[0]), (sample, printed)
    # fields the demo fixes whatever the machine: the LR, and ppo_kl, exactly 0 at a rollout's
    # only optimizer step (the README once showed a drift the run never printed)
    for field in ("ppo_kl", "lr"):
        said, shown = (re.search(rf"\| {field} (\S+) \|", line)[1] for line in (sample, printed[0]))
        assert said == shown, (field, sample, printed[0])


def test_sigterm_stops_with_the_message_the_readme_quotes(demo):
    quoted = claim(r"exits 75 with `(stopped after rollout N \(SIGTERM\); [^`]*N\+1)`", RESUME)[1]
    expected = re.sub(r"\bN\b", "148", re.sub(r"\bN\+1\b", "149", quoted))
    stopped = demo["stopped"]
    assert stopped.returncode == STOPPED_EXIT and expected in stopped.stdout, stopped.stdout[-2000:]
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
    layout = block_after(section("Resume: the contract", RESUME), "`--save DIR` writes Megatron")
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


def test_no_internal_session_numbers_in_docs_or_code():
    """A reader cannot know what an internal session number was: name commits and dates."""
    pattern = re.compile(r"\bsessions? \d+", re.I)
    found = []
    for path in sorted(REPO.rglob("*")):
        parts = path.relative_to(REPO).parts
        if path.suffix not in {".md", ".py", ".sh", ".toml"} or parts[0].startswith("."):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:80]}")
    assert found == []


def test_the_composition_matrix_runs_every_pair_of_factors_under_kills():
    """docs/composition.md's table covers every pair (scripts/composition_pairs.py); the check
    names what a row's removal leaves uncovered."""
    import runpy

    pairs = runpy.run_path(str(REPO / "scripts" / "composition_pairs.py"))
    text = (REPO / "docs" / "composition.md").read_text()
    report, missing = pairs["coverage"](text)
    assert missing == [] and len(report) == 103, missing
    without_45 = "\n".join(line for line in text.splitlines() if not line.startswith("| 45 |"))
    _, missing = pairs["coverage"](without_45)
    assert "source=rollout fn x weights=full" in missing, missing
    # every row the table names is a test function of the suite
    for test in re.findall(r"\| (test_\w+\.py)::(test_\w+)", text):
        assert f"def {test[1]}(" in (REPO / "tests" / test[0]).read_text(), test
