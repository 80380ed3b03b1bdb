"""GGUF vocabularies (SentencePiece 'llama' and byte-level 'gpt2') trained here with `tokenizers`, written with
GGUFWriter, read by inferlab: the same ids as the trained `tokenizers` model and as transformers' own GGUF
tokenizer, and text back unchanged, on a unicode corpus."""

import json

import gguf
import pytest
from gguf_writer import finish
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from inferlab.model.gguf_loader import read_gguf_fields
from inferlab.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "tabs\tand\nnewlines\n\n\n",
    "naïve café — déjà vu",
    "日本語のテキスト",
    "emoji 🤖🚀 mix",
    "numbers 1234567890 3.14159",
    "a    b     c",
    "def f(x):\n    return x ** 2\n",
    "trailing  ",
    "Привет, мир! Ελληνικά. עברית. العربية",
    "Zalgo: Z̷̢a̶l̸g̵o",
    "한국어 텍스트와 ไทย",
    "x",
    "ümlaut\u00a0nbsp",
    "ﬁligature 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<s> not special in text </s>",
    "mixed\r\nline\rendings",
]
CORPUS = [line for text in TEXTS for line in text.splitlines()] + [
    "the quick brown fox jumps over the lazy dog",
    "Tokenizers merge frequent pairs of symbols into new symbols.",
    "Les élèves étudient à l'école; die Straße ist naß.",
    "数据 处理 与 模型 训练",
    "🙂🙃😉 emoji everywhere",
] * 5
SPECIAL = ["<unk>", "<s>", "</s>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüß dich 👋"}]
BYTES = [f"<0x{i:02X}>" for i in range(256)]


def write_vocab(path, vocab: dict, arch: str):
    return finish(gguf.GGUFWriter(str(path), arch), vocab, path)


def sentencepiece_bpe() -> HFTokenizer:
    """A SentencePiece-style BPE: '▁' for spaces, a prefix space on the first word, byte fallback."""
    backend = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIAL + BYTES, limit_alphabet=150, show_progress=False),
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    return backend


def byte_level_bpe() -> HFTokenizer:
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=700,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return backend


def gguf_fields(kind: str, backend: HFTokenizer) -> dict:
    tokens = [backend.id_to_token(i) for i in range(backend.get_vocab_size())]
    if kind == "llama":  # scores in merge order (a trained BPE numbers its tokens so), as SentencePiece BPE keeps them
        types = [2 if t == "<unk>" else 3 if t in SPECIAL else 6 if t in BYTES else 1 for t in tokens]
        return dict(
            model="llama",
            tokens=tokens,
            token_type=types,
            scores=[-float(i) for i in range(len(tokens))],
            unk=0,
            bos=1,
            eos=2,
            add_bos=False,
            chat_template=TEMPLATE,
        )
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(backend.to_str())["model"]["merges"]]
    return dict(
        model="gpt2",
        tokens=tokens,
        token_type=[3 if t == "<|endoftext|>" else 1 for t in tokens],
        merges=merges,
        eos=0,
        add_bos=False,
        chat_template=TEMPLATE,
    )


# (tokenizer.ggml.model, general.architecture): Gemma and Phi-3 spell spaces their own way (model/gguf_vocab.py)
VARIANTS = [("llama", "llama"), ("gpt2", "llama"), ("llama", "gemma3"), ("llama", "phi3")]


@pytest.fixture(scope="module", params=VARIANTS, ids=["-".join(v) for v in VARIANTS])
def vocab(request, tmp_path_factory):
    kind, arch = request.param
    backend = sentencepiece_bpe() if kind == "llama" else byte_level_bpe()
    path = write_vocab(tmp_path_factory.mktemp(kind) / "vocab.gguf", gguf_fields(kind, backend), arch)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # the trained pipeline is the reference where the file's reading is the plain one
    return backend if arch == "llama" else None, reference, Tokenizer.from_gguf_fields(read_gguf_fields(path))


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_vocab_encodes_like_tokenizers_and_transformers(vocab, text):
    backend, reference, ours = vocab
    ids = ours.encode(text)
    if backend is not None:
        assert ids == backend.encode(text, add_special_tokens=False).ids
    assert ids == reference.encode(text, add_special_tokens=False)
    decoded = ours.decode(ids, skip_special=False)
    assert decoded == reference.decode(ids)
    if "<s>" not in text:  # Phi-3's normalizer gives the text after a control token its own prefix space
        assert decoded == text


def test_gguf_chat_template_renders_like_transformers(vocab):
    _, reference, ours = vocab
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(MESSAGES) == expected
