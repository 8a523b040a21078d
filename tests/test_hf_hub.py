"""--hf-config org/name[@revision]: a Hub id read through huggingface_hub's cache, offline, from a
cache laid out the way huggingface_hub lays it out; a local path wins; each failure one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli

hub = pytest.importorskip("huggingface_hub")

COMMIT = "d04e592bb4f6aa9cfee91e2e20afa771667e1d4b"
# meta-llama/Llama-3.1-8B config.json as published on huggingface.co
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}
# Hand count (as tests/test_hf.py's Llama 3 8B row, the same weights): 2*128256*4096 +
# 32*(2*4096^2 + 2*4096*1024 + 3*4096*14336 + 2*4096) + 4096
LLAMA31_8B_TOTAL = 8_030_261_248


def hub_cache(root: Path, repo: str, raw: dict, commit: str = COMMIT) -> Path:
    """A cache as huggingface_hub writes it: models--org--name/{refs/main, snapshots/<commit>}."""
    repo_dir = root / "hub" / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(raw))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return root


def gptcalc(*args: str, home: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"))
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    return subprocess.run([sys.executable, "-m", "gptcalc", *args], capture_output=True,
                          text=True, env=env, cwd=cwd)


def test_hub_id_from_an_offline_cache(tmp_path):
    home = hub_cache(tmp_path / "hf", "meta-llama/Llama-3.1-8B", LLAMA31_8B)
    r = gptcalc("params", "--hf-config", "meta-llama/Llama-3.1-8B", home=home)
    assert r.returncode == 0, r.stderr
    assert f"{LLAMA31_8B_TOTAL:,}" in r.stdout
    # pinned to the cached commit, and to main through refs/main
    for ref in (f"@{COMMIT}", "@main"):
        r = gptcalc("params", "--hf-config", f"meta-llama/Llama-3.1-8B{ref}", "--json", home=home)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["total"] == LLAMA31_8B_TOTAL


@pytest.mark.parametrize("ref", ["meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-8B@v2"])
def test_offline_and_not_cached_is_one_line(tmp_path, ref):
    home = hub_cache(tmp_path / "hf", "meta-llama/Llama-3.1-8B", LLAMA31_8B)
    r = gptcalc("params", "--hf-config", ref, home=home)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("Error: --hf-config:"), r.stderr
    assert "HF_HUB_OFFLINE" in r.stderr and "cache" in r.stderr


def test_a_local_path_wins(tmp_path):
    home = hub_cache(tmp_path / "hf", "meta-llama/Llama-3.1-8B", LLAMA31_8B)
    local = tmp_path / "work" / "meta-llama" / "Llama-3.1-8B"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps(LLAMA31_8B | {"num_hidden_layers": 1}))
    r = gptcalc("params", "--hf-config", "meta-llama/Llama-3.1-8B", "--json", home=home,
                cwd=tmp_path / "work")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["total"] < LLAMA31_8B_TOTAL  # the one-block local file


def test_config_file_names_a_hub_id(tmp_path):
    home = hub_cache(tmp_path / "hf", "meta-llama/Llama-3.1-8B", LLAMA31_8B)
    (tmp_path / "run.toml").write_text('[model]\nhf_config = "meta-llama/Llama-3.1-8B"\n')
    r = gptcalc("params", "--config", str(tmp_path / "run.toml"), "--json", home=home)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["total"] == LLAMA31_8B_TOTAL


def test_import_gptcalc_does_not_import_huggingface_hub():
    code = "import sys, gptcalc; assert 'huggingface_hub' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def _error(cls, message: str):
    """A huggingface_hub error without an HTTP response (their constructors want one)."""
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    return err


@pytest.mark.parametrize("error,needle", [
    ("GatedRepoError", "gated"),
    ("RepositoryNotFoundError", "nor repository on the Hub"),
    ("RevisionNotFoundError", "no revision 'v9'"),
    ("EntryNotFoundError", "has no config.json"),
    ("HfHubHTTPError", "the Hub answered"),
])
def test_hub_errors_are_one_line(monkeypatch, error, needle):
    from huggingface_hub import errors

    def fail(*args, **kwargs):
        raise _error(getattr(errors, error), "a long\nmulti-line server message")
    monkeypatch.setattr(hub, "hf_hub_download", fail)
    r = CliRunner().invoke(cli, ["params", "--hf-config", "org/model@v9"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("Error: --hf-config:"), r.stderr
    assert needle in r.stderr and "org/model@v9" in r.stderr


def test_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    r = CliRunner().invoke(cli, ["params", "--hf-config", "org/model"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "pip install 'gptcalc[hf]'" in r.stderr


def test_retry_warnings_do_not_break_the_one_line(tmp_path):
    # without a network huggingface_hub logs each retry on stderr before giving up; those
    # lines are silenced, so the refusal stays one line (a subprocess: the library's log
    # handler writes to the real stderr, which CliRunner does not capture)
    code = textwrap.dedent("""
        import sys, huggingface_hub
        from huggingface_hub import errors
        from huggingface_hub.utils import logging
        def fail(*args, **kwargs):
            logging.get_logger("huggingface_hub.utils._http").warning("Retrying in 8s [Retry 1/5].")
            raise errors.LocalEntryNotFoundError("not cached")
        huggingface_hub.hf_hub_download = fail
        from gptcalc.cli import main
        sys.argv = ["gptcalc", "params", "--hf-config", "org/model"]
        main()
    """)
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub")}
    env.pop("HF_HUB_OFFLINE", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.count("\n") == 1 and "the Hub cannot be reached" in r.stderr, r.stderr
