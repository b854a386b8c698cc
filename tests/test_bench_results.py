"""Result files and the tables made from them: a report saved with ``--save`` loads back
and renders as it printed; the published pages and the README's headline table are what
``python -m fsharded.bench.publish`` makes from ``fsharded/bench/results/`` (so a table
cannot drift from its data); a file that is not a result, or a headline row that no file
has, is an error naming it."""

from __future__ import annotations

import json

import pytest

from fsharded.bench import Qty, Report, Row, Section, _results, publish


def _report() -> Report:
    r = Report("demo", params={"model": "tiny"})
    r.sections.append(Section("step time", "the eager loop", (Row("step", "8x16", 0.012, 0.010),), target=1.0,
                              notes=("3 rounds",)))
    r.sections.append(Section("bytes", "DeepSpeed", (Qty("sent", "8x16", 2048.0, float("nan"), unit="B"),)))
    r.finish()
    return r


def test_a_saved_report_loads_and_renders_as_it_printed(tmp_path):
    r = _report()
    path = _results.save(r.to_dict(), tmp_path / "sub" / "demo.json")
    d = _results.load(path)
    assert _results.render(d) == r.markdown()
    row = d["sections"][0]["rows"][0]
    assert (row["ours"], row["peer"], row["cells"]) == (0.012, 0.010, ["step", "8x16", "12.00 ms", "10.00 ms", "1.20"])
    assert d["sections"][0]["summary"] == "target ours/peer <= 1.00: met by 0 of 1 rows"
    assert d["sections"][1]["rows"][0]["peer"] is None  # a peer not run: null, not NaN
    assert "machine: " in r.markdown() and d["machine"]["torch"]


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.pop("date"), "field 'date'"),
    (lambda d: d.update(format=99), "format 99"),
    (lambda d: d["sections"][0]["rows"][0]["cells"].pop(), "5 cells expected"),
    (lambda d: d.update(sections=[]), "no sections"),
])
def test_a_damaged_result_file_is_refused_naming_it(tmp_path, edit, message):
    d = _report().to_dict()
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(_results.ResultFileError, match=message) as e:
        _results.load(path)
    assert str(path) in str(e.value)


def test_a_printed_report_converts_back_to_the_same_tables():
    r = _report()
    (d,) = _results.from_markdown(r.markdown(), "printed.md")
    assert d["converted_from"] == "printed.md" and d["bench"] == "demo"
    text = _results.render(d)
    drop = ("- machine:", "- converted from")
    assert [ln for ln in text.splitlines() if not ln.startswith(drop)] == \
        [ln for ln in r.markdown().splitlines() if not ln.startswith(drop)]


def test_the_published_tables_are_those_the_result_files_make():
    differ = publish.publish(check=True)
    assert not differ, (f"published benchmark tables differ from fsharded/bench/results/: {differ}; "
                        f"run python -m fsharded.bench.publish")


def test_every_headline_row_and_page_comes_from_a_result_file():
    found = publish.results()
    table = publish.headline(found)
    assert len(table.splitlines()) == 2 + len(publish.HEADLINE)
    pages = publish.pages(found)
    for path, d in found:
        assert f"fsharded/bench/results/{path.name}" in pages[f"{d['bench']}.md"]
        assert d["command"] in pages[f"{d['bench']}.md"]


def test_a_headline_row_no_file_has_is_an_error(monkeypatch):
    monkeypatch.setattr(publish, "HEADLINE", (publish.Headline("x", "zero", "no such section", "no such row"),))
    with pytest.raises(publish.PublishError, match="in no result file"):
        publish.headline(publish.results())


def test_run_args_name_the_variant():
    assert publish.run_args("python -m fsharded bench zero --markdown") == ()
    assert publish.run_args("fsharded bench zero --stages 3 --save x.json --zero3-keep") == ("--stages", "3",
                                                                                            "--zero3-keep")
    assert publish.run_args("fsharded bench seq --plot a.png --save=b.json --ranks 4") == ("--ranks", "4")
