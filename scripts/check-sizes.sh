#!/usr/bin/env bash
# Fails when the Rust code outgrows the project's bars (issue 53):
#   - a .rs file under crates/, tests/, bench/ or examples/ has more than 600 lines;
#   - a function (an `fn NAME` item with a body: free, method, nested, in an impl,
#     trait or mod, with any of pub/const/unsafe/async/extern before it) spans more
#     than 120 lines, from the line of its `fn` keyword to the line of its closing
#     brace. Trait method declarations (`fn f();`), fn pointer types (`fn(u8)`) and
#     closures are not functions here.
# A file may exceed either bar only when one of its first 15 lines is a comment
#   //! size: <the reason it is allowed to>
# (`//`, `///` or `//!`; the regex is ^\s*//[/!]?\s*size:\s*\S, so a reason is
# required). Tests and simulations are not exempt by their name or folder: they need
# the line too.
#
# The functions are found by a small Rust lexer (below, in Python): it skips line and
# nested block comments, strings (escaped, raw r#"…"#, byte and C strings) and char
# literals (told apart from lifetimes and labels), then matches braces. A const
# generic default written in braces in a signature is not understood (none exists).
#
# Usage: scripts/check-sizes.sh [--list-exempt] [PATH...]
#   PATH: .rs files or folders to check (default: crates tests bench examples, from
#   the repository root); folders named `target` are skipped. --list-exempt also
#   prints each exempt file with its reason (it does not change the result).
set -euo pipefail

if ! command -v python3 >/dev/null 2>&1; then
  echo "check-sizes: python3 is needed (scripts/test-services.sh installs it)" >&2
  exit 1
fi

list_exempt=0
paths=()
for arg in "$@"; do
  case $arg in
    --list-exempt) list_exempt=1 ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    -*)
      echo "check-sizes: unknown option $arg (usage: $0 [--list-exempt] [PATH...])" >&2
      exit 2
      ;;
    *) paths+=("$arg") ;;
  esac
done
if [[ ${#paths[@]} == 0 ]]; then
  # The default folders, named relative to the repository root in the output.
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  paths=(crates tests bench examples)
fi

exec python3 - "$list_exempt" "${paths[@]}" <<'PY'
import os
import re
import sys

FILE_BAR = 600
FN_BAR = 120
MARKER_LINES = 15
MARKER = re.compile(r"^\s*//[/!]?\s*size:\s*(\S.*?)\s*$")


class LexError(Exception):
    def __init__(self, pos, what):
        super().__init__(what)
        self.pos = pos
        self.what = what


def is_ident_start(c):
    return c == "_" or c.isalpha()


def is_ident_char(c):
    return c == "_" or c.isalnum()


def lex(src):
    """Returns (tokens, comment_starts): tokens are (kind, text, pos) with kind 'word'
    (identifiers, keywords, numbers) or 'punct' (one character; only the brackets
    and `;` matter); comments, strings and char literals produce no token.
    comment_starts holds the offset of every `//` comment."""
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
            start, depth = i, 1
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
        elif c == '"':
            i = skip_string(src, i)
        elif c == "'":
            i = skip_quote(src, i, tokens)
        elif is_ident_start(c) or c.isdigit():
            j = i
            while j < n and is_ident_char(src[j]):
                j += 1
            word = src[i:j]
            if word in ("r", "br", "cr"):
                k = j
                while k < n and src[k] == "#":
                    k += 1
                if k < n and src[k] == '"':
                    i = skip_raw_string(src, i, k - j, k + 1)
                    continue
                if word == "r" and k == j + 1 and k < n and is_ident_start(src[k]):
                    # A raw identifier (r#fn is a name, not the keyword).
                    m = k
                    while m < n and is_ident_char(src[m]):
                        m += 1
                    tokens.append(("word", "r#" + src[k:m], i))
                    i = m
                    continue
            tokens.append(("word", word, i))
            i = j
        else:
            tokens.append(("punct", c, i))
            i += 1
    return tokens, comment_starts


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


OPEN = {"(": ")", "[": "]", "{": "}"}
CLOSE = set(OPEN.values())


def functions(tokens):
    """Yields (name, fn_pos, end_pos) for every `fn NAME` with a body."""
    count = len(tokens)
    for t, (kind, text, pos) in enumerate(tokens):
        if kind != "word" or text != "fn":
            continue
        if t + 1 >= count or tokens[t + 1][0] != "word":
            continue  # fn(u8) -> u8, or `fn $name` in a macro_rules! template
        name = tokens[t + 1][1]
        # The first `{` or `;` at the fn's own depth: a body or a declaration.
        depth, u, body = 0, t + 2, None
        while u < count:
            k, s, _ = tokens[u]
            if k == "punct":
                if depth == 0 and s == ";":
                    break
                if depth == 0 and s == "{":
                    body = u
                    break
                if s in OPEN:
                    depth += 1
                elif s in CLOSE:
                    depth -= 1
                    if depth < 0:
                        break  # not an item (e.g. inside a macro pattern)
            u += 1
        if body is None:
            continue
        depth, u = 0, body
        while u < count:
            k, s, p = tokens[u]
            if k == "punct":
                if s == "{":
                    depth += 1
                elif s == "}":
                    depth -= 1
                    if depth == 0:
                        yield name, pos, p
                        break
            u += 1
        else:
            raise LexError(pos, "the body of fn %s never closes" % name)


def rust_files(paths):
    for path in paths:
        if os.path.isfile(path):
            yield path
        elif os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d != "target")
                for f in sorted(files):
                    if f.endswith(".rs"):
                        yield os.path.join(root, f)
        else:
            raise SystemExit("check-sizes: %s: no such file or folder" % path)


def main():
    list_exempt = sys.argv[1] == "1"
    paths = sys.argv[2:]
    problems, exempt = [], []
    unreadable = 0
    nfiles = nfns = 0
    for path in rust_files(paths):
        with open(path, encoding="utf-8", errors="replace") as f:
            src = f.read()
        nfiles += 1
        line_starts = [0] + [m.end() for m in re.finditer("\n", src)]

        def line_of(pos):
            lo, hi = 0, len(line_starts) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if line_starts[mid] <= pos:
                    lo = mid
                else:
                    hi = mid - 1
            return lo + 1

        try:
            tokens, comment_starts = lex(src)
            fns = list(functions(tokens))
        except LexError as e:
            unreadable += 1
            problems.append("check-sizes: %s:%d: %s (the lexer in scripts/check-sizes.sh "
                            "could not read this file)" % (path, line_of(e.pos), e.what))
            continue
        nfns += len(fns)

        lines = src.split("\n")
        nlines = len(lines) - 1 if src.endswith("\n") else len(lines)
        if src == "":
            nlines = 0
        reason = None
        for no, line in enumerate(lines[:MARKER_LINES]):
            m = MARKER.match(line)
            if m and line_starts[no] + line.index("//") in comment_starts:
                reason = m.group(1)
                break

        over = []
        if nlines > FILE_BAR:
            over.append("check-sizes: %s: %d lines (bar %d)" % (path, nlines, FILE_BAR))
        for name, fn_pos, end_pos in fns:
            first, last = line_of(fn_pos), line_of(end_pos)
            length = last - first + 1
            if length > FN_BAR:
                over.append("check-sizes: %s:%d: fn %s is %d lines (bar %d)"
                            % (path, first, name, length, FN_BAR))
        if reason is None:
            problems.extend(over)
        else:
            exempt.append((path, reason, nlines, len(over)))

    if list_exempt:
        for path, reason, nlines, nover in exempt:
            used = ("needs it: %d over the bars" % nover) if nover else "within the bars: the line can go"
            print("check-sizes: exempt: %s (%d lines; %s): %s" % (path, nlines, used, reason))
    if problems:
        for p in problems:
            print(p, file=sys.stderr)
        over = len(problems) - unreadable
        print("check-sizes: FAILED — %d over the bars%s (a file may exceed them only with "
              "a `//! size: <reason>` line in its first %d)"
              % (over, ", %d file(s) not read" % unreadable if unreadable else "", MARKER_LINES),
              file=sys.stderr)
        return 1
    print("check-sizes: OK — %d files, %d functions within the bars (%d exempt files)"
          % (nfiles, nfns, len(exempt)))
    return 0


sys.exit(main())
PY
