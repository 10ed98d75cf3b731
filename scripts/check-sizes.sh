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
# The functions are found by a small Rust lexer (scripts/rustlex.py, shared with
# scripts/check-imports.sh): it skips line and nested block comments, strings (escaped,
# raw r#"…"#, byte and C strings) and char literals (told apart from lifetimes and
# labels); the program below then matches braces. A const generic default written in
# braces in a signature is not understood (none exists).
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

# The embedded program imports the lexer from this folder (found before any cd).
SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export SCRIPTS_DIR
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ left in scripts/

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

sys.path.insert(0, os.environ["SCRIPTS_DIR"])
import rustlex  # noqa: E402 (the lexer shared with scripts/check-imports.sh)
from rustlex import CLOSERS, OPENERS, LexError  # noqa: E402

FILE_BAR = 600
FN_BAR = 120
MARKER_LINES = 15
MARKER = re.compile(r"^\s*//[/!]?\s*size:\s*(\S.*?)\s*$")


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
                if s in OPENERS:
                    depth += 1
                elif s in CLOSERS:
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
        line_starts = rustlex.line_starts(src)

        def line_of(pos):
            return rustlex.line_of(line_starts, pos)

        try:
            tokens, comment_starts = rustlex.lex(src, raw_prefix="r#")
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
