"""`gptcalc report`: the tables hold the library's numbers, the HTML is self-contained and every
image in it loads in a real headless browser (Debian's chromium)."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gptcalc import Workload, count_flops, count_params, from_name

ROOT = Path(__file__).resolve().parents[1]
CFG = from_name("debug")
WL = Workload(2, 16)


@pytest.fixture(scope="module")
def report(debug_report):
    return debug_report  # tests/conftest.py: built once per session


@pytest.fixture(scope="module")
def md(report) -> str:
    return report.markdown.read_text()


def section(md: str, heading: str) -> str:
    """The text under a heading, up to the next heading of the same or a higher level."""
    m = re.search(rf"^(#+) {re.escape(heading)}\n", md, re.M)
    assert m, heading
    level = len(m.group(1))
    rest = md[m.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def rows(text: str) -> list[list[str]]:
    """Cells of every Markdown table row in text (header and separator lines dropped)."""
    out = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|\s*-", line):
            out.append([c.strip().strip("*") for c in line.strip("|").split("|")])
    return [r for r in out if r]


def num(cell: str) -> int:
    return int(cell.replace(",", "").replace("+", ""))


def test_the_title_is_the_models_name(report, md):
    assert md.startswith("# debug\n")
    assert "<title>debug</title>" in report.html.read_text()


@pytest.mark.parametrize("args,name", [
    (["--preset", "gpt2"], "gpt2"),
    (["--preset", "gpt2", "-L", "6"], "gpt2 (n_layer=6)"),
    (["--hf-config", "{dir}"], "Qwen2-0.5B"),  # the folder holding config.json
    (["--hf-config", "{dir}/config.json", "-L", "2"], "Qwen2-0.5B (n_layer=2)"),
    ([], "shakespeare-char"),
])
def test_model_name(tmp_path, args, name):
    import click
    from click.testing import CliRunner

    from gptcalc.cli.options import model_options
    from gptcalc.cli.options import model_name

    from .test_hf import QWEN2_05B

    folder = tmp_path / "Qwen2-0.5B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN2_05B))

    @click.command()
    @model_options
    @click.pass_context
    def show(ctx, model):
        click.echo(model_name(ctx))

    r = CliRunner().invoke(show, [a.format(dir=folder) for a in args])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == name


def test_parameter_table_holds_count_params(md):
    p = count_params(CFG)
    table = {r[0]: r for r in rows(section(md, "Parameters by component"))[1:]}
    assert num(table["total"][1]) == p.total
    for key, value in p.components.items():
        if value:
            assert num(table[key][1]) == value, key
    # and the parts in the table sum to the total row
    assert sum(num(r[1]) for k, r in table.items() if k != "total") == p.total


def test_flops_table_holds_count_flops(md):
    fc = count_flops(CFG, WL)
    table = {r[0]: r for r in rows(section(md, "FLOPs by component"))[1:]}
    assert num(table["total"][1]) == fc.forward_total // WL.seq_len
    assert num(table["total"][2]) == fc.backward_total // WL.seq_len
    for key, value in fc.forward.items():
        if value:
            assert num(table[key][1]) == value // WL.seq_len, key


def test_conventions_table(md):
    table = {r[0]: r for r in rows(section(md, "Published conventions compared"))[1:]}
    # 6N from the parameter count directly
    assert num(table["6N"][1]) == 6 * count_params(CFG).total
    assert set(table) >= {"6N", "kaplan", "palm"}


def test_verification_table_all_equal(md):
    body = rows(section(md, "Verification: analytic vs measured"))
    header, data = body[0], body[1:]
    assert header[:5] == ["quantity", "analytic", "measured", "difference", "agrees"]
    assert len(data) >= 10
    assert all(r[4].startswith("yes") for r in data), [r for r in data if r[4] != "yes"]
    by_name = {r[0]: r for r in data}
    assert num(by_name["params total"][2]) == count_params(CFG).total
    # the memory checks run_checks appends: saved activations and model states, exact
    for name in ("saved activation bytes", "weight bytes", "optimizer state bytes"):
        assert by_name[name][3] == "+0", by_name[name]
    assert num(by_name["weight bytes"][2]) == 4 * count_params(CFG).total  # fp32
    # measured at the report's own workload, saying which tensors ran (debug is cheap: real)
    text = section(md, "Verification: analytic vs measured")
    assert f"B = {WL.batch_size} and S = {WL.seq_len}" in text and "real tensors" in text


def test_memory_section_sums(md):
    table = {r[0]: r for r in rows(section(md, "Memory"))[1:6 + 1]}
    parts = ["weights", "gradients", "optimizer", "activations", "logits"]
    assert sum(num(table[k][1]) for k in parts) == num(table["sum (all at once)"][1])
    # fp32 weights: 4 bytes per parameter
    assert num(table["weights"][1]) == 4 * count_params(CFG).total


def test_size_claim_measured(md):
    text = section(md, "Is model size independent of the context length?")
    data = rows(text)[1:]
    E = CFG.n_embd
    T0, P0 = num(data[0][0]), num(data[0][1])
    for r in data:
        T, measured, analytic = num(r[0]), num(r[1]), num(r[2])
        assert measured == analytic
        assert measured - P0 == (T - T0) * E  # only the T x E position table grows
        assert num(r[5]) == CFG.n_layer * T * T  # one T x T tril buffer per block


def test_cost_claim_measured(md):
    text = section(md, "How does the cost of one token grow with T?")
    data = rows(text)[1:]
    L, E = CFG.n_layer, CFG.n_embd
    for r in data:
        T = num(r[0])
        # q @ k^T and att @ v over the full T x T: 2 * 2 * L * T * T * E per sequence
        assert num(r[3]) == 4 * L * E * T
    fits = re.findall(r"exponent \*\*([0-9.]+)\*\*", text)
    assert len(fits) == 4
    per_token, attention, no_cache, cached = map(float, fits)
    assert attention == pytest.approx(1.0, abs=1e-3)
    assert 0 < per_token < 1 and 1 < no_cache < 2


def test_html_has_the_same_numbers(report, md):
    page = html.unescape(report.html.read_text())
    numbers = set(re.findall(r"\d[\d,]*\.?\d*", md))
    missing = [n for n in numbers if n not in page]
    assert not missing, missing[:10]


def test_html_is_self_contained(report):
    page = report.html.read_text()
    assert "<script" not in page and "<link" not in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    srcs = re.findall(r'<img src="([^"]+)"', page)
    assert len(srcs) == len(report.plots) >= 7
    for src in srcs:
        f = report.out_dir / src
        assert f.parent == report.out_dir and f.read_bytes()[:4] == b"\x89PNG"
    assert srcs == re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.markdown.read_text())


# ---------------------------------------------------------------- a real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

_PROBE = """<script>
window.addEventListener('load', function () {
  var out = [];
  for (var i = 0; i < document.images.length; i++) {
    var im = document.images[i];
    out.push({src: im.getAttribute('src'), loaded: im.complete && im.naturalWidth > 0});
  }
  var pre = document.createElement('pre');
  pre.id = 'image-probe';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def browser_image_status(page: Path, tmp: Path) -> list[dict]:
    """Open `page` (a copy beside it, with a probe script) in headless chromium; for every
    <img>, whether the browser decoded it (naturalWidth > 0)."""
    probe = page.with_name("probe-" + page.name)
    probe.write_text(page.read_text().replace("</body>", _PROBE + "</body>"))
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp / 'chromium-profile'}",
           "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        probe.unlink()
    m = re.search(r'<pre id="image-probe">(.*?)</pre>', r.stdout, re.S)
    assert m, f"no probe output; chromium said: {r.stderr[-2000:]}"
    return json.loads(html.unescape(m.group(1)))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_every_image_loads_in_chromium(report, tmp_path):
    status = browser_image_status(report.html, tmp_path)
    assert sorted(s["src"] for s in status) == sorted(p.path.name for p in report.plots)
    assert all(s["loaded"] for s in status), status


_WIDTH_PROBE = """<script>
window.addEventListener('load', function () {
  var pre = document.createElement('pre');
  pre.id = 'width-probe';
  var root = document.documentElement;
  var wide = [];
  document.querySelectorAll('.table-wrap').forEach(function (w) {
    if (w.scrollWidth > w.clientWidth) wide.push(w.scrollWidth);
  });
  pre.textContent = JSON.stringify({page: root.scrollWidth, window: root.clientWidth,
                                    scrolling_tables: wide.length});
  document.body.appendChild(pre);
});
</script>"""


def browser_widths(page: Path, tmp: Path, width: int) -> dict:
    """The page's scroll width against the window's, in headless chromium `width` pixels
    wide, and how many tables scroll inside their own box."""
    probe = page.with_name("width-" + page.name)
    probe.write_text(page.read_text().replace("</body>", _WIDTH_PROBE + "</body>"))
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--hide-scrollbars", f"--window-size={width},800",
           f"--user-data-dir={tmp / 'chromium-profile'}", "--virtual-time-budget=10000",
           "--dump-dom", probe.as_uri()]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        probe.unlink()
    m = re.search(r'<pre id="width-probe">(.*?)</pre>', r.stdout, re.S)
    assert m, f"no probe output; chromium said: {r.stderr[-2000:]}"
    return json.loads(html.unescape(m.group(1)))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_wide_tables_scroll_inside_the_page_in_chromium(report, tmp_path):
    # a phone-sized window: the verification table's tool column alone is wider
    got = browser_widths(report.html, tmp_path, 480)
    assert got["page"] <= got["window"], got  # the page itself never scrolls sideways
    assert got["scrolling_tables"] >= 1, got  # the wide tables scroll in their boxes


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_the_browser_probe_sees_a_broken_image(tmp_path):
    # the probe can fail: a page whose image is missing reports it as not loaded
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><img src="missing.png"></body></html>')
    assert browser_image_status(page, tmp_path) == [{"src": "missing.png", "loaded": False}]


# ---------------------------------------------------------------- the command

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gptcalc", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a whole process: the report of the debug model
def test_report_command(tmp_path):
    r = _cli("report", "--preset", "debug", "--out", str(tmp_path), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.html").exists()
    assert "context sweep" in r.stderr  # the progress lines go to stderr
    assert "wrote" in r.stdout and "29,088 parameters" in r.stdout
    # golden: debug = gpt2 arch, L=2 E=32 T=16 V=97: wte 97*32 + wpe 16*32 + 2 blocks of
    # 12*32^2 + 13*32 (weights and biases of c_attn, c_proj, c_fc, mlp c_proj, two LayerNorms)
    # + ln_f 2*32 = 3104 + 512 + 2*(12288 + 416) + 64 = 29088 (nanoGPT's layout)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA present")
def test_report_cuda_without_cuda_is_an_error(tmp_path):
    from click.testing import CliRunner

    from gptcalc.cli import cli

    r = CliRunner().invoke(cli, ["report", "--preset", "debug", "--out", str(tmp_path),
                                 "--device", "cuda"])
    assert r.exit_code == 2
    assert "--device" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_report_on_cuda(tmp_path):
    from reports.report import build_report

    r = build_report(CFG, WL, tmp_path, device="cuda", name="debug", progress=False)
    assert r.facts["device"] == "cuda"
    body = rows(section(r.markdown.read_text(), "Verification: analytic vs measured"))[1:]
    assert all(row[4].startswith("yes") for row in body)


def test_verification_of_a_slow_workload_runs_shape_only_and_says_so():
    """A workload too slow to run for real is verified at its own size on FakeTensorMode,
    memory included, and the section names the mode."""
    from reports.document import to_markdown
    from reports.report import _verification_blocks

    wl = Workload(100_000, 16)  # debug at B = 100k: far above verify's real-work limit
    text = to_markdown(_verification_blocks(CFG, wl, "cpu"))
    data = {r[0]: r for r in rows(text)[1:]}
    assert "shape-only tensors" in text and "SHAPE-ONLY" in text and "B = 100000" in text
    assert data["step peak bytes"][4].startswith("yes") and "FakeTensorMode" in data["step peak bytes"][5]
    assert data["saved activation bytes"][3] == "+0"


# ---------------------------------------------------------------- the top of the page

def test_summary_answers_come_first(md):
    from gptcalc.gpus import GPUS
    from gptcalc.memory import memory_report
    from gptcalc.training import default_setup

    top = md.split("\n## ", 1)[0]  # everything above the first section
    answers = {r[0]: r[1] for r in rows(top)[1:]}
    assert answers["parameters"].startswith(f"{count_params(CFG).total:,} ")
    fc = count_flops(CFG, WL)
    flops = answers["training FLOPs per token (forward + backward)"]
    assert flops.startswith(f"{fc.training_total // WL.seq_len:,} ")
    peak = memory_report(CFG, WL, default_setup(CFG)).peak.bytes
    assert f"({peak:,} bytes)" in answers[f"training step peak (B = {WL.batch_size}, S = "
                                          f"{WL.seq_len})"]
    # the debug model's step is a few hundred KiB: it fits any catalogued GPU
    assert peak < GPUS["h100-sxm"].usable_memory_bytes
    assert answers["fits on one `h100-sxm`"].startswith("yes")
    assert re.match(r"\d+ of \d+ checks agree, on `cpu` with real tensors", answers["verified"])


def test_contents_links_every_section(report):
    page = report.html.read_text()
    nav = re.search(r'<nav class="contents">(.*?)</nav>', page, re.S)
    assert nav and page.index("<nav") < page.index("<h2")  # above the first section
    links = re.findall(r'href="#([^"]+)"', nav.group(1))
    ids = re.findall(r'<h2 id="([^"]+)"', page)
    assert links == ids and len(ids) >= 8
    assert "verification-analytic-vs-measured" in ids  # GitHub's slug of the heading


def test_every_table_scrolls_in_its_own_box(report):
    page = report.html.read_text()
    assert page.count("<table>") == page.count('<div class="table-wrap"><table>') > 5
    assert re.search(r"\.table-wrap\s*{[^}]*overflow-x:\s*auto", page)


def test_verification_measures_the_memory_sections_set_up(md):
    """The debug family trains under bf16 autocast with SDPA on CUDA: the verification runs
    that set-up on CPU kernels, and the Memory section shows both, the verified column equal
    to what the verification table measured."""
    verification = section(md, "Verification: analytic vs measured")
    assert "(sdpa attention, on `cpu`)" in verification
    assert "amp (bf16 autocast, fp32 weights)" in verification
    assert "device cuda -> cpu" in verification
    memory = section(md, "Memory")
    header = rows(memory)[0]
    assert header[1].startswith("assumed") and header[3].startswith("verified here")
    cats = {r[0]: r for r in rows(memory)[1:]}
    measured = {r[0]: r for r in rows(verification)[1:]}
    assert num(cats["weights"][3]) == num(measured["weight bytes"][2])
    assert num(cats["optimizer"][3]) == num(measured["optimizer state bytes"][2])
    assert "device cuda -> cpu" in memory


def test_the_verified_set_up_keeps_all_that_runs_on_one_device():
    from gptcalc import TrainingSetup
    from reports.report import setup_changes, verified_training

    setup = TrainingSetup(mode="amp", attn_impl="sdpa", device="cuda", recompute="full",
                          optimizer="lion", dp=4, zero=3, loss="chunked")
    v = verified_training(setup, "cpu")
    assert (v.mode, v.attn_impl, v.recompute, v.optimizer, v.loss) == (
        "amp", "sdpa", "full", "lion", "chunked")
    assert setup_changes(setup, v) == ["device cuda -> cpu", "dp 4 -> 1", "zero 3 -> 0"]
    assert setup_changes(v, verified_training(v, "cpu")) == []  # nothing left to change
