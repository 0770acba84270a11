"""`evotune new-family NAME` writes a scaffold whose own CPU test passes as generated, and refuses a bad name or an
existing folder with one line (exit 2)."""

from __future__ import annotations

import pytest

from evotune.cli.new_family import scaffold


def test_scaffold_test_passes_as_generated(tmp_path, main_in_process, monkeypatch):
    """The command writes kernel, family file, reference and test; that test (run by pytest in this process) passes."""
    monkeypatch.chdir(tmp_path)
    done = main_in_process("new-family", "myaxpy")
    assert done.returncode == 0, done.stderr
    written = sorted(p.name for p in (tmp_path / "myaxpy").iterdir())
    assert written == ["myaxpy.cu", "myaxpy.yaml", "reference.py", "test_myaxpy.py"]
    assert "evotune search --family myaxpy/myaxpy.yaml" in done.stdout
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        str(tmp_path / "myaxpy" / "test_myaxpy.py")])
    assert code == 0


@pytest.mark.parametrize("name, said", [("my-fam", "must be an identifier"), ("class", "must be an identifier")])
def test_bad_names_are_one_line(tmp_path, main_in_process, monkeypatch, name, said):
    """A name that cannot name a C++ function is refused before anything is written."""
    monkeypatch.chdir(tmp_path)
    done = main_in_process("new-family", name)
    assert done.returncode == 2 and said in done.stderr and list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_not_overwritten(tmp_path):
    """A folder that exists is left as it is."""
    (tmp_path / "fam").mkdir()
    with pytest.raises(Exception, match="already exists"):
        scaffold("fam", tmp_path / "fam")
    assert list((tmp_path / "fam").iterdir()) == []
