"""Prompt files: JSONL and Parquet records of text or chat prompts, every bad record named where it is."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo_trainer.data import ChatMessage, Prompt
from ppo_trainer.prompt_files import load_prompt_file

SYSTEM, USER = {"role": "system", "content": "Reply with a number."}, {"role": "user", "content": "2+2?"}
CHAT = Prompt.chat([ChatMessage("system", "Reply with a number."), ChatMessage("user", "2+2?")], label="4")


def write_lines(tmp_path, lines: list[str], name: str = "prompts.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(tmp_path, columns: dict, name: str = "prompts.parquet", row_group_size: int | None = None):
    path = tmp_path / name
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


# --- JSONL -------------------------------------------------------------------------------------


def test_jsonl_text_and_chat_prompts_with_string_numeric_and_missing_labels(tmp_path):
    path = write_lines(
        tmp_path,
        [
            json.dumps({"prompt": "2+2?", "label": "4"}),
            "",
            json.dumps({"prompt": "3*3?", "label": 9}),
            json.dumps({"prompt": "half of 5?", "label": 2.5}),
            json.dumps({"prompt": "free text", "label": None}),
            json.dumps({"prompt": "no label"}),
            json.dumps({"prompt": [SYSTEM, USER], "label": 4}),
        ],
    )
    assert load_prompt_file(path) == [
        Prompt("2+2?", "4"),
        Prompt("3*3?", "9"),
        Prompt("half of 5?", "2.5"),
        Prompt("free text", None),
        Prompt("no label", None),
        CHAT,
    ]


def test_jsonl_custom_keys(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"question": "q", "answer": "#### 1"})])
    assert load_prompt_file(path, prompt_key="question", label_key="answer") == [Prompt("q", "#### 1")]


def test_jsonl_yields_one_prompt_per_record_and_skips_blank_lines_only(tmp_path):
    records = [json.dumps({"prompt": f"p{i}", "label": i}) for i in range(500)]
    lines = [line for i, line in enumerate(records) for line in ([line, ""] if i % 7 == 0 else [line])]
    prompts = load_prompt_file(write_lines(tmp_path, lines))
    assert [p.text for p in prompts] == [f"p{i}" for i in range(500)]


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", ":2: invalid JSON"),
        ("[1, 2]", ":2: expected a JSON object, got list"),
        (json.dumps({"question": "q"}), ":2: missing key 'prompt' (keys: ['question']); set data.promptKey"),
        (json.dumps({"prompt": 3}), ":2: key 'prompt': must be a string or a list of {role, content} messages, got int"),
        (json.dumps({"prompt": None}), ":2: key 'prompt': is null; every record needs a prompt"),
        (json.dumps({"prompt": "p", "label": ["a"]}), ":2: key 'label': must be a string or a number, got list"),
        (json.dumps({"prompt": "p", "label": True}), ":2: key 'label': must be a string or a number, got bool"),
        ('{"prompt": "p", "label": NaN}', ":2: key 'label': nan is not a label; give a string, a finite number or null"),
        (json.dumps({"prompt": []}), ":2: key 'prompt': is an empty list of messages"),
        (json.dumps({"prompt": ["hi"]}), ":2: key 'prompt': message 0: must be an object with role and content, got str"),
        (json.dumps({"prompt": [{"role": "user"}]}),
         ":2: key 'prompt': message 0: has no content (keys: ['role']); each message needs a role and a content"),
        (json.dumps({"prompt": [USER, {"role": "user", "content": "x", "name": "bob"}]}),
         ":2: key 'prompt': message 1: has keys besides role and content (['name']); remove them"),
        (json.dumps({"prompt": [{"role": "tool", "content": "x"}, USER]}),
         ":2: key 'prompt': message 0: role 'tool' is not one of system, user, assistant"),
        (json.dumps({"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
         ":2: key 'prompt': message 0: content must be a string, got list"),
        (json.dumps({"prompt": [USER, SYSTEM, USER]}), ":2: key 'prompt': message 1: a system message may only come first"),
        (json.dumps({"prompt": [USER, {"role": "assistant", "content": "4"}]}),
         ":2: key 'prompt': the last message (1) is the assistant's; end with the user's message"),
    ],
)
def test_jsonl_malformed_record_names_file_line_and_key(tmp_path, line, message):
    path = write_lines(tmp_path, [json.dumps({"prompt": "fine"}), line])
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}{message}")):
        load_prompt_file(path)


def test_jsonl_text_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"prompt": "fine"}).encode() + b'\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}:2: not UTF-8 (byte 16 of the line)")):
        load_prompt_file(path)


def test_a_missing_label_is_an_error_where_the_reward_needs_one(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"prompt": "p", "label": 0}), json.dumps({"prompt": "q", "label": None})])
    assert len(load_prompt_file(path)) == 2
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: key 'label': no label, and the reward scores against one")):
        load_prompt_file(path, require_labels=True)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="no prompts"):
        load_prompt_file(write_lines(tmp_path, [""]))
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        load_prompt_file(tmp_path / "absent.jsonl")
    with pytest.raises(FileNotFoundError, match="absent.parquet"):
        load_prompt_file(tmp_path / "absent.parquet")


# --- Parquet -----------------------------------------------------------------------------------

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def test_parquet_text_prompts_with_integer_labels_and_nulls(tmp_path):
    path = write_parquet(tmp_path, {"question": ["2+2?", "3*3?", "free"], "answer": pa.array([4, 9, None], pa.int64())})
    assert load_prompt_file(path, prompt_key="question", label_key="answer") == [
        Prompt("2+2?", "4"), Prompt("3*3?", "9"), Prompt("free", None)
    ]


def test_parquet_chat_prompts_from_a_list_of_structs_with_float_and_string_labels(tmp_path):
    path = write_parquet(tmp_path, {
        "prompt": pa.array([[SYSTEM, USER], [USER]], MESSAGES),
        "label": pa.array([4.0, 0.5], pa.float64()),
    })
    assert load_prompt_file(path) == [
        Prompt.chat(CHAT.messages, label="4.0"), Prompt.chat([ChatMessage("user", "2+2?")], label="0.5")
    ]
    strings = write_parquet(tmp_path, {"prompt": pa.array([[USER]], MESSAGES), "label": ["#### 4"]}, "strings.parquet")
    assert load_prompt_file(strings) == [Prompt.chat([ChatMessage("user", "2+2?")], label="#### 4")]


def test_parquet_without_a_label_column_has_no_labels(tmp_path):
    assert load_prompt_file(write_parquet(tmp_path, {"prompt": ["a", "b"]})) == [Prompt("a"), Prompt("b")]


def test_parquet_reads_every_row_of_every_row_group_in_order(tmp_path):
    path = write_parquet(tmp_path, {"prompt": [f"p{i}" for i in range(2500)], "label": list(range(2500))},
                         row_group_size=300)
    assert pq.ParquetFile(path).num_row_groups == 9
    prompts = load_prompt_file(path)
    assert [(p.text, p.label) for p in prompts] == [(f"p{i}", str(i)) for i in range(2500)]


def test_parquet_malformed_row_names_file_row_and_column_across_row_groups(tmp_path):
    texts = ["fine"] * 1000
    texts[777] = None
    path = write_parquet(tmp_path, {"prompt": texts}, row_group_size=100)
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: row 777, column 'prompt': is null; every record needs a prompt")):
        load_prompt_file(path)


@pytest.mark.parametrize(
    "columns,message",
    [
        ({"text": ["a"]}, ": no column 'prompt' (columns: ['text']); set data.promptKey to the column"),
        ({"prompt": pa.array([1, 2], pa.int64())}, ": row 0, column 'prompt': must be a string or a list of {role, content} messages, got int"),
        ({"prompt": ["a", "b"], "label": pa.array([1.0, float("inf")])}, ": row 1, column 'label': inf is not a label"),
        ({"prompt": ["a", "b"], "label": pa.array([False, True])}, ": row 0, column 'label': must be a string or a number, got bool"),
        ({"prompt": pa.array([[USER], [{"role": "robot", "content": "x"}]], MESSAGES)},
         ": row 1, column 'prompt': message 0: role 'robot' is not one of system, user, assistant"),
        ({"prompt": pa.array([[USER], [{"role": "user", "content": None}]], MESSAGES)},
         ": row 1, column 'prompt': message 0: content must be a string, got NoneType"),
        ({"prompt": pa.array([[USER], []], MESSAGES)}, ": row 1, column 'prompt': is an empty list of messages"),
        ({"prompt": pa.array([[{"role": "user"}]], pa.list_(pa.struct([("role", pa.string())])))},
         ": row 0, column 'prompt': message 0: has no content (keys: ['role'])"),
        ({"prompt": pa.array([], pa.string())}, ": no prompts (the file has no records)"),
    ],
)
def test_parquet_malformed_file_names_file_row_and_column(tmp_path, columns, message):
    path = write_parquet(tmp_path, columns)
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}{message}")):
        load_prompt_file(path)


def test_parquet_struct_fields_beyond_role_and_content_are_refused_unless_null(tmp_path):
    named = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())]))
    fine = write_parquet(tmp_path, {"prompt": pa.array([[{**USER, "name": None}]], named)}, "fine.parquet")
    assert load_prompt_file(fine) == [Prompt.chat([ChatMessage("user", "2+2?")])]
    named_row = write_parquet(tmp_path, {"prompt": pa.array([[{**USER, "name": "bob"}]], named)}, "named.parquet")
    with pytest.raises(ValueError, match=re.escape("row 0, column 'prompt': message 0: has keys besides role and content (['name'])")):
        load_prompt_file(named_row)


def test_a_file_that_is_not_parquet_says_so(tmp_path):
    path = tmp_path / "prompts.parquet"
    path.write_text('{"prompt": "a JSONL line in a .parquet file"}\n')
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: not a readable Parquet file (")):
        load_prompt_file(path)
