"""Output directories (report, plot): staged and renamed into place, locked, no symlinks."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli
from gptcalc.errors import ConfigError
from reports.output import LOCK_NAME, staged_output


def listing(d):
    return {p.name: p.read_bytes() for p in d.iterdir() if p.name != LOCK_NAME
            and not p.name.startswith(".gptcalc-staging-")}


def test_a_complete_run_renames_every_file_into_place(tmp_path):
    (tmp_path / "report.md").write_text("old")
    with staged_output(tmp_path) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".")
        (staging / "report.md").write_text("new")
        (staging / "plot.png").write_bytes(b"png")
        assert listing(tmp_path)["report.md"] == b"old"  # nothing final until the end
    assert listing(tmp_path) == {"report.md": b"new", "plot.png": b"png"}
    # and no lock file left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "report.md"]


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_run_leaves_the_directory_as_it_was(tmp_path, error):
    (tmp_path / "report.md").write_text("old")
    before = listing(tmp_path)
    with pytest.raises(error):
        with staged_output(tmp_path) as staging:
            (staging / "plot.png").write_bytes(b"")  # a half-written file
            raise error()
    assert listing(tmp_path) == before  # no 0-byte final name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


def test_a_symlinked_output_name_is_refused_and_nothing_moves(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        with staged_output(out) as staging:
            (staging / "a.png").write_bytes(b"png")
            (staging / "report.md").write_text("new")
    assert target.read_text() == "keep me" and not (out / "a.png").exists()


def test_a_second_run_on_the_same_directory_is_refused(tmp_path):
    with staged_output(tmp_path):
        with pytest.raises(ConfigError, match="busy"):
            with staged_output(tmp_path):
                pass
    with staged_output(tmp_path):  # released at the end of the first
        pass


def test_plot_command_refuses_a_symlink_and_a_busy_directory(tmp_path, monkeypatch):
    from reports import plots

    def one_plot(out_dir, cfg, wl, name, setup=None):  # the real plots take seconds; one file
        (out_dir / "kv_cache.png").write_bytes(b"png")
        return []

    monkeypatch.setattr(plots, "make_plots", one_plot)
    (tmp_path / "kv_cache.png").symlink_to(tmp_path / "target.png")
    r = CliRunner().invoke(cli, ["plot", "--preset", "debug", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--out" in r.stderr and "symbolic link" in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "target.png").exists()
    os.unlink(tmp_path / "kv_cache.png")
    with staged_output(tmp_path):
        r = CliRunner().invoke(cli, ["plot", "--preset", "debug", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "busy" in r.stderr
