"""`mileage` starts without torch: the parser builds a command's flags only when that command is
parsed (train's flags come from config classes whose modules import torch and transformers),
and each command still parses as it did."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mileage.cli.main import COMMANDS, build_parser, main

HEAVY = ("torch", "transformers")


def test_help_and_ckpt_ls_import_neither_torch_nor_transformers(tmp_path):
    # a fresh interpreter: this one has imported torch long ago
    code = (
        "import sys\n"
        "from mileage.cli.main import build_parser, main\n"
        "build_parser()\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"assert main(['ckpt', 'ls', {str(tmp_path)!r}]) == 0\n"
        f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout, done.stdout


def test_a_command_gets_its_flags_when_it_is_parsed():
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    assert [name for name, _, _ in COMMANDS] == list(commands.choices)
    # nothing but -h until parsed
    assert [a.dest for a in commands.choices["train"]._actions] == ["help"]
    args = parser.parse_args(["train", "--lr", "0.5"])
    assert args.lr == 0.5 and commands.choices["train"].get_default("func") is not None


@pytest.mark.parametrize("name", [name for name, _, _ in COMMANDS])
def test_every_command_builds_and_shows_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: mileage {name} ")


def test_the_process_collects_nothing_while_importing_and_freezes_what_it_imported(
    tmp_path, monkeypatch
):
    """`run` (the `mileage` process) keeps the collector off while the command's modules are
    imported, then freezes them and turns it back on: a run must still collect its cycles."""
    import gc

    import mileage.cli.main as cli_main

    seen = {}
    real_main = cli_main.main

    def spy(argv=None, after_parse=None):
        seen["parsing"] = gc.isenabled()

        def after():
            after_parse()
            seen["running"] = (gc.isenabled(), gc.get_freeze_count())

        return real_main(["ckpt", "ls", str(tmp_path)], after_parse=after)

    monkeypatch.setattr(cli_main, "main", spy)
    monkeypatch.setattr("mileage.allocator.keep_freed_memory", lambda: False)
    try:
        assert cli_main.run() == 0
    finally:  # what run() froze stays frozen, as conftest freezes the worker's imports
        gc.enable()
    enabled, frozen = seen["running"]
    assert seen["parsing"] is False
    assert enabled and frozen > 0
