"""ppo-train reads the prompt files before Ray starts: a missing or malformed one exits 2 naming its field."""

from __future__ import annotations

import pytest
import yaml

from ppo_trainer.cli import EXIT_CONFIG, ConfigError, check_prompt_files, load_config, main


def config(tmp_path, data: dict):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "builtin:tiny"}, "data": data}))
    return path


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"validation": {"prompts": "MISSING"}}, "data.validation.prompts: prompt file "),
        ({"validation": {"prompts": "BAD"}}, "data.validation.prompts: BAD:2: invalid JSON"),
        ({"prompts": "MISSING"}, "data.prompts: prompt file "),
        ({"prompts": "GOOD", "validation": {"prompts": "GOOD"}, "promptKey": "question"},
         "data.prompts: GOOD:1: missing key 'question'"),
    ],
)
def test_a_bad_prompt_file_exits_2_before_ray_starts_naming_the_field(tmp_path, capsys, data, expected):
    files = {"MISSING": tmp_path / "missing.jsonl", "BAD": tmp_path / "bad.jsonl", "GOOD": tmp_path / "good.jsonl"}
    files["BAD"].write_text('{"prompt": "ok"}\n{oops\n')
    files["GOOD"].write_text('{"prompt": "ok"}\n')

    def real(value):
        return str(files[value]) if value in files else value

    data = {k: ({"prompts": real(v["prompts"])} if k == "validation" else real(v)) for k, v in data.items()}
    assert main([str(config(tmp_path, data)), "--run-dir", str(tmp_path / "run")]) == EXIT_CONFIG
    first = capsys.readouterr().err.splitlines()[0]
    for name, path in files.items():
        expected = expected.replace(name, str(path))
    assert first.startswith(f"ppo-train: {expected}"), first
    assert not (tmp_path / "run").exists()  # made just before Ray starts


def test_good_and_synthetic_prompt_files_pass_the_check(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "ok", "label": 3}\n')
    spec, _ = load_config(str(config(tmp_path, {"prompts": "synthetic", "validation": {"prompts": str(good)}})))
    check_prompt_files(spec)
    spec, _ = load_config(str(config(tmp_path, {"prompts": str(good), "validation": {"prompts": "synthetic"}})))
    check_prompt_files(spec)
    with pytest.raises(ConfigError, match="fix the file or point data.validation.prompts at another"):
        spec, _ = load_config(str(config(tmp_path, {"validation": {"prompts": str(tmp_path / "none.jsonl")}})))
        check_prompt_files(spec)
