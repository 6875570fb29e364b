"""The workbench seen in a real browser: headless system Chromium driven by Playwright.

- The HTML report of every recorded bundle, opened from disk with the network blocked:
  every Plotly figure is drawn, no JS console errors, no request leaves the page.
  Screenshots go to test-artifacts/.
- JupyterLab serving the tour notebook: run all cells in the page (live kernel, real
  engines), then the stepper's widgets and its FigureWidget are drawn and the console is
  clean.

Skips only when /usr/bin/chromium is missing (.ci/run installs it). Playwright's own
browser download is never used.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
BUNDLES = sorted((ROOT / "fixtures" / "bundles").glob("*.wbundle"))
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"{CHROMIUM} is missing: install Debian's chromium (.ci/run does)")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Console:
    """Console errors, uncaught page errors and failed requests of one page."""

    def __init__(self, page):
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.on("requestfailed", lambda r: self.errors.append(f"request failed: {r.url} {r.failure}")
                if not r.url.startswith("ws") else None)


# -- the HTML report -------------------------------------------------------------------
@pytest.mark.parametrize("bundle_path", BUNDLES, ids=[b.name.removesuffix(".wbundle") for b in BUNDLES])
def test_report_draws_every_figure_offline(browser, bundle_path, recorded_report):
    from workbench.postmortem import bundle, report

    b = bundle.load(bundle_path)
    ARTIFACTS.mkdir(exist_ok=True)
    name = bundle_path.name.removesuffix(".wbundle")
    # report.write's page (render, then write_atomic), rendered once a run for every file that reads it (conftest)
    html_path = report.write_atomic(ARTIFACTS / f"report-{name}.html", recorded_report(name))
    n_figs = html_path.read_text(encoding="utf-8").count('class="plotly-graph-div"')
    assert n_figs >= 2 * len(b), "a report shows at least the per-step views of every run"

    ctx = browser.new_context(viewport={"width": 1300, "height": 900}, offline=True)
    outside: list[str] = []

    def block(route):  # anything but the file itself would mean the report is not self-contained
        outside.append(route.request.url)
        route.abort()

    ctx.route("http*://**", block)
    page = ctx.new_page()
    console = Console(page)
    page.goto(html_path.as_uri(), wait_until="load")
    page.wait_for_function(
        "n => document.querySelectorAll('.plotly-graph-div .main-svg').length >= n", arg=n_figs, timeout=60_000)
    drawn = page.evaluate("""() => Array.from(document.querySelectorAll('.plotly-graph-div')).map(gd => ({
        id: gd.id, traces: (gd._fullData || []).length, svg: gd.querySelectorAll('.main-svg').length,
        marks: gd.querySelectorAll('.heatmaplayer image, .scatterlayer path, .barlayer path, .shapelayer path')
               .length}))""")
    # the first screen, for a glance: a full-page shot of an 80-figure report took 12.8 s of this test
    page.screenshot(path=str(ARTIFACTS / f"report-{name}.png"))
    ctx.close()
    assert len(drawn) == n_figs
    assert [d["id"] for d in drawn] == [f"wb-fig-{i}" for i in range(1, n_figs + 1)]
    undrawn = [d for d in drawn if d["traces"] == 0 or d["svg"] == 0 or d["marks"] == 0]
    assert not undrawn, f"figures without drawn data: {undrawn}"
    assert console.errors == [], console.errors
    assert outside == [], f"the report reached for the network: {outside}"
    assert (ARTIFACTS / f"report-{name}.png").stat().st_size > 10_000


JOB = """
import sys, torch
from torch import nn
import workbench.job as wj


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.rotary_emb = nn.Linear(8, 8), Rotary()

    def forward(self, x):
        return self.lin(x) * self.rotary_emb.inv_freq.sum()


cap = wj.capture(sys.argv[1], name="train")
with torch.device("meta"):
    model = Model()
cap.point("meta", model=model)
model.to_empty(device="cpu")  # the user's bug: inv_freq (not persistent) is never written again
torch.manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
cap.point("materialize", model=model)
for i in range(3):
    out = model(torch.ones(2, 8))
    cap.point(f"step{i}", model=model, logits=out)
cap.close()
"""


def test_a_jobs_report_reads_as_a_jobs(browser, tmp_path):
    """The report of a job's own capture: its title once, no "bug path" (a job has no fix paths), the outline
    on the column where the story starts (the buffer never written after ``materialize``), and no horizontal
    scroll at 1300 px."""
    from workbench.postmortem import bundle, report

    script = tmp_path / "train.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKBENCH_CAPTURE", "RANK", "WORLD_SIZE"))}
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "train")], capture_output=True, text=True,
                         timeout=120, env={**env, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    b = bundle.load(tmp_path / "train")
    d = b.bug.diagnose()
    assert d.step == "materialize" and "inv_freq" in d.sentence, d.sentence
    ARTIFACTS.mkdir(exist_ok=True)
    path = report.write(b, ARTIFACTS / "report-job.html")
    text = path.read_text(encoding="utf-8")
    assert "bug path" not in text
    assert "<h1>train: the job&#x27;s own capture (no launcher, 1 rank(s))</h1>" in text
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    console = Console(page)
    page.goto(path.as_uri(), wait_until="load")
    page.wait_for_function("() => document.querySelectorAll('.plotly-graph-div .main-svg').length >= 2",
                           timeout=60_000)
    got = page.evaluate("""() => { const gd = document.getElementById('wb-fig-1');
        const x0 = gd.layout.shapes[0].x0, x1 = gd.layout.shapes[0].x1;
        return {scroll: document.documentElement.scrollWidth, width: document.documentElement.clientWidth,
                outlined: gd.layout.xaxis.categoryarray[Math.round((x0 + x1) / 2)],
                h1: document.querySelector('h1').textContent}; }""")
    page.screenshot(path=str(ARTIFACTS / "report-job.png"))
    page.close()
    assert got["outlined"] == "materialize", got
    assert got["scroll"] <= got["width"], f"the page scrolls sideways at 1300 px: {got}"
    assert got["h1"].count("train") == 1, got
    assert console.errors == [], console.errors


# -- the status views at 2 and 8 ranks -------------------------------------------------
@pytest.mark.parametrize("n", [2, 8])
def test_status_view_reads_at_a_glance(browser, n):
    """Categorical legend (a swatch per status, no colour bar), rows tall enough to read at any rank
    count, tick labels without the shared prefix and the full name on hover; screenshots kept."""
    import plotly.io as pio

    from workbench import viz
    from workbench.analysis.diagnosis import diagnose
    from workbench.analysis.synthetic import incident_step
    from workbench.postmortem import bundle
    from workbench.viz.diagnosis import figure as diagnosis_figure

    t = incident_step(n, odd=None if n == 2 else 3)
    figs = [viz.status_matrix(t, title=f"synthetic incident, {n} ranks", group=False)]
    if n == 2:
        figs.append(diagnosis_figure(diagnose(bundle.load(BUNDLES[[b.name for b in BUNDLES].index(
            "fsdp1-rotary-meta-init.wbundle")]).bug)))
    heat = figs[0].data[0]
    assert not any(x.startswith("model.") for x in heat.x) and "model.rotary_emb.inv_freq" in heat.text[0][0]
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"status-{n}-ranks.html"
    path.write_text("".join(pio.to_html(f, full_html=False, include_plotlyjs=i == 0, div_id=f"f{i}")
                            for i, f in enumerate(figs)), encoding="utf-8")
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    console = Console(page)
    page.goto(path.as_uri(), wait_until="load")
    page.wait_for_function("() => document.querySelectorAll('.main-svg').length >= 2", timeout=30_000)
    got = page.evaluate("""() => { const gd = document.getElementById('f0');
        return {colorbars: gd.querySelectorAll('.colorbar').length,
                legend: Array.from(gd.querySelectorAll('.legend .traces .legendtext')).map(e => e.textContent),
                plot_h: gd._fullLayout.yaxis._length}; }""")
    page.screenshot(path=str(ARTIFACTS / f"status-{n}-ranks.png"), full_page=True)
    page.close()
    assert got["colorbars"] == 0
    assert sorted(got["legend"]) == sorted(heat.meta["statuses"]) and len(got["legend"]) >= 3
    assert got["plot_h"] / n >= viz.tensors.ROW_PX_MIN - 1, got  # every rank row is readable
    assert console.errors == [], console.errors


# -- JupyterLab ------------------------------------------------------------------------
TOUR = ROOT / "notebooks" / "00_tour.ipynb"



@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a temp copy of the tour notebook; kernels shut down cleanly after."""
    if not TOUR.exists():
        pytest.fail(f"{TOUR.relative_to(ROOT)} is missing")
    root = tmp_path_factory.mktemp("lab")
    nb_name = TOUR.name
    shutil.copy(TOUR, root / nb_name)
    port, token = free_port(), "workbench-browser-test"
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(root / ".cfg"), JUPYTER_RUNTIME_DIR=str(root / ".rt"),
               JUPYTER_DATA_DIR=str(root / ".data"), PYTHONWARNINGS="ignore")
    log = open(root / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True", f"--LabApp.workspaces_dir={root / '.ws'}",
         f"--LabApp.user_settings_dir={root / '.settings'}", "--LabApp.news_url=",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"jupyter lab exited with {proc.returncode}: {(root / 'lab.log').read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("jupyter lab did not answer within 120 s")
            time.sleep(0.3)
    yield {"base": base, "token": token, "root": root, "notebook": nb_name}
    try:  # a graceful kernel shutdown lets the notebook's cluster stop its engines
        kernels = json.load(urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=5))
        for k in kernels:
            req = urllib.request.Request(f"{base}/api/kernels/{k['id']}?token={token}", method="DELETE")
            urllib.request.urlopen(req, timeout=30)
    except OSError:
        pass
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


RAN_UP_TO = """upto => {
  const nb = window.jupyterapp.shell.currentWidget;
  const kernel = nb && nb.sessionContext && nb.sessionContext.session && nb.sessionContext.session.kernel;
  if (!kernel || kernel.status !== 'idle') return false;
  return nb.content.widgets.slice(0, upto < 0 ? undefined : upto).every(
    c => c.model.type !== 'code' || c.model.executionCount !== null || !c.model.sharedModel.getSource().trim());
}"""
# Run every cell above the one that stops the cluster (so the stepper can still be driven), or all.
RUN_ABOVE_STOP = """async needle => {
  const app = window.jupyterapp, nb = app.shell.currentWidget;
  const idx = nb.content.widgets.findIndex(c => c.model.sharedModel.getSource().includes(needle));
  if (idx < 0) { app.commands.execute('notebook:run-all-cells'); return -1; }
  nb.content.activeCellIndex = idx;
  app.commands.execute('notebook:run-all-above');
  return idx;
}"""
RUN_REST = """idx => {
  const app = window.jupyterapp, nb = app.shell.currentWidget;
  nb.content.activeCellIndex = idx;
  app.commands.execute('notebook:run-all-below');
}"""


CELL_STATES = """() => window.jupyterapp.shell.currentWidget.content.widgets.map((c, i) =>
  `${i}:${c.model.type}:${c.model.executionCount}:${c.model.sharedModel.getSource().slice(0, 40)}`)"""


def _wait_ran(page, upto: int, timeout_ms: int) -> None:
    """Wait until the cells (above ``upto``) ran; on timeout keep a screenshot and say which did not."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(RAN_UP_TO, arg=upto, timeout=timeout_ms, polling=1000)
    except PlaywrightTimeout:
        page.screenshot(path=str(ARTIFACTS / "lab-tour-timeout.png"), full_page=True)
        pytest.fail(f"cells did not finish in {timeout_ms / 1000:.0f} s: {page.evaluate(CELL_STATES)}")


@pytest.mark.slow
def test_lab_tour_stepper_and_figurewidget_render(browser, lab):
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    console = Console(page)
    page.goto(f"{lab['base']}/lab/tree/{lab['notebook']}?token={lab['token']}&reset", wait_until="load")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.wait_for_function("""() => { const nb = window.jupyterapp && window.jupyterapp.shell.currentWidget;
        const s = nb && nb.sessionContext && nb.sessionContext.session;
        return !!(s && s.kernel && s.kernel.status === 'idle'); }""", timeout=120_000)
    stop_at = page.evaluate(RUN_ABOVE_STOP, "cluster.stop()")
    _wait_ran(page, stop_at, 300_000)
    out = ".jp-OutputArea-output"
    # The stepper: ipywidgets buttons and a plotly FigureWidget drawn from its live model.
    page.wait_for_selector(f"{out} .widget-button", timeout=60_000)
    page.wait_for_selector(f"{out} .jupyter-widgets .js-plotly-plot .main-svg", timeout=60_000)
    buttons = page.eval_on_selector_all(f"{out} .widget-button", "els => els.map(e => e.textContent.trim())")
    widget_plots = page.eval_on_selector_all(
        f"{out} .jupyter-widgets .js-plotly-plot",
        "els => els.map(e => ({traces: (e._fullData || []).length, image: e.querySelectorAll('.heatmaplayer image,"
        " .scatterlayer path, .barlayer path').length}))")
    errors_in_cells = page.eval_on_selector_all(
        "[data-mime-type='application/vnd.jupyter.error'], .jp-OutputArea-output .jp-RenderedText[data-mime-type="
        "'application/vnd.jupyter.stderr'] .ansi-red-fg", "els => els.map(e => e.textContent.slice(0, 300))")
    unrendered = page.eval_on_selector_all(
        f"{out}", "els => els.filter(e => /Error displaying widget|Loading widget/.test(e.textContent))"
                  ".map(e => e.textContent.slice(0, 200))")
    # Drive the stepper from the page: Reset, then Next; the FigureWidget redraws from the kernel.
    stepper = page.locator(".widget-vbox").filter(has=page.locator(".widget-button", has_text="Next")).filter(
        has=page.locator(".js-plotly-plot")).last
    title = stepper.locator(".js-plotly-plot .gtitle").first
    reset = stepper.locator(".widget-button", has_text="Reset")
    if reset.count():
        reset.first.click()
        page.wait_for_function("el => /press/i.test(el.textContent)", arg=title.element_handle(), timeout=60_000)
    before = title.text_content()
    stepper.locator(".widget-button", has_text="Next").first.click()
    page.wait_for_function("([el, old]) => el.textContent !== old", arg=[title.element_handle(), before],
                           timeout=120_000)
    after = title.text_content()
    stepper.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "lab-tour.png"), full_page=False)
    if stop_at >= 0:  # the rest of the tour, cluster.stop() included
        page.evaluate(RUN_REST, stop_at)
        _wait_ran(page, -1, 240_000)
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_timeout(2000)
    late_errors = page.eval_on_selector_all(
        "[data-mime-type='application/vnd.jupyter.error']", "els => els.map(e => e.textContent.slice(0, 300))")
    page.close()
    assert late_errors == [], late_errors
    assert "after" in after and after != before, (before, after)
    assert any("next" in b.lower() for b in buttons), f"no stepper 'Next' button among {buttons}"
    assert widget_plots and all(p["traces"] > 0 and p["image"] > 0 for p in widget_plots), widget_plots
    assert unrendered == [], unrendered
    assert errors_in_cells == [], errors_in_cells
    assert console.errors == [], console.errors
    saved_path = lab["root"] / lab["notebook"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the save is asynchronous
        saved = json.loads(saved_path.read_text())
        if all(c.get("execution_count") for c in saved["cells"] if c["cell_type"] == "code"):
            break
        time.sleep(0.5)
    assert all(c.get("execution_count") for c in saved["cells"] if c["cell_type"] == "code"), "not saved executed"
    failed = [o for c in saved["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not failed, f"cells raised: {[f['ename'] + ': ' + f['evalue'] for f in failed]}"
