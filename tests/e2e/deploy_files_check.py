#!/usr/bin/python3
"""Static checks of the deploy files (run by deploy_files_test.sh).

  deploy_files_check.py k8s REPO PSD_HELP WORKER_HELP  Kubernetes manifests + the configs they carry
  deploy_files_check.py docker REPO BINARY...         Dockerfile + .dockerignore vs the built binaries
  deploy_files_check.py k8s-json REPO OUT.json        the manifests as JSON (for the schema check)

Each check names the file and what to change; the first failures are printed and the exit status
is 1 when any failed, 0 otherwise. Needs Debian's python3-yaml.
"""
import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib

import yaml

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def load_docs(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def known_psd_flags(help_file):
    """Long flag names (without dashes) listed by `psd --help`."""
    with open(help_file, encoding="utf-8") as f:
        return set(re.findall(r"--([a-z][a-z0-9-]*)", f.read()))


def check_config_keys(text, where, flags):
    """A psd config (TOML, keys = flag names): parses, and every key is a psd flag."""
    try:
        conf = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        check(False, f"{where}: not valid TOML ({e})")
        return {}
    for key in conf:
        check(key in flags, f"{where}: key '{key}' is not a psd flag (see psd --help)")
    return conf


def expand_k8s_env(value, env_names_before):
    """Kubernetes $(VAR) references must name variables defined earlier in the same env list."""
    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value):
        check(ref in env_names_before, f"env value '{value}' references $({ref}) which is not defined before it")


def container_env(container):
    env, names = {}, []
    for e in container.get("env", []):
        if "value" in e:
            expand_k8s_env(str(e["value"]), names)
        env[e["name"]] = e
        names.append(e["name"])
    return env


def shell_words(container):
    """The container's command line as words: `sh -c SCRIPT` is split into the script's words."""
    cmd = list(container.get("command", [])) + list(container.get("args", []))
    if len(cmd) >= 3 and os.path.basename(cmd[0]) in ("sh", "bash") and cmd[1] == "-c":
        return shlex.split(cmd[2])
    return cmd


def flag_value(words, flag):
    vals = [words[i + 1] for i, w in enumerate(words[:-1]) if w == flag]
    return vals[-1] if vals else None


def port_number(container, port):
    """A probe's port (a number or a containerPort name) as a number."""
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return p["containerPort"]
    check(False, f"container {container['name']}: port name '{port}' is not one of its ports")
    return None


def secret_name_at(pod_spec, container, path):
    """The name of the Secret volume mounted into CONTAINER that holds PATH (None if none)."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/") and "secret" in volumes.get(m["name"], {}):
            return volumes[m["name"]]["secret"].get("secretName")
    return None


def secret_mount_for(pod_spec, container, path, secrets):
    """True when PATH is a key of a Secret (in SECRETS) mounted into CONTAINER."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        mount = m["mountPath"].rstrip("/") + "/"
        if not path.startswith(mount):
            continue
        vol = volumes.get(m["name"], {})
        if "secret" not in vol:
            continue
        name = vol["secret"].get("secretName")
        key = path[len(mount):]
        items = vol["secret"].get("items")
        if items:
            keys = {i["path"]: i["key"] for i in items}
            key = keys.get(key)
        if not check(name in secrets, f"{container['name']}: mounts Secret '{name}', but no Secret manifest defines it"):
            return False
        data = dict(secrets[name].get("data", {}), **secrets[name].get("stringData", {}))
        return check(key in data, f"{container['name']}: {path} is key '{key}' of Secret '{name}', which has {sorted(data)}")
    check(False, f"{container['name']}: {path} is not inside a mounted Secret volume")
    return False


# Flags the operations issue adds to psd (notes/ops_spec.md); until the psd under test has them,
# their absence is reported, not failed.
PENDING_FLAGS = {"metrics-host", "metrics-port", "metrics-port-file"}


def check_flags(words, program, flags, where):
    """Every --flag on a command line running PROGRAM is one PROGRAM knows."""
    if program not in words:
        return
    for w in words[words.index(program) + 1:]:
        m = re.fullmatch(r"--([a-z][a-z0-9-]*)(=.*)?", w)
        if not m or m.group(1) in flags:
            continue
        if m.group(1) in PENDING_FLAGS:
            print(f"note: {where}: this {program} has no --{m.group(1)} yet (issue 12 adds it)")
        else:
            check(False, f"{where}: {program} has no flag --{m.group(1)} (see {program} --help)")


def check_k8s(repo, help_file, worker_help_file):
    flags = known_psd_flags(help_file)
    worker_flags = known_psd_flags(worker_help_file)
    kdir = os.path.join(repo, "deploy", "kubernetes")
    docs = []
    for name in sorted(os.listdir(kdir)):
        if name.endswith((".yaml", ".yml")):
            try:
                docs += [(name, d) for d in load_docs(os.path.join(kdir, name))]
            except yaml.YAMLError as e:
                check(False, f"{name}: YAML does not parse: {e}")
    if failures:
        return
    for name, d in docs:
        ok = isinstance(d, dict) and d.get("apiVersion") and d.get("kind") and (d.get("metadata") or {}).get("name")
        check(ok, f"{name}: every object needs apiVersion, kind and metadata.name: {str(d)[:80]}")
    by_kind = {}
    for _, d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    secrets = {s["metadata"]["name"]: s for s in by_kind.get("Secret", [])}
    configmaps = {c["metadata"]["name"]: c for c in by_kind.get("ConfigMap", [])}
    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    sets = by_kind.get("StatefulSet", [])
    jobs = by_kind.get("Job", [])
    if not (check(len(sets) == 1, f"expected one StatefulSet (the shards), found {len(sets)}")
            and check(len(jobs) == 1, f"expected one worker Job, found {len(jobs)}")):
        return
    sts, job = sets[0], jobs[0]
    spec, name = sts["spec"], sts["metadata"]["name"]
    tmpl = spec["template"]
    labels = tmpl["metadata"].get("labels", {})

    # The headless Service behind the per-shard DNS names.
    svc = services.get(spec.get("serviceName"))
    if not check(svc is not None, f"StatefulSet {name}: serviceName '{spec.get('serviceName')}' is no Service here"):
        return
    svc_name = svc["metadata"]["name"]
    check(svc["spec"].get("clusterIP") == "None", f"Service {svc_name}: must be headless (clusterIP: None)")
    check(svc["spec"].get("publishNotReadyAddresses") is True,
          f"Service {svc_name}: publishNotReadyAddresses: true (shards must resolve each other before ready)")
    sel = svc["spec"].get("selector", {})
    check(sel and all(labels.get(k) == v for k, v in sel.items()),
          f"Service {svc_name}: selector {sel} does not match the StatefulSet pod labels {labels}")
    match = spec["selector"].get("matchLabels", {})
    check(match and all(labels.get(k) == v for k, v in match.items()),
          f"StatefulSet {name}: selector {match} does not match its template labels {labels}")
    check(spec.get("podManagementPolicy") == "Parallel", f"StatefulSet {name}: podManagementPolicy: Parallel")
    check(tmpl["spec"].get("restartPolicy", "Always") == "Always", "a StatefulSet only allows restartPolicy Always")
    check(tmpl["spec"].get("terminationGracePeriodSeconds", 30) > 30,
          f"StatefulSet {name}: terminationGracePeriodSeconds must leave the final checkpoint more than 30 s")

    psd = [c for c in tmpl["spec"]["containers"] if "psd" in shell_words(c)]
    if not check(len(psd) == 1, f"StatefulSet {name}: one container must run psd (exec psd ...)"):
        return
    c = psd[0]
    words = shell_words(c)
    env = container_env(c)
    check_flags(words, "psd", flags, f"StatefulSet {name}")
    check("--exit-when-done" not in words,
          f"StatefulSet {name}: no --exit-when-done (restartPolicy Always would restart a finished psd)")
    check(flag_value(words, "--shard-index") == "${HOSTNAME##*-}",
          f"StatefulSet {name}: --shard-index must be the pod ordinal \"${{HOSTNAME##*-}}\"")
    # The cluster list: one entry per replica, psd-K.<service>.<namespace>.svc... in ordinal order.
    cluster_ref = flag_value(words, "--cluster") or ""
    var = cluster_ref.lstrip("$").strip("{}")
    cluster = str(env.get(var, {}).get("value", "")) if cluster_ref.startswith("$") else cluster_ref
    entries = cluster.split(",") if cluster else []
    replicas = spec.get("replicas", 1)
    check(len(entries) == replicas, f"StatefulSet {name}: --cluster has {len(entries)} entries for {replicas} replicas")
    data_port = None
    for k, entry in enumerate(entries):
        host, _, port = entry.rpartition(":")
        pattern = rf"{re.escape(name)}-{k}\.{re.escape(svc_name)}(\.\$\(POD_NAMESPACE\)\.svc\.cluster\.local)?"
        check(re.fullmatch(pattern, host), f"cluster entry {k} '{entry}' is not {name}-{k}.{svc_name}.<ns>.svc.cluster.local")
        check(data_port in (None, int(port)), "cluster entries use different ports")
        data_port = int(port)
    if flag_value(words, "--port"):
        check(int(flag_value(words, "--port")) == data_port, "psd --port differs from the cluster entries' port")
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    check(data_port in ports.values(), f"psd container: the data port {data_port} is not a containerPort")
    svc_ports = {p.get("targetPort") if isinstance(p.get("targetPort"), int) else ports.get(p.get("targetPort"))
                 for p in svc["spec"]["ports"]}
    check(data_port in svc_ports, f"Service {svc_name}: no port targets the data port {data_port}")

    # Metrics, probes and scrape annotations on the same port psd is told to use.
    metrics = flag_value(words, "--metrics-port")
    if check(metrics is not None, "psd: --metrics-port must be set (the probes need it)"):
        metrics = int(metrics)
        check(flag_value(words, "--metrics-host") == "0.0.0.0", "psd: --metrics-host 0.0.0.0 (probes come from the kubelet)")
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")):
            p = c.get(probe)
            if probe == "startupProbe" and p is None:
                continue
            get = (p or {}).get("httpGet", {})
            check(get.get("path") == path, f"psd: {probe} must be httpGet {path}, is {p}")
            check(port_number(c, get.get("port")) == metrics, f"psd: {probe} port is not --metrics-port {metrics}")
        ann = tmpl["metadata"].get("annotations", {})
        check(ann.get("prometheus.io/scrape") == "true", "psd pods: annotation prometheus.io/scrape: \"true\"")
        check(ann.get("prometheus.io/port") == str(metrics), f"psd pods: prometheus.io/port must be \"{metrics}\"")
        check(ann.get("prometheus.io/path", "/metrics") == "/metrics", "psd pods: prometheus.io/path: /metrics")
        check(metrics in ports.values(), f"psd container: the metrics port {metrics} is not a containerPort")

    # The token: a mounted Secret key, passed as --auth-token-file.
    token = flag_value(words, "--auth-token-file")
    if check(token, "psd: --auth-token-file must be given (from the Secret)"):
        secret_mount_for(tmpl["spec"], c, token, secrets)
    # The shards' own secret (protected mode refuses a cluster beyond loopback without it): a key
    # of another Secret, which the workers never mount.
    cluster_secret = flag_value(words, "--cluster-secret-file")
    cluster_secret_name = None
    if check(cluster_secret, "psd: --cluster-secret-file must be given (from a Secret of its own)"):
        secret_mount_for(tmpl["spec"], c, cluster_secret, secrets)
        cluster_secret_name = secret_name_at(tmpl["spec"], c, cluster_secret)
        check(cluster_secret_name != secret_name_at(tmpl["spec"], c, token or ""),
              "psd: --cluster-secret-file must come from another Secret than --auth-token-file (workers get that one)")

    # The config file: a mounted ConfigMap whose psd.conf is a valid psd config.
    conf_path = flag_value(words, "--config")
    conf = {}
    volumes = {v["name"]: v for v in tmpl["spec"].get("volumes", [])}
    for m in c.get("volumeMounts", []):
        vol = volumes.get(m["name"], {})
        if "configMap" in vol and conf_path and conf_path.startswith(m["mountPath"]):
            cm = configmaps.get(vol["configMap"]["name"])
            if check(cm is not None, f"ConfigMap {vol['configMap']['name']} is not defined"):
                key = m.get("subPath") or os.path.basename(conf_path)
                conf = check_config_keys(cm["data"].get(key, ""), f"ConfigMap {cm['metadata']['name']}/{key}", flags)
    check(conf, f"psd: --config {conf_path} is not a key of a mounted ConfigMap")
    check(not conf.get("exit-when-done"), "ConfigMap: exit-when-done must not be set under a StatefulSet")

    # A checkpoint volume per shard, mounted where checkpoint-dir points.
    ckpt = conf.get("checkpoint-dir") or flag_value(words, "--checkpoint-dir") or ""
    claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
    mounted = [m for m in c.get("volumeMounts", []) if m["name"] in claims
               and ckpt.startswith(m["mountPath"].rstrip("/") + "/")]
    check(mounted, f"checkpoint-dir '{ckpt}' is not on a volumeClaimTemplates volume (one per shard)")

    # The worker Job: indexed, one completion per worker, the environment contract.
    jspec = job["spec"]
    jname = job["metadata"]["name"]
    check(jspec.get("completionMode") == "Indexed", f"Job {jname}: completionMode: Indexed")
    completions = jspec.get("completions")
    check(jspec.get("parallelism") == completions, f"Job {jname}: parallelism must equal completions (all workers at once)")
    jpod = jspec["template"]["spec"]
    check(jpod.get("restartPolicy") in ("OnFailure", "Never"), f"Job {jname}: restartPolicy OnFailure or Never")
    want = conf.get("replicas-to-aggregate", 1) + conf.get("backup-replicas", 0)
    check(completions == want, f"Job {jname}: {completions} workers, psd expects R + B = {want}")
    for wc in jpod["containers"]:
        check_flags(shell_words(wc), "psd_logreg_worker", worker_flags, f"Job {jname}")
        wenv = container_env(wc)
        value = lambda k: str(wenv.get(k, {}).get("value"))  # noqa: E731
        check(value("PSD_CLUSTER") == cluster, f"Job {jname}: PSD_CLUSTER must be the shards' --cluster list")
        idx = wenv.get("PSD_WORKER_INDEX", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        check("job-completion-index" in idx, f"Job {jname}: PSD_WORKER_INDEX from the completion index annotation")
        check(value("PSD_NUM_WORKERS") == str(completions), f"Job {jname}: PSD_NUM_WORKERS must be {completions}")
        check("$(PSD_WORKER_INDEX)" in value("PSD_WORKER_NAME"), f"Job {jname}: PSD_WORKER_NAME from the index")
        if check("PSD_AUTH_TOKEN_FILE" in wenv, f"Job {jname}: PSD_AUTH_TOKEN_FILE must be set"):
            secret_mount_for(jpod, wc, value("PSD_AUTH_TOKEN_FILE"), secrets)
    mounted = {v["secret"].get("secretName") for v in jpod.get("volumes", []) if "secret" in v}
    check(cluster_secret_name is None or cluster_secret_name not in mounted,
          f"Job {jname}: the workers must not mount the shards' Secret '{cluster_secret_name}'")


def check_psd_conf(repo, help_file):
    with open(os.path.join(repo, "deploy", "psd.conf"), encoding="utf-8") as f:
        text = f.read()
    check_config_keys(text, "deploy/psd.conf", known_psd_flags(help_file))
    for key in ("metrics-host", "metrics-port"):
        check(re.search(rf"^# {key} = ", text, re.M), f"deploy/psd.conf: a commented '{key}' example")


# ---- Dockerfile -------------------------------------------------------------------------------
def dockerfile_instructions(path):
    """(instruction, argument text) pairs, continuation lines joined, comments dropped."""
    out, cur = [], ""
    with open(path, encoding="utf-8") as f:
        for line in f:
            s = line.rstrip("\n")
            if not cur and (not s.strip() or s.lstrip().startswith("#")):
                continue
            if cur and s.lstrip().startswith("#"):
                continue
            if s.endswith("\\"):
                cur += s[:-1] + " "
                continue
            cur += s
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    return out


def dockerignored(patterns, path):
    parts = path.strip("/").split("/")
    for p in patterns:
        p = p.strip("/")
        for i in range(1, len(parts) + 1):
            if fnmatch.fnmatch("/".join(parts[:i]), p):
                return True
    return False


def package_of(lib):
    """The Debian package that ships LIB (usrmerge: try the path, /usr + path, the real path)."""
    for candidate in (lib, "/usr" + lib, os.path.realpath(lib)):
        r = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout.split(":")[0].strip()
    return None


def check_docker(repo, binaries):
    path = os.path.join(repo, "deploy", "docker", "Dockerfile")
    if not check(os.path.exists(path), "deploy/docker/Dockerfile is missing"):
        return
    ins = dockerfile_instructions(path)
    ignore_path = os.path.join(repo, ".dockerignore")
    check(os.path.exists(ignore_path), ".dockerignore is missing (the host build tree would enter the context)")
    patterns = []
    if os.path.exists(ignore_path):
        with open(ignore_path, encoding="utf-8") as f:
            patterns = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    check(dockerignored(patterns, "build") and dockerignored(patterns, ".git"), ".dockerignore must exclude build and .git")

    stages, cur = {}, None
    for word, arg in ins:
        if word == "FROM":
            words = arg.split()
            image = [w for w in words if not w.startswith("--")][0]
            check(re.fullmatch(r"debian:(12|bookworm)(-slim|-[0-9.]+.*)?", image), f"Dockerfile: FROM {image} is not Debian 12")
            stage = words[-1] if len(words) >= 3 and words[-2].upper() == "AS" else str(len(stages))
            cur = stages.setdefault(stage, [])
            continue
        if check(cur is not None, f"Dockerfile: {word} before FROM"):
            cur.append((word, arg))
    if not check(len(stages) >= 2, "Dockerfile: multi-stage (a build stage and a runtime stage)"):
        return
    names = list(stages)
    build, runtime = stages[names[0]], stages[names[-1]]
    btext = " ".join(a for _, a in build)
    check(re.search(r"install_deps\.sh", btext), "Dockerfile build stage: run deploy/install_deps.sh")
    check("-G Ninja" in btext and "CMAKE_BUILD_TYPE=Release" in btext, "Dockerfile build stage: Release build with Ninja")
    for exe in ("psd_logreg_worker", "cmake --install"):  # psrun, psd, psd_admin: install() targets
        check(exe in btext, f"Dockerfile build stage: stages '{exe}' for the runtime image")

    # COPY sources: files of the context (present, not ignored) or a named earlier stage.
    for stage in stages.values():
        for word, arg in stage:
            if word not in ("COPY", "ADD"):
                continue
            words = arg.split()
            opts = [w for w in words if w.startswith("--")]
            src = [w for w in words if not w.startswith("--")][:-1]
            frm = [o.split("=", 1)[1] for o in opts if o.startswith("--from=")]
            if frm:
                check(frm[0] in names, f"Dockerfile: COPY --from={frm[0]} names no stage")
                continue
            for s in src:
                if s == ".":
                    continue
                check(os.path.exists(os.path.join(repo, s)), f"Dockerfile: COPY source {s} does not exist")
                check(not dockerignored(patterns, s), f"Dockerfile: COPY source {s} is excluded by .dockerignore")

    rtext = {}
    for word, arg in runtime:
        rtext.setdefault(word, []).append(arg)
    user = (rtext.get("USER") or ["root"])[-1].split(":")[0]
    check(user not in ("root", "0"), "Dockerfile runtime stage: USER must not be root")
    check(any("/var/lib/psd" in v for v in rtext.get("VOLUME", [])), "Dockerfile runtime stage: VOLUME /var/lib/psd")
    exposed = {int(p.split("/")[0]) for v in rtext.get("EXPOSE", []) for p in v.split()}
    check({7070, 9090} <= exposed, f"Dockerfile runtime stage: EXPOSE 7070 and 9090 (has {sorted(exposed)})")
    for hc in rtext.get("HEALTHCHECK", []):
        check(hc.strip().upper() == "NONE" or "/healthz" in hc, "Dockerfile: a HEALTHCHECK must use /healthz")
    check(any("/etc/psd/psd.conf" in v for v in rtext.get("COPY", [])), "Dockerfile runtime stage: COPY the config")

    # The runtime packages cover every shared library of the built binaries.
    installed = set()
    for arg in rtext.get("RUN", []):
        for m in re.finditer(r"apt-get install((?:\s+[^&|;]+)+)", arg):
            installed |= {w for w in m.group(1).split() if not w.startswith("-")}
    base = {"libc6", "libgcc-s1"}  # in debian:bookworm-slim already
    if subprocess.run(["sh", "-c", "command -v dpkg"], capture_output=True).returncode != 0:
        print("deploy_files_check: no dpkg here; the runtime package check is skipped")
        return
    for binary in binaries:
        if not os.path.exists(binary):
            continue
        ldd = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
        for lib in re.findall(r"=>\s+(/\S+)", ldd):
            # A sanitizer build (tests/run_all.sh's second build) links the sanitizer runtimes; the
            # image is a Release build without them.
            if re.search(r"/lib(asan|ubsan|lsan|tsan)\.so", lib):
                continue
            if os.path.realpath(lib).startswith(os.path.realpath(os.path.dirname(os.path.dirname(binary)))):
                check("cmake --install" in btext, f"{os.path.basename(lib)} is built here: the image must install it")
                continue
            pkg = package_of(lib)
            if check(pkg, f"{binary}: no Debian package ships {lib}"):
                check(pkg in installed | base,
                      f"Dockerfile runtime stage: {os.path.basename(binary)} needs {lib} from package {pkg}; "
                      f"add {pkg} to its apt-get install (has {sorted(installed)})")


def main():
    mode, repo = sys.argv[1], sys.argv[2]
    if mode == "k8s":
        check_k8s(repo, sys.argv[3], sys.argv[4])
        check_psd_conf(repo, sys.argv[3])
    elif mode == "docker":
        check_docker(repo, sys.argv[3:])
    elif mode == "k8s-json":
        docs = []
        kdir = os.path.join(repo, "deploy", "kubernetes")
        for name in sorted(os.listdir(kdir)):
            if name.endswith((".yaml", ".yml")):
                docs += load_docs(os.path.join(kdir, name))
        with open(sys.argv[3], "w", encoding="utf-8") as f:
            json.dump(docs, f)
    for f in failures[:20]:
        print(f"FAIL: {f}")
    if not failures:
        print(f"deploy_files_check {mode}: ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
