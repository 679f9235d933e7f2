#!/usr/bin/env bash
# Keep a sweep's finished runs in git without their checkpoints: a run's record is its
# config.json, summary.json and metrics.jsonl, which is all `nobubble report` reads and all a
# sweep needs to find the run complete and skip it.
#
#   experiments/run_records.sh pack ROOT ARCHIVE     # ARCHIVE (.tar.xz) <- every finished run
#                                                    # under ROOT (replaces ARCHIVE)
#   experiments/run_records.sh unpack ARCHIVE ROOT   # add each run whose folder ROOT lacks; a
#                                                    # folder that exists is left as it is
#
# Runs are bitwise reproducible only on the same torch and CPU kind; the records say which
# commit and machine made them in each run's config.json and summary.json.
set -euo pipefail
usage() { sed -n '6,9p' "$0" >&2; exit 2; }
[ $# -eq 3 ] || usage
case $1 in
pack)
    root=$2 archive=$3
    [ -d "$root" ] || { echo "run_records.sh: $root is not a folder" >&2; exit 1; }
    list=$(mktemp)
    trap 'rm -f "$list" "$archive.partial"' EXIT
    # a run is finished when it has summary.json; its sweep log folder (_sweep) is left out
    (cd "$root" && find . -path ./_sweep -prune -o -name summary.json -print | sort |
        while read -r summary; do
            run=$(dirname "$summary")
            for f in config.json summary.json metrics.jsonl; do
                [ -f "$run/$f" ] && echo "$run/$f"
            done
        done) > "$list"
    [ -s "$list" ] || { echo "run_records.sh: no finished run under $root" >&2; exit 1; }
    tar -C "$root" --sort=name --owner=0 --group=0 --mtime=@0 -cJf "$archive.partial" -T "$list"
    mv "$archive.partial" "$archive"  # a failed pack leaves the old archive as it was
    echo "run_records.sh: $(grep -c summary.json "$list") runs -> $archive ($(du -h "$archive" | cut -f1))"
    ;;
unpack)
    archive=$2 root=$3
    [ -f "$archive" ] || { echo "run_records.sh: no archive $archive" >&2; exit 1; }
    mkdir -p "$root"
    tmp=$(mktemp -d "$root/.unpack.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    tar -C "$tmp" -xJf "$archive"
    added=0 kept=0
    while read -r summary; do
        run=$(dirname "${summary#"$tmp"/}")
        if [ -e "$root/$run" ]; then  # never mix a record into a folder that already exists
            kept=$((kept + 1))
        else
            mkdir -p "$(dirname "$root/$run")"
            mv "$tmp/$run" "$root/$run"
            added=$((added + 1))
        fi
    done < <(find "$tmp" -name summary.json | sort)
    echo "run_records.sh: $archive -> $root: $added runs added, $kept left as they were (folder exists)"
    ;;
*) usage ;;
esac
