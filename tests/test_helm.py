"""The Helm chart `deploy/helm/baton`: `helm lint --strict`, `helm template` for the default values and for
`ci/all-values.yaml` (every switch on), every manifest against the Kubernetes schema, and the wiring the
schema cannot see — the router's worker addresses against the StatefulSets and headless Services, probes on
the HTTP port's /health, non-root security, engine flags through the ConfigMap, and every command-line flag
against the processes' own `--help`.

Offline: helm-python-sdk embeds Helm as a native library and kubernetes-validate ships its schemas.
"""

from __future__ import annotations

import base64
import importlib
import io
import re
from contextlib import redirect_stdout
from functools import cache
from pathlib import Path

import helm_python as helm
import kubernetes_validate as kv
import pytest
import yaml

from baton.proto.auth import CLUSTER_SECRET_ENV, ClusterCredential

CHART = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "baton"
ALL_VALUES = CHART / "ci" / "all-values.yaml"
RELEASE, NAMESPACE = "demo", "serving"
KUBE_VERSION = kv.utils.latest_version()
MODULES = {"router": "baton.router.server", "prefill": "baton.prefill_node.server",
           "decode": "baton.decode_node.server"}
CASES = ["default", "all"]


def values(case: str) -> dict | None:
    return None if case == "default" else yaml.safe_load(ALL_VALUES.read_text())


def render(vals: dict | None) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(vals, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@cache
def manifests(case: str) -> tuple[dict, ...]:
    return tuple(render(values(case)))


def one(docs, kind: str, component: str | None = None) -> dict:
    found = of_kind(docs, kind, component)
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
    return found[0]


def of_kind(docs, kind: str, component: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind
            and (component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)]


def workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def arg_map(args: list[str]) -> dict[str, list[str]]:
    """`--flag v1 v2 --other v` -> {"--flag": ["v1", "v2"], "--other": ["v"]} (later repeats extend)."""
    out: dict[str, list[str]] = {}
    cur = None
    for a in args:
        if a.startswith("--"):
            cur = a
            out.setdefault(cur, [])
        else:
            assert cur is not None, f"positional argument {a!r} in {args}"
            out[cur].append(a)
    return out


def port(c: dict, name: str) -> int:
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return p


def svc_port(svc: dict, name: str) -> dict:
    (p,) = [p for p in svc["spec"]["ports"] if p["name"] == name]
    return p


def expand(c: dict, docs) -> list[str]:
    """The container's args with $(VAR) replaced as the kubelet does, from literal env values and the
    chart's ConfigMap (asserts every reference resolves)."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            cms = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref["name"]]
            assert cms, f"env {e['name']} refers to ConfigMap {ref['name']} that the chart does not create"
            assert ref["key"] in cms[0]["data"], f"ConfigMap {ref['name']} lacks key {ref['key']}"
            env[e["name"]] = cms[0]["data"][ref["key"]]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = f"<{e['valueFrom']['fieldRef']['fieldPath']}>"

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) in args is not defined in the container's env"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in c["args"]]


@pytest.mark.parametrize("case", CASES)
def test_lint_strict(case):
    report = helm.lint(str(CHART), values(case), strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("case", CASES)
def test_manifests_pass_kubernetes_schema(case):
    docs = manifests(case)
    kinds = sorted(d["kind"] for d in docs)
    expected = ["ConfigMap", "Deployment", "PodDisruptionBudget", "PodDisruptionBudget", "PodDisruptionBudget",
                "Service", "Service", "Service", "ServiceAccount", "StatefulSet", "StatefulSet"]
    if case == "all":
        expected += ["HorizontalPodAutoscaler", "ServiceMonitor"]
    else:  # all-values names an existing cluster Secret
        expected += ["Secret"]
    assert kinds == sorted(expected)
    for d in docs:
        if d["kind"] == "ServiceMonitor":  # a CRD: checked by test_service_monitor
            continue
        kv.validate(d, KUBE_VERSION, strict=True)


def with_discovery(case: str, discovery: str) -> dict:
    vals = values(case) or {}
    vals.setdefault("router", {})["discovery"] = discovery
    return vals


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("discovery", ["dns", "static"])
def test_router_addresses_match_statefulsets(case, discovery):
    """dns: the router resolves each headless Service; static: it is given every pod's DNS name, as many as
    the StatefulSet has replicas (or its HPA's maxReplicas)."""
    vals = with_discovery(case, discovery)
    docs = render(vals)
    router = container(one(docs, "Deployment", "router"))
    args = arg_map(router["args"])
    hpas = of_kind(docs, "HorizontalPodAutoscaler")
    domain = vals.get("clusterDomain", "cluster.local")
    for role in ("prefill", "decode"):
        sts = one(docs, "StatefulSet", role)
        svc = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"]]
        assert len(svc) == 1, f"{role}: serviceName {sts['spec']['serviceName']} is not a Service of the chart"
        svc = svc[0]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        node = container(sts)
        node_args = arg_map(node["args"])
        grpc = svc_port(svc, "grpc")
        assert grpc["targetPort"] == "grpc" and grpc["port"] == port(node, "grpc")
        assert node_args["--port"] == [str(port(node, "grpc"))]
        assert node_args["--http-port"] == [str(port(node, "http"))]
        hpa = [h for h in hpas if h["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1", "kind": "StatefulSet", "name": sts["metadata"]["name"]}]
        if hpa:  # the HPA owns replicas
            assert "replicas" not in sts["spec"]
            n = hpa[0]["spec"]["maxReplicas"]
        else:
            n = sts["spec"]["replicas"]
        if discovery == "dns":
            assert args[f"--{role}-dns"] == [f"{svc['metadata']['name']}.{NAMESPACE}.svc.{domain}:{grpc['port']}"]
            assert f"--{role}" not in args
        else:
            assert args[f"--{role}"] == [
                f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}.{NAMESPACE}.svc.{domain}:{grpc['port']}"
                for i in range(n)]
            assert f"--{role}-dns" not in args
    assert args["--host"] == ["0.0.0.0"]
    assert args["--port"] == [str(port(router, "grpc"))]
    assert args["--http-port"] == [str(port(router, "http"))]
    assert args["--prefill-queue-limit-tokens"] == [str(vals.get("router", {}).get("prefillQueueLimitTokens", 0))]
    svc = one(docs, "Service", "router")
    for name in ("grpc", "http"):
        assert svc_port(svc, name)["targetPort"] == name
    assert svc["spec"]["selector"].items() <= \
        one(docs, "Deployment", "router")["spec"]["template"]["metadata"]["labels"].items()
    prefill = container(one(docs, "StatefulSet", "prefill"))
    assert arg_map(prefill["args"])["--side-channel-port"] == [str(port(prefill, "side-channel"))]
    assert svc_port(one(docs, "Service", "prefill"), "side-channel")["targetPort"] == "side-channel"


@pytest.mark.parametrize("discovery", ["dns", "static"])
def test_no_prefill_nodes(discovery):
    docs = render({"prefill": {"replicas": 0}, "router": {"discovery": discovery}})
    assert of_kind(docs, "StatefulSet", "prefill") == [] and of_kind(docs, "Service", "prefill") == []
    args = arg_map(container(one(docs, "Deployment", "router"))["args"])
    assert "--prefill" not in args and "--prefill-dns" not in args


@pytest.mark.parametrize("case", CASES)
def test_probes_and_security(case):
    docs = manifests(case)
    for w in workloads(docs):
        pod = w["spec"]["template"]["spec"]
        c = container(w)
        http = port(c, "http")
        assert arg_map(c["args"])["--http-port"] == [str(http)]
        # Ready (startup, readiness) only while serving and not draining; alive (liveness) while draining too.
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, (w["metadata"]["name"], probe)
        assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        added = sc["capabilities"].get("add", [])
        assert added == (["IPC_LOCK"] if case == "all" and w["kind"] == "StatefulSet" else [])
        assert w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 0
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert "/tmp" in mounts  # the only writable path
        assert all(m.get("readOnly") for p, m in mounts.items() if p.startswith("/models"))


@pytest.mark.parametrize("case", CASES)
def test_node_pods(case):
    docs = manifests(case)
    vals = values(case) or {}
    for role in ("prefill", "decode"):
        sts = one(docs, "StatefulSet", role)
        pod = sts["spec"]["template"]["spec"]
        c = container(sts)
        res = c["resources"]
        gpus = str(vals.get(role, {}).get("gpus", 1))
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == gpus
        vols = {v["name"]: v for v in pod["volumes"]}
        (shm,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert vols[shm["name"]]["emptyDir"]["medium"] == "Memory"
        assert vols[shm["name"]]["emptyDir"]["sizeLimit"] == vals.get("shm", {}).get("sizeLimit", "16Gi")
        (model,) = [m for m in c["volumeMounts"] if m["name"] == "model"]
        assert ("hostPath" if case == "all" else "persistentVolumeClaim") in vols["model"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        if case == "all":
            assert res["limits"]["rdma/rdma_shared_device_a"] == "1"
            assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
            assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
            assert env["UCX_RNDV_THRESH"] == "8192"
            assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == 10
        else:
            assert not any(k.startswith("rdma/") for k in res["limits"])
            assert "hostNetwork" not in pod and "UCX_TLS" not in env and "lifecycle" not in c
        args = arg_map(expand(c, docs))
        assert args["--model"] == [model["mountPath"] + "/" + (vals.get("model", {}).get("subPath") or "nemotron-h-8b")]
        assert args["--engine-id"] == ["<metadata.name>"] and args["--host"] == ["<status.podIP>"]
        assert args["--dtype"] == ["bfloat16"] and args["--device"] == ["cuda"]


def test_engine_settings_through_configmap():
    docs = manifests("all")
    prefill = arg_map(expand(container(one(docs, "StatefulSet", "prefill")), docs))
    decode = arg_map(expand(container(one(docs, "StatefulSet", "decode")), docs))
    for a in (prefill, decode):  # shared settings
        assert a["--speculative-tokens"] == ["2"] and a["--block-size"] == ["16"]
        assert a["--max-model-len"] == ["32768"] and a["--cache-memory-mb"] == ["40000"]
        assert a["--ssm-state-dtype"] == ["bfloat16"]
    assert prefill["--max-num-seqs"] == ["32"] and prefill["--long-prefill-token-threshold"] == ["4096"]
    assert prefill["--lease-seconds"] == ["60"]
    assert decode["--max-num-seqs"] == ["256"] and decode["--num-kv-blocks"] == ["20000"]
    assert decode["--read-timeout"] == ["15"]
    assert "--num-kv-blocks" not in prefill and "--max-num-batched-tokens" not in decode
    # Switches given as YAML booleans or quoted on / off reach the command line as on / off.
    assert decode["--cuda-graphs"] == ["on"] and decode["--async-scheduling"] == ["off"]
    assert decode["--fused-gemv-max-tokens"] == ["16"]
    assert "--cuda-graphs" not in prefill and "--fused-gemv-max-tokens" not in prefill
    # An engine change rolls the pods: the pod template carries a checksum of its settings.
    before = one(docs, "StatefulSet", "decode")["spec"]["template"]["metadata"]["annotations"]["checksum/engine"]
    vals = values("all")
    vals["decode"]["engine"]["max-num-seqs"] = 128
    after = one(render(vals), "StatefulSet", "decode")["spec"]["template"]["metadata"]["annotations"]
    assert after["checksum/engine"] != before


def test_mixed_graph_tokens_reach_the_decode_nodes_only():
    vals = values("all")
    vals["engine"]["speculative-tokens"] = None  # mixed graphs are for K = 0
    vals["decode"]["engine"]["mixed-graph-tokens"] = 256
    docs = render(vals)
    decode = arg_map(expand(container(one(docs, "StatefulSet", "decode")), docs))
    prefill = arg_map(expand(container(one(docs, "StatefulSet", "prefill")), docs))
    assert decode["--mixed-graph-tokens"] == ["256"] and "--mixed-graph-tokens" not in prefill
    assert "--speculative-tokens" not in decode


def test_tensor_parallel_decode_pods_ask_for_a_gpu_per_rank():
    vals = {"prefill": {"replicas": 0}, "decode": {"gpus": 1, "engine": {"tensor-parallel-size": 4}}}
    docs = render(vals)
    c = container(one(docs, "StatefulSet", "decode"))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert arg_map(expand(c, docs))["--tensor-parallel-size"] == ["4"]


def test_prefill_and_decode_pods_of_different_tensor_parallel_sizes_ask_for_their_own_gpus():
    vals = {"prefill": {"gpus": 1, "engine": {"tensor-parallel-size": 4}},
            "decode": {"gpus": 1, "engine": {"tensor-parallel-size": 2}}}
    docs = render(vals)
    for role, tp in (("prefill", "4"), ("decode", "2")):
        c = container(one(docs, "StatefulSet", role))
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp, role
        assert arg_map(expand(c, docs))["--tensor-parallel-size"] == [tp], role


def test_a_cluster_secret_is_generated_url_safe_and_reaches_every_pod_as_env():
    docs = manifests("default")
    secret = one(docs, "Secret")
    text = base64.b64decode(secret["data"]["secret"]).decode()
    assert "+" not in text and "/" not in text
    assert len(ClusterCredential.parse(text).secret) == 32
    # Drawn afresh where no release holds one yet.
    assert one(render(None), "Secret")["data"] != secret["data"]
    for w in workloads(docs):
        c = container(w)
        (env,) = [e for e in c["env"] if e["name"] == CLUSTER_SECRET_ENV]
        assert env["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "secret"}
        assert not any("secret" in a for a in c["args"])


def test_an_existing_cluster_secret_is_used_instead():
    docs = manifests("all")
    assert of_kind(docs, "Secret") == []
    for w in workloads(docs):
        (env,) = [e for e in container(w)["env"] if e["name"] == CLUSTER_SECRET_ENV]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "baton-cluster-secret", "key": "cluster.secret"}


@pytest.mark.parametrize("case", CASES)
def test_every_process_drains_within_its_pods_grace_period(case):
    docs = manifests(case)
    vals = values(case) or {}
    for w in workloads(docs):
        role = w["metadata"]["labels"]["app.kubernetes.io/component"]
        c = container(w)
        given = vals.get(role, {})
        drain = given.get("drainTimeoutSeconds", 60)
        pre = given.get("preStopSleepSeconds", 0)
        assert arg_map(c["args"])["--drain-timeout-s"] == [str(drain)]
        grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace == given.get("terminationGracePeriodSeconds", drain + pre + 15) and grace >= drain + pre


@pytest.mark.parametrize("bad, message", [
    ({"router": {"grace": 5}}, "router.grace was renamed router.drainTimeoutSeconds"),
    ({"decode": {"drainTimeoutSeconds": 60, "terminationGracePeriodSeconds": 30}},
     "decode.terminationGracePeriodSeconds must be at least"),
    ({"decode": {"replicas": 0}}, "replicas"),
    ({"decode": {"engine": {"block-size": 32}}}, "block-size"),
    ({"prefill": {"engine": {"ssm-state-dtype": "float16"}}}, "ssm-state-dtype"),
    ({"engine": {"max-num-sequences": 8}}, "max-num-sequences"),
    ({"decode": {"engine": {"cuda-graphs": "yes"}}}, "cuda-graphs"),
    ({"engine": {"fused-gemv-max-tokens": -1}}, "fused-gemv-max-tokens"),
    ({"decode": {"engine": {"mixed-graph-tokens": -8}}}, "mixed-graph-tokens"),
    ({"engine": {"speculative-tokens": 2}, "decode": {"engine": {"mixed-graph-tokens": 128}}},
     "mixed-graph-tokens must be 0 or unset with speculative-tokens > 0 \\(decode"),
    ({"engine": {"tensor-parallel-size": 0}}, "tensor-parallel-size"),
    ({"model": {"source": "s3"}}, "source"),
    ({"router": {"discovery": "consul"}}, "discovery"),
])
def test_bad_values_are_refused(bad, message):
    with pytest.raises(helm.HelmError, match=message):
        render(bad)


@cache
def help_flags(module: str) -> frozenset[str]:
    """The flags in `python -m MODULE --help`, from the module's `main` in this process."""
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(["--help"])
    assert exit_.value.code == 0
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("discovery", ["dns", "static"])
def test_every_flag_exists(case, discovery):
    """Each flag the chart passes is one the process accepts (its own --help)."""
    flags = {role: help_flags(module) for role, module in MODULES.items()}
    docs = render(with_discovery(case, discovery))
    for w in workloads(docs):
        role = w["metadata"]["labels"]["app.kubernetes.io/component"]
        c = container(w)
        assert c["command"][1:] == ["-m", MODULES[role]]
        unknown = set(arg_map(c["args"])) - flags[role]
        assert not unknown, f"{role}: {MODULES[role]} does not accept {sorted(unknown)}"


def test_service_monitor():
    docs = manifests("all")
    sm = one(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == "http" and ep["path"] == "/metrics" and ep["interval"] == "30s"
    selector = sm["spec"]["selector"]["matchLabels"]
    scraped = [s for s in of_kind(docs, "Service") if selector.items() <= s["metadata"]["labels"].items()]
    assert sorted(s["metadata"]["labels"]["app.kubernetes.io/component"] for s in scraped) == \
        ["decode", "prefill", "router"]
    for s in scraped:  # each scraped Service's "http" port reaches the container's HTTP port
        assert svc_port(s, "http")["targetPort"] == "http"
    assert of_kind(manifests("default"), "ServiceMonitor") == []


@pytest.mark.parametrize("case", CASES)
def test_pdbs_and_hpa_select_the_chart_pods(case):
    docs = manifests(case)
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        matched = [w for w in workloads(docs) if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, pdb["metadata"]["name"]
    if case == "all":
        hpa = one(docs, "HorizontalPodAutoscaler")
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "StatefulSet", "decode")["metadata"]["name"]
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
