"""A GGUF file's SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`: tokens, scores and
token types, as llama.cpp's converter writes them from a tokenizer.model) gives a working
tokenizer from the metadata alone: encode and decode equal to sentencepiece's own on the model
the file was written from (a tiny BPE model trained here, byte fallback on, as Llama's)."""

from __future__ import annotations

import io

import pytest

gguf = pytest.importorskip("gguf")
spm = pytest.importorskip("sentencepiece")

from hetserve.errors import ModelLoadError  # noqa: E402
from hetserve.model.tokenizer import Tokenizer  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts out of many.",
    "llama.cpp reads GGUF files; hetserve reads them too, tensor by tensor.",
    "In 2026 the experts stayed in their blocks: q4_K, q6_K and q8_0 alike.",
    "She sells sea shells by the sea shore, and the shells she sells are sea shells.",
    "Numbers like 3.14159 and 42 and 1,000,000 appear in text as well.",
] * 20
TEXTS = [
    "The lazy fox routes tokens to experts.",
    "  two leading spaces, and  double  spaces inside ",
    "tabs\tand\nnewlines\n\nstay",
    "unseen characters: é, ü, 中文, and an emoji 🙂 fall back to bytes",
    "42 experts, 3.5 bits, 1,000,000 tokens",
    "",
    " ",
]


def _trained() -> spm.SentencePieceProcessor:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=320,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        user_defined_symbols=["<tool>"], minloglevel=2,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _write(sp: spm.SentencePieceProcessor, path, **keys) -> None:
    """The tokenizer metadata llama.cpp's converter writes for a SentencePiece model."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                     else 6 if sp.is_byte(i) else 4 if tokens[-1] == "<tool>" else 1)  # fmt: skip
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(keys.get("model", "llama"))
    writer.add_token_list(tokens)
    if keys.get("scores", True):
        writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):  # fmt: skip
        step()


@pytest.fixture(scope="module")
def sp_and_file(tmp_path_factory):
    sp = _trained()
    path = tmp_path_factory.mktemp("spm") / "model.gguf"
    _write(sp, path)
    return sp, path


def test_encode_and_decode_equal_sentencepiece(sp_and_file):
    sp, path = sp_and_file
    ours = Tokenizer(path)
    for text in TEXTS:
        theirs = sp.encode(text)
        assert ours.encode(text) == [sp.bos_id(), *theirs], text
        assert ours.encode(text, add_special_tokens=False) == theirs, text
        assert ours.decode([sp.bos_id(), *theirs]) == sp.decode(theirs) == text, text
    bytes_used = [i for i in sp.encode(TEXTS[3]) if sp.is_byte(i)]
    assert bytes_used  # the emoji and the CJK characters went through byte fallback
    assert ours.eos_token_ids == (sp.eos_id(),) and ours.bos_token == "<s>"


def test_user_defined_pieces_stay_whole(sp_and_file):
    """A user-defined piece is matched whole; the text after it starts a new stretch with its
    own space prefix, as llama.cpp tokenizes it (sentencepiece, one string, would not)."""
    sp, path = sp_and_file
    tool = sp.piece_to_id("<tool>")
    ours = Tokenizer(path).encode("call <tool> now", add_special_tokens=False)
    assert ours == [*sp.encode("call "), tool, *sp.encode(" now")]


def test_a_llama_vocab_without_scores_is_one_line(sp_and_file, tmp_path):
    sp, _ = sp_and_file
    _write(sp, tmp_path / "bad.gguf", scores=False)
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.scores") as exc:
        Tokenizer(tmp_path / "bad.gguf")
    assert "\n" not in str(exc.value)
    _write(sp, tmp_path / "t5.gguf", model="t5")
    with pytest.raises(ModelLoadError, match="'t5'.*supported: llama"):
        Tokenizer(tmp_path / "t5.gguf")


def test_encode_equals_llama_cpp_on_the_same_file(sp_and_file):
    """llama.cpp's own tokenizer on the file (vocabulary only), special tokens parsed."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")
    sp, path = sp_and_file
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    ours = Tokenizer(path)
    for text in [*TEXTS, "call <tool> now", "<tool>x"]:
        assert ours.encode(text) == theirs.tokenize(text.encode(), add_bos=True, special=True)
