"""Reuters C50 as train/dev/test JSONL, for the long-versus-short study (benchmarks/long_vs_short.py).

    python -m benchmarks.reuters_c50 --git-dir MIRROR --out data/reuters_c50

Reuter_50_50 (UCI; texts from Reuters RCV1, research use): 50 journalists, 50 articles each in the
official train and test folders; the task is the author. MIRROR is a git directory holding the UCI
folders as `data/C50train/<author>/<id>newsML.txt` and `data/C50test/...` (zpantovic/Reuter_50_50 at
COMMIT). No dev split exists: --dev-per-author articles of each author's training ones (a seeded
shuffle) become dev. --authors N keeps N authors (a seeded sample, for a study sized to a small
machine) and --test-per-author M the first M of each one's test articles (a seeded shuffle).
Text is read as UTF-8, its CRLF line ends made LF and outer blanks stripped.
Nothing is downloaded; the study's results files name the commit.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import random
import subprocess

COMMIT = "cc6261d5b915f0d1b3f0979519c33d16e2012a18"


def _git(git_dir: pathlib.Path, *args: str, stdin: bytes | None = None) -> bytes:
  return subprocess.run(["git", "--git-dir", str(git_dir), *args], input=stdin, capture_output=True,
                        check=True).stdout


def read_split(git_dir: pathlib.Path, commit: str, folder: str) -> list[dict]:
  """Every article under `folder` at `commit`, in path order: {"text", "label", "source_file"}."""
  entries = []  # (path, blob id)
  for line in _git(git_dir, "ls-tree", "-r", commit, folder).decode().splitlines():
    meta, path = line.split("\t", 1)
    entries.append((path, meta.split()[2]))
  entries.sort()
  # `git cat-file --batch`: for each id a header "<id> blob <size>\n", the bytes, then "\n".
  stream = _git(git_dir, "cat-file", "--batch", stdin="\n".join(b for _, b in entries).encode() + b"\n")
  rows, at = [], 0
  for path, _ in entries:
    header_end = stream.index(b"\n", at)
    size = int(stream[at:header_end].split()[2])
    text = stream[header_end + 1:header_end + 1 + size].decode("utf-8")
    at = header_end + 1 + size + 1
    rows.append({"text": text.replace("\r\n", "\n").strip(), "label": path.split("/")[2],
                 "source_file": path})
  return rows


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--git-dir", type=pathlib.Path, required=True, help="the mirror's git directory")
  parser.add_argument("--commit", default=COMMIT)
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--dev-per-author", type=int, default=5)
  parser.add_argument("--authors", type=int, default=50, help="how many of the 50 authors to keep")
  parser.add_argument("--test-per-author", type=int, default=50, help="test articles kept per author")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if not 2 <= args.authors <= 50:
    parser.error(f"--authors must be in [2, 50]; got {args.authors}")
  if not 1 <= args.test_per_author <= 50:
    parser.error(f"--test-per-author must be in [1, 50]; got {args.test_per_author}")
  train_all = read_split(args.git_dir, args.commit, "data/C50train")
  test_all = read_split(args.git_dir, args.commit, "data/C50test")
  rng = random.Random(args.seed)
  kept = set(rng.sample(sorted({r["label"] for r in train_all}), args.authors))
  train_all = [r for r in train_all if r["label"] in kept]
  test_by_author = collections.defaultdict(list)
  for row in test_all:
    if row["label"] in kept:
      test_by_author[row["label"]].append(row)
  test = []
  for author in sorted(test_by_author):
    rows = list(test_by_author[author])
    rng.shuffle(rows)
    test += rows[:args.test_per_author]
  by_author = collections.defaultdict(list)
  for row in train_all:
    by_author[row["label"]].append(row)
  train, dev = [], []
  for author in sorted(by_author):
    rows = list(by_author[author])
    rng.shuffle(rows)
    dev += rows[:args.dev_per_author]
    train += rows[args.dev_per_author:]
  args.out.mkdir(parents=True, exist_ok=True)
  for name, rows in (("train", train), ("dev", dev), ("test", test)):
    rng.shuffle(rows)
    with open(args.out / f"{name}.jsonl", "w", encoding="utf-8") as f:
      f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"{name}: {len(rows)} articles, {len({r['label'] for r in rows})} authors")


if __name__ == "__main__":
  main()
