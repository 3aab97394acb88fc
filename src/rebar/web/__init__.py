"""The chat page, as built files; its TypeScript sources live in web/ at the repository root.

The build is committed under `static/`, so serving the page needs no Node.js.
"""

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
