#!/usr/bin/env bash
# Rebuilds data/corpus.txt, the text corpus of examples/transformer_lm, from this repository's own
# documentation: the Markdown files, then the doc and line comments of every tracked Rust file
# (comment markers stripped), in `git ls-files` order. Deterministic for a given commit.
#
#     bash data/make_corpus.sh    # run from anywhere inside the repository
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
out=data/corpus.txt
{
    for f in README.md BENCHMARKS.md CHANGELOG.md data/README.md; do
        [ -f "$f" ] && cat "$f" && echo
    done
    git ls-files '*.rs' | LC_ALL=C sort | while read -r f; do
        # Comment lines only (`//!`, `///`, `//`), markers and leading blanks removed.
        sed -n 's#^[[:space:]]*//[/!]\{0,1\} \{0,1\}##p' "$f"
        echo
    done
} | tr -d '\r' | cat -s > "$out"
wc -c "$out"
