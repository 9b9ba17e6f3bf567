"""The ready-made monitoring: docs/grafana/gpupool.json and docs/prometheus/alerts.yml (issue 19).

promtool checks the rules and runs their unit tests (docs/prometheus/alerts_test.yml); mutated
copies of each rule, one that never fires and one that always does, show that those tests bite.
Every series the dashboard and the rules name is looked up in what a live pool server serves on
/metrics and in a worker's registry, with its labels and the label values the expressions match,
so a renamed metric or label fails here rather than leaving a blank panel or a silent alert.

No YAML library is a dependency: the rules file is read by a small line reader that knows only its
shape (`- alert:` items with an `expr:` key), checked against promtool's own count of the rules.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.job import JobState, Outcome
from daemon.metrics.worker import GpuSample, GpuShare, WorkerMetrics
from protocol import Enqueue, Enqueued
from tests.support.paths import ROOT
from tests.support.pool import Pool
from tests.support.workers import fake_gpus

DASHBOARD = ROOT / "docs" / "grafana" / "gpupool.json"
ALERTS = ROOT / "docs" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "docs" / "prometheus" / "alerts_test.yml"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="needs promtool (Debian's prometheus package, which `make test` installs when run as root)",
)

# Labels Prometheus adds to every scraped series, and series it makes itself rather than scrapes.
TARGET_LABELS = frozenset({"instance", "job"})
PROMETHEUS_SERIES = frozenset({"up"})
# Grafana's own variables; the dashboard's are in its templating list.
GRAFANA_VARIABLES = frozenset({"__rate_interval", "__interval", "__range"})
PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"}) | frozenset(
    {"and", "or", "unless", "offset", "bool", "inf", "nan"}
)
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


# -- reading PromQL, just enough to name its series and labels --


@dataclass(frozen=True, slots=True)
class Selector:
    metric: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)


def selectors(expr: str) -> list[Selector]:
    """Every series selector of `expr`: a metric name, with the label matchers in braces if any.
    Function names, keywords, label lists (by, on, ...) and durations are not series."""
    found = []
    text = GROUPING.sub(" ", expr)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations
    pattern = r"(?<![\w.:$])([a-zA-Z_:][\w:]*)\s*(\{(?:[^}\"]|\"(?:[^\"\\]|\\.)*\")*\})?(\s*\()?"
    for m in re.finditer(pattern, text):
        name, braces, call = m.group(1), m.group(2), m.group(3)
        if (call is not None and braces is None) or name.lower() in PROMQL_WORDS:
            continue
        matchers = re.findall(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', braces or "")
        found.append(Selector(name, tuple(matchers)))
    return found


def grouping_labels(expr: str) -> set[str]:
    """The labels named in `by (...)`, `on (...)` and the like."""
    labels: set[str] = set()
    for m in GROUPING.finditer(STRING.sub('""', expr)):
        labels |= {label.strip() for label in m.group(2).split(",") if label.strip()}
    return labels


@dataclass
class Exposition:
    """What daemons expose: every series name, and per name the labels and values seen."""

    names: set[str] = field(default_factory=set)
    labels: dict[str, dict[str, set[str]]] = field(default_factory=dict)

    def add(self, text: str) -> None:
        # A family is exposed even before it has a sample (a labelled counter before its first
        # increment): its TYPE line says which series names it will have.
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "info": ("_info",)}
        for family in text_string_to_metric_families(text):
            self.names |= {family.name + s for s in suffixes.get(family.type, ("",))}
            for sample in family.samples:
                self.names.add(sample.name)
                seen = self.labels.setdefault(sample.name, {})
                for label, value in sample.labels.items():
                    seen.setdefault(label, set()).add(value)


def problems(expr: str, exposed: Exposition) -> list[str]:
    """What in `expr` the daemons do not expose: a series name, a label of a series that has
    samples, a label value an equality matcher asks for and no sample has, a grouping label that
    none of the expression's series has."""
    found = []
    seen_labels = set(TARGET_LABELS)
    sampled = False
    for sel in selectors(expr):
        if sel.metric in PROMETHEUS_SERIES:
            continue
        if sel.metric not in exposed.names:
            found.append(f"no series {sel.metric}")
            continue
        labels = exposed.labels.get(sel.metric)
        if labels is None:  # exposed, not yet with a sample: its labels are unknown
            continue
        sampled = True
        seen_labels |= set(labels)
        for label, op, value in sel.matchers:
            if label in TARGET_LABELS:
                continue
            if label not in labels:
                found.append(f"{sel.metric} has no label {label}")
            elif op == "=" and "$" not in value and value not in labels[label]:
                found.append(f'{sel.metric}{{{label}="{value}"}} matches nothing ({sorted(labels[label])})')
    if sampled:
        found += [f"no series here has a label {label}" for label in grouping_labels(expr) - seen_labels]
    return found


# -- the two files --


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))  # a collapsed row holds its panels


def template_query(variable: dict[str, Any]) -> str:
    query = variable["query"]
    return str(query["query"] if isinstance(query, dict) else query)


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and, for `label_values(sel,
    label)` variables, `sum by (label) (sel)`, which names the same series and label."""
    d = dashboard()
    exprs = [t["expr"] for p in all_panels(d["panels"]) for t in p.get("targets", [])]
    for variable in d["templating"]["list"]:
        if variable["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", template_query(variable))
            assert m is not None, f"variable {variable['name']}: {template_query(variable)}"
            exprs.append(f"sum by ({m.group(2)}) ({m.group(1)})")
    return exprs


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    expr: str
    lines: tuple[int, int]  # the `expr:` key and its continuation lines: [start, end)
    text: str  # the whole rule


def read_rules(text: str) -> list[Rule]:
    """The alerting rules of a rules file shaped like alerts.yml: `- alert: NAME` items, each with
    `expr:` on one line or as a block scalar (`>-`, `|`) of more deeply indented lines."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"\s*- alert:", line)]
    rules = []
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        i = next(i for i in range(start, end) if lines[i].lstrip().startswith("expr:"))
        indent = len(lines[i]) - len(lines[i].lstrip())
        value = lines[i].split(":", 1)[1].strip()
        j = i + 1
        if value in (">", ">-", "|", "|-"):
            while j < end and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                j += 1
            while not lines[j - 1].strip():
                j -= 1
            value = " ".join(line.strip() for line in lines[i + 1 : j])
        name = lines[start].split(":", 1)[1].strip()
        rules.append(Rule(name, value, (i, j), "\n".join(lines[start:end])))
    return rules


def rule_tests(text: str) -> tuple[set[str], set[str]]:
    """The alerts alerts_test.yml expects to fire at some time, and those it expects silent."""
    firing: set[str] = set()
    silent: set[str] = set()
    for m in re.finditer(r"alertname: (\w+)\n\s*exp_alerts:(.*)", text):
        (silent if m.group(2).strip() == "[]" else firing).add(m.group(1))
    return firing, silent


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


# -- the reader itself --


def test_the_promql_reader_names_series_labels_and_what_is_missing() -> None:
    expr = (
        'sum by (queue) (rate(gpupool_jobs_finished_total{queue=~"$queue", state="dead"}[$__rate_interval]))'
        " > 0 unless on (queue, le) gpupool_queue_depth offset 30m"
        ' or histogram_quantile(0.99, sum by (le) (rate(gpupool_job_wait_seconds_bucket{queue="a}"}[5m])))'
    )
    assert [s.metric for s in selectors(expr)] == [
        "gpupool_jobs_finished_total",
        "gpupool_queue_depth",
        "gpupool_job_wait_seconds_bucket",
    ]
    assert selectors(expr)[0].matchers == (("queue", "=~", "$queue"), ("state", "=", "dead"))
    assert grouping_labels(expr) == {"queue", "le"}

    exposed = Exposition()
    exposed.add(
        "# TYPE gpupool_queue_depth gauge\n"
        'gpupool_queue_depth{queue="default"} 1\n'
        "# TYPE gpupool_jobs_finished counter\n"
        'gpupool_jobs_finished_total{queue="default",state="succeeded"} 1\n'
    )
    assert problems('gpupool_queue_depth{queue=~"x|y"} > 0', exposed) == []  # regexes: any value
    assert problems('gpupool_jobs_finished_total{queue=~"$queue"}', exposed) == []
    assert problems("gpupool_queue_depth{instance='a'} and up == 0", exposed) == []
    assert problems("gpupool_queue_depths", exposed) == ["no series gpupool_queue_depths"]
    assert problems('gpupool_queue_depth{q="default"}', exposed) == ["gpupool_queue_depth has no label q"]
    assert problems('gpupool_jobs_finished_total{state="lost"}', exposed) == [
        "gpupool_jobs_finished_total{state=\"lost\"} matches nothing (['succeeded'])"
    ]
    assert problems("max by (state) (gpupool_queue_depth)", exposed) == ["no series here has a label state"]


# -- promtool --


@needs_promtool
def test_promtool_accepts_the_rules_and_the_reader_finds_them_all() -> None:
    checked = promtool("check", "rules", str(ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    m = re.search(r"SUCCESS: (\d+) rules found", checked.stdout)
    assert m is not None, checked.stdout
    rules = read_rules(ALERTS.read_text())
    assert len(rules) == int(m.group(1))
    assert {r.name for r in rules} >= {
        "GpupoolWorkerDead",
        "GpupoolDeadLetters",
        "GpupoolQueueOnlyGrowing",
        "GpupoolGpuQuarantined",
        "GpupoolGpuUnhealthy",
        "GpupoolRedisUnreachable",
    }
    for rule in rules:
        assert re.search(r"^\s+for: \d+[smh]$", rule.text, re.M), f"{rule.name} has no `for:`"
        assert re.search(r"^\s+severity: (critical|warning)$", rule.text, re.M), f"{rule.name}: severity"
        for key in ("summary", "description"):
            assert re.search(rf"^\s+{key}: \S", rule.text, re.M), f"{rule.name} has no {key}"


@needs_promtool
def test_each_alert_fires_on_its_fault_and_is_silent_otherwise() -> None:
    tested = promtool("test", "rules", str(ALERTS_TEST))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    firing, silent = rule_tests(ALERTS_TEST.read_text())
    names = {r.name for r in read_rules(ALERTS.read_text())}
    assert names - firing == set(), "alerts no test expects to fire"
    assert names - silent == set(), "alerts no test expects to stay silent"


@needs_promtool
def test_the_rule_tests_catch_an_alert_that_never_or_always_fires(tmp_path: Path) -> None:
    text = ALERTS.read_text()
    lines = text.splitlines()
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    for rule in read_rules(text):
        start, end = rule.lines
        indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
        for mutant in ("vector(0) > 1", "vector(1)"):
            mutated = [*lines[:start], f"{indent}expr: {mutant}", *lines[end:]]
            (tmp_path / ALERTS.name).write_text("\n".join(mutated) + "\n")
            run = promtool("test", "rules", ALERTS_TEST.name, cwd=tmp_path)
            assert run.returncode != 0, f"{rule.name} as `{mutant}` passes the rule tests"
            assert f"alertname: {rule.name}," in run.stdout + run.stderr, run.stdout + run.stderr


@needs_promtool
def test_every_dashboard_expression_is_promql(tmp_path: Path) -> None:
    """Each expression, with Grafana's variables filled in, as a recording rule promtool parses."""
    fill = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$queue": ".*", "$worker": ".*"}
    rules = []
    for n, expr in enumerate(dashboard_exprs()):
        filled = expr
        for variable, value in fill.items():
            filled = filled.replace(variable, value)
        rules.append({"record": f"gpupool:dashboard_{n}", "expr": filled})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules)} rules found" in checked.stdout


# -- the dashboard --


def test_the_dashboard_imports_with_a_datasource_input_and_unique_panels() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 36
    assert d["uid"] == "gpupool"
    assert d["id"] is None  # Grafana gives it one on import
    inputs = {i["name"]: i for i in d["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    panels = list(all_panels(d["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) > 10
    queries = [p for p in panels if p["type"] != "row"]
    for panel in queries:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    for variable in d["templating"]["list"]:
        assert variable["datasource"] == DATASOURCE, variable["name"]


def test_the_dashboard_panels_do_not_overlap_and_fit_the_grid() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels(dashboard()["panels"]):
        g = panel["gridPos"]
        assert g["x"] >= 0, panel["title"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_the_dashboard_variables_are_defined() -> None:
    d = dashboard()
    defined = {v["name"] for v in d["templating"]["list"]} | GRAFANA_VARIABLES
    assert {"queue", "worker"} <= defined
    for panel in all_panels(d["panels"]):
        for target in panel.get("targets", []):
            used = set(re.findall(r"\$\{?(\w+)", target["expr"]))
            assert used <= defined, f"{panel['title']}: {sorted(used - defined)}"


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    used = {s.metric for expr in dashboard_exprs() for s in selectors(expr)}
    assert used >= {
        "gpupool_queue_depth",  # queue depth per queue
        "gpupool_job_wait_seconds_bucket",  # wait and run time percentiles
        "gpupool_job_run_seconds_bucket",
        "gpupool_jobs_finished_total",  # jobs by outcome
        "gpupool_pool_workers",  # workers by state
        "gpupool_gpu_utilization_ratio",  # per-GPU utilisation and memory
        "gpupool_gpu_memory_used_bytes",
        "gpupool_attempts_reclaimed_total",  # reclaims and dead letters
        "gpupool_jobs_dead_lettered_total",
    }
    percentiles = [e for e in dashboard_exprs() if "histogram_quantile" in e]
    assert all("_bucket" in e and "by (le" in e for e in percentiles)


# -- against what the daemons expose --


async def live_server_scrape(pool: Pool) -> str:
    """GET /metrics from the pool server once a job has gone through it, so that its per-queue
    series have samples: enqueued, waited, ran (a stand-in worker claims it) and finished."""
    assert pool.server.metrics_server is not None
    port = pool.server.metrics_server.port
    async with pool.client() as c:
        await c.call(Enqueue({"argv": ["true"]}, None), Enqueued)
    lease = await pool.queue.claim("stand-in", ["default"])
    assert lease is not None
    await pool.queue.complete(lease, Outcome(JobState.SUCCEEDED, exit_code=0))
    deadline = time.monotonic() + 10
    while True:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await writer.wait_closed()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        text = body.decode()
        if "gpupool_job_run_seconds_count{" in text or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.05)  # the server learns of the end from Redis's event stream


def worker_exposition() -> str:
    """A worker's registry as it builds it at start (WorkerMetrics with its GPUs and an NVML
    sampler), here with a made-up GPU and readings, after it has done a bit of everything."""
    gpu = fake_gpus(1)[0]
    sample = GpuSample(gpu.uuid, utilization=0.5, memory_used=2**30, memory_total=gpu.memory, temperature=40)
    metrics = WorkerMetrics([gpu], lambda: [sample])
    metrics.set_slots(1, 2)
    metrics.job_started("default")
    metrics.heartbeat(0.002)
    metrics.heartbeat_failed()
    metrics.transferred("upload", 10)
    metrics.set_quarantined([gpu.uuid])
    metrics.set_health({gpu.uuid: "lost"})
    metrics.set_shared([GpuShare(gpu.uuid, jobs=1, memory=2**30)])
    return generate_latest(metrics.registry).decode()


async def test_every_series_named_is_one_a_server_or_a_worker_exposes(pool: Pool) -> None:
    exposed = Exposition()
    exposed.add(await live_server_scrape(pool))
    exposed.add(worker_exposition())
    assert {"gpupool_queue_depth", "gpupool_job_run_seconds_bucket", "gpupool_gpu_utilization_ratio"} <= set(
        exposed.labels
    ), "the scrape lacks the samples this test relies on"
    exprs = dashboard_exprs() + [r.expr for r in read_rules(ALERTS.read_text())]
    assert len(exprs) > 20
    assert all(selectors(e) for e in exprs), [e for e in exprs if not selectors(e)]
    found = {e: p for e in exprs if (p := problems(e, exposed))}
    assert found == {}
