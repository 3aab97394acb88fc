"""Documents written by the tests themselves: PDFs with fpdf2 (text, outline, encrypted, no text
layer), DOCX with python-docx. pypdf and python-docx then read them back as rebar does."""

from __future__ import annotations

import io
from collections.abc import Sequence

import docx
from fpdf import FPDF
from fpdf.enums import EncryptionMethod


def pdf_bytes(
    pages: Sequence[str],
    sections: dict[int, str] | None = None,
    user_password: str | None = None,
) -> bytes:
    """One page per text; `sections` maps a 0-based page to an outline entry starting there."""
    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    if user_password is not None:
        pdf.set_encryption(
            owner_password="owner",
            user_password=user_password,
            encryption_method=EncryptionMethod.RC4,
        )
    for index, text in enumerate(pages):
        pdf.add_page()
        if sections and index in sections:
            pdf.start_section(sections[index])
        for paragraph in text.split("\n\n"):
            pdf.multi_cell(0, 6, paragraph)
            pdf.ln(6)
    return bytes(pdf.output())


def scanned_pdf_bytes(num_pages: int) -> bytes:
    """Pages with drawings and no text: what a scan looks like to a text extractor."""
    pdf = FPDF()
    for _ in range(num_pages):
        pdf.add_page()
        pdf.rect(20, 20, 100, 60, style="F")
    return bytes(pdf.output())


def docx_bytes(items: Sequence[tuple[str, str]]) -> bytes:
    """(kind, text) items: "h1"/"h2" headings, "p" paragraphs, "break" a page break."""
    document = docx.Document()
    for kind, text in items:
        if kind == "break":
            document.add_page_break()
        elif kind.startswith("h"):
            document.add_heading(text, level=int(kind[1:]))
        else:
            document.add_paragraph(text)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()
