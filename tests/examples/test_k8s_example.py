"""Issue 22 item 2: examples/k8s is a deployment a cluster can apply (not run on a cluster here: see
examples/k8s/README.md).

* Every manifest is checked against the Kubernetes API schema of the ``kubernetes`` Python client (32.x, the
  pin of ci/install.sh): each object walks its kind's model class, an unknown field or a wrong type anywhere is
  an error (the client's own deserializer ignores unknown fields, so the walk checks them), and the client's
  deserializer builds the model (required fields).
* The image (examples/k8s/Dockerfile) is FROM Dynamo's vLLM runtime at the version the tests run, copies files
  that exist and installs this package; the containers run scripts the image copies, and the worker's script is
  the project's launcher (``kvbm_backend.integrations.dynamo.vllm_worker``).
* Frontend and worker agree on discovery (etcd at a Service the manifests define), request and event plane.
* The worker's container command runs here, as written, in dry-run mode (examples/dynamo's
  ``KVBM_BACKEND_DRY_RUN``) with the ConfigMap's YAML and the manifest's environment, the container paths mapped
  to temp dirs: it must pass the launcher's preflight and report the ConfigMap's G3/G4 settings.
"""
from __future__ import annotations

import base64
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does (the unit lane runs at nice 19)

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "examples" / "k8s"
kubernetes = pytest.importorskip("kubernetes", reason="kubernetes client not installed (bash ci/install.sh)")
from kubernetes import client  # noqa: E402

KINDS = {("v1", "ConfigMap"): "V1ConfigMap", ("v1", "Service"): "V1Service", ("apps/v1", "Deployment"): "V1Deployment",
         ("apps/v1", "StatefulSet"): "V1StatefulSet", ("v1", "Secret"): "V1Secret"}
PRIMITIVE = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object, "datetime": str,
             "date": str}


def strict(data, typ: str, where: str) -> list[str]:
    """Problems of ``data`` against the client's model type ``typ`` (unknown fields, wrong types)."""
    if typ in PRIMITIVE:
        ok = isinstance(data, PRIMITIVE[typ]) and not (typ == "int" and isinstance(data, bool))
        return [] if ok else [f"{where}: expected {typ}, got {data!r}"]
    m = re.fullmatch(r"list\[(.+)\]", typ)
    if m:
        if not isinstance(data, list):
            return [f"{where}: expected a list"]
        return [p for i, x in enumerate(data) for p in strict(x, m.group(1), f"{where}[{i}]")]
    m = re.fullmatch(r"dict\(str, (.+)\)", typ)
    if m:
        if not isinstance(data, dict):
            return [f"{where}: expected a mapping"]
        return [p for k, v in data.items() for p in strict(v, m.group(1), f"{where}.{k}")]
    cls = getattr(client.models, typ)
    if not isinstance(data, dict):
        return [f"{where}: expected a {typ} mapping, got {data!r}"]
    by_json = {v: k for k, v in cls.attribute_map.items()}
    out = []
    for k, v in data.items():
        if k not in by_json:
            out.append(f"{where}.{k}: unknown field of {typ}")
        elif v is not None:
            out += strict(v, cls.openapi_types[by_json[k]], f"{where}.{k}")
    return out


def manifests() -> list[tuple[str, dict]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        out += [(f.name, d) for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def objects() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for _, d in manifests()}


def test_strict_walk_rejects_what_the_api_server_would():
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {"spec": {"containers": [
               {"name": "c", "image": "i", "volumeMount": []}]}}}}
    assert strict(dep, "V1Deployment", "x") == ["x.spec.template.spec.containers[0].volumeMount: unknown field of V1Container"]
    dep["spec"]["template"]["spec"]["containers"][0] = {"name": "c", "image": "i", "ports": [{"containerPort": "80"}]}
    assert strict(dep, "V1Deployment", "x") == ["x.spec.template.spec.containers[0].ports[0].containerPort: expected int, got '80'"]


def test_manifests_match_the_kubernetes_schema():
    api = client.ApiClient()
    seen = set()
    for name, d in manifests():
        typ = KINDS.get((d.get("apiVersion"), d.get("kind")))
        assert typ, f"{name}: unexpected {d.get('apiVersion')} {d.get('kind')}"
        problems = strict(d, typ, f"{name}:{d['kind']}/{d['metadata']['name']}")
        assert not problems, problems
        obj = api._ApiClient__deserialize(d, typ)  # builds the model: required fields present
        assert obj.metadata.name == d["metadata"]["name"]
        seen.add(d["kind"])
    assert {"ConfigMap", "Deployment", "Service"} <= seen
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def pod(name: str) -> dict:
    return objects()[("Deployment", name)]["spec"]["template"]["spec"]


def env_of(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (K8S / "Dockerfile").read_text())
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1].strip()) for ln in text.splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def copies() -> dict[str, Path]:
    """Image path -> repo path for every COPY (sources must exist)."""
    out = {}
    for ins, arg in dockerfile():
        if ins == "COPY":
            *srcs, dest = shlex.split(arg)
            assert not any(s.startswith("--from") for s in srcs)
            for s in srcs:
                assert (REPO / s).exists(), f"Dockerfile COPY {s}: not in the repository"
                out[dest.rstrip("/") + "/" + Path(s).name if dest.endswith("/") else dest] = REPO / s
    return out


def in_image(path: str) -> Path:
    """The repo file a path inside the image is (through the Dockerfile's COPY lines)."""
    for dest, src in copies().items():
        if path == dest or path.startswith(dest + "/"):
            return src / path[len(dest):].lstrip("/") if path != dest else src
    raise AssertionError(f"{path}: not copied into the image by examples/k8s/Dockerfile")


def test_dockerfile_builds_on_dynamos_runtime_and_installs_this_package():
    ins = dockerfile()
    base = [a for i, a in ins if i == "FROM"]
    pin = re.search(r'"ai-dynamo==([\d.]+)"', (REPO / "ci" / "install.sh").read_text()).group(1)
    assert base == [f"nvcr.io/nvidia/ai-dynamo/vllm-runtime:{pin}"]  # the Dynamo the tests run
    cp = copies()
    assert cp["/opt/kvbm-backend/kvbm_backend"] == REPO / "kvbm_backend"
    assert cp["/opt/kvbm-backend/pyproject.toml"] == REPO / "pyproject.toml"
    run = " ".join(a for i, a in ins if i == "RUN")
    assert "pip install" in run and "/opt/kvbm-backend" in run  # this package, from the copied tree
    assert "import kvbm_backend.integrations.dynamo.vllm_worker" in run  # the build fails if it does not import
    env = " ".join(a for i, a in ins if i == "ENV")
    layouts = re.search(r"KVBM_BACKEND_LAYOUTS=(\S+)", env).group(1)
    assert in_image(layouts) == REPO / "layouts"


def test_containers_run_the_projects_scripts_from_the_image():
    w = pod("vllm-worker-kvbm")["containers"][0]
    f = pod("dynamo-frontend")["containers"][0]
    assert w["image"] == f["image"]
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert w["image"].split(":")[0] in [i["name"] for i in kust["images"]]
    assert w["command"][0] == "bash" and f["command"][0] == "bash"
    worker_script, frontend_script = in_image(w["command"][1]), in_image(f["command"][1])
    assert worker_script == REPO / "examples" / "dynamo" / "agg_kvbm_backend.sh"
    assert frontend_script == REPO / "examples" / "dynamo" / "frontend.sh"
    assert 'exec ${KVBM_BACKEND_DRY_RUN:+"$PYTHON" -m kvbm_backend.apps.effective --dry-run} \\\n  "$PYTHON" -m ' \
           "kvbm_backend.integrations.dynamo.vllm_worker" in worker_script.read_text()
    assert "-m dynamo.frontend" in frontend_script.read_text()


def test_discovery_and_planes_agree():
    objs = objects()
    w, f = pod("vllm-worker-kvbm")["containers"][0], pod("dynamo-frontend")["containers"][0]

    def flag(c, name):
        return c["args"][c["args"].index(name) + 1]

    for name in ("--discovery-backend", "--request-plane", "--event-plane"):
        assert flag(w, name) == flag(f, name), name
    assert flag(w, "--discovery-backend") == "etcd"
    we, fe = env_of(w), env_of(f)
    assert we["ETCD_ENDPOINTS"] == fe["ETCD_ENDPOINTS"] and we["DYN_NAMESPACE"] == fe["DYN_NAMESPACE"]
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", we["ETCD_ENDPOINTS"]).groups()
    svc = objs[("Service", host)]
    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
    etcd = objects()[("Deployment", "etcd")]
    assert svc["spec"]["selector"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()
    assert we["DYN_TCP_RPC_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}  # reachable from the frontend
    assert 0 < int(we["DYN_SYSTEM_PORT"]) <= 32767  # Dynamo 1.6.1 parses it as an i16
    fsvc = objs[("Service", "dynamo-frontend")]
    assert fsvc["spec"]["selector"].items() <= objs[("Deployment", "dynamo-frontend")]["spec"]["template"]["metadata"]["labels"].items()
    assert fe["HTTP_PORT"] == "8000" and w["readinessProbe"]["httpGet"]["port"] == "system"
    # a gated model's tokenizer is fetched by the frontend too (Dynamo 1.6.1's model card download): the same
    # optional hf-token Secret as the worker's
    assert fe["HF_TOKEN"] == we["HF_TOKEN"] and fe["HF_TOKEN"]["secretKeyRef"]["optional"] is True


def test_worker_storage_secrets_and_keyring():
    from kvbm_backend.config import load_config
    spec = pod("vllm-worker-kvbm")
    c = spec["containers"][0]
    cm = yaml.safe_load(objects()[("ConfigMap", "kvbm-backend-config")]["data"]["kvbm-backend.yaml"])
    cfg = load_config(cm, use_env=False)
    env = env_of(c)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    # the worker reads the ConfigMap's file: the script's default config path or KVBM_BACKEND_CONFIG_FILE
    assert Path(env["KVBM_BACKEND_CONFIG_FILE"]).parent.as_posix() == mounts["config"]["mountPath"]
    assert vols["config"]["configMap"]["name"] == "kvbm-backend-config"
    # G3: a node-local volume at the YAML's path; nothing overrides it from the environment
    assert cfg.g3.paths == [mounts["g3"]["mountPath"]]
    assert "hostPath" in vols["g3"] or "persistentVolumeClaim" in vols["g3"]
    assert not any(k.startswith(("DYN_KVBM_", "KVBM_BACKEND__")) for k in env)
    if "hostPath" in vols["g3"]:  # one pool per G3 directory (G3LockedError otherwise): one worker per node,
        dep = objects()[("Deployment", "vllm-worker-kvbm")]["spec"]      # and a rollout stops the old pod first
        anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert any(t["topologyKey"] == "kubernetes.io/hostname"
                   and t["labelSelector"]["matchLabels"] == dep["selector"]["matchLabels"] for t in anti)
        assert dep["strategy"]["rollingUpdate"]["maxSurge"] == 0
    assert {"cpu", "memory"} <= set(c["resources"].get("requests", {}))  # not BestEffort
    # G4 credentials and KEK from Secrets
    secret_env = {k: v["secretKeyRef"]["name"] for k, v in env.items() if isinstance(v, dict) and "secretKeyRef" in v}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", cfg.g4.keyring.kek_env} <= set(secret_env)
    # keyring: one shared Secret, read-only, whole directory (subPath never sees updates), 0400, no fsGroup
    kr = cfg.g4.keyring
    assert cfg.g4.enabled and cfg.g4.encrypt and kr.auto_create_tenants is False
    assert "secret" in vols["keyring"] and vols["keyring"]["secret"]["defaultMode"] & 0o077 == 0
    assert mounts["keyring"].get("readOnly") is True and "subPath" not in mounts["keyring"]
    assert str(Path(kr.path).parent) == mounts["keyring"]["mountPath"]
    assert "fsGroup" not in (spec.get("securityContext") or {})
    assert c["securityContext"]["runAsUser"] == 0  # the 0400 Secret file is root's


def test_worker_container_command_passes_the_launchers_checks(tmp_path):
    """The worker container's command, args and env run here with KVBM_BACKEND_DRY_RUN (paths in the container
    mapped to temp dirs, Secrets replaced by test values): the script reports the ConfigMap's settings as coming
    from the file, and the launcher's preflight (config, keyring, KEK) passes."""
    from kvbm_backend.config import KeyringConfig
    from kvbm_backend.crypto.keyring import Keyring
    spec = pod("vllm-worker-kvbm")
    c = spec["containers"][0]
    cm_text = objects()[("ConfigMap", "kvbm-backend-config")]["data"]["kvbm-backend.yaml"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    mapped = {p: tmp_path / p.strip("/").replace("/", "_") for p in mounts.values()}
    for p in mapped.values():
        p.mkdir()
    for src, dst in mapped.items():
        cm_text = cm_text.replace(src + "/", f"{dst}/").replace(src + "]", f"{dst}]")
    (mapped[mounts["config"]] / "kvbm-backend.yaml").write_text(cm_text)
    kek = base64.b64encode(os.urandom(32)).decode()
    keyring = mapped[mounts["keyring"]] / "keyring.json"
    old = os.environ.get("KVBM_BACKEND_KEK")
    os.environ["KVBM_BACKEND_KEK"] = kek
    try:  # the operator's `kvbm-backend keys create` with the KEK from the Secret
        Keyring.from_config(KeyringConfig(path=str(keyring))).close()
    finally:
        os.environ.pop("KVBM_BACKEND_KEK") if old is None else os.environ.__setitem__("KVBM_BACKEND_KEK", old)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_KVBM_", "KVBM_BACKEND"))}
    for k, v in env_of(c).items():
        if isinstance(v, str):
            env[k] = str(mapped[v]) + "" if v in mapped else v
    env["KVBM_BACKEND_CONFIG_FILE"] = str(mapped[mounts["config"]] / "kvbm-backend.yaml")
    env.update(KVBM_BACKEND_KEK=kek, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", KVBM_BACKEND_DRY_RUN="1",
               PYTHON=sys.executable, PYTHONPATH=str(REPO))
    script = in_image(c["command"][1])
    r = subprocess.run([c["command"][0], str(script), *c["args"]], env=env, capture_output=True, text=True,
                       timeout=HANG_S, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("kvbm-backend effective (dynamo, config file ")]
    assert len(line) == 1, r.stderr
    g3 = mapped[mounts["g3"]]
    assert f"g3.paths={g3} [file]" in line[0] and "g3.capacity_gb=800 [file]" in line[0], line[0]
    assert f"g4.keyring.path={keyring} [file]" in line[0] and "g4.kek=[env KVBM_BACKEND_KEK]" in line[0], line[0]
    # the line examples/k8s/README.md quotes is how this one starts (it left out the first field, g3.enabled)
    quoted = re.search(r"`(kvbm-backend effective \(dynamo, [^`]*?) \.\.\.`", (K8S / "README.md").read_text()).group(1)
    for src, dst in mapped.items():
        quoted = quoted.replace(src + "/", f"{dst}/").replace(src + " ", f"{dst} ")
    assert line[0].startswith(quoted + " "), (quoted, line[0])
    exec_line = next(ln for ln in r.stdout.splitlines() if ln.startswith("kvbm-backend dry run: exec "))
    argv = shlex.split(exec_line[len("kvbm-backend dry run: exec "):])
    assert argv[1:3] == ["-m", "kvbm_backend.integrations.dynamo.vllm_worker"]
    assert argv[argv.index("--model") + 1] == env_of(c)["MODEL"]
    assert " ".join(c["args"]) in " ".join(argv)


# Fields of the Prometheus Operator's monitoring.coreos.com/v1 PodMonitor that the example may use (the operator's
# CRD, example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml); there is no client model to walk.
PODMONITOR_SPEC = {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels", "sampleLimit",
                   "attachMetadata"}
PODMONITOR_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels", "relabelings",
                       "metricRelabelings", "params"}


def test_podmonitor_scrapes_both_metric_ports_of_the_worker():
    """examples/k8s/monitoring/podmonitor.yaml selects the worker's pods and scrapes /metrics on the two ports that
    serve our series: the ConfigMap's metrics.port (kvbm_*, kvbm_backend_*) and DYN_SYSTEM_PORT (Dynamo's, with
    vLLM's vllm:kvbm_backend_* counters); both are named container ports of the worker."""
    docs = [d for d in yaml.safe_load_all((K8S / "monitoring" / "podmonitor.yaml").read_text()) if d]
    assert len(docs) == 1
    pm = docs[0]
    assert (pm["apiVersion"], pm["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert set(pm["spec"]) <= PODMONITOR_SPEC, set(pm["spec"]) - PODMONITOR_SPEC
    dep = objects()[("Deployment", "vllm-worker-kvbm")]
    assert pm["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (worker,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    cm = yaml.safe_load(objects()[("ConfigMap", "kvbm-backend-config")]["data"]["kvbm-backend.yaml"])
    want = {cm["metrics"]["port"], int(env_of(worker)["DYN_SYSTEM_PORT"])}
    eps = pm["spec"]["podMetricsEndpoints"]
    for ep in eps:
        assert set(ep) <= PODMONITOR_ENDPOINT, set(ep) - PODMONITOR_ENDPOINT
        assert ep["port"] in ports and ep["path"] == "/metrics", ep
    assert {ports[ep["port"]] for ep in eps} == want


def test_readme_steps_do_not_wait_on_a_command_that_never_ends():
    """Review finding (2026-11-30): the README's last step was ``kubectl port-forward ... && curl ...``.
    ``kubectl port-forward`` runs until it is interrupted (and then exits non-zero), so the ``curl`` after ``&&``
    never ran. Every long-running command in the README's shell blocks is started in the background."""
    text = (K8S / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [ln.split("#", 1)[0].rstrip() for b in blocks for ln in b.splitlines()]
    forwards = [ln for ln in lines if "kubectl port-forward" in ln]
    assert forwards, "the README shows how to reach the frontend"
    for ln in forwards:
        assert ln.endswith("&") and not ln.endswith("&&") and "&&" not in ln.split("port-forward", 1)[1], ln
    assert any(ln.lstrip().startswith(("curl", "sleep")) and "curl localhost:8000/v1/models" in ln for ln in lines)


def test_worker_grace_period_covers_the_pools_close_bounds():
    """Kubernetes SIGKILLs a pod ``terminationGracePeriodSeconds`` after SIGTERM (default 30 s). The worker's
    shutdown closes G3 (queued offloads written for up to ``g3.load_timeout_s + 10`` s, twice that when
    storage hangs: ``G3Pool.close``) and G4 (up to ``2 x g4.timeout_s``: ``G4Pool.close``); the grace period
    lets both run to their bound with the ConfigMap's settings."""
    from kvbm_backend.config import load_config
    spec = pod("vllm-worker-kvbm")
    cm = yaml.safe_load(objects()[("ConfigMap", "kvbm-backend-config")]["data"]["kvbm-backend.yaml"])
    cfg = load_config(cm, use_env=False)
    need = 2 * (cfg.g3.load_timeout_s + 10) + (2 * cfg.g4.timeout_s if cfg.g4.enabled else 0)
    assert spec.get("terminationGracePeriodSeconds", 30) >= need, need


def test_the_worker_model_env_alone_names_the_kv_namespace(tmp_path):
    """Review finding (2026-12-01): the ConfigMap said ``model: meta-llama/Llama-3.1-8B-Instruct`` and ``revision:
    main`` beside the container's ``MODEL``: changing MODEL alone kept the Instruct model's namespace (another
    model's KV under it), and the fixed revision dropped the ``+q=``/``+hf=`` suffixes of a quantized engine. The
    ConfigMap, loaded as the connector loads it, now leaves both to the engine: the namespace follows MODEL."""
    from kvbm_backend.integrations.vllm.extra_config import config_from_extra
    from kvbm_backend.integrations.vllm.namespaces import namespace_model, namespace_revision
    c = pod("vllm-worker-kvbm")["containers"][0]
    cm_text = objects()[("ConfigMap", "kvbm-backend-config")]["data"]["kvbm-backend.yaml"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for name in ("g3", "keyring"):
        (tmp_path / name).mkdir()
        cm_text = cm_text.replace(mounts[name], str(tmp_path / name))
    f = tmp_path / "kvbm-backend.yaml"
    f.write_text(cm_text)
    cfg, _ = config_from_extra({"config_file": str(f)})
    for served in (env_of(c)["MODEL"], "my-org/llama-3.1-8b-finetune"):  # the manifest's, and an operator's edit
        assert namespace_model(cfg, served) == served, cfg.model
    assert namespace_revision(cfg, None, quantization="fp8") == "main+q=fp8"


# The directory kubelet hands the container for each volume kind the docs offer for G3, by its mode:
# hostPath DirectoryOrCreate makes it 0755 (pkg/volume/hostpath), an emptyDir is 0777 on the node's disk
# (pkg/volume/emptydir: defaultPerm 0777) and 1777 as a tmpfs (medium: Memory; a new tmpfs's root keeps its 1777).
VOLUME_MODES = {"hostPath": [0o755], "emptyDir": [0o777, 0o1777]}


def _g3_path_for_empty_dir(text: str, where: str) -> str | None:
    """The ``g3.paths: [P]`` the docs' emptyDir advice names (None: the advice names none)."""
    flat = " ".join(ln.lstrip("# ").strip() for ln in text.splitlines())
    found = set(re.findall(r"emptyDir[^.]*?[^.]*?g3\.paths: \[([^\]]+)\]", flat))
    assert len(found) <= 1, (where, found)
    return found.pop() if found else None


def test_g3_opens_on_each_volume_kind_the_docs_offer(tmp_path):
    """Review finding (2026-12-03): worker.yaml and examples/k8s/README.md said an emptyDir works for G3 in place
    of the hostPath, with the ConfigMap as it is (``g3.paths: [/kvbm-g3]``, the mount itself). Kubelet makes an
    emptyDir's directory 0777 (1777 as a tmpfs), and G3 refuses a directory others can write (G3PathError: "G3
    directory /kvbm-g3 is writable by group or others (mode 0777)"): the worker could not open G3. The docs now name
    a directory inside the emptyDir, which G3 creates 0700. Each volume kind is set up here with kubelet's mode
    (owned by this uid, as the worker runs as root over root's directories) and G3 opens the path the docs give."""
    from kvbm_backend.config import load_config
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace
    from kvbm_backend.pool.g3 import G3Pool
    c = pod("vllm-worker-kvbm")["containers"][0]
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["g3"]
    cm = yaml.safe_load(objects()[("ConfigMap", "kvbm-backend-config")]["data"]["kvbm-backend.yaml"])
    (configmap_path,) = cm["g3"]["paths"]
    advice = {where: _g3_path_for_empty_dir((K8S / where).read_text(), where) for where in ("README.md", "worker.yaml")}
    assert advice["README.md"] == advice["worker.yaml"], advice  # both docs give the same path
    paths = {"hostPath": configmap_path, "emptyDir": advice["README.md"] or configmap_path}  # none: the ConfigMap's
    ns = Namespace(model="test/k8s-g3-volume", revision="r1", tp_world_size=1,
                   layout=KvLayout(num_layers=2, outer_dim=2, page_size=16, inner_dim=64, dtype="bfloat16"))
    for kind, modes in VOLUME_MODES.items():
        assert paths[kind] == mount or paths[kind].startswith(mount + "/"), (kind, paths[kind], mount)
        for mode in modes:
            vol = tmp_path / f"{kind}-{mode:o}"
            vol.mkdir()
            os.chmod(vol, mode)
            local = str(vol) + paths[kind][len(mount):]
            cfg = load_config({**cm, "g3": {**cm["g3"], "paths": [local], "capacity_gb": 0.05, "engine": "posix"}},
                              use_env=False)
            pool = G3Pool(cfg.g3, ns)  # G3PathError when the directory is one others can write
            pool.close()
