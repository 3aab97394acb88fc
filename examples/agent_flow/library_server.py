"""The example's own MCP server (stdio, offline): `search` finds the passages of a folder of text
files that share the most words with a query; `format_report` lays the flow's results out as
Markdown. Run by rebar as a configured server:

    [[mcp.servers]]
    label = "library"
    command = "python"
    args = ["examples/agent_flow/library_server.py", "examples/agent_flow/library"]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer

WORD = re.compile(r"[a-z]+")
server = MCPServer("library")
FOLDER = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("library")


def _words(text: str) -> set[str]:
    return {w for w in WORD.findall(text.lower()) if len(w) > 3}


@server.tool()
def search(query: str, limit: int = 2) -> str:
    """Search the library's text files; the best passages, each with its file name."""
    wanted = _words(query)
    scored = []
    for path in sorted(FOLDER.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        scored.append((len(wanted & _words(text)), path.name, " ".join(text.split())))
    best = [entry for entry in sorted(scored, key=lambda e: -e[0]) if entry[0] > 0]
    if not best:
        return "no passage matches"
    return "\n".join(f"[{name}] {text}" for _, name, text in best[: max(1, min(limit, 5))])


@server.tool()
def format_report(title: str, summary: str, translation: str) -> str:
    """The flow's results as a Markdown report."""
    return f"# {title}\n\n## Summary\n\n{summary}\n\n## Traduction\n\n{translation}\n"


if __name__ == "__main__":
    server.run("stdio")
