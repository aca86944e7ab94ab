"""Dataset files, the prompt stream and chat templates (pure logic: no engine, no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vime.config.schema import DataConfig
from vime.data import chat, examples, files
from vime.data.dataset import (
    FilePromptSet,
    load_tokenizer,
    make_prompts,
    response_text,
    stop_token_ids,
)
from vime.errors import DataError


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The tiny Qwen3 with the chat tokenizer (Qwen3's special tokens, a chat template), vocab 128."""
    from rl_kernel.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(
        tmp_path_factory.mktemp("chat_tiny"),
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        num_kv_heads=2,
        chat=True,
    )


@pytest.fixture(scope="module")
def tok(chat_model):
    return load_tokenizer(chat_model)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("examples")
    examples.write_examples(out, n_train=10, n_test=4, seed=3)
    return out


def _cfg(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), prompt_key=kw.pop("prompt_key", "question"), **kw)


# ---- files ---------------------------------------------------------------------------------------


def test_rows_from_jsonl_parquet_json_dir_and_glob(data_dir, tmp_path):
    rows = files.load_rows(str(data_dir / "gsm8k_train.jsonl"), "question", "answer")
    assert len(rows) == 10 and rows[0].prompt.startswith(rows[0].prompt.split()[0])
    assert rows[0].label.splitlines()[-1].startswith("#### ") and rows[0].metadata == {"id": "s3-0"}
    boxed = files.load_rows(str(data_dir / "boxed_train.parquet"), "problem", "answer")
    assert set(boxed[0].metadata) == {"solution", "level"} and "\\boxed{" in boxed[0].metadata["solution"]
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps([{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]))
    assert [r.label for r in files.load_rows(str(as_list), "prompt", "answer")] == [1, 2]
    shards = tmp_path / "shards"
    for i in range(3):
        examples.write_jsonl(examples.gsm8k_rows(2, seed=i), shards / f"part-{i}.jsonl")
    by_dir = files.load_rows(str(shards), "question", "answer")
    by_glob = files.load_rows(str(shards / "part-*.jsonl"), "question", "answer")
    assert len(by_dir) == 6 and [r.prompt for r in by_dir] == [r.prompt for r in by_glob]
    assert [r.metadata["id"] for r in by_dir] == [f"s{i}-{j}" for i in range(3) for j in range(2)]  # file order


def test_chat_message_prompts(tmp_path):
    path = examples.write_jsonl(
        [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}], "a": "2"}],
        tmp_path / "chat.jsonl",
    )
    (row,) = files.load_rows(str(path), "messages", "a")
    assert row.prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: d / "nope.jsonl", r"data.path=.*nope.jsonl: no such file or directory; pass a .jsonl"),
        (lambda d: _write(d / "x.csv", "a,b\n"), r"unknown format of x.csv; use .jsonl, .json or .parquet"),
        (lambda d: _write(d / "empty.jsonl", ""), r"the dataset is empty \(0 rows\)|cannot read it as json"),
        (lambda d: d / "*.nothing", r"the glob matches no file"),
        (lambda d: _write(d / "bad.jsonl", '{"question": "a", "answer": 1}\n{not json\n'), r"cannot read it as json"),
        (lambda d: _mkdir(d / "emptydir"), r"the directory has no .jsonl/.json/.parquet file"),
    ],
)
def test_bad_files_are_one_line_naming_the_path(tmp_path, make, match):
    with pytest.raises(DataError, match=match) as e:
        files.load_rows(str(make(tmp_path)), "question", "answer")
    assert "\n" not in str(e.value)


def test_empty_dataset_is_refused(tmp_path):
    """A parquet file with the columns and no rows: an empty dataset, said so."""
    path = tmp_path / "empty.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)
    with pytest.raises(DataError, match=r"empty.parquet: the dataset is empty \(0 rows\); point it at a file"):
        files.load_rows(str(path), "question", "answer")


def test_a_missing_key_names_the_keys_the_file_has(data_dir):
    with pytest.raises(DataError, match=r"no column 'prompt' \(data.prompt_key\); the file has \['question', 'answer'"):
        files.load_rows(str(data_dir / "gsm8k_train.jsonl"), "prompt", "answer")
    with pytest.raises(DataError, match=r"no column 'label' \(eval.answer_key\)"):
        files.load_rows(str(data_dir / "gsm8k_train.jsonl"), "question", "label", key="eval.path")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


# ---- the prompt stream -------------------------------------------------------------------------------


def test_shuffled_every_epoch_and_cycling(data_dir, tok):
    ps = FilePromptSet(_cfg(data_dir / "gsm8k_train.jsonl", seed=7), tok, 128)
    epochs = [[p.index for p in ps.batch(0, 10)] for _ in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # every row once per epoch
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch
    again = FilePromptSet(_cfg(data_dir / "gsm8k_train.jsonl", seed=7), tok, 128)
    assert [[p.index for p in again.batch(0, 10)] for _ in range(3)] == epochs  # seeded
    other = FilePromptSet(_cfg(data_dir / "gsm8k_train.jsonl", seed=8), tok, 128)
    assert [p.index for p in other.batch(0, 10)] != epochs[0]
    plain = FilePromptSet(_cfg(data_dir / "gsm8k_train.jsonl", shuffle=False), tok, 128)
    assert [p.index for p in plain.batch(0, 4)] == [0, 1, 2, 3] and [p.index for p in plain.batch(1, 8)] == [
        4,
        5,
        6,
        7,
        8,
        9,
        0,
        1,
    ]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 7), stop=st.integers(0, 9), more=st.integers(1, 9), seed=st.integers(0, 3))
def test_a_restored_stream_continues_exactly(data_dir, tok, n, stop, more, seed):
    """Draw `stop` batches, save, restore into a fresh set, draw `more`: the same prompts, in bits, as one
    uninterrupted stream, across epoch boundaries (10 rows, batches of n)."""
    cfg = _cfg(data_dir / "gsm8k_train.jsonl", seed=seed)
    whole = FilePromptSet(cfg, tok, 128)
    expected = [[(p.index, p.token_ids) for p in whole.batch(s, n)] for s in range(stop + more)]
    first = FilePromptSet(cfg, tok, 128)
    for s in range(stop):
        first.batch(s, n)
    state = json.loads(json.dumps(first.state_dict()))  # as plain as the checkpoint keeps it
    resumed = FilePromptSet(cfg, tok, 128)
    resumed.load_state_dict(state)
    assert [[(p.index, p.token_ids) for p in resumed.batch(s, n)] for s in range(stop, stop + more)] == expected[stop:]


def test_a_state_of_other_data_is_refused(data_dir, tok):
    a = FilePromptSet(_cfg(data_dir / "gsm8k_train.jsonl"), tok, 128)
    b = FilePromptSet(_cfg(data_dir / "gsm8k_test.jsonl"), tok, 128)
    with pytest.raises(DataError, match="belongs to another dataset"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(DataError, match="this run has data.task"):
        make_prompts(DataConfig(num_prompts=4), tok, 128).load_state_dict(a.state_dict())


def test_max_prompt_tokens_drops_and_counts_and_refuses_when_none_is_left(data_dir, tok, caplog):
    import logging

    rows = files.load_rows(str(data_dir / "gsm8k_train.jsonl"), "question", "answer")
    lengths = sorted(len(r.prompt) for r in rows)  # the char tokenizer: one token a character
    limit = lengths[4]
    with caplog.at_level(logging.INFO, logger="vime"):
        ps = FilePromptSet(_cfg(data_dir / "gsm8k_train.jsonl", max_prompt_tokens=limit), tok, 128)
    kept = sum(n <= limit for n in lengths)
    assert len(ps.prompts) == kept and ps.dropped == 10 - kept
    assert all(len(p.token_ids) <= limit for p in ps.prompts)
    assert f"data: {kept} prompts from" in caplog.text and f"({10 - kept} dropped longer than" in caplog.text
    with pytest.raises(DataError, match=r"every prompt is longer than data.max_prompt_tokens=5 \(the shortest has "):
        FilePromptSet(_cfg(data_dir / "gsm8k_train.jsonl", max_prompt_tokens=5), tok, 128)


# ---- chat templates ----------------------------------------------------------------------------------


def test_chat_template_renders_with_a_generation_prompt_system_prompt_and_kwargs(data_dir, tok):
    cfg = _cfg(data_dir / "gsm8k_train.jsonl", chat_template=True, system_prompt="Answer with #### n.")
    p = FilePromptSet(cfg, tok, 128).prompts[0]
    assert p.text.startswith("<|im_start|>system\nAnswer with #### n.<|im_end|>\n<|im_start|>user\n")
    assert p.text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(p.token_ids) == p.text and tok.convert_tokens_to_ids("<|im_start|>") in p.token_ids
    no_think = _cfg(data_dir / "gsm8k_train.jsonl", chat_template=True, template_kwargs={"enable_thinking": False})
    assert FilePromptSet(no_think, tok, 128).prompts[0].text.endswith("assistant\n<think>\n\n</think>\n\n")


def test_end_of_turn_token_joins_the_stop_tokens_and_cuts_the_response(data_dir, tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.end_of_turn_ids(tok) == [im_end] and im_end != tok.eos_token_id
    assert stop_token_ids(_cfg(data_dir / "x", chat_template=True), tok) == [tok.eos_token_id, im_end]
    assert stop_token_ids(_cfg(data_dir / "x"), tok) == [tok.eos_token_id]
    ids = tok("#### 42", add_special_tokens=False)["input_ids"] + [im_end] + tok("junk")["input_ids"]
    assert response_text(tok, ids, [tok.eos_token_id, im_end]) == "#### 42"
    assert response_text(tok, ids[:3], [tok.eos_token_id, im_end]) == "###"  # cut at max_new_tokens: all of it


def test_no_template_is_refused_and_messages_need_one(data_dir, tiny_qwen3_path, tmp_path):
    plain = load_tokenizer(tiny_qwen3_path)
    with pytest.raises(DataError, match=r"data.chat_template=true but the tokenizer in .* has no chat template"):
        FilePromptSet(_cfg(data_dir / "gsm8k_train.jsonl", chat_template=True), plain, 512, str(tiny_qwen3_path))
    path = examples.write_jsonl([{"m": [{"role": "user", "content": "hi"}], "answer": "x"}], tmp_path / "m.jsonl")
    with pytest.raises(DataError, match=r"row 0's prompt is a list of chat messages but data.chat_template=false"):
        FilePromptSet(_cfg(path, prompt_key="m"), plain, 512)
    with pytest.raises(DataError, match="data.chat_template=true needs data.path"):
        make_prompts(DataConfig(chat_template=True), plain, 512)


def test_the_plain_tiny_tokenizer_is_unchanged(tiny_qwen3_path):
    """chat=False keeps the tokenizer every earlier run used (ids of the copy task's prompts, eos)."""
    plain = load_tokenizer(tiny_qwen3_path)
    assert plain("g=", add_special_tokens=False)["input_ids"] == [20, 84] and plain.eos_token_id == 3  # as before chat=
    assert not getattr(plain, "chat_template", None)


def test_unknown_characters_are_named(tmp_path, tok):
    path = examples.write_jsonl([{"question": "caf\u00e9?", "answer": "1"}], tmp_path / "u.jsonl")
    with pytest.raises(DataError, match=r"prompt 0 \('caf.\?'\) has characters the tokenizer does not know"):
        FilePromptSet(_cfg(path), tok, 128)


def test_examples_are_deterministic_by_seed():
    assert examples.gsm8k_rows(5, 1) == examples.gsm8k_rows(5, 1) != examples.gsm8k_rows(5, 2)
    for r in examples.gsm8k_rows(50, 0):
        steps, last = r["answer"].rsplit("\n", 1)
        assert last == f"#### {eval(steps.splitlines()[-1].split('=')[0])}"  # noqa: S307 - our own arithmetic
    assert examples.boxed_rows(3, 0) == examples.boxed_rows(3, 0)
