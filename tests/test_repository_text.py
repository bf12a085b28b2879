"""The repository explains itself: no text cites a file outside it, every documentation path it
names exists, and "seed" only ever means a random seed.

Files checked: every text file git knows of (tracked, or untracked and not ignored) ending in .py,
.md, .sh, .slurm, .txt, .json, .toml or .cfg, except the recorded GPU outputs under
benchmarks/results/ (their README.md files are checked), the licence text of the sample corpus
(examples/data/LICENSE-PSF.txt, not ours) and this file. This file passes the same check as text:
its patterns and examples spell the phrases they look for in pieces (``[-]``, ``{SYSTEM}``).

Citations of outside files (``test_no_file_outside_the_repository_is_cited``): the reference notes
the project was started from are not part of the repository, so a line may not contain their
folder (OUTSIDE_ALWAYS) nor a path ending in one of their names (OUTSIDE_NAMES: the design notes,
the Megatron-DeepSpeed study, the reliability, performance and code-style notes) unless that path is
a file of the repository.

Paths that must exist (``test_documentation_paths_exist``): the target of every relative markdown
link ``[text](target)`` in a .md file (resolved from that file's directory, without its #anchor;
URLs and bare anchors are not paths), and every ``docs/NAME.md`` named in any file (from the root).

"seed" (``test_seed_means_a_random_seed``). The system this framework replaces is called
Megatron-DeepSpeed, never by the word "seed". Every occurrence of "seed", as a word or a word part, in any
case, is a random seed unless the line, read with underscores as spaces (so identifiers read as
words), matches one of these:

1. a possessive: ``seed's``, ``seeds'``;
2. a compound naming the system: "seed" joined to "system" or "compatible" by a hyphen or a space,
   or followed by ``§``;
3. "seed" (not ``--seed``) followed by a noun that names something of the system rather than a
   number: flag(s), name(s), script(s), example(s), semantics, format, fields, tags, numbering,
   loop, rule(s), padding, form, tflops, flops, vocabulary, layout, default(s), path, order of
   operations;
4. "seed" or "seeds" after "the", on a line without a random-seed context: ``--seed``, random, rng,
   generator, draw(n), dropout, shuffl(e/ing), manual seed, hash, seeded, permutation, ``seed +``,
   ``seed=``.

The failure lists every offending ``path:line``.

The README (``test_readme_is_a_guide_without_dated_measurements``) is the user guide: at most
README_MAX_LINES lines and no date (YYYY-MM-DD) on any line, since measurements, each with its date,
machine and command, belong in docs/performance.md.
"""
import os
import re
import subprocess

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELF = os.path.relpath(os.path.abspath(__file__), REPO_ROOT)
TEXT_SUFFIXES = (".py", ".md", ".sh", ".slurm", ".txt", ".json", ".toml", ".cfg")
RECORDED_OUTPUTS = "benchmarks/results/"  # logs and tables as the GPU runs wrote them
EXCLUDED_FILES = {"examples/data/LICENSE-PSF.txt", SELF}
IGNORED_DIRECTORIES = {".git", "__pycache__", "build", "dist", "_build", "runs", ".whl", ".pytest_cache"}

OUTSIDE_NAMES = r"(?:DESIGN|megatron-deepspeed|reliability|performance|code-style)\.md"
OUTSIDE_PATH = re.compile(r"[\w./-]*\b" + OUTSIDE_NAMES, re.IGNORECASE)
OUTSIDE_ALWAYS = re.compile(r"\.\.[/]shared|seed[-]system", re.IGNORECASE)
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*?\.md\b")
URL_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
README_MAX_LINES = 250
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")

SYSTEM_NOUNS = (r"flags?|names?|scripts?|examples?|semantics|format|fields|tags|numbering|loop|rules?|padding|"
                r"form|tflops|flops|vocabulary|layout|defaults?|path|order of operations")
SEED_AS_SYSTEM = (
    re.compile(r"(?:\bthe )?seeds?'s?", re.IGNORECASE),
    re.compile(r"\bseed(?:-system|-compatible| system| §)", re.IGNORECASE),
    re.compile(r"(?<![-\w])seed (?:" + SYSTEM_NOUNS + r")\b", re.IGNORECASE),
)
THE_SEED = re.compile(r"\bthe[ ]seeds?\b", re.IGNORECASE)
RANDOM_CONTEXT = re.compile(r"--seed|random|\brng|generator|\bdraw|dropout|shuffl|manual seed|hash|seeded|"
                            r"permutation|seed \+|seed ?=", re.IGNORECASE)
SEED = re.compile(r"seed", re.IGNORECASE)


def repository_files() -> list[str]:
    """Paths (relative to the root) of the files git tracks or would track, else of the whole tree."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                                capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        listed = []
        for directory, subdirectories, names in os.walk(REPO_ROOT):
            subdirectories[:] = [d for d in subdirectories
                                 if d not in IGNORED_DIRECTORIES and not d.endswith(".egg-info")]
            listed += [os.path.relpath(os.path.join(directory, name), REPO_ROOT) for name in names]
    return sorted(path for path in listed if os.path.isfile(os.path.join(REPO_ROOT, path)))


def checked_files() -> list[str]:
    return [path for path in repository_files()
            if path.endswith(TEXT_SUFFIXES) and not (path.startswith(RECORDED_OUTPUTS) and not path.endswith(".md"))
            and path not in EXCLUDED_FILES]


def numbered_lines(path: str):
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8", errors="replace") as f:
        yield from enumerate(f, start=1)


def outside_citations(path: str, line: str) -> list[str]:
    """The parts of ``line`` (in ``path``) that cite a file outside the repository."""
    found = [match.group(0) for match in OUTSIDE_ALWAYS.finditer(line)]
    for match in OUTSIDE_PATH.finditer(line):
        cited = match.group(0)
        candidates = (os.path.join(REPO_ROOT, cited), os.path.join(REPO_ROOT, os.path.dirname(path), cited))
        if not any(os.path.isfile(candidate) for candidate in candidates):
            found.append(cited)
    return found


def missing_paths(path: str, line: str) -> list[str]:
    """Relative markdown link targets (in .md files) and docs/NAME.md paths of ``line`` that do not exist."""
    missing = []
    if path.endswith(".md"):
        for target in MARKDOWN_LINK.findall(line):
            if URL_SCHEME.match(target) or target.startswith("#"):
                continue
            resolved = os.path.join(REPO_ROOT, os.path.dirname(path), target.split("#", 1)[0])
            if not os.path.exists(resolved):
                missing.append(target)
    missing += [named for named in DOCS_PATH.findall(line) if not os.path.isfile(os.path.join(REPO_ROOT, named))]
    return missing


def seed_as_system(line: str) -> list[str]:
    """The phrases of ``line`` in which "seed" names Megatron-DeepSpeed (module docstring, rules 1-4)."""
    words = line.replace("_", " ")
    found = [match.group(0) for pattern in SEED_AS_SYSTEM for match in pattern.finditer(words)]
    if not found and not RANDOM_CONTEXT.search(words):
        found = [match.group(0) for match in THE_SEED.finditer(words)]
    return found


def violations(finder, files) -> list[str]:
    """``path:line: found (text)`` for every line of ``files`` where ``finder(path, line)`` finds something."""
    report = []
    for path in files:
        for number, line in numbered_lines(path):
            found = finder(path, line)
            if found:
                report.append(f"{path}:{number}: {', '.join(found)}    | {line.strip()[:120]}")
    return report


def test_no_file_outside_the_repository_is_cited():
    report = violations(outside_citations, checked_files())
    assert not report, ("these lines cite files outside the repository (write the fact itself, or cite a "
                        "file of the repository such as docs/architecture.md):\n" + "\n".join(report))


def test_documentation_paths_exist():
    report = violations(missing_paths, checked_files())
    assert not report, "these lines name paths that do not exist in the repository:\n" + "\n".join(report)


def test_seed_means_a_random_seed():
    report = violations(lambda path, line: seed_as_system(line) if SEED.search(line) else [], checked_files())
    assert not report, ("these lines use \"seed\" for the system we follow: say Megatron-DeepSpeed (rules in "
                        f"{SELF}):\n" + "\n".join(report))


def dated_lines(path: str) -> list[str]:
    """``path:line: text`` for every line of ``path`` that holds a date."""
    return [f"{path}:{number}: {line.strip()[:120]}" for number, line in numbered_lines(path) if DATE.search(line)]


def test_readme_is_a_guide_without_dated_measurements():
    lines = sum(1 for _ in numbered_lines("README.md"))
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines, more than {README_MAX_LINES}: move the "
                                       "detail into a page of docs/ and link it")
    report = dated_lines("README.md")
    assert not report, ("README.md holds dated lines; measurements go to docs/performance.md with their date, "
                        "machine and command:\n" + "\n".join(report))


def test_dated_lines_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Guide\nmeasured 2026-11-27 on one H200\nversion 0.19.8, seq 2048\n")
    assert dated_lines(str(page)) == [f"{page}:2: measured 2026-11-27 on one H200"]


def test_seed_rules_on_examples():
    """The classifier against sentences whose meaning is known."""
    system = [text.format(SYSTEM="seed") for text in (
        "as in the {SYSTEM}.", "the {SYSTEM}'s log line", "({SYSTEM}-system.md §5)", "Seed § 4.1",
        "the {SYSTEM} system", "def seed_tflops(t):", "no seed flag", "with seed semantics",
        "def test_layer_list_follows_the_{SYSTEM}_numbering():", "the {SYSTEM}s' scripts", "as the {SYSTEM} does")]
    random_seed = ["--seed 1234", "torch.manual_seed(seed)", "seed + 100 * pp_rank", "seeded with --seed",
                   "def test_random_sampler_order_depends_on_seed():",
                   "the {SYSTEM} is drawn from a generator".format(SYSTEM="seed"),
                   "PYTHONHASHSEED=0", "random_tokens(2, 16, 64, seed=3)", "the --seed flag",
                   "model_parallel_seed(SEED, tp_rank=0, pp_rank=0)", "parameter_seed(seed, layer, name)"]
    assert [text for text in system if not seed_as_system(text)] == []
    assert [text for text in random_seed if seed_as_system(text)] == []


def test_citation_and_path_rules_on_examples():
    assert outside_citations("x.py", "see ..{}shared/notes".format("/"))
    assert outside_citations("x.py", "{}.md principle 3".format("DESIGN"))
    assert outside_citations("docs/a.md", "reliability.md") and not outside_citations("x.py", "docs/architecture.md")
    assert missing_paths("docs/a.md", "[x](no-such-file.md)") == ["no-such-file.md"]
    assert missing_paths("docs/a.md", "[x](architecture.md#principles) [y](https://github.com/a/b.md)") == []
    assert missing_paths("x.py", "see docs/no-such-doc.md") == ["docs/no-such-doc.md"]
    assert missing_paths("x.py", "a[i](j) and tests/docs/x.md") == []
