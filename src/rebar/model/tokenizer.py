"""Tokenizers built from a GGUF file's metadata or an HF `tokenizer.json`.

The `tokenizers` library is the BPE/WordPiece engine; this module decides how it is assembled
(vocabulary, merges, pre-tokenizer regex, special tokens) so that token ids match the reference
implementation of each format: llama.cpp for GGUF, the `tokenizer.json` itself for HF folders.

GGUF files carry two kinds: byte-level BPE (`gpt2`: merges in the file) and SentencePiece (`llama`,
as Gemma's: a score per token, spaces written as "▁", bytes outside the vocabulary as <0xXX>
tokens). llama.cpp tokenizes the latter by repeatedly merging the adjacent pair whose joined text is
the highest-scoring token; a BPE whose merges are every such pair, ranked by that score (ties by the
pieces' ids, as Hugging Face's own SentencePiece conversion does), takes the same merges.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from rebar.errors import ModelFormatError, UnsupportedModelError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_only() -> pre_tokenizers.PreTokenizer:
    # GPT-2's own split regex, applied by the ByteLevel pre-tokenizer itself.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    # StarCoder/SmolLM: every digit is its own pre-token, then GPT-2's regex.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level_only()]
    )


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# GGUF `tokenizer.ggml.pre` names (as llama.cpp's converter writes them) -> pre-tokenizer.
_GGUF_PRE_TOKENIZERS = {
    "default": _byte_level_only,
    "gpt-2": _byte_level_only,
    "gpt2": _byte_level_only,
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
    "refact": _digits_then_byte_level,
    "codeshell": _digits_then_byte_level,
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}


@dataclass(frozen=True)
class SpecialTokens:
    """Ids and strings a generator needs; any of them may be absent in a checkpoint."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token: str
    eos_token: str
    add_bos: bool


class Tokenizer:
    """Text <-> token ids for one model.

    `encode` never adds BOS/EOS (callers decide); special tokens written in the text, such as
    `<|im_start|>`, are matched as single special ids. `decode` is the exact inverse of the
    byte-level encoding, so `decode(encode(s)) == s` for any string.
    """

    def __init__(self, backend: BackendTokenizer, special: SpecialTokens, kind: str = "") -> None:
        self._backend = backend
        self.special = special
        self._kind = kind
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(
            token_id for token_id, token in added.items() if token.special
        )
        texts = sorted(
            {token.content for token in added.values() if token.special and token.content},
            key=len,
            reverse=True,
        )
        self._special_pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._text_backend: BackendTokenizer | None = None
        self._full_backend: BackendTokenizer | None = None  # without the truncation, if set

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the model's post-processor (BERT's
        [CLS]/[SEP])."""
        return _encode_one(self._backend, text, add_special_tokens)

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of `text` with any special token written in it ("<|im_start|>") spelled out
        as ordinary text: what a user typed can never become a control token."""
        if self._text_backend is None:
            # A private copy: the flag is the backend's state, and the shared one must keep
            # matching.
            self._text_backend = BackendTokenizer.from_str(self._backend.to_str())
            self._text_backend.encode_special_tokens = True
        return _encode_one(self._text_backend, text, False)

    def holds_special_text(self, text: str) -> bool:
        """True when `text` contains the written form of a special token."""
        return self._special_pattern is not None and self._special_pattern.search(text) is not None

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False, truncated: bool = True
    ) -> list[list[int]]:
        """Token ids of each text; `truncated` False ignores `set_truncation` (to measure what
        an input would be whole)."""
        backend = self._backend
        if not truncated and backend.truncation is not None:
            if self._full_backend is None:
                self._full_backend = BackendTokenizer.from_str(backend.to_str())
                self._full_backend.no_truncation()
            backend = self._full_backend
        encodings = backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def backend_json(self) -> str:
        """The whole tokenizer as Hugging Face `tokenizer.json` text (what grammar libraries read
        to learn each token's bytes)."""
        return self._backend.to_str()

    def set_truncation(self, max_length: int) -> None:
        """Truncate encodings (post-processor tokens included) to `max_length`; used by encoders."""
        self._backend.enable_truncation(max_length)

    def save_hf_files(self, folder: Path, chat_template: str | None = None) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` so that `from_hf_folder(folder,
        eos_token_ids=self.special.eos_token_ids)` rebuilds this tokenizer; the chat template (if
        any) goes into the config, where HF folders keep it."""
        self._backend.save(str(folder / "tokenizer.json"))
        config: dict[str, object] = {
            "bos_token": self.special.bos_token or None,
            "eos_token": self.special.eos_token or None,
            "add_bos_token": self.special.add_bos,
        }
        if chat_template is not None:
            config["chat_template"] = chat_template
        (folder / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8"
        )

    @property
    def kind(self) -> str:
        """What kind of tokenizer this is, for `rebar inspect` (e.g. "SentencePiece (GGUF 'llama'),
        byte fallback")."""
        return self._kind or type(self._backend.model).__name__

    @classmethod
    def from_gguf_vocab(
        cls,
        model: str,
        pre: str,
        tokens: Sequence[str],
        token_types: Sequence[int] | None,
        merges: Sequence[str],
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        scores: Sequence[float] | None = None,
        unknown_token_id: int | None = None,
        add_space_prefix: bool = True,
        end_of_turn_ids: Sequence[int] = (),
    ) -> Tokenizer:
        """Assemble a byte-level BPE (`gpt2`) or SentencePiece (`llama`, with `scores`) tokenizer
        the way llama.cpp reads the same metadata. Generation ends at the end-of-sequence token, at
        `end_of_turn_ids` (the file's end-of-turn / end-of-message ids) and, as in llama.cpp, at any
        token spelled like a chat format's end of turn (Gemma's `<end_of_turn>`, ChatML's
        `<|im_end|>`): files often name only `<eos>`, which a chat reply never reaches."""
        vocab = {token: index for index, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ModelFormatError("GGUF vocabulary has duplicate tokens")
        if model == "gpt2":
            backend = _byte_level_bpe(vocab, merges, pre)
            kind = f"byte-level BPE (GGUF 'gpt2', pre-tokenizer {pre!r})"
        elif model == "llama":
            if scores is None or len(scores) != len(tokens):
                raise ModelFormatError(
                    "a SentencePiece ('llama') GGUF vocabulary needs one score per token"
                )
            backend = _sentencepiece_bpe(vocab, tokens, scores, unknown_token_id, add_space_prefix)
            kind = "SentencePiece (GGUF 'llama'), byte fallback"
        else:
            raise UnsupportedModelError(
                f"GGUF tokenizer model {model!r} is not supported (rebar reads "
                "'gpt2' byte-level BPE and 'llama' SentencePiece vocabularies)"
            )
        _add_typed_tokens(backend, tokens, token_types)
        special = SpecialTokens(
            bos_token_id=bos_token_id,
            eos_token_ids=_end_of_generation_ids(vocab, eos_token_id, end_of_turn_ids),
            bos_token=tokens[bos_token_id] if bos_token_id is not None else "",
            eos_token=tokens[eos_token_id] if eos_token_id is not None else "",
            add_bos=add_bos,
        )
        return cls(backend, special, kind)

    @classmethod
    def from_hf_folder(cls, folder: Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load `tokenizer.json`; special-token strings and BOS policy come from
        `tokenizer_config.json`."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise UnsupportedModelError(
                f"{folder} has no tokenizer.json (only fast tokenizers are supported)"
            )
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on malformed JSON
            raise ModelFormatError(f"cannot read {path}: {exc}") from exc
        # Padding and truncation baked into tokenizer.json would corrupt ids and masks silently;
        # callers pad batches and check lengths themselves.
        backend.no_padding()
        backend.no_truncation()
        config = read_tokenizer_config(folder)
        bos_token = _token_string(config.get("bos_token"))
        eos_token = _token_string(config.get("eos_token"))
        bos_id = backend.token_to_id(bos_token) if bos_token else None
        eos_ids = list(eos_token_ids)
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.insert(0, eos_id)
        special = SpecialTokens(
            bos_token_id=bos_id,
            eos_token_ids=tuple(eos_ids),
            bos_token=bos_token,
            eos_token=eos_token,
            add_bos=bool(config.get("add_bos_token", False)) and bos_id is not None,
        )
        return cls(backend, special)


# Tokens that end a turn in common chat formats; llama.cpp ends generation at each (its EOG set).
END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
)


# Past this many characters a text goes through `encode_batch`: the backend's single `encode` holds
# the GIL for the whole call (a megabyte: half a second in which no other thread of the server
# runs), its batch form releases it. Both give the same ids.
_GIL_FREE_CHARS = 4096


def _encode_one(backend: BackendTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= _GIL_FREE_CHARS:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _end_of_generation_ids(
    vocab: dict[str, int], eos_token_id: int | None, end_of_turn_ids: Sequence[int]
) -> tuple[int, ...]:
    ids = [] if eos_token_id is None else [eos_token_id]
    ids += [i for i in end_of_turn_ids if i not in ids]
    ids += [vocab[text] for text in END_OF_TURN_TEXTS if text in vocab and vocab[text] not in ids]
    return tuple(ids)


def _byte_level_bpe(vocab: dict[str, int], merges: Sequence[str], pre: str) -> BackendTokenizer:
    make_pre = _GGUF_PRE_TOKENIZERS.get(pre)
    if make_pre is None:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(_GGUF_PRE_TOKENIZERS)}"
        )
    merge_pairs = []
    for line in merges:
        left, sep, right = line.partition(" ")
        if not sep:
            raise ModelFormatError(f"GGUF merge {line!r} is not two space-separated tokens")
        merge_pairs.append((left, right))
    try:
        model = BPE(vocab, merge_pairs, fuse_unk=False, byte_fallback=False)
    except (
        Exception
    ) as exc:  # the library raises a bare Exception for a merge of tokens not in the vocabulary
        raise ModelFormatError(f"GGUF merges do not fit the vocabulary: {exc}") from exc
    backend = BackendTokenizer(model)
    backend.pre_tokenizer = make_pre()
    backend.decoder = decoders.ByteLevel()
    return backend


SPACE = "\u2581"  # SentencePiece's visible space


def _sentencepiece_bpe(
    vocab: dict[str, int],
    tokens: Sequence[str],
    scores: Sequence[float],
    unknown_token_id: int | None,
    add_space_prefix: bool,
) -> BackendTokenizer:
    """llama.cpp's SentencePiece tokenization as a BPE: see the module docstring."""
    candidates = []
    for token, score in zip(tokens, scores):
        for split in range(1, len(token)):
            left, right = token[:split], token[split:]
            left_id, right_id = vocab.get(left), vocab.get(right)
            if left_id is not None and right_id is not None:
                candidates.append((-score, left_id, right_id))
    candidates.sort()
    merge_pairs = [(tokens[left], tokens[right]) for _, left, right in candidates]
    unk = tokens[unknown_token_id] if unknown_token_id is not None else None
    backend = BackendTokenizer(
        BPE(vocab, merge_pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(SPACE, 1, 0)] if add_space_prefix else [])
    )
    return backend


def read_tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (
        UnicodeDecodeError,
        ValueError,
    ) as exc:  # ValueError: JSONDecodeError, or an integer of 4,300+ digits
        raise ModelFormatError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelFormatError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def _token_string(value: object) -> str:
    # tokenizer_config.json stores special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _add_typed_tokens(
    backend: BackendTokenizer, tokens: Sequence[str], token_types: Sequence[int] | None
) -> None:
    """Control and unknown tokens as special tokens, user-defined ones as added text tokens."""
    types = list(token_types) if token_types is not None else [TOKEN_TYPE_NORMAL] * len(tokens)
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(types)
            if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(types)
            if kind == TOKEN_TYPE_USER_DEFINED
        ]
    )
