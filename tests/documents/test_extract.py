"""Extraction: every format read into blocks with their pages and headings, and every file rebar
cannot read refused with the error that names its problem."""

from __future__ import annotations

import io
import zipfile

import pytest
from tests.documents.files import docx_bytes, pdf_bytes, scanned_pdf_bytes

from rebar.documents.errors import (
    DocumentNotAllowed,
    DocumentNotFound,
    DocumentTooLarge,
    EmptyDocument,
    EncryptedDocument,
    MalformedDocument,
    NoTextLayer,
    UnsupportedDocument,
)
from rebar.documents.extract import read_document, read_path, resolve_under
from rebar.documents.model import DocumentLimits

LIMITS = DocumentLimits(max_bytes=2**20, max_pages=50)


def test_pdf_pages_and_outline_headings() -> None:
    pages = [
        "Bees gather nectar.\n\nThe hive stores honey.",
        "Wax cells hold the brood.",
        "Swarms leave in spring.",
    ]
    document = read_document("bees.pdf", pdf_bytes(pages, {0: "Foraging", 2: "Swarming"}), LIMITS)
    assert document.kind == "pdf" and document.num_pages == 3
    text = [(b.page, b.section, b.text) for b in document.blocks if not b.is_heading]
    assert text == [
        (1, "Foraging", "Bees gather nectar."),
        (1, "Foraging", "The hive stores honey."),
        (2, "Foraging", "Wax cells hold the brood."),
        (3, "Swarming", "Swarms leave in spring."),
    ]
    assert document.sections == ["Foraging", "Swarming"]
    assert "brood" in document.page_text(2) and "brood" not in document.page_text(1)


def test_pdf_with_a_password_is_refused() -> None:
    data = pdf_bytes(["secret plans"], user_password="hunter2")
    with pytest.raises(EncryptedDocument, match="password"):
        read_document("locked.pdf", data, LIMITS)


def test_pdf_with_owner_restrictions_only_is_read() -> None:
    data = pdf_bytes(["open to read"], user_password="")
    assert read_document("open.pdf", data, LIMITS).blocks[0].text == "open to read"


def test_scanned_pdf_has_no_text_layer() -> None:
    with pytest.raises(NoTextLayer, match=r"3 pages .* no OCR"):
        read_document("scan.pdf", scanned_pdf_bytes(3), LIMITS)


def test_pdf_past_the_page_bound() -> None:
    data = pdf_bytes([f"page {i}" for i in range(6)])
    with pytest.raises(DocumentTooLarge, match="6 pages, more than the 5 allowed"):
        read_document("long.pdf", data, DocumentLimits(max_bytes=2**20, max_pages=5))


@pytest.mark.parametrize(
    "data",
    [b"%PDF-1.7\nthis is not a pdf", pdf_bytes(["cut short"])[:300]],
    ids=["garbage", "truncated"],
)
def test_malformed_pdf(data: bytes) -> None:
    with pytest.raises((MalformedDocument, NoTextLayer, EmptyDocument)) as caught:
        read_document("broken.pdf", data, LIMITS)
    assert "broken.pdf" in str(caught.value)


def test_bytes_past_the_bound_are_refused_before_parsing() -> None:
    with pytest.raises(DocumentTooLarge, match="2000 bytes, more than the 1024 allowed"):
        read_document("big.txt", b"a" * 2000, DocumentLimits(max_bytes=1024, max_pages=5))


@pytest.mark.parametrize("data", [b"", b"  \n\t\n"], ids=["zero-bytes", "whitespace"])
def test_empty_files(data: bytes) -> None:
    with pytest.raises(EmptyDocument, match="empty"):
        read_document("nothing.txt", data, LIMITS)


def test_html_without_text_is_empty() -> None:
    with pytest.raises(EmptyDocument, match="no text"):
        read_document("blank.html", b"<html><script>var x = 1;</script></html>", LIMITS)


def test_markdown_headings_paragraphs_and_code() -> None:
    text = "# Bees\n\nWorkers forage\nall day.\n\nDrones\n------\n\n```\n# not a heading\n```\n\fNext page text.\n"
    document = read_document("notes.md", text.encode(), LIMITS)
    blocks = [(b.page, b.section, b.is_heading, b.text) for b in document.blocks]
    assert blocks == [
        (1, "Bees", True, "Bees"),
        (1, "Bees", False, "Workers forage all day."),
        (1, "Drones", True, "Drones"),
        (1, "Drones", False, "``` # not a heading ```"),
        (2, "Drones", False, "Next page text."),
    ]
    assert document.num_pages == 2


def test_plain_text_pages_on_form_feeds() -> None:
    document = read_document("a.txt", b"one\n\ntwo\fthree", LIMITS)
    assert [(b.page, b.text) for b in document.blocks] == [(1, "one"), (1, "two"), (2, "three")]


def test_text_that_is_not_utf8() -> None:
    with pytest.raises(MalformedDocument, match=r"not UTF-8 text .*0xff"):
        read_document("latin.txt", b"caf\xff au lait", LIMITS)


def test_html_headings_and_paragraphs_without_scripts() -> None:
    html = (
        b"<html><head><title>t</title><style>p {}</style></head><body><h1>Hives</h1>"
        b"<p>Frames hold <b>comb</b>.</p><ul><li><p>Smoke calms bees.</p></li></ul>"
        b"<script>alert(1)</script><h2>Honey</h2><p>Extracted in summer.</p></body></html>"
    )
    document = read_document("page.html", html, LIMITS)
    blocks = [(b.section, b.is_heading, b.text) for b in document.blocks]
    assert blocks == [
        ("Hives", True, "Hives"),
        ("Hives", False, "Frames hold comb ."),
        ("Hives", False, "Smoke calms bees."),
        ("Honey", True, "Honey"),
        ("Honey", False, "Extracted in summer."),
    ]


def test_docx_headings_and_page_breaks() -> None:
    data = docx_bytes(
        [
            ("h1", "Queens"),
            ("p", "One queen per colony."),
            ("break", ""),
            ("h2", "Mating"),
            ("p", "She mates in flight."),
        ]
    )
    document = read_document("hive.docx", data, LIMITS)
    blocks = [(b.page, b.section, b.is_heading, b.text) for b in document.blocks]
    assert blocks == [
        (1, "Queens", True, "Queens"),
        (1, "Queens", False, "One queen per colony."),
        (2, "Mating", True, "Mating"),
        (2, "Mating", False, "She mates in flight."),
    ]


def test_docx_that_is_not_a_zip() -> None:
    with pytest.raises(MalformedDocument, match="not a readable DOCX"):
        read_document("bad.docx", b"PK\x03\x04 but nothing more", LIMITS)


def test_zip_without_a_word_document() -> None:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("hello.txt", "hi")
    with pytest.raises(MalformedDocument, match="not a readable DOCX"):
        read_document("other.docx", out.getvalue(), LIMITS)


def test_docx_zip_bomb() -> None:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("word/document.xml", b"\0" * (8 * 2**20))
    with pytest.raises(DocumentTooLarge, match="zip bomb"):
        read_document("bomb.docx", out.getvalue(), LIMITS)


def test_password_protected_office_file() -> None:
    data = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + b"\0" * 512
    with pytest.raises(EncryptedDocument, match="password-protected"):
        read_document("locked.docx", data, LIMITS)


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("photo.png", b"\x89PNG\r\n", r"\.png files are not supported"),
        ("blob", b"\x00\x01\x02", "binary data"),
    ],
)
def test_unsupported_files(name: str, data: bytes, message: str) -> None:
    with pytest.raises(UnsupportedDocument, match=message):
        read_document(name, data, LIMITS)


def test_format_sniffed_without_a_suffix() -> None:
    assert read_document("upload", pdf_bytes(["sniffed"]), LIMITS).kind == "pdf"
    assert read_document("upload", b"<!DOCTYPE html><p>x</p>", LIMITS).kind == "html"
    assert read_document("upload", b"just words", LIMITS).kind == "text"


def test_paths_stay_under_the_folder(tmp_path) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("inside")
    (tmp_path / "secret.txt").write_text("outside")
    (folder / "link.txt").symlink_to(tmp_path / "secret.txt")
    assert read_path(resolve_under(folder, "a.txt"), LIMITS).blocks[0].text == "inside"
    for escape in ("../secret.txt", str(tmp_path / "secret.txt"), "link.txt", "."):
        with pytest.raises(DocumentNotAllowed):
            resolve_under(folder, escape)
    with pytest.raises(DocumentNotAllowed, match=r"documents\.folder"):
        resolve_under(None, "a.txt")
    with pytest.raises(DocumentNotFound):
        read_path(resolve_under(folder, "missing.txt"), LIMITS)
