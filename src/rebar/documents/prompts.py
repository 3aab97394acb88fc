"""What the model is asked at each step of a summary, one definition per step and style."""

from __future__ import annotations

from typing import Literal

Style = Literal["abstract", "key_points", "per_section"]
STYLES: tuple[Style, ...] = ("abstract", "key_points", "per_section")

SYSTEM = "You summarise documents accurately and briefly, using only facts the text states."

CHUNK = (
    "Summarise this part of a document in two or three sentences. Keep the names, numbers and "
    "key terms it uses.\n\n{text}"
)
COMBINE = (
    "These are summaries of consecutive parts of one document. Combine them into one summary of "
    "three or four sentences that keeps the main facts and key terms.\n\n{text}"
)
FINAL: dict[Style, str] = {
    "abstract": (
        "Write a short abstract of this {what} in three to five sentences. Say what it is about "
        "and its main points.\n\n{text}"
    ),
    "key_points": (
        "List the five most important points of this {what}, one per line, each starting with "
        '"- " and written as a full sentence.\n\n{text}'
    ),
    "per_section": "Summarise this section of a document in two or three sentences.\n\n{text}",
}


def messages(instruction: str, text: str, what: str = "document") -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": instruction.format(text=text, what=what)},
    ]


def longest_instruction() -> str:
    """The instruction with the most text: what every request's overhead is measured on."""
    return max([CHUNK, COMBINE, *FINAL.values()], key=len)
