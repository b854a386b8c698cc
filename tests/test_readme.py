"""The README's shard_map example runs and prints the manifest it shows; the training and
Hugging Face examples of the docs' guides run."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TRAINING = ROOT / "docs" / "guides" / "training.md"
YOUR_MODEL = ROOT / "docs" / "guides" / "your-model.md"


def test_readme_example_runs_and_matches_its_printed_manifest():
    text = README.read_text()
    code = re.search(r"## shard_map in one screen\s+```python\n(.*?)```", text, re.S).group(1)
    shown = re.search(r"```python\n.*?```\s+```\n(.*?)```", text[text.index("## shard_map in one screen"):], re.S).group(1)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "README.md", "exec"), {})
    assert buf.getvalue().strip() == shown.strip()


def test_readme_training_example_runs():
    text = TRAINING.read_text()
    code = re.search(r"# Training.*?```python\n(.*?)```", text, re.S).group(1)
    assert "range(1000)" in code
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code.replace("range(1000)", "range(2)"), str(TRAINING), "exec"), {})
    assert "total over data" in buf.getvalue() and "total over tensor" in buf.getvalue()


def test_readme_hugging_face_example_runs(tmp_path):
    """The "Your own model" section's Hugging Face example: every ZeRO stage, then
    load_into and save_pretrained, with no warning."""
    import pytest

    pytest.importorskip("transformers")
    text = YOUR_MODEL.read_text()
    section = text[text.index("# Your own model"):text.index("## Tensor parallelism for any")]
    code = [c for c in re.findall(r"```python\n(.*?)```", section, re.S) if "transformers" in c][0]
    out = tmp_path / "llama-trained"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(code.replace("/tmp/llama-trained", str(out)), str(YOUR_MODEL), "exec"), {})
    assert (out / "config.json").exists()
    # the model keeps its default (SDPA) attention, which fs.nn runs without torch's vmap fallback
    assert [str(w.message) for w in caught] == []
