"""The requests `rebar bench spec` sends: answers grounded in a given text, and free-form chat.

Grounded requests give the model a text and ask for an answer that repeats much of it: a function
rewritten with a variable renamed, the sentences of a passage that mention something, a summary of
a passage. Their answers copy long spans of their prompts, which is what n-gram drafts predict.
Free-form chat asks open questions whose answers copy nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

FUNCTION = '''def merge_intervals(intervals, gap=0):
    """Merge overlapping intervals; intervals closer than `gap` are merged too."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1] + gap:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    total = 0
    for start, end in merged:
        total += end - start
    return [tuple(pair) for pair in merged], total
'''

PASSAGE = (
    "The harbour town grew around a single stone quay built by fishermen in the early years. "
    "Ships from the northern ports brought timber, and the timber built the first warehouses "
    "along the water. When the railway arrived, the warehouses were joined by a station and a "
    "row of hotels for travellers waiting on the tides. The fishermen kept their boats at the "
    "old quay, while the merchants moved their trade to a new deep-water pier. A storm in the "
    "winter of the great flood broke the new pier in two, and for a whole season the merchants "
    "had to share the old quay with the fishermen again. The town council then paid for a "
    "breakwater of granite blocks, which still shelters the harbour today. Visitors now come "
    "for the lighthouse at the end of the breakwater, the fish market on the quay, and the "
    "walk along the cliffs to the ruined watchtower above the bay."
)


@dataclass(frozen=True)
class SpecRequest:
    """One request of the benchmark: its kind, and the user message."""

    kind: str
    message: str


GROUNDED = (
    SpecRequest(
        "rename",
        "Rewrite this Python function with the variable `merged` renamed to `joined`. "
        "Change nothing else and answer with the whole function only.\n\n" + FUNCTION,
    ),
    SpecRequest(
        "extract",
        "Copy, word for word, every sentence of the following text that mentions the quay. "
        "Answer with those sentences only.\n\n" + PASSAGE,
    ),
    SpecRequest(
        "summarise",
        "Summarise the following passage in a few sentences, keeping its own words where you "
        "can.\n\n" + PASSAGE,
    ),
)

CHAT = (
    SpecRequest("chat", "What are three good habits for someone learning to cook at home?"),
    SpecRequest("chat", "Explain in simple words why the sky looks blue during the day."),
    SpecRequest("chat", "Give me some ideas for a quiet weekend in the countryside."),
    SpecRequest("chat", "How does a bicycle stay upright when it is moving?"),
)
