import hashlib

import pytest

from inference import tokenizer


def test_packaged_vocab_is_openais():
    path = tokenizer.PACKAGED_VOCAB_DIR / tokenizer.VOCAB_FILE
    assert hashlib.sha256(path.read_bytes()).hexdigest() == tokenizer.VOCAB_SHA256


def test_harmony_special_tokens_and_round_trip():
    enc = tokenizer.harmony_encoding()
    assert set(enc.stop_tokens_for_assistant_actions()) == set(tokenizer.ASSISTANT_STOP_TOKENS)
    ids = tokenizer.encode_text("Hello, world! ünïcödé")
    assert tokenizer.decode_tokens(ids) == "Hello, world! ünïcödé"
    assert enc.encode("<|call|>", allowed_special="all") == [tokenizer.CALL]


def test_corrupt_vocab_is_refused(tmp_path, monkeypatch):
    (tmp_path / tokenizer.VOCAB_FILE).write_bytes(b"not the vocabulary")
    tokenizer._check_vocab.cache_clear()
    with pytest.raises(tokenizer.VocabularyError, match="sha256"):
        tokenizer._check_vocab(tmp_path / tokenizer.VOCAB_FILE)
    with pytest.raises(tokenizer.VocabularyError, match="not found"):
        tokenizer._check_vocab(tmp_path / "missing" / tokenizer.VOCAB_FILE)
