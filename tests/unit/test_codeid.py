"""What code a node runs (runtime/codeid.py): digests follow contents, not paths; a mismatch names the fix."""
from pathlib import Path

from unbroken.runtime.codeid import identity, mismatch, script_digest, source_digest


def test_the_source_digest_follows_every_file_and_its_name(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    first = source_digest(tmp_path)
    source_digest.cache_clear()
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    changed = source_digest(tmp_path)
    source_digest.cache_clear()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    assert source_digest(tmp_path) == first != changed
    source_digest.cache_clear()
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "c.py")
    assert source_digest(tmp_path) != first
    source_digest.cache_clear()


def test_a_script_is_known_by_its_content_not_its_path(tmp_path):
    a, b = tmp_path / "x" / "train.py", tmp_path / "y" / "train.py"
    for f in (a, b):
        f.parent.mkdir()
        f.write_text("print('hi')\n")
    assert script_digest((str(a), "--epochs", "2")) == script_digest((str(b),))
    b.write_text("print('hello')\n")
    assert script_digest((str(a),)) != script_digest((str(b),))
    assert script_digest(("unbroken.jobs.tiny_gpt",)) != script_digest((str(a),))


def test_a_mismatch_names_what_differs_and_the_fix(tmp_path):
    s = tmp_path / "train.py"
    s.write_text("pass\n")
    node0 = identity((str(s),))
    assert mismatch(dict(node0), node0, 1) is None
    why = mismatch({**node0, "script": "0" * 64}, node0, 2)
    assert "node 2's training script train.py" in why and "run the same script on every node" in why
    why = mismatch({**node0, "unbroken": "0.0.9"}, node0, 1)
    assert "runs unbroken 0.0.9" in why and "install the same unbroken on every node" in why
    assert Path(node0["script_name"]).name == "train.py"
