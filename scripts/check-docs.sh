#!/usr/bin/env bash
# Fails when a Markdown file in docs/ or README.md names a repository path that does
# not exist. Only root-relative paths are looked at, so that a hit is certain: a token
# (backticked or not) starting with one of the top-level directories below (k8s/ and
# fuzz/ do not exist, so any path under them is reported) and ending in a file
# extension or `/` (so `.ci/run`, without one, is not looked at). A trailing `:line`, `::item` or
# `#anchor` and trailing punctuation are dropped; `../` before a path in docs/ is
# resolved; globs and placeholders (`*`, `…`, `...`, `<`, `{`, `$`) are skipped.
# Paths relative to a crate (`amqp/run.rs`) are not checked.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dirs='crates|tests|scripts|docs|bench|sql|deploy|docker|k8s|\.ci|packaging|fuzz|examples'
# The token may follow only a character that cannot be part of a longer path.
re="(^|[^[:alnum:]_./-])(\\.\\./)*($dirs)/[^][:space:]\`()\"',;|]*"

status=0 checked=0
while IFS= read -r doc; do
  while IFS= read -r hit; do
    line=${hit%%:*}
    token=${hit#*:}
    # The character before the token, if any.
    [[ $token =~ ^[^.a-zA-Z] ]] && token=${token:1}
    case $token in *'*'* | *'…'* | *'...'* | *'<'* | *'{'* | *'$'*) continue ;; esac
    token=${token%%#*}
    token=${token%%:*}
    while [[ $token =~ [.!?\>]$ ]]; do token=${token%?}; done
    [[ $token =~ (\.[A-Za-z0-9]+|/)$ ]] || continue
    path=$token
    if [[ $path == ../* ]]; then
      [[ $doc == docs/* ]] || continue
      path=${path#../}
    fi
    checked=$((checked + 1))
    if [[ ! -e $path ]]; then
      echo "check-docs: $doc:$line: $token does not exist" >&2
      status=1
    fi
  done < <(grep -onE "$re" "$doc" || true)
done < <(find README.md docs -name '*.md' -type f | sort)

if [[ $checked == 0 ]]; then
  echo "check-docs: FAILED: no path found in README.md and docs/ (is the pattern broken?)" >&2
  exit 1
fi
if [[ $status != 0 ]]; then
  echo "check-docs: FAILED" >&2
  exit 1
fi
echo "check-docs: OK — $checked path(s) named in README.md and docs/ exist"
