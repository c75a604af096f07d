"""compose.yaml's wiring, checked without an engine (tests/test_compose_demo.py runs it for real).

The file is parsed with PyYAML (merge keys resolved, ${VAR:-default} substituted as compose
would), and every pdserve container's command goes through pdserve's own CLI parser, so a flag
typo fails here instead of in a container. Then the wiring: every node registers in the Redis
registry the router reads, under its own service name (its NIXL side channel too), node ids are unique (they name NIXL agents), and health checks probe the ports
the processes serve; the `tp` profile's decode node runs at a tensor-parallel degree the
model's heads allow, and the `epd` profile's encoder node is wired like the others. When
docker-compose (or the docker compose plugin) is installed, its own `config -q` check runs too.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from pdserve.entrypoints.cli import build_parser

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
NODE_ROLES = ("prefill", "decode")
_VAR = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\})")


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution for the forms this file may use: $$, ${V}, ${V:-d}, ${V-d}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group("name"), m.group("op"), m.group("default")
        current = env.get(name)
        if op == ":-" and not current:
            return default
        if op == "-" and current is None:
            return default
        return current or ""

    out = _VAR.sub(sub, value)
    assert "$" not in _VAR.sub("", value), f"unsupported variable syntax in {value!r}"
    return out


def load(env: dict[str, str] | None = None) -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env or {})


def endpoint(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.scheme == "tcp" and parts.hostname and parts.port, f"not a tcp://host:port endpoint: {url}"
    return parts.hostname, parts.port


def parse_command(name: str, command: list[str]):
    assert isinstance(command, list) and all(isinstance(a, str) for a in command), \
        f"{name}: command must be a list of strings (exec form), got {command!r}"
    try:
        return build_parser().parse_args(command)
    except SystemExit as exc:  # argparse reports the bad flag on stderr
        pytest.fail(f"{name}: `pdserve {' '.join(command)}` does not parse (exit {exc.code})")


def pdserve_services(doc: dict) -> dict[str, dict]:
    """Services that run the pdserve image (built from the Dockerfile), not e.g. redis."""
    return {name: svc for name, svc in doc["services"].items() if "build" in svc}


def default_services(doc: dict) -> dict[str, dict]:
    """What a plain `docker compose up` starts: services in no profile."""
    return {name: svc for name, svc in doc["services"].items() if not svc.get("profiles")}


@pytest.fixture(scope="module", params=[{}, {"PDSERVE_KV_TRANSFER": "store"}, {"PDSERVE_KV_TRANSFER": "nixl"}],
                ids=["default-env", "store", "nixl"])
def cluster(request):
    doc = load(request.param)
    args = {name: parse_command(name, svc["command"]) for name, svc in pdserve_services(doc).items()}
    return doc, args, request.param


def test_services_and_image(cluster):
    doc, args, _ = cluster
    services = doc["services"]
    assert {"redis", "prefill-0", "prefill-1", "decode-0", "decode-1", "router"} <= set(services)
    images = {svc["image"] for svc in pdserve_services(doc).values()}
    assert len(images) == 1, f"every pdserve service should share one image, got {images}"
    assert {a.command for a in args.values()} == {"prefill", "decode", "encode", "router"}
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    cmd = redis["command"]
    assert cmd[0] == "redis-server"
    assert cmd[cmd.index("--save") + 1] == "" and cmd[cmd.index("--appendonly") + 1] == "no"


def test_nodes_bind_all_interfaces_and_have_unique_ids(cluster):
    doc, args, _ = cluster
    nodes = {n: a for n, a in args.items() if a.command in NODE_ROLES}
    for name, a in nodes.items():
        host, port = endpoint(a.bind)
        assert host == "0.0.0.0", f"{name} binds {a.bind}: other containers cannot reach it"
        assert str(port) in doc["services"][name].get("expose", []), f"{name} does not expose {port}"
        assert a.node_id == name, f"{name} runs as --node-id {a.node_id}"
    ids = [a.node_id for a in nodes.values()]
    assert len(ids) == len(set(ids)), f"duplicate node ids (NIXL agent names): {ids}"


def test_prefill_side_channel_is_advertised_under_the_service_name(cluster):
    doc, args, _ = cluster
    prefill = {n: a for n, a in args.items() if a.command == "prefill"}
    assert len(prefill) >= 2
    for name, a in prefill.items():
        assert a.nixl_side_channel, f"{name} has no --nixl-side-channel"
        host, port = endpoint(a.nixl_side_channel)
        assert host == "0.0.0.0" and str(port) in doc["services"][name].get("expose", [])
        assert a.advertise_host == name, f"{name} advertises {a.advertise_host!r}: decode nodes dial that name"


def test_nodes_share_the_redis_service(cluster):
    doc, args, _ = cluster
    for name, a in args.items():
        if a.command not in NODE_ROLES:
            continue
        assert a.store, f"{name} has no --store"
        url = urlsplit(a.store)
        assert url.scheme == "redis" and url.hostname in doc["services"], f"{name}: --store {a.store}"
        assert url.port == 6379
        assert url.hostname in doc["services"][name].get("depends_on", {}), f"{name} does not wait for {url.hostname}"
        if a.command == "decode":
            assert a.nixl, f"{name} cannot pull KV over NIXL without --nixl"


def test_router_finds_every_node_in_the_shared_registry(cluster):
    doc, args, env = cluster
    router = [n for n, a in args.items() if a.command == "router"]
    assert len(router) == 1
    name, r = router[0], args[router[0]]
    assert not r.prefill and not r.decode, "the router takes its nodes from the registry, not from lists"
    registry = urlsplit(r.registry or "")
    assert registry.scheme == "redis" and registry.hostname in doc["services"], f"router --registry {r.registry}"
    assert registry.path not in ("", "/", "/0"), "the registry shares the store's database"
    nodes = {n: a for n, a in args.items() if a.command in NODE_ROLES}
    for node, a in nodes.items():
        assert a.registry == r.registry, f"{node} registers at {a.registry}, the router reads {r.registry}"
        # A node bound to 0.0.0.0 registers under --advertise-host: its service name is what others dial.
        assert a.advertise_host == node, f"{node} advertises {a.advertise_host!r}"
    deps = doc["services"][name].get("depends_on", {})
    always = set(nodes) & set(default_services(doc))
    assert always <= set(deps), f"router does not depend on {always - set(deps)}"
    # A service in a profile is not started by a plain `up`: the router must not wait for it.
    assert not set(deps) - set(default_services(doc)), "the router depends on a profile's service"
    assert r.kv_transfer == env.get("PDSERVE_KV_TRANSFER", "nixl")
    assert r.host == "0.0.0.0"
    published = [str(p).rsplit(":", 1)[-1] for p in doc["services"][name].get("ports", [])]
    assert str(r.port) in published, f"router listens on {r.port}, publishes {published}"


def test_health_checks_probe_the_served_ports(cluster):
    doc, args, _ = cluster
    for name, a in args.items():
        check = doc["services"][name].get("healthcheck")
        assert check and check["test"][0] == "CMD", f"{name} has no exec-form healthcheck"
        probe = " ".join(check["test"][1:])
        if a.command == "router":
            assert f"http://127.0.0.1:{a.port}/health" in probe
        else:
            assert f"tcp://127.0.0.1:{endpoint(a.bind)[1]}" in probe, f"{name}'s healthcheck misses its port"


def test_node_healthcheck_speaks_the_control_protocol():
    """The node healthcheck's inline script must still match pdserve.wire.messages."""
    doc = load()
    probe = doc["services"]["prefill-0"]["healthcheck"]["test"][-1]
    script = probe.split(";")
    assert any("from pdserve.wire.messages import" in part for part in script)
    compile(probe, "healthcheck", "exec")  # valid Python
    import pdserve.wire.messages as messages
    for name in ("Ping", "Pong", "encode", "decode"):
        assert hasattr(messages, name)


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_docker_compose_config_accepts_the_file():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed")
    for env, profile in (({}, []), ({"PDSERVE_KV_TRANSFER": "store"}, []), ({}, ["--profile", "tp"]),
                         ({}, ["--profile", "epd"])):
        result = subprocess.run([*cli, "-f", str(COMPOSE), *profile, "config", "-q"], capture_output=True, text=True,
                                timeout=60, env={**os.environ, **env}, cwd=ROOT)
        assert result.returncode == 0, result.stderr


def test_nodes_get_a_thread_share_of_the_host():
    """Four node containers each sizing their pools to every core oversubscribe the host: the
    node environment carries a per-node share, and node_main turns it into a thread count."""
    from pdserve.node.main import node_thread_share
    node_env = load()["services"]["prefill-0"]["environment"]
    assert node_env["PDSERVE_NODES_PER_HOST"] == "4"
    assert load({"PDSERVE_THREADS_PER_NODE": "3"})["services"]["decode-1"]["environment"][
        "PDSERVE_THREADS_PER_NODE"] == "3"
    cores = len(os.sched_getaffinity(0))
    assert node_thread_share({"PDSERVE_NODES_PER_HOST": "4"}) == max(1, cores // 4)
    assert node_thread_share({"PDSERVE_NODES_PER_HOST": "1"}) == cores
    assert node_thread_share({"PDSERVE_THREADS_PER_NODE": "3", "PDSERVE_NODES_PER_HOST": "4"}) == 3
    assert node_thread_share({"OMP_NUM_THREADS": "2"}) == 2  # what `pdserve up` sets per node
    assert node_thread_share({}) is None
    for service in ("prefill-0", "decode-0", "redis", "router"):
        assert load()["services"][service]["restart"] == "unless-stopped", f"{service} stays down when it dies"


@pytest.mark.parametrize("env,model,degree", [
    ({}, "SmolLM2-135M-Instruct", 3),
    ({"PDSERVE_MODEL": "builtin:tiny", "PDSERVE_DECODE_TP": "2"}, "builtin:tiny", 2),
], ids=["default-model-tp3", "tiny-tp2"])
def test_tp_profile_adds_a_tensor_parallel_decode_node(env, model, degree):
    """`docker compose --profile tp up` adds decode-tp; a plain `up` (the CI demo) is unchanged."""
    from transformers import AutoConfig

    from pdserve.executor.setup import check_tp_support
    from pdserve.models.loader import resolve_model_path
    doc = load(env)
    assert set(default_services(doc)) == {"redis", "prefill-0", "prefill-1", "decode-0", "decode-1", "router"}
    svc = doc["services"]["decode-tp"]
    assert svc["profiles"] == ["tp"]
    a = parse_command("decode-tp", svc["command"])
    assert (a.command, a.model, a.tensor_parallel_size) == ("decode", model, degree)
    # The check the node runs before it starts its workers: the degree divides the heads.
    check_tp_support(AutoConfig.from_pretrained(resolve_model_path(model)), a.tensor_parallel_size)
    if model == "SmolLM2-135M-Instruct":  # why the default is not 2: 9 attention heads
        with pytest.raises(ValueError, match="does not divide"):
            check_tp_support(AutoConfig.from_pretrained(resolve_model_path(model)), 2)


def test_epd_profile_adds_an_encoder_node():
    """`docker compose --profile epd up` adds encode-0, for a vision-language PDSERVE_MODEL; a plain
    `up` is unchanged."""
    doc = load({"PDSERVE_MODEL": "/models/qwen2.5-vl"})
    svc = doc["services"]["encode-0"]
    assert svc["profiles"] == ["epd"] and "encode-0" not in default_services(doc)
    node = parse_command("encode-0", svc["command"])
    router = parse_command("router", doc["services"]["router"]["command"])
    assert (node.command, node.node_id, node.model) == ("encode", "encode-0", "/models/qwen2.5-vl")
    assert endpoint(node.bind) == ("0.0.0.0", 5600) and node.advertise_host == "encode-0"
    assert endpoint(node.nixl_side_channel) == ("0.0.0.0", 5601) and {"5600", "5601"} <= set(svc["expose"])
    assert node.registry == router.registry, "the router finds the encoder node in the registry"
    assert "encode-0" not in doc["services"]["router"]["depends_on"]
    assert "tcp://127.0.0.1:5600" in " ".join(svc["healthcheck"]["test"])
