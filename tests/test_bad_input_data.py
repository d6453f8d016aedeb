"""Prompt files and model configs that are wrong in their content, not their shape: a byte that is
not UTF-8, a null label or prompt, a config field of the wrong type. Each is one line naming
where it is (file and line, or file and field), never a traceback or a run that learns nothing.

Runs `mileage.cli.main.main` in-process; every case fails in preflight, before a model is built.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mileage.cli.main import main
from mileage.errors import UserError
from mileage.rollout.data import load_prompts


def one_line_error(capsys, argv: list) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mileage: error: "), err
    return lines[0]


def test_a_byte_that_is_not_utf8_names_file_line_and_column(capsys, tiny_hf, tmp_path):
    good = '{"prompt": "café ∑", "label": "2"}\r\n'.encode()
    readable = tmp_path / "good.jsonl"
    readable.write_bytes(good)  # UTF-8 beyond ASCII, CRLF endings: read as before
    assert [(p.text, p.label) for p in load_prompts(str(readable), "prompt", "label")] == [
        ("café ∑", "2")
    ]
    data = tmp_path / "d.jsonl"
    data.write_bytes(good + b'{"prompt": "caf\xe9", "label": "4"}\n')  # Latin-1 on line 2
    line = one_line_error(capsys, ["plan", "--hf-checkpoint", tiny_hf, "--prompt-data", data])
    assert f"{data}:2: not UTF-8 (byte 0xe9 at column 16)" in line, line


@pytest.mark.parametrize("key", ["label", "prompt"])
def test_a_null_jsonl_value_is_refused_naming_file_line_and_key(capsys, tiny_hf, tmp_path, key):
    data = tmp_path / "d.jsonl"
    record = {"prompt": "2+2", "label": "4", key: None}
    data.write_text('{"prompt": "1+1", "label": "2"}\n' + json.dumps(record) + "\n")
    line = one_line_error(capsys, ["plan", "--hf-checkpoint", tiny_hf, "--prompt-data", data])
    assert f"{data}:2: '{key}' is null" in line, line


def test_a_null_label_in_eval_data_is_refused_too(capsys, tiny_hf, tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text('{"prompt": "1+1", "label": "2"}\n')
    held.write_text('{"q": "1+1", "a": null}\n')
    argv = ["plan", "--hf-checkpoint", tiny_hf, "--prompt-data", train]
    argv += ["--eval-prompt-data", held, "--eval-input-key", "q", "--eval-label-key", "a"]
    assert f"{held}:1: 'a' is null" in one_line_error(capsys, argv)


def test_a_null_parquet_label_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1", "2+2"], "label": ["2", None]}), data)
    with pytest.raises(UserError, match=rf"{data}: row 1: 'label' is null"):
        load_prompts(str(data), "prompt", "label")


def model_with(tiny_hf: Path, root: Path, **fields) -> Path:
    model = root / "model"
    shutil.copytree(tiny_hf, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **fields}))
    return model


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("hidden_size", "big", '"hidden_size" is "big"; expected a positive integer'),
        ("num_hidden_layers", 2.5, '"num_hidden_layers" is 2.5; expected a positive integer'),
        ("vocab_size", 0, '"vocab_size" is 0; expected a positive integer'),
        ("rms_norm_eps", "tiny", '"rms_norm_eps" is "tiny"; expected a number'),
        # a field only transformers knows the type of: its check, as one line
        ("tie_word_embeddings", "yes", "'tie_word_embeddings' expected bool, got str"),
    ],
)
def test_a_config_field_of_the_wrong_type_is_one_line(
    capsys, tiny_hf, tmp_path, field, value, expected
):
    model = model_with(tiny_hf, tmp_path, **{field: value})
    line = one_line_error(capsys, ["plan", "--hf-checkpoint", model])
    assert f"{model / 'config.json'}: " in line and expected in line, line


def test_a_utf8_bom_at_the_start_of_a_jsonl_file_is_read_past(tmp_path):
    """Windows editors save UTF-8 with a BOM; JSON itself has none, so it is read past."""
    from mileage.rollout.prompts import load_jsonl

    path = tmp_path / "bom.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": "4"}\n'
    )
    prompts = load_jsonl(str(path), "prompt", "label")
    assert [(p.text, p.label) for p in prompts] == [("1+1=", "2"), ("2+2=", "4")]
