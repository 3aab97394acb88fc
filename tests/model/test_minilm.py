"""all-MiniLM-L6-v2 embeddings against an independent reference: transformers' BertModel + mean
pooling."""

from __future__ import annotations

import pytest
import torch

from needs import need_module
from rebar.errors import InvalidRequestError

transformers = need_module("transformers")

TEXTS = [
    "A man is eating food.",
    "hello",
    "The quick brown fox jumps over the lazy dog, then naps in the afternoon sun for a while.",
    "Déjà vu: ça arrive à tout le monde.",
    "東京は日本の首都です。",
    "",
]


def reference_embeddings(folder: str, texts: list[str]) -> torch.Tensor:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def test_embeddings_match_transformers(minilm) -> None:
    ours = minilm.embed(TEXTS)
    reference = reference_embeddings(str(minilm.checkpoint.path), TEXTS)
    assert ours.shape == (len(TEXTS), 384)
    cosine = torch.nn.functional.cosine_similarity(ours, reference)
    assert cosine.min() >= 0.9999, cosine
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)


def test_long_input_is_truncated_like_the_reference(minilm) -> None:
    text = "word " * 600
    ours = minilm.embed([text])
    reference = reference_embeddings(str(minilm.checkpoint.path), [text])
    assert torch.nn.functional.cosine_similarity(ours, reference).item() >= 0.9999


def test_batching_does_not_change_a_vector(minilm) -> None:
    alone = minilm.embed([TEXTS[0]])
    together = minilm.embed(TEXTS, batch_size=4)
    assert torch.allclose(alone[0], together[0], atol=1e-5)


def test_related_sentences_are_closer_than_unrelated(minilm) -> None:
    a, b, c = minilm.embed(
        ["A man is eating food.", "Someone is having a meal.", "The stock market fell today."]
    )
    assert a @ b > a @ c + 0.2


@pytest.mark.parametrize("bad", [[], [1, 2], None])
def test_bad_input_is_rejected(minilm, bad) -> None:
    with pytest.raises(InvalidRequestError):
        minilm.embed(bad)
