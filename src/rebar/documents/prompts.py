"""What the model is asked at each step of a summary, one definition per step and style. The text
comes first and the instruction after it: a small model follows an instruction it has just read,
and one placed before a long text is often lost (it then edits or continues the text instead)."""

from __future__ import annotations

from typing import Literal

Style = Literal["abstract", "key_points", "per_section"]
STYLES: tuple[Style, ...] = ("abstract", "key_points", "per_section")

SYSTEM = "You summarise documents accurately and briefly, using only facts the text states."

CHUNK = (
    "{text}\n\nSummarise the text above in two or three sentences. Keep its names, numbers and "
    "key terms."
)
COMBINE = (
    "{text}\n\nCombine the summaries above into one summary of three or four sentences that "
    "keeps the main facts and key terms."
)
FINAL: dict[Style, str] = {
    "abstract": (
        "{text}\n\nWrite a short abstract of the text above in three to five sentences: what it "
        "is about and its main points."
    ),
    "key_points": (
        "{text}\n\nList the five most important points of the text above, one per line, each "
        'starting with "- " and written as a full sentence.'
    ),
    "per_section": "{text}\n\nSummarise this section of a document in two or three sentences.",
}


def messages(instruction: str, text: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": instruction.format(text=text)},
    ]


def longest_instruction() -> str:
    """The instruction with the most text: what every request's overhead is measured on."""
    return max([CHUNK, COMBINE, *FINAL.values()], key=len)
