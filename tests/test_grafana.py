"""Grafana dashboards (`deploy/grafana/baton-*.json`, docs/metrics.md "Dashboards").

- every dashboard type-checks, with TypeScript's `tsc --strict`, against `Dashboard` from `@grafana/schema`
  (the classic dashboard JSON model that Grafana imports; pinned in deploy/grafana/package.json), and a
  broken copy of it does not (so the check bites);
- every panel has a title, the `${datasource}` Prometheus data source and at least one query; ids are unique,
  panels fit the 24-column grid, every `$variable` a query uses is defined;
- every metric a query names (PromQL `expr`s and variable queries) is a series that a real cluster (router +
  prefill + decode processes, MTP on, after a local-prefill and a disaggregated request) exports on /metrics,
  `_bucket` / `_sum` / `_count` / `_total` included; every label a selector matches, aggregates or joins on is
  one of those series' labels, and every label value a selector pins exists;
- together the dashboards query every metric Baton exports.

The npm packages are installed by `make test` (`npm ci --prefix deploy/grafana`); without Node.js or the
packages the type check fails, naming what is missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from baton.cli.cluster import Cluster
from baton.client import Client
from baton.node.metrics import NodeMetrics
from baton.router.metrics import RouterMetrics
from baton.transfer.stats import TransferStats
from tests.test_metrics import mtp_model, scrape  # noqa: F401  (mtp_model is a fixture)

GRAFANA = Path(__file__).parent.parent / "deploy" / "grafana"
DASHBOARDS = sorted(GRAFANA.glob("baton-*.json"))
TOOLING = {"package.json", "package-lock.json", "tsconfig.json"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Labels Prometheus adds to every scraped series; `le` is every histogram bucket's.
TARGET_LABELS = {"instance", "job"}
BUILTIN_VARS = {"__rate_interval", "__interval", "__range", "__all"}

METRIC = re.compile(r"\bbaton_[A-Za-z0-9_:]*")
SELECTOR = re.compile(r"\b(baton_[A-Za-z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r'\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
VARIABLE = re.compile(r"\$\{?(\w+)")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel that queries, rows' nested panels included."""
    out = []
    for p in dashboard.get("panels", []):
        if p["type"] == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def queries(dashboard: dict) -> list[str]:
    """Every PromQL string: panel targets and query variables."""
    out = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    out += [v["query"] for v in dashboard.get("templating", {}).get("list", []) if v["type"] == "query"]
    return out


def test_the_dashboards_are_there():
    assert [p.name for p in DASHBOARDS] == ["baton-node.json", "baton-overview.json"]
    # No other JSON file in deploy/grafana: a dashboard not named baton-*.json would escape these tests.
    assert {p.name for p in GRAFANA.glob("*.json")} == TOOLING | {p.name for p in DASHBOARDS}
    assert len({load(p)["uid"] for p in DASHBOARDS}) == len(DASHBOARDS)


# --- the type check ------------------------------------------------------------------------------------------

def tsc_command() -> list[str]:
    node = shutil.which("node")
    if node is None:
        pytest.fail("Node.js (`node`, >= 18) is not installed: tests/test_grafana.py type-checks the dashboards with "
                    "TypeScript. Install Node.js and npm, then `make test` (or `npm ci --prefix deploy/grafana`).")
    pins = load(GRAFANA / "package.json")["devDependencies"]
    for package, version in pins.items():
        installed = GRAFANA / "node_modules" / package / "package.json"
        if not installed.exists() or load(installed)["version"] != version:
            pytest.fail(f"deploy/grafana/node_modules lacks {package}@{version} (package.json's pin): run "
                        "`npm ci --prefix deploy/grafana` (`make test` does).")
    return [node, str(GRAFANA / "node_modules" / "typescript" / "bin" / "tsc")]


def typecheck(sources: dict[str, dict]) -> tuple[int, dict[str, list[str]]]:
    """Run `tsc --strict --noEmit` over `const dashboard: DashboardJson = <json>` per name; errors by name.

    The JSON starts on the file's second line, so an error's line number minus one is the JSON line.
    """
    cmd = tsc_command()
    # Inside deploy/grafana, so that `@grafana/schema` resolves to deploy/grafana/node_modules.
    work = Path(tempfile.mkdtemp(prefix=".typecheck-", dir=GRAFANA))
    try:
        for name, dashboard in sources.items():
            (work / f"{name}.ts").write_text("import type { DashboardJson } from '../dashboard-json';\n"
                                             f"export const dashboard: DashboardJson = {json.dumps(dashboard, indent=2)};\n")
        (work / "tsconfig.json").write_text(json.dumps({"extends": "../tsconfig.json",
                                                        "files": [f"{n}.ts" for n in sources]}))
        r = subprocess.run([*cmd, "--strict", "--noEmit", "-p", str(work)], capture_output=True, text=True,
                           timeout=120, cwd=GRAFANA)
    finally:
        shutil.rmtree(work)
    errors: dict[str, list[str]] = {}
    for line in (r.stdout + r.stderr).splitlines():
        m = re.match(r"\s*(?:\S*[/\\])?([\w.-]+)\.ts\((\d+),\d+\): (.*)", line)
        if m:
            errors.setdefault(m[1], []).append(f"JSON line {int(m[2]) - 1}: {m[3]}")
        elif line.strip() and not line.startswith(" "):
            errors.setdefault("", []).append(line)
    return r.returncode, errors


def break_grid(d):
    panels(d)[0]["gridPos"] = "x"


def break_threshold_mode(d):
    next(p for p in panels(d) if "thresholds" in p["fieldConfig"]["defaults"])[
        "fieldConfig"]["defaults"]["thresholds"]["mode"] = "sometimes"


def break_unknown_panel_field(d):
    panels(d)[0]["queries"] = panels(d)[0].pop("targets")


def break_variable_type(d):
    d["templating"]["list"][0]["type"] = "prometheus"


def break_schema_version(d):
    del d["schemaVersion"]


BREAKS = [break_grid, break_threshold_mode, break_unknown_panel_field, break_variable_type, break_schema_version]


def test_dashboards_type_check_against_grafana_schema_and_broken_ones_do_not():
    sources = {p.stem: load(p) for p in DASHBOARDS}
    rc, errors = typecheck(sources)
    assert rc == 0 and not errors, f"tsc rc={rc}: {json.dumps(errors, indent=1)}"
    # The same check on copies broken one way each: every copy fails, at least once for its own file.
    broken = {}
    for p in DASHBOARDS:
        for b in BREAKS:
            d = load(p)
            b(d)
            broken[f"{p.stem}.{b.__name__}"] = d
    rc, errors = typecheck(broken)
    assert rc != 0
    assert not errors.get(""), errors[""]
    assert set(errors) == set(broken), f"not caught: {sorted(set(broken) - set(errors))}"
    grid = errors[f"{DASHBOARDS[0].stem}.break_grid"]
    assert any("not assignable" in e for e in grid), grid


# --- panels and variables ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_has_a_title_a_datasource_and_a_query(path):
    d = load(path)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]] + [q["id"] for p in d["panels"] if p["type"] == "row" for q in p["panels"]]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    for p in panels(d):
        what = f"{path.name}: panel {p.get('id')} {p.get('title')!r}"
        assert p.get("title"), what
        assert p.get("datasource") == DATASOURCE, what
        assert p.get("targets"), what
        assert p["fieldConfig"]["defaults"].get("unit"), f"{what}: no unit"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), what
        for t in p["targets"]:
            assert t.get("expr") and t.get("datasource") == DATASOURCE, what
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, what
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE, v["name"]
    for q in queries(d):
        used = set(VARIABLE.findall(q)) - BUILTIN_VARS
        assert used <= set(variables), f"{path.name}: {q} uses undefined {sorted(used - set(variables))}"


def test_the_dashboards_query_every_metric_baton_exports():
    node = NodeMetrics("decode", "d0", TransferStats(), held_leases=lambda: 0, fallbacks=lambda: 0)
    exported = {fam.name + "_total" if fam.type == "counter" else fam.name
                for fam in (*RouterMetrics().registry.collect(), *node.registry.collect())}
    referenced = {re.sub(r"_(bucket|sum|count)$", "", m) for p in DASHBOARDS for q in queries(load(p))
                  for m in METRIC.findall(q)}
    assert sorted(exported - referenced) == []


# --- against a live scrape -----------------------------------------------------------------------------------

def test_every_queried_series_exists_in_a_live_scrape(mtp_model, tmp_path):  # noqa: F811
    engine_args = ("--block-size", "8", "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
                   "--num-kv-blocks", "128", "--speculative-tokens", "2")
    with Cluster(mtp_model, prefill_workers=1, decode_workers=1, local_prefill_threshold=4,
                 engine_args=engine_args, log_dir=str(tmp_path / "logs")) as cluster:
        with Client(cluster.router_addr) as client:
            for n in (3, 20):  # prefilled on the decode node; disaggregated (prefill node + NIXL pull)
                out = client.generate([(3 * i + n) % 8 for i in range(n)], max_tokens=8, ignore_eos=True)
                assert len(out.token_ids) == 8
        scrapes = [scrape(cluster.router_http_url + "/metrics"),
                   *(scrape(cluster.node_http_url(a) + "/metrics")
                     for a in (*cluster.prefill_addrs, *cluster.decode_addrs))]
    # series name -> label name -> values seen
    series: dict[str, dict[str, set[str]]] = {}
    for samples in scrapes:
        for name, by_labels in samples.items():
            labels = series.setdefault(name, {})
            for key in by_labels:
                for k, v in key:
                    labels.setdefault(k, set()).add(v)
    assert series["baton_router_routing_decisions_total"]["decision"] >= {"disaggregated", "local_prefill"}
    assert series["baton_node_info"]["role"] == {"prefill", "decode"}
    assert "baton_node_spec_acceptance_length_tokens" in series

    problems = []
    for path in DASHBOARDS:
        for q in queries(load(path)):
            names = set(METRIC.findall(q))
            missing = sorted(n for n in names if n not in series)
            if missing:
                problems.append(f"{path.name}: {missing} not exported: {q}")
                continue
            known = TARGET_LABELS | {"le"} | {lab for n in names for lab in series[n]}
            for name, body in SELECTOR.findall(q):
                assert MATCHER.sub("", body).strip() == "", f"cannot parse matchers {body!r} in {q}"
                for label, op, value in MATCHER.findall(body):
                    if label in TARGET_LABELS:
                        continue
                    if label not in series[name]:
                        problems.append(f"{path.name}: {name} has no label {label}: {q}")
                    elif op == "=" and value not in series[name][label]:
                        problems.append(f"{path.name}: {name}{{{label}={value!r}}} never exported: {q}")
            for group in LABEL_LISTS.findall(q):
                for label in filter(None, (s.strip() for s in group.split(","))):
                    if label not in known:
                        problems.append(f"{path.name}: label {label} is on none of {sorted(names)}: {q}")
    assert not problems, "\n".join(problems)
