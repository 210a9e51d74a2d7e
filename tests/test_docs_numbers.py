"""The numbers in README.md and docs/*.md are the numbers in benchmarks/results/.

`benchmarks.docs_numbers` maps each marked number (`<!--n:key-->value<!--/n-->`) to a results file,
a path into its JSON and a format. These tests fail when a marked number differs from its file, when
a registry entry cannot be read (missing file or field), and when a headline number of the README is
written without a marker. The fixtures are small JSON files written here, not the real results.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from benchmarks import docs_numbers as dn

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_marked_number_agrees_with_its_file():
  problems = dn.check()
  assert not problems, "\n".join(map(str, problems)) + (
      "\nrun `python -m benchmarks.docs_numbers --write` after a new measurement")


def test_every_registry_entry_reads_from_an_existing_file():
  failures = []
  for key, number in sorted(dn.REGISTRY.items()):
    try:
      text = dn.render(key)
    except (KeyError, FileNotFoundError, ValueError, TypeError) as e:
      failures.append(f"{key}: {e}")
      continue
    if not text or "nan" in text:
      failures.append(f"{key}: renders {text!r} from {number.file}")
  assert not failures, "\n".join(failures)


def test_no_unmarked_headline_number_in_the_readme():
  readme = (ROOT / "README.md").read_text()
  cells = dn.headline_cells(readme)
  # The quickstart result and the headline table's rows are what counts as headline numbers.
  assert any("test accuracy" in cell for _, cell in cells)
  assert len(cells) >= 15, cells
  unmarked = dn.unmarked_headline_numbers(readme)
  assert not unmarked, "\n".join(f"README.md:{line}: {n} in {cell!r}" for line, n, cell in unmarked)


# --- The machinery itself, on small fixtures ---------------------------------------------------

README = """# x

The quickstart: **<!--n:acc-->96.7<!--/n-->% accuracy, 8.0 min** (2026-12-02).

## Headline numbers

| what | number | measured on |
|---|---|---|
| memory, [8, 512, 12, 64] on v5p:2x2x2 | <!--n:mem-->224.5<!--/n--> MiB, 32k: 1.22× | 2-core VM, 2026-12-01 |

## Next

| what | number |
|---|---|
| not a headline | 17 |
"""


def test_headline_numbers_are_the_number_column_and_bold_spans():
  cells = dn.headline_cells(README)
  assert [cell for _, cell in cells] == [
      "<!--n:acc-->96.7<!--/n-->% accuracy, 8.0 min",
      "<!--n:mem-->224.5<!--/n--> MiB, 32k: 1.22×"]
  # Marked values, shapes in brackets, names (v5p, 2x2x2, 32k), dates and other tables don't count.
  assert [(line, n) for line, n, _ in dn.unmarked_headline_numbers(README)] == [(3, "8.0"), (9, "1.22")]


def _fixture(tmp_path, page: str, results: dict[str, object]) -> pathlib.Path:
  (tmp_path / "docs").mkdir()
  (tmp_path / "benchmarks" / "results").mkdir(parents=True)
  (tmp_path / "README.md").write_text(page)
  for name, data in results.items():
    (tmp_path / "benchmarks" / "results" / name).write_text(json.dumps(data))
  return tmp_path


ROWS = {"date": "2026-12-03", "rows": [{"impl": "a", "shape": [1, 8], "mem": {"temp": 3 * 2**20}},
                                        {"impl": "b", "shape": [1, 8], "mem": {"temp": 12 * 2**20}}]}


def test_check_flags_a_disagreement_and_write_fixes_it(tmp_path, monkeypatch):
  monkeypatch.setattr(dn, "REGISTRY", {
      "t.a": dn.Number("r.json", "rows.[impl=a,shape=1x8].mem.temp", ".1f", dn.MIB),
      "t.ratio": dn.Number("r.json", ("/", "rows.[impl=b].mem.temp", "rows.[impl=a].mem.temp"), ".2f"),
      "t.date": dn.Number("r.json", "date", "s")})
  root = _fixture(tmp_path, "a <!--n:t.a-->3.0<!--/n--> MiB, <!--n:t.ratio-->4.50<!--/n-->× "
                            "(<!--n:t.date-->2026-12-03<!--/n-->)\n", {"r.json": ROWS})
  problems = dn.check(root)
  assert [(p.where, p.key) for p in problems] == [("README.md:1", "t.ratio")]
  assert "'4.50'" in problems[0].message and "'4.00'" in problems[0].message
  assert dn.write(root) == ["README.md"]
  assert "<!--n:t.ratio-->4.00<!--/n-->" in (root / "README.md").read_text()
  assert dn.check(root) == []


def test_check_flags_missing_files_fields_unknown_and_unused_keys(tmp_path, monkeypatch):
  monkeypatch.setattr(dn, "REGISTRY", {
      "t.nofile": dn.Number("gone.json", "date", "s"),
      "t.nofield": dn.Number("r.json", "rows.[impl=a].mem.peak", "d"),
      "t.ambiguous": dn.Number("r.json", "rows.[shape=1x8].mem.temp", "d"),
      "t.unused": dn.Number("r.json", "date", "s")})
  root = _fixture(tmp_path, "<!--n:t.nofile-->x<!--/n--> <!--n:t.nofield-->1<!--/n-->\n"
                            "<!--n:t.ambiguous-->1<!--/n--> <!--n:t.unknown-->1<!--/n-->\n", {"r.json": ROWS})
  problems = {p.key: p for p in dn.check(root)}
  assert set(problems) == {"t.nofile", "t.nofield", "t.ambiguous", "t.unknown", "t.unused"}
  assert "gone.json" in problems["t.nofile"].message
  assert "'peak'" in problems["t.nofield"].message
  assert "matches 2 rows" in problems["t.ambiguous"].message
  assert "not in" in problems["t.unknown"].message
  assert problems["t.unused"].where == "REGISTRY"


def test_lookup_paths():
  data = {"rows": [{"a": {"b": 1}, "v": 2}, {"a": {"b": 3}, "v": 4}], "x": [5, 6]}
  assert dn.lookup(data, "rows.[a/b=3].v") == 4
  assert dn.lookup(data, "x.[-1]") == 6
  with pytest.raises(KeyError, match="no element 2"):
    dn.lookup(data, "x.[2]")
  with pytest.raises(KeyError, match="selects from a list"):
    dn.lookup(data, "rows.[0].a.[b=1]")
