#!/usr/bin/env bash
# Proof that the code's shape holds (issue 53). Fails when
#   - an import circle between source files appears in crates/publisher/src (a library
#     rooted at lib.rs) or crates/relay/src (a binary rooted at main.rs);
#   - a file of the AMQP connection (crates/publisher/src/amqp/connection/) imports an
#     item from elsewhere in the publisher that ALLOWED_OUTSIDE_CONNECTION (below) does
#     not list, or the list names an item the connection no longer imports.
#
# The graph: every non-test source file reached from the crate root through `mod x;`
# declarations is a node. Test code is left out: items under `#[cfg(test)]` (modules
# and their files, uses, functions, statements), files named tests.rs or sim.rs and
# files under a tests/ or sim/ folder. A -> B is an edge when A's code (outside
# comments, string literals and test code) names an item defined in B by a path: one
# starting with `crate::`, `self::` or `super::`, or with a name in scope of A's module
# (a child module, a `use` alias), in a `use` tree (braces nested or not) or in code
# (`crate::x::f(...)`). Paths are resolved the Rust way: `crate::a::b` is the module
# of src/a/b.rs or src/a/b/mod.rs, else the item `b` of src/a.rs or src/a/mod.rs;
# `mod x;` in a.rs is a/x.rs; inline `mod m { }` blocks and `#[path]` on `mod x;` are
# understood; a name imported by a `use` (`pub use` or not: a child sees its parent's
# imports) is followed to the file that defines it, through as many re-exports as
# there are. A path that cannot be resolved is attributed to the file of the last
# module it names. Not edges: `mod x;`, naming a module (only the items reached
# through it count), a `pub use` that the file's own code does not use (a re-export
# is a facade: who goes through it depends on the file defining the item), and a
# file's uses of the modules nested in its own (a parent owns its children, which
# may use it back through `super::`; --strict counts these too). A circle is a
# strongly connected component of more than one file; each is reported as its
# shortest cycles through each of its files, with the names each file takes from the
# next.
#
# The connection is a standalone AMQP client (issue 53): it takes nothing from the
# rest of the publisher. Were that ever needed, the item is listed here at item
# granularity (the path as written, normalised to start with `crate::` and cut after
# its first segment that is not a module), each with its reason. A new outside import fails until it is listed with a
# reason; an entry the connection no longer imports fails until it is removed.
# Lines: `<path> <reason>`.
ALLOWED_OUTSIDE_CONNECTION='
'
#
# Usage: scripts/check-imports.sh [--root DIR] [--graph publisher|relay] [--strict]
#   --root DIR: the repository root (default: this script's repository);
#   --graph CRATE: print CRATE's edges (`from -> to: names`), one a line, and exit;
#   --strict: also count a file's uses of the modules nested in its own.
set -euo pipefail

if ! command -v python3 >/dev/null 2>&1; then
  echo "check-imports: python3 is needed (scripts/test-services.sh installs it)" >&2
  exit 1
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The embedded program imports the lexer, scripts/rustlex.py, from this script's own
# folder (whatever --root says); no bytecode cache is written there.
SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export SCRIPTS_DIR PYTHONDONTWRITEBYTECODE=1
graph=""
strict=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --root)
      [[ $# -ge 2 ]] || { echo "check-imports: --root needs a folder" >&2; exit 2; }
      root=$2
      shift 2
      ;;
    --graph)
      [[ $# -ge 2 ]] || { echo "check-imports: --graph needs publisher or relay" >&2; exit 2; }
      graph=$2
      shift 2
      ;;
    --strict)
      strict=1
      shift
      ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "check-imports: unknown argument $1 (usage: $0 [--root DIR] [--graph publisher|relay] [--strict])" >&2
      exit 2
      ;;
  esac
done
case $graph in "" | publisher | relay) ;; *)
  echo "check-imports: --graph takes publisher or relay, not $graph" >&2
  exit 2
  ;;
esac
[[ -d $root/crates ]] || { echo "check-imports: $root/crates: no such folder" >&2; exit 2; }

cd "$root"
ALLOWED="$ALLOWED_OUTSIDE_CONNECTION" exec python3 - "$graph" "$strict" <<'PY'
import os
import sys
from collections import deque

sys.path.insert(0, os.environ["SCRIPTS_DIR"])
import rustlex  # noqa: E402 (the lexer shared with scripts/check-sizes.sh)
from rustlex import OPENERS, LexError  # noqa: E402

CRATES = [("publisher", "crates/publisher/src", "lib.rs"),
          ("relay", "crates/relay/src", "main.rs")]
CONNECTION_CRATE = "publisher"
CONNECTION_MODULE = ("crate", "amqp", "connection")
CONNECTION_DIR = "crates/publisher/src/amqp/connection/"


# ---- Modules and items ----

class Module:
    def __init__(self, name, path, file, parent, folder):
        self.name = name
        self.path = path            # ("crate", "amqp", ...)
        self.file = file            # the file its items are written in
        self.parent = parent
        self.folder = folder        # where its `mod x;` files are
        self.children = {}          # name -> Module
        self.items = set()          # names of its own non-module items
        self.aliases = {}           # name -> (segments, line) of its `use`s
        self.globs = []             # segments of its `use ...::*`
        self.is_test = False        # `#![cfg(test)]` inside


class Ref:
    """A path written in a file: segments as written, the module it is written in."""
    def __init__(self, segs, module, line, reexport=None):
        self.segs = segs
        self.module = module
        self.line = line
        self.reexport = reexport    # the name a `pub use` gives, else None


ITEM_KEYWORDS = {"fn", "struct", "enum", "union", "trait", "type", "const", "static"}


class FileParser:
    def __init__(self, crate, rel, src):
        self.crate = crate
        self.rel = rel
        self.src = src
        # Words (lifetimes included) and punctuation, `::` one token, a raw identifier
        # as its plain name; comments, strings and chars give none.
        self.toks, _ = rustlex.lex(src, path_sep=True)
        self.line_starts = rustlex.line_starts(src)

    def line_of(self, t):
        pos = self.toks[t][2] if t < len(self.toks) else len(self.src)
        return rustlex.line_of(self.line_starts, pos)

    def is_p(self, t, s):
        return t < len(self.toks) and self.toks[t][0] == "punct" and self.toks[t][1] == s

    def is_w(self, t, s=None):
        return (t < len(self.toks) and self.toks[t][0] == "word"
                and (s is None or self.toks[t][1] == s))

    def match(self, t):
        """t is an opening bracket: the index of its closing one."""
        stack = []
        for u in range(t, len(self.toks)):
            k, s, _ = self.toks[u]
            if k != "punct":
                continue
            if s in OPENERS:
                stack.append(OPENERS[s])
            elif s in (")", "]", "}"):
                if not stack or stack.pop() != s:
                    raise LexError(self.toks[u][2], "unbalanced %s" % s)
                if not stack:
                    return u
        raise LexError(self.toks[t][2], "never closed")

    def item_end(self, t, end):
        """Just past the item (or statement) starting at t: its first `;` outside
        brackets, or the `}` closing its first brace at depth 0; at most `end` (the
        end of the enclosing block)."""
        u = t
        while u < end:
            k, s, _ = self.toks[u]
            if k == "punct":
                if s == ";":
                    return u + 1
                if s in OPENERS:
                    close = self.match(u)
                    if s == "{":
                        return close + 1
                    u = close + 1
                    continue
                if s in (")", "]", "}"):
                    return u
            u += 1
        return end

    def attribute(self, t):
        """t is `#`: (index past the attribute, is it cfg(test), inner?, path value)."""
        u = t + 1
        inner = self.is_p(u, "!")
        if inner:
            u += 1
        if not self.is_p(u, "["):
            return t + 1, False, False, None
        close = self.match(u)
        body = [s for _, s, _ in self.toks[u + 1:close]]
        is_test = body == ["cfg", "(", "test", ")"]
        path = None
        if body[:1] == ["path"]:
            # #[path = "x.rs"]: the lexer dropped the string; read it from the source.
            text = self.src[self.toks[u][2]:self.toks[close][2]]
            q = text.find('"')
            if q >= 0:
                path = text[q + 1:text.find('"', q + 1)]
        return close + 1, is_test, inner, path

    # -- module level --

    def parse_items(self, start, end, module, ctx):
        t = start
        test_attr, path_attr = False, None
        while t < end:
            if self.is_p(t, "#"):
                t2, is_test, inner, path = self.attribute(t)
                if inner and is_test:
                    module.is_test = True
                    return
                test_attr = test_attr or is_test
                path_attr = path or path_attr
                t = t2
                continue
            if self.is_p(t, ";"):
                t += 1
                continue
            u = t
            if self.is_w(u, "pub"):
                u += 1
                if self.is_p(u, "("):
                    u = self.match(u) + 1
            while self.is_w(u) and self.toks[u][1] in ("unsafe", "async", "extern", "default") \
                    and not self.is_p(u + 1, "!"):
                u += 1
            if self.is_w(u, "const") and self.is_w(u + 1) and self.toks[u + 1][1] in (
                    "fn", "unsafe", "async", "extern"):
                u += 1
                while self.is_w(u) and self.toks[u][1] in ("unsafe", "async", "extern"):
                    u += 1
            kw = self.toks[u][1] if self.is_w(u) else None
            if kw == "mod" and self.is_w(u + 1):
                name = self.toks[u + 1][1]
                if self.is_p(u + 2, ";"):
                    if not test_attr:
                        ctx.declare_file_module(self, module, name, path_attr, self.line_of(u))
                    t = u + 3
                elif self.is_p(u + 2, "{"):
                    close = self.match(u + 2)
                    if not test_attr:
                        child = ctx.new_module(name, module, self.rel,
                                               os.path.join(module.folder, name))
                        self.parse_items(u + 3, close, child, ctx)
                    t = close + 1
                else:
                    t = self.item_end(t, end)
                test_attr, path_attr = False, None
                continue
            stop = self.item_end(t, end)
            if not test_attr:
                if kw == "use":
                    self.parse_use(u + 1, stop, module, ctx, top=True, public=u > t)
                else:
                    if kw in ITEM_KEYWORDS:
                        v = u + 1
                        if kw == "static" and self.is_w(v, "mut"):
                            v += 1
                        if self.is_w(v) and self.toks[v][1] != "_":
                            module.items.add(self.toks[v][1])
                    elif kw == "macro_rules" and self.is_p(u + 1, "!") and self.is_w(u + 2):
                        module.items.add(self.toks[u + 2][1])
                    self.scan(t, stop, module, ctx)
            t = stop if stop > t else t + 1
            test_attr, path_attr = False, None

    # -- `use` trees --

    def parse_use(self, t, end, module, ctx, top, public=False):
        leaves = []
        self.use_tree(t, end, [], leaves)
        for segs, alias, glob, at in leaves:
            line = self.line_of(at)
            if glob:
                if top:
                    module.globs.append(segs)
                ctx.refs.append(Ref(segs, module, line, "*" if public else None))
                continue
            if alias is not None and alias != "_" and top:
                module.aliases.setdefault(alias, (segs, line))
            ctx.refs.append(Ref(segs, module, line, alias if public else None))

    def use_tree(self, t, end, prefix, leaves):
        """Parses one tree at t; returns the index past it."""
        segs = list(prefix)
        if self.is_p(t, "::"):
            t += 1
        while t < end:
            if self.is_p(t, "{"):
                close = self.match(t)
                u = t + 1
                while u < close:
                    u = self.use_tree(u, close, segs, leaves)
                    if self.is_p(u, ","):
                        u += 1
                return close + 1
            if self.is_p(t, "*"):
                leaves.append((segs, None, True, t))
                return t + 1
            if self.is_p(t, "$") and self.is_w(t + 1, "crate"):
                t += 1
            if not self.is_w(t):
                return t + 1
            name = self.toks[t][1]
            t += 1
            if self.is_p(t, "::"):
                segs.append(name)
                t += 1
                continue
            alias = name
            if name == "self":
                alias = segs[-1] if segs else None
            else:
                segs.append(name)
            if self.is_w(t, "as") and self.is_w(t + 1):
                alias = self.toks[t + 1][1]
                t += 2
            if segs:
                leaves.append((segs, alias, False, t - 1))
            return t
        return t

    # -- code --

    def scan(self, start, end, module, ctx):
        """Records every path in code between start and end (test code skipped)."""
        t = start
        while t < end:
            k, s, _ = self.toks[t]
            if k == "punct" and s == "#" and self.is_p(t + 1, "["):
                t2, is_test, _, _ = self.attribute(t)
                if is_test:
                    while self.is_p(t2, "#"):
                        t2 = self.attribute(t2)[0]
                    t2 = self.item_end(t2, end)
                t = t2
                continue
            if k == "word":
                ctx.code_words.setdefault(self.rel, set()).add(s)
            if k == "word" and s == "use" and not self.is_p(t - 1, "::"):
                stop = self.item_end(t, end)
                self.parse_use(t + 1, stop, module, ctx, top=False)
                t = stop
                continue
            first = t
            if k == "punct" and s == "$" and self.is_w(t + 1, "crate"):
                t += 1
            if (self.is_w(t) and self.is_p(t + 1, "::")
                    and not self.is_p(first - 1, "::") and not self.is_p(first - 1, ".")):
                segs = [self.toks[t][1]]
                u = t + 1
                while self.is_p(u, "::") and self.is_w(u + 1):
                    segs.append(self.toks[u + 1][1])
                    u += 2
                ctx.refs.append(Ref(segs, module, self.line_of(t)))
                t = u
                continue
            t = first + 1


class Crate:
    def __init__(self, name, src, root_file):
        self.name = name
        self.src = src
        self.refs = []
        self.code_words = {}        # file -> the words of its code outside `use`s
        self.files = []             # (rel path) of non-test files
        self.problems = []
        self.modules = []
        rel = os.path.join(src, root_file)
        self.root = self.new_module("crate", None, rel, src)
        self.load_file(rel, self.root)

    def new_module(self, name, parent, file, folder):
        path = ("crate",) if parent is None else parent.path + (name,)
        m = Module(name, path, file, parent, folder)
        if parent is not None:
            parent.children[name] = m
        self.modules.append(m)
        return m

    def is_test_file(self, rel):
        parts = os.path.relpath(rel, self.src).split(os.sep)
        return (parts[-1] in ("tests.rs", "sim.rs")
                or any(p in ("tests", "sim") for p in parts[:-1]))

    def declare_file_module(self, parser, module, name, path_attr, line):
        if path_attr:
            # Relative to the file's folder, or to the inline module's (approximately).
            inline = module.folder != self.folder_of(parser.rel)
            base = module.folder if inline else os.path.dirname(parser.rel)
            candidates = [os.path.normpath(os.path.join(base, path_attr))]
        else:
            candidates = [os.path.join(module.folder, name + ".rs"),
                          os.path.join(module.folder, name, "mod.rs")]
        found = [c for c in candidates if os.path.isfile(c)]
        if not found:
            self.problems.append("check-imports: %s:%d: mod %s; has no file (looked for %s)"
                                 % (parser.rel, line, name, " and ".join(candidates)))
            return
        rel = found[0]
        if self.is_test_file(rel):
            return
        child = self.new_module(name, module, rel, self.folder_of(rel))
        self.load_file(rel, child)

    def folder_of(self, rel):
        base = os.path.basename(rel)
        if base in ("mod.rs", "lib.rs", "main.rs"):
            return os.path.dirname(rel)
        return os.path.join(os.path.dirname(rel), base[:-3])

    def load_file(self, rel, module):
        with open(rel, encoding="utf-8", errors="replace") as f:
            src = f.read()
        try:
            parser = FileParser(self, rel, src)
            parser.parse_items(0, len(parser.toks), module, self)
        except LexError as e:
            line = src.count("\n", 0, e.pos) + 1
            self.problems.append("check-imports: %s:%d: %s (the lexer in scripts/check-imports.sh "
                                 "could not read this file)" % (rel, line, e.what))
            return
        if module.is_test:
            return
        self.files.append(rel)

    # -- resolution --

    def start(self, segs, module):
        """(module the rest of segs is looked up in, index of the rest), or None when
        the path is not the crate's (an extern crate, std, a generic)."""
        first = segs[0]
        if first == "crate":
            return self.root, 1
        if first in ("self", "super"):
            m, i = module, 0
            if first == "self":
                i = 1
            while i < len(segs) and segs[i] == "super":
                if m.parent is None:
                    return None
                m, i = m.parent, i + 1
            return m, i
        return module, 0

    def lookup(self, m, name, guard):
        """name in module m: ('mod', M) | ('item', file, name) | ('ext',) | None."""
        if name in m.children and not m.children[name].is_test:
            return ("mod", m.children[name])
        if name in m.items:
            return ("item", m.file, name)
        if name in m.aliases:
            key = (id(m), name)
            if key in guard:
                return None
            r = self.resolve(m.aliases[name][0], m, guard | {key})
            if r[0] == "unresolved":
                return None
            return r
        for glob in m.globs:
            key = (id(m), "*", tuple(glob))
            if key in guard:
                continue
            r = self.resolve(glob, m, guard | {key})
            if r[0] == "mod":
                found = self.lookup(r[1], name, guard | {key})
                if found is not None:
                    return found
        return None

    def resolve(self, segs, module, guard=frozenset()):
        """('mod', M) | ('item', file, name) | ('unresolved', file, name) | ('ext',)."""
        s = self.start(segs, module)
        if s is None:
            return ("ext",)
        m, i = s
        if i == 0:
            r = self.lookup(m, segs[0], guard)
            if r is None or r[0] == "ext":
                return ("ext",)
            if r[0] == "item":
                return r
            m, i = r[1], 1
        while i < len(segs):
            r = self.lookup(m, segs[i], guard)
            if r is None:
                return ("unresolved", m.file, segs[i])
            if r[0] != "mod":
                return r
            m, i = r[1], i + 1
        return ("mod", m)

    def absolute(self, segs, module, guard=frozenset()):
        """The path as written, from `crate` (aliases of its first name expanded), or
        None when it is not the crate's."""
        s = self.start(segs, module)
        if s is None:
            return None
        m, i = s
        if i > 0 or segs[0] in ("crate",):
            return list(m.path) + list(segs[i:])
        first = segs[0]
        if first in m.children or first in m.items:
            return list(m.path) + list(segs)
        if first in m.aliases and (id(m), first) not in guard:
            base = self.absolute(m.aliases[first][0], m, guard | {(id(m), first)})
            return None if base is None else base + list(segs[1:])
        return None

    def item_granular(self, abs_path):
        """abs_path cut after its first segment that is not a module of the tree."""
        m = self.root
        for i, seg in enumerate(abs_path[1:], start=1):
            if seg in m.children:
                m = m.children[seg]
                continue
            return abs_path[:i + 1]
        return abs_path

    def edges(self, strict=False):
        """{(from file, to file): names}. Unless strict, a file's uses of the modules
        nested in its own (its children's files, theirs, ...) are left out: a parent
        owns its children, which may use it back through `super::`."""
        edges = {}
        nodes = set(self.files)
        file_module = {m.file: m for m in self.modules if m.file in nodes and
                       (m.parent is None or m.parent.file != m.file)}
        for ref in self.refs:
            if ref.module.is_test:
                continue
            if ref.reexport is not None and \
                    ref.reexport not in self.code_words.get(ref.module.file, ()):
                continue  # a `pub use` the file's own code does not use: a facade
            r = self.resolve(ref.segs, ref.module)
            if r[0] not in ("item", "unresolved"):
                continue
            source, target = ref.module.file, r[1]
            if target == source or target not in nodes or source not in nodes:
                continue
            if not strict:
                above, below = file_module[source].path, file_module[target].path
                if below[:len(above)] == above:
                    continue
            edges.setdefault((source, target), set()).add(r[2])
        return edges


def circles(nodes, edges):
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    succ = {n: sorted(b for (a, b) in edges if a == n) for n in nodes}
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, pi = work.pop()
            if pi == 0:
                index[v] = low[v] = counter[0]
                counter[0] += 1
                stack.append(v)
                on.add(v)
            recurse = False
            for k in range(pi, len(succ[v])):
                w = succ[v][k]
                if w not in index:
                    work.append((v, k + 1))
                    work.append((w, 0))
                    recurse = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if recurse:
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return comps


def shortest_cycle(start, comp, edges):
    inside = set(comp)
    prev = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for (a, b) in sorted(edges):
            if a != v or b not in inside:
                continue
            if b == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                path.reverse()
                return path
            if b not in prev:
                prev[b] = v
                queue.append(b)
    return None


def main():
    graph = sys.argv[1]
    strict = sys.argv[2] == "1"
    problems = []
    crates = {}
    for name, src, root_file in CRATES:
        if not os.path.isfile(os.path.join(src, root_file)):
            problems.append("check-imports: %s: no such file" % os.path.join(src, root_file))
            continue
        crate = Crate(name, src, root_file)
        crates[name] = crate
        problems.extend(crate.problems)

    summary = []
    ncircles = 0
    for name, crate in crates.items():
        edges = crate.edges(strict)
        if graph == name:
            for (a, b), names in sorted(edges.items()):
                print("%s -> %s: %s" % (a, b, ", ".join(sorted(names))))
            return 0
        for comp in circles(crate.files, edges):
            ncircles += 1
            seen = set()
            for start in comp:
                cycle = shortest_cycle(start, comp, edges)
                if cycle is None:
                    continue
                k = cycle.index(min(cycle))
                canon = tuple(cycle[k:] + cycle[:k])
                if canon in seen:
                    continue
                seen.add(canon)
                hops = [canon[0]]
                for a, b in zip(canon, canon[1:] + canon[:1]):
                    hops.append("%s (%s)" % (b, ", ".join(sorted(edges[(a, b)]))))
                problems.append("check-imports: circle: " + " -> ".join(hops))
        summary.append("%s %d files %d edges" % (name, len(crate.files), len(edges)))
        if len(crate.files) < 2:
            problems.append("check-imports: %s: %d file(s) found from %s (is the root right?)"
                            % (name, len(crate.files), crate.src))

    # The connection's outside imports against the allowlist.
    allowed = {}
    for raw in os.environ.get("ALLOWED", "").splitlines():
        raw = raw.strip()
        if not raw:
            continue
        parts = raw.split(None, 1)
        if len(parts) < 2:
            problems.append("check-imports: allowlist entry %s has no reason (scripts/"
                            "check-imports.sh, ALLOWED_OUTSIDE_CONNECTION)" % parts[0])
        allowed[parts[0]] = parts[1] if len(parts) > 1 else ""
    used = set()
    crate = crates.get(CONNECTION_CRATE)
    conn_files = [f for f in crate.files if f.startswith(CONNECTION_DIR)] if crate else []
    if crate and not conn_files:
        problems.append("check-imports: no file found in %s (is the root right?)" % CONNECTION_DIR)
    reported = set()
    for ref in (crate.refs if crate else []):
        if ref.module.is_test or ref.module.file not in conn_files:
            continue
        abs_path = crate.absolute(ref.segs, ref.module)
        if abs_path is None or tuple(abs_path[:3]) == CONNECTION_MODULE:
            continue
        cut = crate.item_granular(abs_path)
        if cut == abs_path and crate.resolve(ref.segs, ref.module)[0] == "mod":
            continue  # a module named: the items used through it are listed
        item = "::".join(cut)
        used.add(item)
        if item not in allowed and (ref.module.file, item) not in reported:
            reported.add((ref.module.file, item))
            problems.append("check-imports: %s:%d: imports %s from outside connection/ (not in "
                            "the allowlist: connection/ is a standalone client, issue 53; "
                            "extend ALLOWED_OUTSIDE_CONNECTION in scripts/check-imports.sh only "
                            "with a reason)" % (ref.module.file, ref.line, item))
    for item in sorted(set(allowed) - used):
        problems.append("check-imports: the allowlist names %s, which connection/ no longer "
                        "imports: remove it from ALLOWED_OUTSIDE_CONNECTION in "
                        "scripts/check-imports.sh" % item)

    if problems:
        for p in problems:
            print(p, file=sys.stderr)
        print("check-imports: FAILED — %d circle(s) (%s), %d other problem(s)"
              % (ncircles, "strongly connected files, shortest cycles shown"
                 + ("" if strict else "; a parent's uses of its own submodules not counted"),
                 len([p for p in problems if not p.startswith("check-imports: circle:")])),
              file=sys.stderr)
        return 1
    ties = ("nothing from the rest of the crate" if not used
            else "only its %d allowed outside names" % len(used))
    print("check-imports: OK — %s, no circle; connection/ imports %s"
          % (", ".join(summary), ties))
    return 0


sys.exit(main())
PY
