"""Documents in, summaries out: local text extraction (PDF, Markdown, plain text, HTML, DOCX),
chunking on the document's structure, and a hierarchical summariser over a generating model."""
