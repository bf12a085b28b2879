"""WikiText's tokenized text turned back into ordinary text before our tokenizer sees it.

WikiText-103 ships with spaces around punctuation and ``@-@``-style markers inside numbers
("1 @,@ 000", "a @-@ b"). The model was trained on ordinary text, so the evaluation undoes that
first; the word count used for the word-level perplexity is taken before this step.
"""
import re

_REPLACEMENTS_BEFORE_BRACKETS = (
    ("s '", "s'"),
    (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),
    (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "),
)
_BRACKETS = (
    (re.compile(r"\(\s*([^\)]*?)\s*\)"), r"(\1)"),
    (re.compile(r"\[\s*([^\]]*?)\s*\]"), r"[\1]"),
    (re.compile(r"{\s*([^}]*?)\s*}"), r"{\1}"),
    (re.compile(r"\"\s*([^\"]*?)\s*\""), r'"\1"'),
    (re.compile(r"'\s*([^']*?)\s*'"), r"'\1'"),
)
_REPLACEMENTS_AFTER_BRACKETS = (
    ("= = = =", "===="), ("= = =", "==="), ("= =", "=="),
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    (" \n", "\n"), ("\n ", "\n"),
    (" N ", " 1 "), (" 's", "'s"),
)


def wikitext_detokenize(text: str) -> str:
    """``text`` with WikiText's token spacing and number markers undone (Megatron's rules, in order)."""
    for old, new in _REPLACEMENTS_BEFORE_BRACKETS:
        text = text.replace(old, new)
    for pattern, replacement in _BRACKETS:
        text = pattern.sub(replacement, text)
    for old, new in _REPLACEMENTS_AFTER_BRACKETS:
        text = text.replace(old, new)
    return text
