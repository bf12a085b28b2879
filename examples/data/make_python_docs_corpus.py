"""Rebuild ``python-docs.jsonl.gz``, the embedded sample corpus, from Debian's python3.11-doc.

The corpus is the reStructuredText source of CPython's documentation (PSF license, see
``LICENSE-PSF.txt``), one JSON document per section, in a fixed order so the file is reproducible::

    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb /tmp/pydoc
    python examples/data/make_python_docs_corpus.py /tmp/pydoc/usr/share/doc/python3.11/html/_sources
"""
import argparse
import gzip
import json
import os
import re

SECTIONS = ["tutorial", "reference", "howto", "faq", "using", "extending", "glossary.rst.txt", "library"]
HEADING_UNDERLINE = re.compile(r"^([=\-~^*#\"'+`])\1{3,}\s*$")


def split_sections(text):
    """Split reST text before each heading (a title line followed by an underline of =, -, ~ ...)."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for i in range(1, len(lines)):
        if HEADING_UNDERLINE.match(lines[i]) and lines[i - 1].strip() and i - 1 > starts[-1]:
            starts.append(i - 1)
    starts.append(len(lines))
    return ["".join(lines[a:b]) for a, b in zip(starts, starts[1:])]


def source_files(root):
    for name in SECTIONS:
        path = os.path.join(root, name)
        if os.path.isfile(path):
            yield path
            continue
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for filename in sorted(filenames):
                if filename.endswith(".rst.txt"):
                    yield os.path.join(dirpath, filename)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", help="the html/_sources folder of python3.11-doc")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "python-docs.jsonl.gz"))
    parser.add_argument("--max-bytes", type=int, default=3_000_000, help="stop after this much text")
    args = parser.parse_args()
    total = 0
    count = 0
    with gzip.GzipFile(args.output, "wb", mtime=0) as raw:
        for path in source_files(args.sources):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            rel = os.path.relpath(path, args.sources)
            for index, section in enumerate(split_sections(text)):
                if len(section.strip()) < 200:
                    continue
                line = json.dumps({"text": section, "source": rel, "section": index}, ensure_ascii=False)
                raw.write(line.encode("utf-8") + b"\n")
                total += len(section.encode("utf-8"))
                count += 1
            if total >= args.max_bytes:
                break
    print(f"wrote {count} documents, {total / 1e6:.2f} MB of text to {args.output}")


if __name__ == "__main__":
    main()
