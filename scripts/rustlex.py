"""A small lexer of Rust source, shared by two checks run by .ci/run:

  - scripts/check-sizes.sh finds every function and its closing brace with it (the
    function size bar), and tells a `// size:` marker in a comment from one in a string;
  - scripts/check-imports.sh reads `mod`, `use` and paths with it (the import graph).

Both are bash wrappers around an embedded Python program; each exports SCRIPTS_DIR
(this folder) and the program does `sys.path.insert(0, os.environ["SCRIPTS_DIR"])`
before `import rustlex`. Not run on its own; standard library only.

What it understands: line and nested block comments, strings (escaped "…", raw
r#"…"#, byte and C strings b"…" br#"…"# c"…" cr#"…"#), char and byte literals ('x',
'\\n', '\\u{1F600}', '\\'', b'x') told apart from lifetimes and labels ('a, 'static,
'outer:), raw identifiers (r#fn) and identifiers. Where the two checks want different
tokens, lex() takes a parameter: `::` as one token (check-imports) or two `:`
(check-sizes); a raw identifier spelt with its `r#` (check-sizes names the function
r#match) or without (check-imports resolves it as the plain name).
"""

OPENERS = {"(": ")", "[": "]", "{": "}"}
CLOSERS = set(OPENERS.values())


class LexError(Exception):
    """The source cannot be read (an unterminated comment, string or char literal, ...):
    pos is the offset in the source where the trouble starts."""

    def __init__(self, pos, what):
        super().__init__(what)
        self.pos = pos
        self.what = what


def is_ident_start(c):
    return c == "_" or c.isalpha()


def is_ident_char(c):
    return c == "_" or c.isalnum()


def lex(src, path_sep=False, raw_prefix=""):
    """Returns (tokens, comment_starts). tokens are (kind, text, pos) with kind 'word'
    (identifiers, keywords, numbers, lifetimes and labels) or 'punct' (one character,
    or `::` when path_sep is true); a raw identifier is the word raw_prefix + its name.
    Comments, strings, char and byte literals give no token. comment_starts holds the
    offset of every `//` comment."""
    tokens = []
    comment_starts = set()
    n = len(src)
    i = 0
    while i < n:
        c = src[i]
        if c.isspace():
            i += 1
        elif src.startswith("//", i):
            comment_starts.add(i)
            j = src.find("\n", i)
            i = n if j < 0 else j + 1
        elif src.startswith("/*", i):
            i = skip_block_comment(src, i)
        elif c == '"':
            i = skip_string(src, i)
        elif c == "'":
            i = skip_quote(src, i, tokens)
        elif is_ident_start(c) or c.isdigit():
            i = lex_word(src, i, tokens, raw_prefix)
        elif path_sep and src.startswith("::", i):
            tokens.append(("punct", "::", i))
            i += 2
        else:
            tokens.append(("punct", c, i))
            i += 1
    return tokens, comment_starts


def skip_block_comment(src, i):
    """src[i:] starts with `/*`: the offset past its `*/` (block comments nest)."""
    start, depth, n = i, 1, len(src)
    i += 2
    while depth:
        if i >= n:
            raise LexError(start, "unterminated block comment")
        if src.startswith("/*", i):
            depth += 1
            i += 2
        elif src.startswith("*/", i):
            depth -= 1
            i += 2
        else:
            i += 1
    return i


def lex_word(src, i, tokens, raw_prefix):
    """src[i] starts an identifier or a number: appends its word (none for the prefix
    of a string or byte literal, which is skipped whole) and returns the offset past."""
    n = len(src)
    j = i
    while j < n and is_ident_char(src[j]):
        j += 1
    word = src[i:j]
    if word in ("r", "br", "cr", "b", "c"):
        k = j
        while k < n and src[k] == "#":
            k += 1
        if k < n and src[k] == '"':
            if word in ("b", "c") and k == j:
                return skip_string(src, k)
            if word in ("r", "br", "cr"):
                return skip_raw_string(src, i, k - j, k + 1)
        if word == "b" and j < n and src[j] == "'":
            return skip_quote(src, j, [])
        if word == "r" and k == j + 1 and k < n and is_ident_start(src[k]):
            # A raw identifier (r#fn is a name, not the keyword).
            m = k
            while m < n and is_ident_char(src[m]):
                m += 1
            tokens.append(("word", raw_prefix + src[k:m], i))
            return m
    tokens.append(("word", word, i))
    return j


def skip_string(src, i):
    """src[i] is the opening quote of an escaped string ("…", b"…", c"…")."""
    start, n = i, len(src)
    i += 1
    while i < n:
        c = src[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        else:
            i += 1
    raise LexError(start, "unterminated string")


def skip_raw_string(src, start, hashes, i):
    """i is just after the opening quote of r#…#"…"#…#; no escapes inside."""
    close = '"' + "#" * hashes
    j = src.find(close, i)
    if j < 0:
        raise LexError(start, "unterminated raw string")
    return j + len(close)


def skip_quote(src, i, tokens):
    """src[i] is `'`: a char literal ('x', '\\n', '\\u{1F600}', '\\'') or a lifetime
    or label ('a, 'static, '_, 'outer:), which is kept as a word."""
    n = len(src)
    if i + 1 < n and src[i + 1] == "\\":
        j = i + 3  # past the escaped character, so '\'' ends at the second quote
        while j < n and src[j] != "'" and src[j] != "\n":
            j += 1
        if j >= n or src[j] != "'":
            raise LexError(i, "unterminated char literal")
        return j + 1
    if i + 2 < n and src[i + 2] == "'":
        return i + 3  # 'x'
    j = i + 1
    while j < n and is_ident_char(src[j]):
        j += 1
    if j == i + 1:
        raise LexError(i, "a quote that is neither a char literal nor a lifetime")
    tokens.append(("word", src[i:j], i))
    return j


def line_starts(src):
    """The offset of the first character of every line of src."""
    return [0] + [k + 1 for k, ch in enumerate(src) if ch == "\n"]


def line_of(starts, pos):
    """The line (from 1) of offset pos, given line_starts(src)."""
    lo, hi = 0, len(starts) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if starts[mid] <= pos:
            lo = mid
        else:
            hi = mid - 1
    return lo + 1
