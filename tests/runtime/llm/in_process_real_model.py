"""The real SmolLM2-135M-Instruct fp16 bundle, loaded from sealed memfds with MNN-LLM."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from runtime.errors import InvalidInput, ModelLoadError
from runtime.llm.scoring import score
from runtime.llm.session import LlmSession, Sampling, StopReason

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def session(smollm2_files):
    with LlmSession(smollm2_files, threads=1) as session:
        yield session


def _prompt(session: LlmSession) -> list[int]:
    return session.encode(session.apply_chat_template(QUESTION))


def _generate(session, ids, **kwargs):
    deltas = list(session.generate(ids, **kwargs))
    return "".join(d.text for d in deltas), deltas[-1].summary


def test_it_answers_a_question_greedily_and_stops_at_end_of_turn(session, capfd):
    ids = _prompt(session)
    text, summary = _generate(session, ids, max_new_tokens=40)
    assert "Paris" in text
    assert "<|im_end|>" not in text
    assert summary.stop_reason is StopReason.EOS
    assert summary.tokens_in == len(ids) and summary.tokens_out == len(summary.output_ids)
    assert summary.ttft_s > 0 and summary.prefill_tps > 0 and summary.decode_tps > 0
    again, _ = _generate(session, ids, max_new_tokens=40)
    assert again == text  # reset between requests: no state carried over
    assert capfd.readouterr().out == ""  # MNN's printf logging never reaches stdout


def test_the_chat_template_is_the_bundles(session):
    text = session.apply_chat_template(QUESTION)
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_token_bytes_rebuild_multibyte_text(session):
    text = "héllo 🦄 日本語"
    ids = session.encode(text)
    assert b"".join(session._engine.token_bytes(t) for t in ids).decode() == text


def test_a_stop_string_ends_the_answer_without_leaking(session):
    text, summary = _generate(session, _prompt(session), max_new_tokens=40, stop_strings=["Paris"])
    assert summary.stop_reason is StopReason.STOP_STRING
    assert "Paris" not in text and "capital" in text


def test_cancelling_stops_within_a_token(session):
    stream = session.generate(_prompt(session), max_new_tokens=200, cancelled=lambda: flag[0])
    flag = [False]
    first = next(stream)
    flag[0] = True
    rest = list(stream)
    summary = rest[-1].summary
    assert first.summary is None and summary.stop_reason is StopReason.CANCELLED
    assert summary.tokens_out <= 2


def test_seeded_sampling_repeats(session):
    ids = _prompt(session)
    sampling = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    first, _ = _generate(session, ids, max_new_tokens=24, sampling=sampling)
    second, _ = _generate(session, ids, max_new_tokens=24, sampling=sampling)
    assert first == second


def test_teacher_forced_logits_reproduce_the_greedy_answer(session):
    ids = _prompt(session)
    _, summary = _generate(session, ids, max_new_tokens=12)
    rows = session.logits(ids, summary.output_ids)
    assert list(rows.argmax(axis=1)) == list(summary.output_ids)
    assert score(rows, rows).top1 == 1.0


def test_the_load_directory_holds_no_plaintext(session, smollm2_files):
    root = session._engine._dir.path
    entries = {p.name: p for p in root.iterdir()}
    assert set(entries) == set(smollm2_files)
    regular = [name for name, p in entries.items() if not p.is_symlink()]
    assert regular == ["config.json"]
    assert json.loads(entries["config.json"].read_text())["use_mmap"] is False
    assert session._engine.vocab_size == 49152


def test_loading_and_generating_write_no_files(smollm2_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MNN resolves relative cache paths against the cwd
    with LlmSession(smollm2_files) as fresh:
        _generate(fresh, _prompt(fresh), max_new_tokens=4)
    assert list(tmp_path.iterdir()) == []


def test_closing_removes_the_load_directory(smollm2_files):
    session = LlmSession(smollm2_files)
    root = session._engine._dir.path
    session.close()
    assert not root.exists()


def test_ids_outside_the_vocabulary_are_refused(session):
    with pytest.raises(InvalidInput, match="outside the vocabulary"):
        session.generate([1, 49152], max_new_tokens=1)


def test_a_prompt_past_the_context_is_refused_before_running(session):
    with pytest.raises(InvalidInput, match="context length is 2048"):
        session.generate(list(np.ones(3000, dtype=int)), max_new_tokens=1)


def _replaced(files: dict[str, int], name: str, data: bytes) -> dict[str, int]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    return {**files, name: fd}


def test_a_bundle_without_a_template_refuses_chat(smollm2_files):
    config = json.loads(os.pread(smollm2_files["llm_config.json"], 1 << 20, 0))
    del config["jinja"]
    files = _replaced(smollm2_files, "llm_config.json", json.dumps(config).encode())
    try:
        with LlmSession(files) as bare:
            with pytest.raises(InvalidInput, match="no chat template"):
                bare.apply_chat_template(QUESTION)
            text, _ = _generate(bare, bare.encode("The capital of France is"), max_new_tokens=3)
            assert text
    finally:
        os.close(files["llm_config.json"])


def test_a_corrupt_graph_is_a_load_error(smollm2_files):
    files = _replaced(smollm2_files, "llm.mnn", b"\0" * 1000)
    try:
        with pytest.raises(ModelLoadError, match="could not load"):
            LlmSession(files)
    finally:
        os.close(files["llm.mnn"])
